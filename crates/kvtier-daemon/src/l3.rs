//! The storage tier behind L2: the configured backend and the asynchronous writer that copies
//! committed pages from the shared-memory pool into it, per the write policy.
//!
//! A page chosen for writing is pinned in its pool ([`HostIndex::queue_for_l3`]) so its slot
//! cannot be reused while the writer copies it; the pin is dropped when the write lands or
//! fails. Nothing is dropped: while L3 is attached a page leaves L2 only once L3 holds it
//! (the index's [`L3Mode`]), so a write that finds the queue full, or fails, leaves its page
//! unwritten in L2, and the flusher ([`run_flusher`]) writes the coldest unwritten pages of a
//! pool running short of free slots, under every write policy. No client ever waits for L3:
//! when writes cannot keep up, reserves find fewer free slots (backpressure on the agents).
//! Only while the breaker is open may unwritten pages be evicted, counted as lost.
//!
//! [`HostIndex::queue_for_l3`]: kvtier_core::host_index::HostIndex::queue_for_l3
//! [`L3Mode`]: kvtier_core::host_index::L3Mode

use parking_lot::Mutex;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvtier_config::daemon::DaemonConfig;
use kvtier_core::{ReadWindow, WritePolicy};
use kvtier_storage::retry::{RetryPolicy, Retrying};
use kvtier_storage::wrappers::{Breaker, BreakerConfig, BreakerState, Delayed, Flaky, Metered};
use kvtier_storage::{OpCtx, PageStore, StorageError, Store};
use tokio::sync::{Semaphore, mpsc};
use tokio_util::sync::CancellationToken;

use crate::state::Job;
use crate::state::Shared;
use kvtier_server::metrics::MetricRegistry;
use kvtier_server::tasks::Tasks;

mod metrics;
pub use kvtier_storage::open_backend;
pub use metrics::L3Metrics;

/// Counters of the writer.
#[derive(Debug, Default)]
pub struct WriterCounters {
    /// Pages written.
    pub written: AtomicU64,
    /// Pages L3 already had.
    pub skipped: AtomicU64,
    /// Pages whose write failed after retries (left unwritten in L2 for the flusher).
    pub failed: AtomicU64,
    /// Early writes that found the queue full (left unwritten in L2 for the flusher).
    pub deferred: AtomicU64,
    /// Pages in the queue or in flight.
    pub queued: AtomicU64,
}

/// The storage tier of a running daemon.
pub struct L3 {
    /// Framed page access over the backend (behind its circuit breaker).
    pub store: PageStore,
    /// The backend's circuit breaker.
    pub breaker: Arc<Breaker>,
    /// Per-call deadline.
    pub timeout: Duration,
    /// Retries of transient failures (under the breaker).
    pub retrying: Arc<Retrying>,
    tx: mpsc::Sender<Job>,
    /// Writer counters.
    pub counters: Arc<WriterCounters>,
    /// How fast this backend loads pages, learnt from finished prefetches.
    pub estimate: Mutex<LoadEstimate>,
    /// How many reads a prefetch keeps in flight, learnt from their latencies.
    pub read_window: Mutex<ReadWindow>,
    /// The tier's series.
    pub metrics: L3Metrics,
}

/// How long loading pages from the backend takes, learnt from finished prefetches: the time
/// to the first landed page (latency) and the rate after it (bandwidth, with the prefetch's
/// concurrency). Exponentially weighted, so it follows a backend that slows down.
#[derive(Debug, Default, Clone, Copy)]
pub struct LoadEstimate {
    /// Seconds from the start of a prefetch to its first landed page.
    pub latency: Option<f64>,
    /// Bytes per second after the first page.
    pub bandwidth: Option<f64>,
}

impl LoadEstimate {
    /// Weight of the newest observation.
    const ALPHA: f64 = 0.3;

    /// Folds in one prefetch: `first` seconds to its first page, then `bytes` more in `rest`
    /// seconds (`bytes` = 0 when only one page landed).
    pub fn observe(&mut self, first: f64, bytes: u64, rest: f64) {
        let mix =
            |old: Option<f64>, new: f64| Some(old.map_or(new, |o| o + Self::ALPHA * (new - o)));
        self.latency = mix(self.latency, first);
        if bytes > 0 && rest > 0.0 {
            self.bandwidth = mix(self.bandwidth, bytes as f64 / rest);
        }
    }

    /// Whether loading `pages` pages of `page_bytes` (`page_size` tokens each) is expected
    /// to take longer than an engine recomputing them at `rate` tokens a second; false
    /// until measured, and for a rate of 0.
    pub fn slower_than_recompute(
        &self,
        pages: u64,
        page_bytes: u64,
        page_size: u64,
        rate: u64,
    ) -> bool {
        if rate == 0 {
            return false;
        }
        let recompute = pages.saturating_mul(page_size) as f64 / rate as f64;
        self.seconds(pages, page_bytes)
            .is_some_and(|load| load > recompute)
    }

