//! The sealer: checksums committed pages and seals their slot records, so a pool survives a
//! crash of its kvtierd (`state/survive.rs`).
//!
//! Checksumming is background work whose size is the commit rate (every committed byte is
//! read once), and it must not compete with the calls engines wait on. So the checksums run on
//! their own thread at a lower CPU priority (nice +[`NICE`]): on a busy node the request
//! threads win every contended core, and the sealer catches up when they idle. That thread
//! never takes the state lock (a low-priority holder preempted mid-section would stall every
//! request behind it); the task that takes jobs and seals them runs on the runtime. A page not
//! sealed yet when the daemon dies is only not taken over (L3, or a recompute, serves it); it
//! is never served unverified.

use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use crate::state::{HostState, SealJob};

/// How often the sealer looks for committed pages when it found none.
pub const PERIOD: Duration = Duration::from_millis(20);
/// Pages checksummed per hand-off to the checksum thread.
pub const BATCH: usize = 256;
/// How much lower than the request threads the checksums run (`setpriority`; +19 is lowest).
pub const NICE: i32 = 10;

type Work = (Vec<SealJob>, oneshot::Sender<Vec<(SealJob, u32)>>);

/// Starts the low-priority checksum thread and returns the task that takes and seals jobs
/// until `stop` is cancelled (it stops and joins the thread before it ends). Fails only when
/// the thread cannot be started.
pub fn start(
    state: Arc<Mutex<HostState>>,
    stop: CancellationToken,
) -> std::io::Result<impl Future<Output = ()> + Send + 'static> {
    let (tx, rx) = mpsc::channel::<Work>();
    let thread = std::thread::Builder::new()
        .name("kvtierd-sealer".into())
        .spawn(move || {
            // Lowering one's own priority is always allowed; if the OS refuses anyway,
            // checksum at normal priority rather than not at all.
            if let Err(e) =
                rustix::process::setpriority_process(Some(rustix::thread::gettid()), NICE)
            {
                tracing::warn!(error = %e, "the sealer's checksums run at normal priority");
            }
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
                let jobs = crate::lock(&state).seal_jobs(BATCH);
                if jobs.is_empty() {
                    break;
                }
                let (reply, done) = oneshot::channel();
                if tx.send((jobs, reply)).is_err() {
                    break 'run;
                }
                let Ok(done) = done.await else { break 'run };
                crate::lock(&state).seal(done);
            }
        }
        drop(tx);
        let _ = tokio::task::spawn_blocking(move || thread.join()).await;
    })
}
