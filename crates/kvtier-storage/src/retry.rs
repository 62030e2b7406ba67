//! [`Retrying`]: retries a backend's transient failures with bounded, jittered backoff, so
//! that one failed call in twenty (S3 throttling, a remote node's pause, a disk being cleaned)
//! costs a few milliseconds instead of a page.
//!
//! It sits under the circuit breaker ([`crate::wrappers::Breaker`]), which then judges the
//! backend by what retries could not save: isolated errors never open it, a dead backend
//! does. Retries run inside the caller's deadline: the caller drops the future when its
//! deadline passes (as [`crate::PageStore`] does), and a backoff that would outlive
//! `budget` is not started.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;

use crate::{ObjectSink, Removed, StorageError, Store, StoreStats};

/// How [`Retrying`] retries.
#[derive(Clone, Copy, Debug)]
pub struct RetryPolicy {
    /// Attempts after the first (0: no retries).
    pub retries: u32,
    /// Backoff before the first retry; it doubles for each next one, up to `max_backoff`.
    /// Each wait is drawn uniformly from half to all of it (jitter), so callers that failed
    /// together do not retry together.
    pub base_backoff: Duration,
    /// Longest backoff.
    pub max_backoff: Duration,
    /// No backoff starts that would end more than this after the call began (the caller's
    /// deadline: a retry that cannot finish in time is not tried).
    pub budget: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            retries: 2,
            base_backoff: Duration::from_millis(10),
            max_backoff: Duration::from_millis(500),
            budget: Duration::from_secs(5),
        }
    }
}

impl RetryPolicy {
    /// The backoff before retry `n` (1 for the first), jittered by `roll` (any u64).
    pub fn backoff(&self, n: u32, roll: u64) -> Duration {
        let full = self
            .base_backoff
            .saturating_mul(1u32 << n.saturating_sub(1).min(16))
            .min(self.max_backoff);
        let half = full / 2;
        let span = (full - half).as_nanos() as u64;
        half + Duration::from_nanos(if span == 0 { 0 } else { roll % (span + 1) })
    }
}

/// Retries transient failures of the wrapped store (see the module doc).
#[derive(Debug)]
pub struct Retrying {
    inner: Arc<dyn Store>,
    policy: RetryPolicy,
    rng: AtomicU64,
    retries: AtomicU64,
    saved: AtomicU64,
}

/// What retries did: attempts after a failure, and calls they turned into a success.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RetryCounts {
    /// Retries made.
    pub retries: u64,
    /// Calls that failed at first and then succeeded.
    pub saved: u64,
}

impl Retrying {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn Store>, policy: RetryPolicy) -> Self {
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64);
        Self {
            inner,
            policy,
            rng: AtomicU64::new(seed | 1),
            retries: AtomicU64::new(0),
            saved: AtomicU64::new(0),
        }
    }

    /// What retries did so far.
    pub fn counts(&self) -> RetryCounts {
        RetryCounts {
            retries: self.retries.load(Ordering::Relaxed),
            saved: self.saved.load(Ordering::Relaxed),
        }
    }

    fn roll(&self) -> u64 {
        // SplitMix64 on a shared counter: cheap and lock-free; jitter needs no more.
        let mut z = self
            .rng
            .fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed)
            .wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    async fn call<T, F, Fut>(&self, op: F) -> Result<T, StorageError>
    where
        F: Fn() -> Fut,
        Fut: Future<Output = Result<T, StorageError>>,
    {
        let started = Instant::now();
        let mut attempt = 0;
        loop {
            match op().await {
                Ok(v) => {
                    if attempt > 0 {
                        self.saved.fetch_add(1, Ordering::Relaxed);
                    }
                    return Ok(v);
                }
                Err(e) if e.is_retryable() && attempt < self.policy.retries => {
                    attempt += 1;
                    let wait = self.policy.backoff(attempt, self.roll());
                    if started.elapsed() + wait >= self.policy.budget {
                        return Err(e);
                    }
                    self.retries.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(attempt, backend = self.inner.kind(), "retrying: {e}");
                    tokio::time::sleep(wait).await;
                }
                Err(e) => return Err(e),
            }
        }
    }
}

