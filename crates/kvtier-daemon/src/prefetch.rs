//! Prefetch: loading a request's pages from L3 into L2 before the engine needs them.
//!
//! Planning costs no memory: the pages ready in L2 are skipped, then one batched `exists`
//! measures the L3 hit, and the prefetch is revoked (nothing allocated) when the hit is under
//! the threshold, would load slower than the engine recomputes it (estimated from finished
//! prefetches), or does not fit the budget. Otherwise slots are reserved for the hit pages
//! under an owner id of the prefetch's own (not the session's), so nothing but the prefetch
//! task can free them: a session that ends, a release or a best-effort take only *asks* the
//! task to stop.
//!
//! The task reads pages with bounded concurrency (the tier's [`ReadWindow`], which learns from
//! read latencies how many reads the backend serves at once), one tokio task per page, each straight into
//! its reserved slot ([`PageStore::get_into`]: the file backend streams through a small
//! per-thread buffer, so there is no page-sized allocation per read) and verified on the way
//! (header fields, CRC32C). Pages land strictly in order, each committed ready, pinned and
//! persisted, so what has landed is always a usable prefix. The first page that fails stops
//! the prefetch and is remembered in a short-lived negative cache, so a stale `exists` is not
//! retried in a loop. When the task stops it aborts its reads, waits for their tasks, and
//! closes a [`Fence`] that refuses writes from backend threads still reading; only then are
//! the slots of pages that did not land freed. Progress goes out on a `watch` channel that
//! the streaming RPC, status polls and takes read.
//!
//! [`ReadWindow`]: kvtier_core::ReadWindow

use parking_lot::Mutex;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{Stream, StreamExt};
use kvtier_config::daemon::{PrefetchConfig, StopPolicy};
use kvtier_core::{LayoutFingerprint, PageKey, SessionId};
use kvtier_proto::ApiError;
use kvtier_server::metrics::MetricRegistry;
use kvtier_shm::ShmPool;
use kvtier_storage::{Landed, MissReason, ObjectSink, OpCtx, PageStore};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::l3::{L3, L3Slot};
use crate::state::Shared;
use crate::state::{Opened, Phase, PrefetchOpen, Progress, StopCause};
use kvtier_server::tasks::Tasks;

mod metrics;
mod negative;
pub use metrics::PrefetchMetrics;
pub use negative::NegativeCache;

/// A prefetch's progress: its plan first, then each change, ending after a final phase.
pub type ProgressStream = Pin<Box<dyn Stream<Item = Progress> + Send>>;

/// What a session asks a prefetch to do (the Prefetch RPC, validated at the edge).
#[derive(Debug, Clone)]
pub struct PrefetchAsk {
    /// The asking session.
    pub session: SessionId,
    /// Its name for the request (checked here: non-empty, at most 256 bytes).
    pub request_id: String,
    /// The request's page keys in prefix order.
    pub keys: Vec<PageKey>,
    /// The key before `keys[0]`, if any.
    pub parent: Option<PageKey>,
    /// Stop policy; `None` takes `prefetch.policy`.
    pub policy: Option<StopPolicy>,
    /// The deadline under the timeout policy; `None` takes one from the hit's size.
    pub timeout: Option<Duration>,
    /// Shortest hit worth fetching, in tokens; `None` takes `prefetch.threshold_tokens`.
    pub threshold_tokens: Option<u64>,
    /// The engine's prefill rate; `None` takes `prefetch.recompute_tokens_per_second`.
    pub recompute_tokens_per_second: Option<u64>,
    /// The pages of the whole load this prefetch is a piece of (0: it is the whole load):
    /// the load-versus-recompute decision weighs them, so every piece gets one answer.
    pub whole_load_pages: u64,
}

/// Plans, runs and hands over prefetches.
#[derive(Debug)]
pub struct Prefetcher {
    cfg: PrefetchConfig,
    state: Arc<Shared>,
    l3: Arc<L3Slot>,
    metrics: PrefetchMetrics,
    negative: Mutex<NegativeCache>,
    /// Where prefetches run; its shutdown cancels them.
    tasks: Tasks,
    max_batch: usize,
}

