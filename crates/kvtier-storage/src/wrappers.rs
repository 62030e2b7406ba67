//! Wrappers that compose over any [`Store`]: a circuit breaker that turns a failing backend
//! into fast misses, and a fault injector for tests.

use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use std::sync::Arc;

use crate::{ObjectSink, Removed, StorageError, Store, StoreStats};

/// Breaker settings.
#[derive(Clone, Copy, Debug)]
pub struct BreakerConfig {
    /// Share of calls failing over `window` that opens the breaker (0 < rate ≤ 1).
    pub failure_rate: f64,
    /// Calls the window must hold before its rate is judged: a few errors never open it.
    pub min_calls: u32,
    /// How far back the failure rate looks.
    pub window: Duration,
    /// How long it stays open before one probe call is let through.
    pub cooldown: Duration,
    /// Deadline of each call to the backend; a call that takes longer counts as a failure.
    pub timeout: Duration,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        Self {
            failure_rate: 0.5,
            min_calls: 10,
            window: Duration::from_secs(10),
            cooldown: Duration::from_secs(1),
            timeout: Duration::from_secs(5),
        }
    }
}

/// What the breaker is doing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BreakerState {
    /// Calls go through.
    Closed,
    /// Calls fail at once with [`StorageError::Unavailable`].
    Open,
    /// One probe call is in flight; others fail at once.
    HalfOpen,
}

/// Buckets the failure-rate window is kept in.
const BUCKETS: usize = 10;

/// Call outcomes over a sliding window, in [`BUCKETS`] buckets of `window / BUCKETS`.
#[derive(Debug)]
struct Window {
    span: Duration,
    start: Instant,
    /// (ok, failed) per bucket; bucket `i` covers the `i`-th span since `start`, mod BUCKETS.
    counts: [(u32, u32); BUCKETS],
    /// Index of the newest bucket since `start`.
    newest: u64,
}

impl Window {
    fn new(window: Duration, now: Instant) -> Self {
        Self {
            span: (window / BUCKETS as u32).max(Duration::from_millis(1)),
            start: now,
            counts: [(0, 0); BUCKETS],
            newest: 0,
        }
    }

    fn advance(&mut self, now: Instant) {
        let at =
            (now.saturating_duration_since(self.start).as_nanos() / self.span.as_nanos()) as u64;
        let gone = at.saturating_sub(self.newest).min(BUCKETS as u64);
        for i in 1..=gone {
            self.counts[((self.newest + i) % BUCKETS as u64) as usize] = (0, 0);
        }
        self.newest = self.newest.max(at);
    }

    fn record(&mut self, ok: bool, now: Instant) {
        self.advance(now);
        let b = &mut self.counts[(self.newest % BUCKETS as u64) as usize];
        if ok {
            b.0 += 1;
        } else {
            b.1 += 1;
        }
    }

    /// (calls, failures) in the window.
    fn totals(&self) -> (u32, u32) {
        self.counts
            .iter()
            .fold((0, 0), |(c, f), (o, x)| (c + o + x, f + x))
    }

    fn clear(&mut self) {
        self.counts = [(0, 0); BUCKETS];
    }
}

/// Breaker transitions so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BreakerCounts {
    /// Closed → open (the backend judged down).
    pub opened: u64,
    /// Open → half-open (a probe let through).
    pub probes: u64,
    /// Half-open → closed (a probe succeeded).
    pub closed: u64,
    /// Calls refused while open.
    pub rejected: u64,
}

#[derive(Debug)]
struct Inner {
    state: BreakerState,
    window: Window,
    opened_at: Instant,
    probe_started: Instant,
}

/// A circuit breaker around a backend. Sustained failure opens it — at least
/// `failure_rate` of the calls over `window`, once the window holds `min_calls` — and calls
/// then fail immediately (callers see misses; writes stay queued) instead of waiting on a
/// dead backend. Isolated errors never open it. After the cooldown one probe call goes
/// through (half-open); its success closes the breaker, its failure opens it again.
#[derive(Debug)]
pub struct Breaker {
    inner: Arc<dyn Store>,
    cfg: BreakerConfig,
    st: Mutex<Inner>,
    opens: AtomicU64,
    probes: AtomicU64,
    closes: AtomicU64,
    rejected: AtomicU64,
}