    /// Estimated seconds to load `pages` pages of `page_bytes`; `None` until measured.
    pub fn seconds(&self, pages: u64, page_bytes: u64) -> Option<f64> {
        let latency = self.latency?;
        let rest = pages.saturating_sub(1) * page_bytes;
        if rest == 0 {
            return Some(latency);
        }
        Some(latency + rest as f64 / self.bandwidth?)
    }
}

impl std::fmt::Debug for L3 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("L3")
            .field("backend", &self.store.store().kind())
            .finish()
    }
}

/// What the writer task needs.
pub struct WriterParts {
    rx: mpsc::Receiver<Job>,
    batch: usize,
    concurrency: usize,
}

impl L3 {
    /// The tier over `store` (measured, then wrapped in a circuit breaker), and the parts of its writer
    /// (run with [`run_writer`]).
    pub fn new(
        store: Arc<dyn Store>,
        cfg: &DaemonConfig,
        metrics: L3Metrics,
    ) -> (Self, WriterParts) {
        let (tx, rx) = mpsc::channel(cfg.l3.queue_pages as usize);
        // backend ← (chaos delay, faults) ← metered (every real call measured) ← retries of
        // transient failures ← breaker (judges what retries could not save) ← framing
        let (get_delay, set_delay) = (cfg.l3.fault_get_delay, cfg.l3.fault_set_delay);
        let store: Arc<dyn Store> = if get_delay.0.is_zero() && set_delay.0.is_zero() {
            store
        } else {
            tracing::warn!(get = %get_delay, set = %set_delay, "l3.fault_get_delay / fault_set_delay is set: L3 calls are slowed on purpose");
            Arc::new(Delayed::with_writes(store, get_delay.0, set_delay.0))
        };
        let store: Arc<dyn Store> = if cfg.l3.fault_error_rate > 0.0 {
            tracing::warn!(
                rate = cfg.l3.fault_error_rate,
                "l3.fault_error_rate is set: L3 calls fail at random on purpose"
            );
            Arc::new(Flaky::new(store, cfg.l3.fault_error_rate, 0x6b76_7469_6572))
        } else {
            store
        };
        let metered: Arc<dyn Store> = Arc::new(Metered::new(store, Arc::new(metrics.clone())));
        let retrying = Arc::new(Retrying::new(
            metered,
            RetryPolicy {
                retries: cfg.l3.retries,
                base_backoff: cfg.l3.retry_backoff.0,
                max_backoff: (cfg.l3.retry_backoff.0 * 32).min(Duration::from_secs(1)),
                budget: cfg.l3.timeout.0,
            },
        ));
        let breaker = Arc::new(Breaker::new(
            retrying.clone(),
            BreakerConfig {
                failure_rate: cfg.l3.breaker_failure_rate,
                min_calls: cfg.l3.breaker_min_calls,
                window: cfg.l3.breaker_window.0,
                cooldown: cfg.l3.breaker_cooldown.0,
                timeout: cfg.l3.timeout.0,
            },
        ));
        (
            Self {
                store: PageStore::new(breaker.clone()),
                breaker,
                timeout: cfg.l3.timeout.0,
                retrying,
                tx,
                counters: Arc::default(),
                estimate: Mutex::default(),
                read_window: Mutex::new(ReadWindow::new(
                    cfg.prefetch.concurrency as usize,
                    cfg.prefetch.max_concurrency as usize,
                )),
                metrics,
            },
            WriterParts {
                rx,
                batch: cfg.l3.batch_pages as usize,
                concurrency: cfg.l3.concurrency as usize,
            },
        )
    }

    /// Whether the breaker is letting calls through.
    pub fn breaker_open(&self) -> bool {
        self.breaker.state() != BreakerState::Closed
    }

    /// Pages the writer queue has room for now.
    pub fn room(&self) -> usize {
        self.tx.capacity()
    }

    /// Queues pages for writing without waiting. Pages that do not fit stay unwritten in L2
    /// (unpinned, counted as deferred): the flusher writes them before their slots are
    /// reused.
    pub fn enqueue(&self, jobs: Vec<Job>, state: &Shared) {
        for job in jobs {
            match self.tx.try_send(job) {
                Ok(()) => {
                    self.counters.queued.fetch_add(1, Ordering::Relaxed);
                }
                Err(
                    mpsc::error::TrySendError::Full(job) | mpsc::error::TrySendError::Closed(job),
                ) => {
                    self.counters.deferred.fetch_add(1, Ordering::Relaxed);
                    self.metrics.writes.with_label_values(&["deferred"]).inc();
                    state.lock().finish_l3(&job, false);
                }
            }
        }
    }
}