/// Most bytes of a request id.
const MAX_REQUEST_ID: usize = 256;

/// Times a prefetch reads one page again after a transient failure (each read already has
/// the store's own retries), within the prefetch's deadline.
const PAGE_REREADS: u8 = 4;

/// L3 exists calls in flight for one key-by-key Lookup.
const EACH_KEY_CONCURRENCY: usize = 32;

/// Closes a prefetch's slots to writes: after [`Fence::close`] returns, no write into them
/// is in progress and none will start. Backend reads may outlive the task that asked for them
/// (a blocking read thread keeps going after its future is dropped); the fence is what keeps
/// such a late read out of a slot that has been freed and handed to someone else.
#[derive(Debug)]
struct Fence(parking_lot::RwLock<bool>);

impl Fence {
    fn new() -> Arc<Self> {
        Arc::new(Self(parking_lot::RwLock::new(true)))
    }

    /// Waits for writes in progress (each one chunk) and refuses every later one.
    fn close(&self) {
        *self.0.write() = false;
    }
}

/// A reserved slot as the destination of a backend read.
struct SlotSink {
    shm: Arc<ShmPool>,
    slot: u32,
    fence: Arc<Fence>,
}

impl ObjectSink for SlotSink {
    fn write_at(&self, offset: u64, bytes: &[u8]) -> Result<(), String> {
        let open = self.fence.0.read();
        if !*open {
            return Err("the prefetch has stopped".into());
        }
        let offset = usize::try_from(offset).map_err(|e| e.to_string())?;
        self.shm
            .write(self.slot, offset, bytes)
            .map_err(|e| format!("slot {}: {e}", self.slot))
    }
}

/// One page read straight into its slot and verified (its CRC32C, which seals the slot's
/// record when it lands), or why not.
async fn fetch_one(
    store: &PageStore,
    ctx: OpCtx,
    fp: LayoutFingerprint,
    key: PageKey,
    sink: SlotSink,
    page_bytes: usize,
) -> Result<u32, MissReason> {
    // The slot is reserved under the prefetch's own owner id: nobody else writes it, and it
    // is not freed before the fence has closed.
    match store
        .get_into(&ctx, &fp, &key, Some(page_bytes), Arc::new(sink))
        .await
    {
        Landed::Hit(v) => Ok(v.crc32c),
        Landed::Miss(why) => Err(why),
    }
}

impl Prefetcher {
    /// A prefetcher configured by `cfg`, over the daemon's state and storage tier, with its
    /// series declared in `registry`.
    pub fn new(
        cfg: PrefetchConfig,
        state: Arc<Shared>,
        l3: Arc<L3Slot>,
        registry: &MetricRegistry,
        tasks: Tasks,
        max_batch: usize,
    ) -> Result<Self, prometheus::Error> {
        let negative = NegativeCache::new(cfg.negative_ttl.0, cfg.negative_capacity as usize);
        Ok(Self {
            cfg,
            metrics: PrefetchMetrics::new(registry, state.clone())?,
            state,
            l3,
            negative: Mutex::new(negative),
            tasks,
            max_batch,
        })
    }

    /// How many leading `keys` are not remembered as failed.
    pub fn usable(&self, fp: LayoutFingerprint, keys: &[PageKey]) -> usize {
        self.negative.lock().first(fp, keys, Instant::now())
    }