/// Whether an error says the backend is unhealthy (as opposed to a bad request or a caller's
/// cancellation).
fn is_backend_failure(e: &StorageError) -> bool {
    matches!(
        e,
        StorageError::Io { .. }
            | StorageError::Timeout(_)
            | StorageError::Backend { .. }
            | StorageError::Unavailable(_)
    )
}

impl Breaker {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn Store>, cfg: BreakerConfig) -> Self {
        let now = Instant::now();
        Self {
            inner,
            cfg,
            st: Mutex::new(Inner {
                state: BreakerState::Closed,
                window: Window::new(cfg.window, now),
                opened_at: now,
                probe_started: now,
            }),
            opens: AtomicU64::new(0),
            probes: AtomicU64::new(0),
            closes: AtomicU64::new(0),
            rejected: AtomicU64::new(0),
        }
    }

    fn lock(&self) -> parking_lot::MutexGuard<'_, Inner> {
        self.st.lock()
    }

    /// The current state.
    pub fn state(&self) -> BreakerState {
        self.lock().state
    }

    /// Its transitions and refusals so far.
    pub fn counts(&self) -> BreakerCounts {
        BreakerCounts {
            opened: self.opens.load(Ordering::Relaxed),
            probes: self.probes.load(Ordering::Relaxed),
            closed: self.closes.load(Ordering::Relaxed),
            rejected: self.rejected.load(Ordering::Relaxed),
        }
    }

    /// Decides whether a call may go to the backend now.
    fn admit(&self) -> Result<(), StorageError> {
        let mut g = self.lock();
        let now = Instant::now();
        match g.state {
            BreakerState::Closed => Ok(()),
            BreakerState::Open if now.duration_since(g.opened_at) >= self.cfg.cooldown => {
                g.state = BreakerState::HalfOpen;
                g.probe_started = now;
                self.probes.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            // A probe that outlived its deadline was dropped by its caller: allow another.
            BreakerState::HalfOpen if now.duration_since(g.probe_started) > self.cfg.timeout => {
                g.probe_started = now;
                Ok(())
            }
            BreakerState::Open | BreakerState::HalfOpen => {
                self.rejected.fetch_add(1, Ordering::Relaxed);
                Err(StorageError::Unavailable(format!(
                    "{} backend's circuit breaker is open",
                    self.inner.kind()
                )))
            }
        }
    }

    fn record(&self, ok: bool) {
        let mut g = self.lock();
        let now = Instant::now();
        match (g.state, ok) {
            (BreakerState::HalfOpen, true) => {
                tracing::info!(backend = self.inner.kind(), "circuit breaker closed");
                self.closes.fetch_add(1, Ordering::Relaxed);
                g.state = BreakerState::Closed;
                g.window.clear();
            }
            (BreakerState::HalfOpen, false) => {
                g.state = BreakerState::Open;
                g.opened_at = now;
            }
            (BreakerState::Closed, _) => {
                g.window.record(ok, now);
                let (calls, failed) = g.window.totals();
                if !ok
                    && calls >= self.cfg.min_calls.max(1)
                    && f64::from(failed) >= self.cfg.failure_rate * f64::from(calls)
                {
                    self.opens.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(
                        backend = self.inner.kind(),
                        calls,
                        failed,
                        "circuit breaker opened: calls fail fast until a probe succeeds"
                    );
                    g.state = BreakerState::Open;
                    g.opened_at = now;
                }
            }
            // Calls admitted before it opened end while it is open: they change nothing.
            (BreakerState::Open, _) => {}
        }
    }

    async fn call<T>(
        &self,
        fut: impl Future<Output = Result<T, StorageError>>,
    ) -> Result<T, StorageError> {
        self.admit()?;
        let r = match tokio::time::timeout(self.cfg.timeout, fut).await {
            Ok(r) => r,
            Err(_) => Err(StorageError::Timeout(self.cfg.timeout)),
        };
        match &r {
            Ok(_) => self.record(true),
            Err(e) if is_backend_failure(e) => self.record(false),
            // A bad name or a full disk says nothing about the backend's health.
            Err(_) => {}
        }
        r
    }
}

