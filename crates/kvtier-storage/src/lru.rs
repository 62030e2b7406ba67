//! What the local backends (file, rocksdb) share: the size-bounded LRU index that keeps
//! their capacity bound (accounting only; the backend deletes what it returns), the clock it
//! runs on, and the hand-off of blocking I/O to tokio's blocking pool.

use std::collections::{BTreeSet, HashMap};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use crate::StorageError;

/// Nanoseconds since the epoch: the LRU's notion of "last access".
pub(crate) fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// Refuses an object that could never fit under the capacity bound (0: unbounded).
pub(crate) fn check_fits(size: u64, capacity: u64) -> Result<(), StorageError> {
    if capacity > 0 && size > capacity {
        return Err(StorageError::NoSpace(format!(
            "object of {size} bytes exceeds capacity_bytes {capacity}"
        )));
    }
    Ok(())
}

/// Runs blocking I/O of `backend` off the async workers.
pub(crate) async fn blocking<T: Send + 'static>(
    backend: &'static str,
    f: impl FnOnce() -> Result<T, StorageError> + Send + 'static,
) -> Result<T, StorageError> {
    match tokio::task::spawn_blocking(f).await {
        Ok(r) => r,
        Err(e) => Err(StorageError::Backend {
            backend,
            message: format!("blocking task failed: {e}"),
            retryable: true,
        }),
    }
}

/// Object sizes and last-access times, ordered for eviction.
#[derive(Debug, Default)]
pub(crate) struct Index {
    /// name → (bytes, last access in ns since the epoch)
    pub(crate) entries: HashMap<String, (u64, u64)>,
    lru: BTreeSet<(u64, String)>,
    pub(crate) bytes: u64,
    pub(crate) evictions: u64,
    pub(crate) delete_failures: u64,
}

impl Index {
    pub(crate) fn insert(&mut self, name: &str, size: u64, at: u64) {
        if let Some((old_size, old_at)) = self.entries.insert(name.to_string(), (size, at)) {
            self.bytes -= old_size;
            self.lru.remove(&(old_at, name.to_string()));
        }
        self.bytes += size;
        self.lru.insert((at, name.to_string()));
    }

    pub(crate) fn remove(&mut self, name: &str) {
        if let Some((size, at)) = self.entries.remove(name) {
            self.bytes -= size;
            self.lru.remove(&(at, name.to_string()));
        }
    }

    pub(crate) fn touch(&mut self, name: &str, at: u64) {
        if let Some(e) = self.entries.get_mut(name) {
            let old = e.1;
            e.1 = at;
            self.lru.remove(&(old, name.to_string()));
            self.lru.insert((at, name.to_string()));
        }
    }

    /// Takes least recently used objects out until `bytes <= capacity`, sparing `keep`.
    pub(crate) fn victims(&mut self, capacity: u64, keep: &str) -> Vec<String> {
        let mut out = Vec::new();
        while capacity > 0 && self.bytes > capacity {
            let Some(first) = self.lru.iter().find(|(_, n)| n != keep).cloned() else {
                break;
            };
            self.remove(&first.1);
            self.evictions += 1;
            out.push(first.1);
        }
        out
    }
}

/// Locks an index (or a sink's state), riding over a poisoned lock (their updates are
/// single statements).
pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}