    /// How many leading `keys` L2 or L3 holds, each page in either (`in_l2[i]`: ready in
    /// L2). L2 keeps pages whose prefix already left it for L3, so a chain can run from L3
    /// into L2 and back; only the pages L2 lacks are asked of L3, in one batched exists.
    /// Keys remembered as failed end the walk.
    pub async fn reachable(
        &self,
        tier: &L3,
        ctx: &OpCtx,
        fp: LayoutFingerprint,
        keys: &[PageKey],
        in_l2: &[bool],
    ) -> Result<usize, kvtier_storage::StorageError> {
        let keys = &keys[..self.usable(fp, keys)];
        let probe: Vec<PageKey> = keys
            .iter()
            .zip(in_l2)
            .filter(|(_, l2)| !**l2)
            .map(|(k, _)| *k)
            .collect();
        let in_l3 = if probe.is_empty() {
            0
        } else {
            tier.store.exists_prefix(ctx, &fp, &probe).await?
        };
        let mut asked = 0;
        Ok(keys
            .iter()
            .zip(in_l2)
            .take_while(|(_, l2)| {
                if **l2 {
                    return true;
                }
                asked += 1;
                asked <= in_l3
            })
            .count())
    }

    /// Key by key, whether L2 (`in_l2[i]`) or L3 holds it. Only the keys L2 lacks are asked
    /// of L3, [`EACH_KEY_CONCURRENCY`] at a time; a key remembered as failed, or whose exists
    /// call fails, is absent.
    pub async fn present(
        &self,
        tier: &L3,
        ctx: &OpCtx,
        fp: LayoutFingerprint,
        keys: &[PageKey],
        in_l2: &[bool],
    ) -> Vec<bool> {
        let now = Instant::now();
        let probe: Vec<usize> = {
            let mut negative = self.negative.lock();
            (0..keys.len())
                .filter(|&i| !in_l2[i] && !negative.contains(fp, &keys[i], now))
                .collect()
        };
        let found: Vec<(usize, bool)> = futures::stream::iter(probe)
            .map(|i| async move {
                let held = tier.store.exists(ctx, &fp, &keys[i]).await;
                (i, matches!(held, Ok(true)))
            })
            .buffer_unordered(EACH_KEY_CONCURRENCY)
            .collect()
            .await;
        let mut out = in_l2.to_vec();
        for (i, held) in found {
            out[i] = held;
        }
        out
    }

    fn remember_failed(&self, fp: LayoutFingerprint, key: PageKey) {
        let mut n = self.negative.lock();
        n.insert(fp, key, Instant::now());
        self.metrics.negative_keys.set(n.len() as i64);
    }

    fn request_id(raw: &str) -> Result<String, ApiError> {
        if raw.is_empty() {
            return Err(ApiError::invalid("request_id", "required"));
        }
        if raw.len() > MAX_REQUEST_ID {
            return Err(ApiError::invalid(
                "request_id",
                format!("longer than {MAX_REQUEST_ID} bytes"),
            ));
        }
        Ok(raw.to_string())
    }

    fn revoked(
        &self,
        request_id: String,
        policy: StopPolicy,
        l2: usize,
        reason: &'static str,
    ) -> Progress {
        self.metrics
            .requests
            .with_label_values(&["revoked", reason])
            .inc();
        tracing::debug!(request = %request_id, reason, "prefetch revoked");
        Progress::revoked(request_id, policy, l2, reason)
    }