// A wrapper forwards every method: one left to the trait's default would bypass it.
#[deny(clippy::missing_trait_methods)]
#[async_trait]
impl Store for Breaker {
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }
    async fn get(&self, name: &str) -> Result<Option<Bytes>, StorageError> {
        self.call(self.inner.get(name)).await
    }
    async fn set(&self, name: &str, head: Bytes, body: Bytes) -> Result<(), StorageError> {
        self.call(self.inner.set(name, head, body)).await
    }
    async fn exists(&self, name: &str) -> Result<bool, StorageError> {
        self.call(self.inner.exists(name)).await
    }
    async fn delete(&self, name: &str) -> Result<(), StorageError> {
        self.call(self.inner.delete(name)).await
    }
    async fn clear(&self) -> Result<u64, StorageError> {
        // Not under the call deadline (a clear walks the whole store), but refused while the
        // breaker is open.
        if self.state() != BreakerState::Closed {
            return Err(StorageError::Unavailable(
                "l3 circuit breaker is open".into(),
            ));
        }
        self.inner.clear().await
    }
    async fn exists_prefix(&self, names: &[String]) -> Result<usize, StorageError> {
        self.call(self.inner.exists_prefix(names)).await
    }
    async fn read_into(
        &self,
        name: &str,
        split: usize,
        sink: Arc<dyn ObjectSink>,
    ) -> Result<Option<(Bytes, u64)>, StorageError> {
        self.call(self.inner.read_into(name, split, sink)).await
    }
    fn stats(&self) -> StoreStats {
        self.inner.stats()
    }
    fn take_removed(&self) -> Removed {
        self.inner.take_removed()
    }
}

/// How [`Faulty`] misbehaves while failing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Every call returns an I/O error.
    Error,
    /// Every call hangs until its caller gives up.
    Hang,
}

/// A fault injector for tests: passes calls through until told to fail, then fails them all
/// (or hangs them) until told to stop.
#[derive(Debug)]
pub struct Faulty {
    inner: Arc<dyn Store>,
    failing: AtomicBool,
    hang: AtomicBool,
    calls: AtomicU64,
}

impl Faulty {
    /// Wraps `inner`, healthy.
    pub fn new(inner: Arc<dyn Store>) -> Self {
        Self {
            inner,
            failing: AtomicBool::new(false),
            hang: AtomicBool::new(false),
            calls: AtomicU64::new(0),
        }
    }

    /// Starts failing every call in the given way, or stops (`None`).
    pub fn set_fault(&self, fault: Option<Fault>) {
        self.hang
            .store(fault == Some(Fault::Hang), Ordering::SeqCst);
        self.failing.store(fault.is_some(), Ordering::SeqCst);
    }

    /// Calls that reached the wrapped store or were failed here.
    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::Relaxed)
    }

    async fn gate(&self, op: &'static str) -> Result<(), StorageError> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        if !self.failing.load(Ordering::SeqCst) {
            return Ok(());
        }
        if self.hang.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        Err(StorageError::Io {
            op,
            target: "faulty".into(),
            source: std::io::Error::other("injected fault"),
        })
    }
}

// A wrapper forwards every method: one left to the trait's default would bypass it.
#[deny(clippy::missing_trait_methods)]
#[async_trait]
impl Store for Faulty {
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }
    async fn get(&self, name: &str) -> Result<Option<Bytes>, StorageError> {
        self.gate("get").await?;
        self.inner.get(name).await
    }
    async fn set(&self, name: &str, head: Bytes, body: Bytes) -> Result<(), StorageError> {
        self.gate("set").await?;
        self.inner.set(name, head, body).await
    }
    async fn exists(&self, name: &str) -> Result<bool, StorageError> {
        self.gate("exists").await?;
        self.inner.exists(name).await
    }
    async fn delete(&self, name: &str) -> Result<(), StorageError> {
        self.gate("delete").await?;
        self.inner.delete(name).await
    }
    async fn clear(&self) -> Result<u64, StorageError> {
        self.gate("clear").await?;
        self.inner.clear().await
    }
    async fn exists_prefix(&self, names: &[String]) -> Result<usize, StorageError> {
        self.gate("exists").await?;
        self.inner.exists_prefix(names).await
    }
    async fn read_into(
        &self,
        name: &str,
        split: usize,
        sink: Arc<dyn ObjectSink>,
    ) -> Result<Option<(Bytes, u64)>, StorageError> {
        self.gate("get").await?;
        self.inner.read_into(name, split, sink).await
    }
    fn stats(&self) -> StoreStats {
        self.inner.stats()
    }
    fn take_removed(&self) -> Removed {
        self.inner.take_removed()
    }
}

/// A slow backend, for chaos drills and tests: every `get` waits `delay` before it starts,
/// every `set` waits `set_delay`. The wait is inside the call, so callers' deadlines and
/// cancellation cut it short as they would a slow real backend.
#[derive(Debug)]
pub struct Delayed {
    inner: Arc<dyn Store>,
    delay: Duration,
    set_delay: Duration,
}