/// Copies the page out of its slot. The slot is pinned, so nobody rewrites it meanwhile.
fn copy_out(job: &Job) -> Result<Bytes, StorageError> {
    let mut buf = vec![0u8; job.len];
    job.pool
        .read(job.slot, 0, &mut buf)
        .map_err(|e| StorageError::Invalid(format!("reading slot {}: {e}", job.slot)))?;
    Ok(Bytes::from(buf))
}

async fn write_one(
    job: &Job,
    store: &PageStore,
    timeout: Duration,
    stop: &CancellationToken,
) -> Result<bool, StorageError> {
    let ctx = OpCtx::child(stop, timeout);
    if store.exists(&ctx, &job.fp, &job.key).await? {
        return Ok(false);
    }
    let bytes = copy_out(job)?;
    store
        .set(&OpCtx::child(stop, timeout), &job.fp, &job.key, bytes)
        .await?;
    Ok(true)
}

/// Runs the writer until `stop`: takes jobs in batches, writes up to `concurrency` at once
/// (each a task on `tasks`), and reports each outcome to the index (persisted, or to be
/// tried again later).
pub async fn run_writer(
    parts: WriterParts,
    l3: Arc<L3>,
    state: Arc<Shared>,
    stop: CancellationToken,
    tasks: Tasks,
) {
    let WriterParts {
        mut rx,
        batch,
        concurrency,
    } = parts;
    let slots = Arc::new(Semaphore::new(concurrency));
    let mut jobs = Vec::with_capacity(batch);
    loop {
        jobs.clear();
        let n = tokio::select! {
            n = rx.recv_many(&mut jobs, batch) => n,
            () = stop.cancelled() => 0,
        };
        if n == 0 {
            break;
        }
        for job in jobs.drain(..) {
            let Ok(permit) = slots.clone().acquire_owned().await else {
                break;
            };
            let (l3, state, stop) = (l3.clone(), state.clone(), stop.clone());
            tasks.spawn(async move {
                let t = Instant::now();
                let r = write_one(&job, &l3.store, l3.timeout, &stop).await;
                let (c, metrics) = (&l3.counters, &l3.metrics);
                let outcome = match &r {
                    Ok(true) => {
                        c.written.fetch_add(1, Ordering::Relaxed);
                        metrics.write_bytes.inc_by(job.len as u64);
                        let secs = t.elapsed().as_secs_f64();
                        metrics.write_seconds.observe(secs);
                        if secs > 0.0 {
                            metrics.write_bandwidth.observe(job.len as f64 / secs / 1e9);
                        }
                        "written"
                    }
                    Ok(false) => {
                        c.skipped.fetch_add(1, Ordering::Relaxed);
                        "present"
                    }
                    Err(e) => {
                        c.failed.fetch_add(1, Ordering::Relaxed);
                        // An open breaker is already logged once, when it opened.
                        if matches!(e, StorageError::Unavailable(_)) {
                            tracing::debug!(key = %job.key, "l3 write dropped: {e}");
                        } else {
                            tracing::warn!(backend = l3.store.store().kind(), key = %job.key, "l3 write failed: {e}");
                        }
                        "failed"
                    }
                };
                metrics.writes.with_label_values(&[outcome]).inc();
                state.lock().finish_l3(&job, r.is_ok());
                c.queued.fetch_sub(1, Ordering::Relaxed);
                drop(permit);
            });
        }
    }
    // Wait for writes in flight (bounded by their own deadlines).
    let _ = slots.acquire_many(concurrency as u32).await;
}

/// Keeps enough cold pages in L3 that reserves find evictable slots, under every write
/// policy, tells the state whether L3 is down, and hands it what the backend evicted on its
/// own (the L3 events' REMOVED). Every 20 ms: the breaker's state goes to
/// [`HostState::set_l3_down`]; each pool with fewer than a quarter of its slots free (every
/// pool while a flush or drain runs) gets its coldest unwritten pages queued (none while L3
/// is down).
pub async fn run_flusher(l3: Arc<L3>, state: Arc<Shared>, batch: usize, stop: CancellationToken) {
    let mut tick = tokio::time::interval(Duration::from_millis(20));
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        // What the backend evicted on its own since the last tick, for the L3 events.
        let removed = l3.store.store().take_removed();
        let jobs = {
            let mut st = state.lock();
            if !removed.is_empty() {
                st.l3_removed(removed);
            }
            st.set_l3_down(l3.breaker_open());
            // No more than the queue takes: a flush of the whole pool waits its turn in L2
            // rather than being counted as deferred.
            st.flush_jobs(batch.min(l3.room()))
        };
        if !jobs.is_empty() {
            l3.enqueue(jobs, &state);
        }
    }
}

