//! The sealer: checksums committed pages and seals their slot records, so a pool survives a
//! crash of its kvtierd (`state/survive.rs`).
//!
//! Checksumming is background work whose size is the commit rate (every committed byte is
//! read once). It runs on its own thread, so it never holds a runtime worker that a request
//! could use, nor the blocking pool the L3 reads use. The thread never takes the state lock;
//! the task that takes jobs and seals them runs on the runtime.
//!
//! The thread runs at normal priority. A lower one (nice +10) was tried: on a saturated node
//! the sealer then fell seconds behind the commits, and a daemon killed at that moment left
//! thousands of computed pages unsealed, so its successor could not take them over (the
//! `l2_survives_a_daemon_crash` simulation, under the full test suite's load, lost 5,700).
//! The crash window must not grow with load. A page not sealed yet when the daemon dies is
//! only not taken over (L3, or a recompute, serves it); it is never served unverified.

use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use crate::state::SealJob;
use crate::state::Shared;

/// How often the sealer looks for committed pages when it found none.
pub const PERIOD: Duration = Duration::from_millis(20);
/// Pages checksummed per hand-off to the checksum thread.
pub const BATCH: usize = 256;

type Work = (Vec<SealJob>, oneshot::Sender<Vec<(SealJob, u32)>>);

/// Starts the checksum thread and returns the task that takes and seals jobs
/// until `stop` is cancelled (it stops and joins the thread before it ends). Fails only when
/// the thread cannot be started.
pub fn start(
    state: Arc<Shared>,
    stop: CancellationToken,
) -> std::io::Result<impl Future<Output = ()> + Send + 'static> {
    let (tx, rx) = mpsc::channel::<Work>();
    let thread = std::thread::Builder::new()
        .name("kvtierd-sealer".into())
        .spawn(move || {
            while let Ok((jobs, reply)) = rx.recv() {
                let done = jobs.into_iter().filter_map(SealJob::checksum).collect();
                let _ = reply.send(done);
            }
        })?;
    Ok(async move {
        let mut tick = tokio::time::interval(PERIOD);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        'run: loop {
            tokio::select! {
                () = stop.cancelled() => break,
                _ = tick.tick() => {}
            }
            loop {
                let jobs = state.lock().seal_jobs(BATCH);
                if jobs.is_empty() {
                    break;
                }
                let (reply, done) = oneshot::channel();
                if tx.send((jobs, reply)).is_err() {
                    break 'run;
                }
                let Ok(done) = done.await else { break 'run };
                state.lock().seal(done);
            }
        }
        drop(tx);
        let _ = tokio::task::spawn_blocking(move || thread.join()).await;
    })
}