    /// Plans a prefetch and starts it. Returns the progress stream: one final message when
    /// revoked, else progress until it is done.
    pub async fn start(self: &Arc<Self>, req: PrefetchAsk) -> Result<ProgressStream, ApiError> {
        let started = Instant::now();
        if req.keys.len() > self.max_batch {
            return Err(ApiError::invalid(
                "keys",
                format!(
                    "{} keys exceed the batch limit of {} (server.max_batch)",
                    req.keys.len(),
                    self.max_batch
                ),
            ));
        }
        let (keys, parent, session) = (req.keys, req.parent, req.session);
        let request_id = Self::request_id(&req.request_id)?;
        let policy = req.policy.unwrap_or(self.cfg.policy);
        let (layout, l2, in_l2) = {
            let mut st = self.state.lock();
            let (layout, l2) = st.prefetch_check(
                session,
                &request_id,
                &keys,
                self.cfg.max_per_session as usize,
                started,
            )?;
            let in_l2 = st.ready_mask(session, &keys[l2..], started)?;
            (layout, l2, in_l2)
        };
        let fp = layout.fingerprint();
        let page_size = layout.page_size() as u64;
        let page_bytes = layout.page_bytes() as u64;
        let m = &self.metrics;
        m.pages
            .with_label_values(&["requested"])
            .inc_by(keys.len() as u64);
        m.bytes
            .with_label_values(&["requested"])
            .inc_by(keys.len() as u64 * page_bytes);
        m.pages.with_label_values(&["in_l2"]).inc_by(l2 as u64);
        let once =
            |p: Progress| -> ProgressStream { Box::pin(futures::stream::once(async move { p })) };
        if l2 == keys.len() {
            return Ok(once(self.revoked(request_id, policy, l2, "in_l2")));
        }
        let Some(tier) = self.l3.current() else {
            return Ok(once(self.revoked(request_id, policy, l2, "no_storage")));
        };
        // Keys that just failed are not asked for again until they expire.
        let ctx = OpCtx::child(&self.tasks.shutdown, tier.timeout);
        let hit = match self.reachable(&tier, &ctx, fp, &keys[l2..], &in_l2).await {
            Ok(n) => n,
            Err(e) => {
                tracing::debug!("prefetch exists failed: {e}");
                return Ok(once(self.revoked(
                    request_id,
                    policy,
                    l2,
                    "storage_unavailable",
                )));
            }
        };
        if hit == 0 {
            return Ok(once(self.revoked(request_id, policy, l2, "miss")));
        }
        let threshold = req.threshold_tokens.unwrap_or(self.cfg.threshold_tokens);
        if (hit as u64) * page_size < threshold {
            return Ok(once(self.revoked(
                request_id,
                policy,
                l2,
                "below_threshold",
            )));
        }
        let rate = req
            .recompute_tokens_per_second
            .unwrap_or(self.cfg.recompute_tokens_per_second);
        // A piece of a larger load is judged as the whole load, so a load the engine
        // planned on is not refused piece by piece (a short last piece is all latency).
        let judged = (hit as u64).max(req.whole_load_pages);
        if rate > 0 {
            let slower = tier
                .estimate
                .lock()
                .slower_than_recompute(judged, page_bytes, page_size, rate);
            if slower {
                return Ok(once(self.revoked(
                    request_id,
                    policy,
                    l2,
                    "slower_than_recompute",
                )));
            }
        }
        let deadline = match (policy, req.timeout) {
            (StopPolicy::Timeout, None) => self.cfg.deadline_for(hit as u64 * page_size),
            (StopPolicy::Timeout, Some(t)) => t.min(self.cfg.timeout_max.0),
            _ => self.cfg.timeout_max.0,
        };
        let cancel = self.tasks.shutdown.child_token();
        let min_pages = threshold.div_ceil(page_size.max(1)) as usize;
        let opened = self.state.lock().prefetch_open(PrefetchOpen {
            session,
            request_id: request_id.clone(),
            keys,
            parent,
            l2,
            hit,
            min_pages,
            policy,
            started,
            deadline: started + deadline,
            cancel: cancel.clone(),
        })?;
        let (id, hit, in_place, l2, shm, rx, first) = match opened {
            Opened::Revoked(reason) => {
                return Ok(once(self.revoked(request_id, policy, l2, reason)));
            }
            Opened::Open {
                id,
                hit,
                in_place,
                l2,
                shm,
                rx,
                first,
            } => (id, hit, in_place, l2, shm, rx, first),
        };
        let there = in_place.iter().filter(|p| **p).count() as u64;
        let fetch = hit.len() as u64 - there;
        m.pages.with_label_values(&["in_l2"]).inc_by(there);
        m.pages.with_label_values(&["hit"]).inc_by(fetch);
        m.bytes
            .with_label_values(&["hit"])
            .inc_by(fetch * page_bytes);
        tracing::debug!(request = %request_id, l2, hit = hit.len(), ?deadline, "prefetch started");
        let me = self.clone();
        self.tasks.spawn(async move {
            me.run(Task {
                id,
                tier,
                fp,
                hit,
                in_place,
                shm,
                page_bytes: page_bytes as usize,
                deadline: started + deadline,
                cancel,
            })
            .await;
        });
        Ok(progress_stream(first, rx))
    }