/// A running storage tier: the tier and the token that stops its writer and flusher.
#[derive(Debug)]
struct Attached {
    l3: Arc<L3>,
    stop: CancellationToken,
}

/// The daemon's storage tier, which can be attached, detached or swapped while it runs.
/// Everything that uses L3 asks [`L3Slot::current`] per call, so a swap takes effect at once;
/// the old tier's queued writes drain (bounded by `server.drain_timeout`) before its writer
/// stops.
#[derive(Debug)]
pub struct L3Slot {
    current: parking_lot::RwLock<Option<Attached>>,
    state: Arc<Shared>,
    metrics: L3Metrics,
    /// Where the writer, the flusher and their writes run; its shutdown stops the tier.
    tasks: Tasks,
    drain: Duration,
}

impl L3Slot {
    /// An empty slot; `tasks`' shutdown stops whatever tier is attached. The tier's series
    /// are declared in `registry` and follow whichever tier is attached.
    pub fn new(
        state: Arc<Shared>,
        registry: &MetricRegistry,
        tasks: Tasks,
        drain: Duration,
    ) -> Result<Arc<Self>, prometheus::Error> {
        let slot = Arc::new(Self {
            current: parking_lot::RwLock::new(None),
            state,
            metrics: L3Metrics::new(registry)?,
            tasks,
            drain,
        });
        slot.metrics.watch(registry, &slot);
        Ok(slot)
    }

    /// The L2 → L3 write policy of the attached tier.
    pub fn write_policy(&self) -> Option<WritePolicy> {
        self.state.lock().write_policy()
    }

    /// The attached tier, if any.
    pub fn current(&self) -> Option<Arc<L3>> {
        let g = self.current.read();
        g.as_ref().map(|a| a.l3.clone())
    }

    /// Opens the backend `cfg` describes, starts its writer and flusher (the flusher runs
    /// under every write policy: it writes the coldest unwritten pages of a pool running short
    /// of free slots) and makes it the tier, draining any tier it replaces. `l3.backend = "none"` detaches.
    pub async fn attach(&self, cfg: &DaemonConfig) -> Result<(), StorageError> {
        let Some(store) = open_backend(cfg).await? else {
            self.detach().await;
            return Ok(());
        };
        let (l3, writer) = L3::new(store, cfg, self.metrics.clone());
        let l3 = Arc::new(l3);
        let stop = self.tasks.shutdown.child_token();
        self.tasks.spawn(run_writer(
            writer,
            l3.clone(),
            self.state.clone(),
            stop.clone(),
            self.tasks.clone(),
        ));
        self.tasks.spawn(run_flusher(
            l3.clone(),
            self.state.clone(),
            cfg.l3.batch_pages as usize,
            stop.clone(),
        ));
        let policy = cfg.l3.write_policy();
        self.state.lock().set_write(Some(policy));
        tracing::info!(backend = l3.store.store().kind(), %policy, "l3 tier attached");
        let old = self.swap(Some(Attached { l3, stop }));
        self.retire(old).await;
        Ok(())
    }

    /// Detaches the tier (draining its queued writes first). Clients keep L2 service.
    pub async fn detach(&self) {
        self.state.lock().set_write(None);
        let old = self.swap(None);
        self.retire(old).await;
    }

    fn swap(&self, new: Option<Attached>) -> Option<Attached> {
        let mut g = self.current.write();
        std::mem::replace(&mut *g, new)
    }

    /// Lets a replaced tier finish its queued writes, then stops it.
    async fn retire(&self, old: Option<Attached>) {
        let Some(old) = old else { return };
        let deadline = Instant::now() + self.drain;
        while old.l3.counters.queued.load(Ordering::Relaxed) > 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        old.stop.cancel();
        tracing::info!(backend = old.l3.store.store().kind(), "l3 tier detached");
    }
}

/// The wire view of a tier: backend, the write policy it serves, holdings and writer
/// counters.
pub fn wire_stats(l3: &L3, policy: Option<WritePolicy>) -> kvtier_proto::v1::L3Stats {
    let st = l3.store.store_stats();
    let w = &l3.counters;
    let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
    kvtier_proto::v1::L3Stats {
        backend: l3.store.store().kind().to_string(),
        write_policy: policy
            .map(WritePolicy::name)
            .unwrap_or_default()
            .to_string(),
        objects: st.objects,
        bytes: st.bytes,
        capacity_bytes: st.capacity,
        written_pages: l(&w.written),
        skipped_pages: l(&w.skipped),
        failed_pages: l(&w.failed),
        deferred_pages: l(&w.deferred),
        queued_pages: l(&w.queued),
        evictions: st.evictions,
    }
}