impl Delayed {
    /// Wraps `inner`; reads wait `delay` first.
    pub fn new(inner: Arc<dyn Store>, delay: Duration) -> Self {
        Self::with_writes(inner, delay, Duration::ZERO)
    }

    /// Wraps `inner`; reads wait `delay` first, writes `set_delay`.
    pub fn with_writes(inner: Arc<dyn Store>, delay: Duration, set_delay: Duration) -> Self {
        Self {
            inner,
            delay,
            set_delay,
        }
    }
}

// A wrapper forwards every method: one left to the trait's default would bypass it.
#[deny(clippy::missing_trait_methods)]
#[async_trait]
impl Store for Delayed {
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }
    async fn get(&self, name: &str) -> Result<Option<Bytes>, StorageError> {
        tokio::time::sleep(self.delay).await;
        self.inner.get(name).await
    }
    async fn read_into(
        &self,
        name: &str,
        split: usize,
        sink: Arc<dyn ObjectSink>,
    ) -> Result<Option<(Bytes, u64)>, StorageError> {
        tokio::time::sleep(self.delay).await;
        self.inner.read_into(name, split, sink).await
    }
    async fn set(&self, name: &str, head: Bytes, body: Bytes) -> Result<(), StorageError> {
        if !self.set_delay.is_zero() {
            tokio::time::sleep(self.set_delay).await;
        }
        self.inner.set(name, head, body).await
    }
    async fn exists(&self, name: &str) -> Result<bool, StorageError> {
        self.inner.exists(name).await
    }
    async fn delete(&self, name: &str) -> Result<(), StorageError> {
        self.inner.delete(name).await
    }
    async fn clear(&self) -> Result<u64, StorageError> {
        self.inner.clear().await
    }
    async fn exists_prefix(&self, names: &[String]) -> Result<usize, StorageError> {
        self.inner.exists_prefix(names).await
    }
    fn stats(&self) -> StoreStats {
        self.inner.stats()
    }
    fn take_removed(&self) -> Removed {
        self.inner.take_removed()
    }
}

/// An unreliable backend, for chaos drills and tests: each call fails with probability
/// `rate` (an I/O error), decided by a fast deterministic generator so runs are repeatable.
#[derive(Debug)]
pub struct Flaky {
    inner: Arc<dyn Store>,
    /// `rate` scaled to `u32::MAX`.
    threshold: u32,
    state: AtomicU64,
}

impl Flaky {
    /// Wraps `inner`; calls fail with probability `rate` (0.0 to 1.0), from `seed`.
    pub fn new(inner: Arc<dyn Store>, rate: f64, seed: u64) -> Self {
        Self {
            inner,
            threshold: (rate.clamp(0.0, 1.0) * f64::from(u32::MAX)) as u32,
            state: AtomicU64::new(seed | 1),
        }
    }

    fn roll(&self, op: &'static str) -> Result<(), StorageError> {
        // SplitMix64 step on a shared counter: cheap, lock-free, repeatable for a seed.
        let x = self
            .state
            .fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed)
            .wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        if ((z ^ (z >> 31)) as u32) < self.threshold {
            return Err(StorageError::Io {
                op,
                target: "flaky".into(),
                source: std::io::Error::other("injected random fault"),
            });
        }
        Ok(())
    }
}

// A wrapper forwards every method: one left to the trait's default would bypass it.
#[deny(clippy::missing_trait_methods)]
#[async_trait]
impl Store for Flaky {
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }
    async fn get(&self, name: &str) -> Result<Option<Bytes>, StorageError> {
        self.roll("get")?;
        self.inner.get(name).await
    }
    async fn set(&self, name: &str, head: Bytes, body: Bytes) -> Result<(), StorageError> {
        self.roll("set")?;
        self.inner.set(name, head, body).await
    }
    async fn exists(&self, name: &str) -> Result<bool, StorageError> {
        self.roll("exists")?;
        self.inner.exists(name).await
    }
    async fn delete(&self, name: &str) -> Result<(), StorageError> {
        self.inner.delete(name).await
    }
    async fn clear(&self) -> Result<u64, StorageError> {
        self.inner.clear().await
    }
    async fn exists_prefix(&self, names: &[String]) -> Result<usize, StorageError> {
        self.roll("exists")?;
        self.inner.exists_prefix(names).await
    }
    async fn read_into(
        &self,
        name: &str,
        split: usize,
        sink: Arc<dyn ObjectSink>,
    ) -> Result<Option<(Bytes, u64)>, StorageError> {
        self.roll("get")?;
        self.inner.read_into(name, split, sink).await
    }
    fn stats(&self) -> StoreStats {
        self.inner.stats()
    }
    fn take_removed(&self) -> Removed {
        self.inner.take_removed()
    }
}