    /// Fetches the pages of one prefetch, in order, landing each as it arrives.
    async fn run(&self, t: Task) {
        let Task {
            id,
            tier,
            fp,
            hit,
            in_place,
            shm,
            page_bytes,
            deadline,
            cancel,
        } = t;
        let batch = self.cfg.batch_pages as usize;
        // Reads in flight: the tier's window, learnt from read latencies across prefetches
        // (wide for a latency-bound backend, narrow for a saturated one).
        let window = || tier.read_window.lock().limit();
        let timeout = tier.timeout;
        // Each page is its own task, so verification and the copy into the pool run on every
        // worker thread at once; results land strictly in order.
        let fence = Fence::new();
        let mut reads = tokio::task::JoinSet::new();
        let spawn = |reads: &mut tokio::task::JoinSet<_>, i: usize| {
            let (key, slot) = hit[i];
            let sink = SlotSink {
                shm: shm.clone(),
                slot,
                fence: fence.clone(),
            };
            let (store, ctx) = (tier.store.clone(), OpCtx::child(&cancel, timeout));
            reads.spawn(async move {
                let t = Instant::now();
                let r = fetch_one(&store, ctx, fp, key, sink, page_bytes).await;
                (i, t.elapsed(), r)
            });
        };
        // Pages ready in L2 already have nothing to fetch: they have arrived.
        // Each arrival: the CRC32C of the bytes read into its slot (none for a page that was
        // in place), or why it missed.
        let mut arrived: Vec<Option<Result<Option<u32>, MissReason>>> = in_place
            .iter()
            .map(|&there| there.then_some(Ok(None)))
            .collect();
        let fetch: Vec<usize> = (0..hit.len()).filter(|&i| !in_place[i]).collect();
        let mut rereads = vec![0u8; hit.len()];
        let mut next = 0;
        while next < fetch.len().min(window()) {
            spawn(&mut reads, fetch[next]);
            next += 1;
        }
        let sleep = tokio::time::sleep_until(deadline.into());
        let mut sleep = std::pin::pin!(sleep);
        let mut landed = 0usize;
        let mut first_at: Option<Instant> = None;
        let started = Instant::now();
        let (state, reason) = 'fetch: loop {
            // Land the contiguous prefix that has arrived.
            while let Some(r) = arrived.get_mut(landed).and_then(Option::take) {
                let crc = match r {
                    Ok(crc) => crc,
                    Err(why) => {
                        let key = hit[landed].0;
                        if !matches!(why, MissReason::Cancelled) {
                            self.remember_failed(fp, key);
                        }
                        tracing::debug!(prefetch = id, key = %key, "prefetch stopped at a page: {why:?}");
                        break 'fetch (Phase::Failed, why.label().to_string());
                    }
                };
                let mut st = self.state.lock();
                if !st.prefetch_land(id, crc) {
                    break 'fetch (Phase::Failed, "cancelled".to_string());
                }
                if !in_place[landed] {
                    first_at.get_or_insert_with(Instant::now);
                }
                landed += 1;
                if landed.is_multiple_of(batch) {
                    st.prefetch_publish(id);
                }
            }
            if landed == hit.len() {
                break (Phase::Completed, String::new());
            }
            let joined = tokio::select! {
                biased;
                () = cancel.cancelled() => break (Phase::Failed, "cancelled".to_string()),
                j = reads.join_next() => j,
                () = &mut sleep => break (Phase::TimedOut, String::new()),
            };
            match joined {
                // A page whose read failed in a way that may pass (the store retried it
                // already) is read again while the deadline allows: one bad call must not cut
                // the chain behind it.
                Some(Ok((i, _, Err(MissReason::Failed(e)))))
                    if e.is_retryable() && rereads[i] < PAGE_REREADS =>
                {
                    rereads[i] += 1;
                    self.metrics.rereads.inc();
                    spawn(&mut reads, i);
                    continue;
                }
                Some(Ok((i, took, r))) => {
                    if r.is_ok() {
                        tier.read_window.lock().observe(took);
                    }
                    arrived[i] = Some(r.map(Some));
                }
                Some(Err(e)) => {
                    tracing::error!(prefetch = id, "a prefetch read task failed: {e}");
                    break (Phase::Failed, "failed".to_string());
                }
                None => break (Phase::Failed, "failed".to_string()),
            }
            // Top up to the window (it may have grown; when it shrank, reads drain first).
            while next < fetch.len() && reads.len() < window() {
                spawn(&mut reads, fetch[next]);
                next += 1;
            }
        };
        // Stop every read, wait until each task has ended, then close the fence: only then
        // may this prefetch's slots be freed, so no read can land in a slot someone else now
        // owns.
        reads.abort_all();
        while reads.join_next().await.is_some() {}
        // Backend threads may still be reading for the aborted tasks: shut them out.
        fence.close();
        let done = self.state.lock().prefetch_finish(id, state, &reason);
        let Some(done) = done else { return };
        let m = &self.metrics;
        let label = done.state.label();
        m.requests.with_label_values(&[label, &done.reason]).inc();
        m.pages
            .with_label_values(&["landed"])
            .inc_by(done.landed as u64);
        m.bytes.with_label_values(&["landed"]).inc_by(done.bytes);
        let secs = done.started.elapsed().as_secs_f64();
        m.seconds.observe(secs);
        if done.landed > 0 && secs > 0.0 {
            m.bandwidth.observe(done.bytes as f64 / secs / 1e9);
        }
        if let Some(first) = first_at {
            // Only pages read from L3 tell how fast it loads.
            let fetched = in_place.iter().take(done.landed).filter(|p| !**p).count();
            let rest_bytes = (fetched as u64).saturating_sub(1) * page_bytes as u64;
            tier.estimate.lock().observe(
                (first - started).as_secs_f64(),
                rest_bytes,
                first.elapsed().as_secs_f64(),
            );
        }
        tracing::debug!(prefetch = id, outcome = label, reason = %done.reason, landed = done.landed, "prefetch done");
    }

    /// Waits (per the prefetch's policy) until it is done, then pins its usable prefix for
    /// the session. Returns its final progress and the slots of that prefix.
    pub async fn take(
        &self,
        session: SessionId,
        request_id: &str,
    ) -> Result<(Progress, Vec<u32>), ApiError> {
        let t = Instant::now();
        let request_id = Self::request_id(request_id)?;
        let (mut rx, _) =
            self.state
                .lock()
                .prefetch_watch(session, &request_id, true, Instant::now())?;
        loop {
            if rx.borrow_and_update().phase.is_final() {
                break;
            }
            tokio::select! {
                r = rx.changed() => if r.is_err() { break },
                () = self.tasks.shutdown.cancelled() => {
                    return Err(ApiError::Unavailable("kvtierd is shutting down".into()));
                }
            }
        }
        self.metrics.wait_seconds.observe(t.elapsed().as_secs_f64());
        Ok(self
            .state
            .lock()
            .prefetch_take(session, &request_id, Instant::now())?)
    }

    /// The progress of an open prefetch.
    pub fn status(&self, session: SessionId, request_id: &str) -> Result<Progress, ApiError> {
        let request_id = Self::request_id(request_id)?;
        Ok(self
            .state
            .lock()
            .prefetch_status(session, &request_id, Instant::now())?)
    }

    /// Cancels a prefetch and drops its pins.
    pub fn release(&self, session: SessionId, request_id: &str) -> Result<(), ApiError> {
        let request_id = Self::request_id(request_id)?;
        let mut st = self.state.lock();
        st.touch(session, Instant::now())?;
        if st.prefetch_drop(session, &request_id, StopCause::Released) {
            Ok(())
        } else {
            Err(ApiError::NotFound(format!(
                "no open prefetch {request_id:?} in this session"
            )))
        }
    }
}