// A wrapper forwards every method: one left to the trait's default would bypass it.
#[deny(clippy::missing_trait_methods)]
#[async_trait]
impl Store for Retrying {
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }
    async fn get(&self, name: &str) -> Result<Option<Bytes>, StorageError> {
        self.call(|| self.inner.get(name)).await
    }
    async fn set(&self, name: &str, head: Bytes, body: Bytes) -> Result<(), StorageError> {
        self.call(|| self.inner.set(name, head.clone(), body.clone()))
            .await
    }
    async fn exists(&self, name: &str) -> Result<bool, StorageError> {
        self.call(|| self.inner.exists(name)).await
    }
    async fn delete(&self, name: &str) -> Result<(), StorageError> {
        self.call(|| self.inner.delete(name)).await
    }
    async fn clear(&self) -> Result<u64, StorageError> {
        // Long-running and idempotent, but not retried: a clear that failed part-way is
        // reported, and the operator runs it again.
        self.inner.clear().await
    }
    async fn exists_prefix(&self, names: &[String]) -> Result<usize, StorageError> {
        self.call(|| self.inner.exists_prefix(names)).await
    }
    async fn read_into(
        &self,
        name: &str,
        split: usize,
        sink: Arc<dyn ObjectSink>,
    ) -> Result<Option<(Bytes, u64)>, StorageError> {
        // A retry writes the body from offset 0 again: what a failed attempt wrote is
        // overwritten before the caller sees anything.
        self.call(|| self.inner.read_into(name, split, sink.clone()))
            .await
    }
    fn stats(&self) -> StoreStats {
        self.inner.stats()
    }
    fn take_removed(&self) -> Removed {
        self.inner.take_removed()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::memory::MemoryStore;
    use crate::wrappers::Flaky;

    #[test]
    fn backoff_doubles_is_jittered_and_capped() {
        let p = RetryPolicy {
            retries: 8,
            base_backoff: Duration::from_millis(10),
            max_backoff: Duration::from_millis(50),
            budget: Duration::from_secs(1),
        };
        for roll in [0, 1, u64::MAX / 3, u64::MAX] {
            let b1 = p.backoff(1, roll);
            assert!(b1 >= Duration::from_millis(5) && b1 <= Duration::from_millis(10));
            let b2 = p.backoff(2, roll);
            assert!(b2 >= Duration::from_millis(10) && b2 <= Duration::from_millis(20));
            let b9 = p.backoff(9, roll);
            assert!(b9 >= Duration::from_millis(25) && b9 <= Duration::from_millis(50));
        }
        assert_ne!(p.backoff(3, 1), p.backoff(3, 12_345_678));
    }

    #[tokio::test]
    async fn transient_failures_are_retried_and_permanent_ones_are_not() {
        let mem: Arc<dyn Store> = Arc::new(MemoryStore::new());
        mem.set("ab", Bytes::from_static(b"h"), Bytes::from_static(b"body"))
            .await
            .unwrap();
        // One call in three fails: with 4 retries nearly every call gets through.
        let flaky: Arc<dyn Store> = Arc::new(Flaky::new(mem, 0.3, 7));
        let r = Retrying::new(
            flaky,
            RetryPolicy {
                retries: 4,
                base_backoff: Duration::from_micros(100),
                max_backoff: Duration::from_millis(1),
                budget: Duration::from_secs(1),
            },
        );
        let mut ok = 0;
        for _ in 0..200 {
            if r.get("ab").await.is_ok_and(|v| v.is_some()) {
                ok += 1;
            }
        }
        assert!(ok >= 195, "{ok} of 200 got through");
        let c = r.counts();
        assert!(c.retries > 40 && c.saved > 40, "{c:?}");
        // A bad name is the caller's error: never retried.
        let plain = Retrying::new(Arc::new(MemoryStore::new()), RetryPolicy::default());
        assert!(matches!(
            plain.get("not hex").await,
            Err(StorageError::Invalid(_))
        ));
        assert_eq!(plain.counts(), RetryCounts::default());
    }

    #[tokio::test]
    async fn no_backoff_outlives_the_budget() {
        let mem: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let dead: Arc<dyn Store> = Arc::new(Flaky::new(mem, 1.0, 1));
        let r = Retrying::new(
            dead,
            RetryPolicy {
                retries: 100,
                base_backoff: Duration::from_millis(20),
                max_backoff: Duration::from_millis(20),
                budget: Duration::from_millis(100),
            },
        );
        let t = Instant::now();
        assert!(r.get("ab").await.is_err());
        assert!(
            t.elapsed() < Duration::from_millis(150),
            "{:?}",
            t.elapsed()
        );
        assert!(r.counts().retries <= 10);
    }
}