/// Receives one record per backend call from [`Metered`]: which backend, which operation,
/// how it ended (`hit`, `miss`, `ok`, or an error's [`StorageError::reason`]), the bytes moved
/// and the time taken. The daemon turns these into Prometheus metrics.
pub trait StoreObserver: Send + Sync + std::fmt::Debug {
    /// One finished call.
    fn observe(
        &self,
        backend: &'static str,
        op: &'static str,
        outcome: &'static str,
        bytes: u64,
        seconds: f64,
    );
}

/// Measures every call to a backend and reports it to a [`StoreObserver`].
#[derive(Debug)]
pub struct Metered {
    inner: Arc<dyn Store>,
    observer: Arc<dyn StoreObserver>,
}

impl Metered {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn Store>, observer: Arc<dyn StoreObserver>) -> Self {
        Self { inner, observer }
    }

    fn record<T>(
        &self,
        op: &'static str,
        t: Instant,
        r: &Result<T, StorageError>,
        outcome: &'static str,
        bytes: u64,
    ) {
        let outcome = match r {
            Ok(_) => outcome,
            Err(e) => e.reason(),
        };
        self.observer.observe(
            self.inner.kind(),
            op,
            outcome,
            bytes,
            t.elapsed().as_secs_f64(),
        );
    }
}

// A wrapper forwards every method: one left to the trait's default would bypass it.
#[deny(clippy::missing_trait_methods)]
#[async_trait]
impl Store for Metered {
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }
    async fn get(&self, name: &str) -> Result<Option<Bytes>, StorageError> {
        let t = Instant::now();
        let r = self.inner.get(name).await;
        let (outcome, bytes) = match &r {
            Ok(Some(b)) => ("hit", b.len() as u64),
            _ => ("miss", 0),
        };
        self.record("get", t, &r, outcome, bytes);
        r
    }
    async fn read_into(
        &self,
        name: &str,
        split: usize,
        sink: Arc<dyn ObjectSink>,
    ) -> Result<Option<(Bytes, u64)>, StorageError> {
        let t = Instant::now();
        let r = self.inner.read_into(name, split, sink).await;
        let (outcome, bytes) = match &r {
            Ok(Some((head, rest))) => ("hit", head.len() as u64 + rest),
            _ => ("miss", 0),
        };
        self.record("get", t, &r, outcome, bytes);
        r
    }
    async fn set(&self, name: &str, head: Bytes, body: Bytes) -> Result<(), StorageError> {
        let t = Instant::now();
        let bytes = (head.len() + body.len()) as u64;
        let r = self.inner.set(name, head, body).await;
        self.record("set", t, &r, "ok", bytes);
        r
    }
    async fn exists(&self, name: &str) -> Result<bool, StorageError> {
        let t = Instant::now();
        let r = self.inner.exists(name).await;
        let outcome = if matches!(r, Ok(true)) { "hit" } else { "miss" };
        self.record("exists", t, &r, outcome, 0);
        r
    }
    async fn exists_prefix(&self, names: &[String]) -> Result<usize, StorageError> {
        let t = Instant::now();
        let r = self.inner.exists_prefix(names).await;
        let outcome = if matches!(r, Ok(n) if n == names.len()) {
            "hit"
        } else {
            "miss"
        };
        self.record("exists_prefix", t, &r, outcome, 0);
        r
    }
    async fn delete(&self, name: &str) -> Result<(), StorageError> {
        let t = Instant::now();
        let r = self.inner.delete(name).await;
        self.record("delete", t, &r, "ok", 0);
        r
    }
    async fn clear(&self) -> Result<u64, StorageError> {
        let t = Instant::now();
        let r = self.inner.clear().await;
        self.record("clear", t, &r, "ok", 0);
        r
    }
    fn stats(&self) -> StoreStats {
        self.inner.stats()
    }
    fn take_removed(&self) -> Removed {
        self.inner.take_removed()
    }
}