/// What a prefetch task needs.
struct Task {
    id: u64,
    tier: Arc<L3>,
    fp: LayoutFingerprint,
    hit: Vec<(PageKey, u32)>,
    in_place: Vec<bool>,
    shm: Arc<ShmPool>,
    page_bytes: usize,
    deadline: Instant,
    cancel: CancellationToken,
}

/// Progress of one prefetch: `first` (its plan), then every change `rx` sees, ending after a
/// final state (or when the prefetch is gone).
fn progress_stream(first: Progress, rx: watch::Receiver<Progress>) -> ProgressStream {
    let head = futures::stream::once(async move { first });
    let rest = futures::stream::unfold((rx, false), |(mut rx, done)| async move {
        if done || rx.changed().await.is_err() {
            return None;
        }
        let p = rx.borrow_and_update().clone();
        let done = p.phase.is_final();
        Some((p, (rx, done)))
    });
    Box::pin(head.chain(rest))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_closed_fence_keeps_late_reads_out_of_the_slot() {
        let shm = Arc::new(
            ShmPool::create(&kvtier_shm::PoolSpec {
                name: format!("kvtier-fence-test-{}", std::process::id()),
                backing: kvtier_shm::Backing::Memfd,
                slots: 2,
                stride: 4096,
                mlock: false,
                huge_pages: false,
                reserve: false,
            })
            .unwrap()
            .0,
        );
        let fence = Fence::new();
        let sink = SlotSink {
            shm: shm.clone(),
            slot: 1,
            fence: fence.clone(),
        };
        sink.write_at(0, &[7; 100]).unwrap();
        // Out of bounds is an error, not a write elsewhere.
        assert!(sink.write_at(4000, &[1; 200]).is_err());
        fence.close();
        let e = sink.write_at(0, &[9; 100]).unwrap_err();
        assert!(e.contains("stopped"), "{e}");
        let mut back = [0u8; 100];
        shm.read(1, 0, &mut back).unwrap();
        assert_eq!(back, [7; 100], "a write after close landed");
    }

    #[test]
    fn a_piece_of_a_load_is_judged_as_the_whole_load() {
        // 10 ms to the first page, then 1 ms a page; the engine recomputes a page (16
        // tokens) in 2 ms.
        let mut e = crate::l3::LoadEstimate::default();
        assert!(
            !e.slower_than_recompute(2, 1000, 16, 8000),
            "unmeasured: never slower"
        );
        e.observe(0.010, 1_000_000, 1.0);
        // A 2-page piece is all latency: 11 ms against 4 ms of recompute.
        assert!(e.slower_than_recompute(2, 1000, 16, 8000));
        // The whole 12-page load: 21 ms against 24 ms.
        assert!(!e.slower_than_recompute(12, 1000, 16, 8000));
    }

    #[test]
    fn load_estimate_needs_measurements_and_follows_them() {
        let mut e = crate::l3::LoadEstimate::default();
        assert_eq!(e.seconds(10, 1000), None);
        e.observe(0.01, 0, 0.0);
        assert_eq!(e.seconds(1, 1000), Some(0.01));
        assert_eq!(e.seconds(2, 1000), None, "no bandwidth known yet");
        e.observe(0.01, 1_000_000, 1.0);
        let s = e.seconds(1001, 1000).unwrap();
        assert!((s - 1.01).abs() < 1e-9, "{s}");
        // A slower backend moves the estimate up, not all the way at once.
        e.observe(0.01, 1_000_000, 10.0);
        let slower = e.seconds(1001, 1000).unwrap();
        assert!(slower > s && slower < 10.01, "{slower}");
    }
}
