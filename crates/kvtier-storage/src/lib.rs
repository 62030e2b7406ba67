//! kvtier-storage: the L3 tier. A small [`Store`] trait over named, opaque objects that every
//! backend implements; the page [`format`] (header + checksum) and [`PageStore`], which frames
//! pages into objects and turns every failure into a miss that says why; the backends; and a
//! [`conformance`] suite that every backend must pass.
//!
//! The cut follows object_store: backends only store bytes under names, atomically; everything
//! that makes those bytes trustworthy (layout fingerprint in the name and the header, page key,
//! length, CRC32C) lives once, above them. So a backend cannot serve a torn, stale or foreign
//! page as a hit: the framing layer refuses it, counts it and deletes it.

pub mod conformance;
mod direct;
pub mod file;
pub mod format;
mod lru;
pub mod memory;
mod open;
mod page;
pub mod remote;
pub mod retry;
pub mod rocks;
pub mod s3;
pub mod wrappers;

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use tokio_util::sync::CancellationToken;

pub use lru::TenantBytes;
pub use open::open_backend;
pub use page::{Fetch, Landed, MissReason, PageStore, PageStoreStats, Verified};

/// Why a storage operation failed. Absence is not an error: `get` returns `Ok(None)`.
#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    /// An I/O call failed.
    #[error("{op} {target}: {source}")]
    Io {
        /// The operation.
        op: &'static str,
        /// The object or path.
        target: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The call's deadline passed.
    #[error("deadline exceeded after {0:?}")]
    Timeout(Duration),
    /// The call was cancelled.
    #[error("cancelled")]
    Cancelled,
    /// The backend refuses writes: its capacity or the disk's free-space guard is reached.
    #[error("no space: {0}")]
    NoSpace(String),
    /// The backend is unavailable (e.g. its circuit breaker is open).
    #[error("unavailable: {0}")]
    Unavailable(String),
    /// A backend-specific failure (a remote service's error).
    #[error("{backend}: {message}")]
    Backend {
        /// Which backend.
        backend: &'static str,
        /// What it said.
        message: String,
        /// Whether the backend says a retry may succeed.
        retryable: bool,
    },
    /// The object name or configuration is invalid.
    #[error("invalid: {0}")]
    Invalid(String),
    /// The read's destination refused the object's bytes (more of them than the page it
    /// should be, or out of order): the object is not the page asked for.
    #[error("refused by the destination: {0}")]
    Refused(String),
}

impl StorageError {
    /// Whether retrying the same call could succeed.
    pub fn is_retryable(&self) -> bool {
        match self {
            StorageError::Io { source, .. } => !matches!(
                source.kind(),
                std::io::ErrorKind::PermissionDenied | std::io::ErrorKind::InvalidInput
            ),
            StorageError::Timeout(_) | StorageError::Unavailable(_) => true,
            StorageError::Backend { retryable, .. } => *retryable,
            StorageError::Cancelled
            | StorageError::NoSpace(_)
            | StorageError::Invalid(_)
            | StorageError::Refused(_) => false,
        }
    }

    /// A short, bounded label for metrics.
    pub fn reason(&self) -> &'static str {
        match self {
            StorageError::Io { .. } => "io",
            StorageError::Timeout(_) => "timeout",
            StorageError::Cancelled => "cancelled",
            StorageError::NoSpace(_) => "no_space",
            StorageError::Unavailable(_) => "unavailable",
            StorageError::Backend { .. } => "backend",
            StorageError::Invalid(_) => "invalid",
            StorageError::Refused(_) => "refused",
        }
    }
}

/// The cancellation token and deadline every storage call carries. [`PageStore`] applies it
/// around each backend call, so every backend honours it the same way (backend futures are
/// cancel safe by contract).
#[derive(Clone, Debug)]
pub struct OpCtx {
    /// Cancelled when the caller gives up (shutdown, request dropped).
    pub cancel: CancellationToken,
    /// When the call must have finished.
    pub deadline: Instant,
}

impl OpCtx {
    /// A context with `timeout` from now and a fresh token.
    pub fn timeout(timeout: Duration) -> Self {
        Self {
            cancel: CancellationToken::new(),
            deadline: Instant::now() + timeout,
        }
    }

    /// A context under `parent`'s cancellation.
    pub fn child(parent: &CancellationToken, timeout: Duration) -> Self {
        Self {
            cancel: parent.child_token(),
            deadline: Instant::now() + timeout,
        }
    }

    /// Runs `fut` until it finishes, the deadline passes or the token is cancelled. A future
    /// that is cut short is dropped; backends make that safe (see [`Store`]).
    pub async fn run<T>(
        &self,
        fut: impl Future<Output = Result<T, StorageError>>,
    ) -> Result<T, StorageError> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        tokio::select! {
            r = fut => r,
            () = self.cancel.cancelled() => Err(StorageError::Cancelled),
            () = tokio::time::sleep(left) => Err(StorageError::Timeout(left)),
        }
    }
}

/// What a backend reports about itself.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StoreStats {
    /// Objects held (as far as the backend tracks them).
    pub objects: u64,
    /// Bytes held.
    pub bytes: u64,
    /// Capacity bound in bytes (0: unbounded).
    pub capacity: u64,
    /// Objects evicted to honour the capacity bound.
    pub evictions: u64,
    /// Objects it failed to delete (left on disk, forgotten by the index).
    pub delete_failures: u64,
    /// Per tenant it tracks (`tenant_quotas` of the file and RocksDB backends): what it
    /// holds, its byte quota and the evictions that quota made. Empty for the others.
    pub tenants: Vec<TenantBytes>,
}

/// Objects a backend removed on its own since it was last asked ([`Store::take_removed`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Removed {
    /// Their names, oldest first.
    pub names: Vec<String>,
    /// More were removed between two calls than a backend remembers ([`REMOVED_LOG`]): the
    /// names are incomplete, and a listener should forget what it knew this store held.
    pub overflowed: bool,
}

impl Removed {
    /// Whether nothing was removed.
    pub fn is_empty(&self) -> bool {
        self.names.is_empty() && !self.overflowed
    }
}

/// Most removals a backend remembers between two [`Store::take_removed`] calls.
pub const REMOVED_LOG: usize = 65_536;

/// A backend's log of its own removals, bounded by [`REMOVED_LOG`].
#[derive(Debug, Default)]
pub(crate) struct RemovedLog(Removed);

impl RemovedLog {
    pub(crate) fn push(&mut self, name: &str) {
        if self.0.overflowed {
            return;
        }
        if self.0.names.len() == REMOVED_LOG {
            self.0.names = Vec::new();
            self.0.overflowed = true;
            return;
        }
        self.0.names.push(name.to_string());
    }

    pub(crate) fn take(&mut self) -> Removed {
        std::mem::take(&mut self.0)
    }
}

/// A backend: named, opaque objects.
///
/// Contract, for every implementation:
/// - **Atomic sets**: a reader sees an object in full or not at all (or a whole older version),
///   never a prefix, even if the writer crashes or the set future is dropped mid-way.
/// - **Idempotent**: setting the same bytes again, or deleting an absent object, succeeds.
/// - **Absence is not an error**: `get` of a missing object is `Ok(None)`, `exists` is `false`.
/// - **Cancel safety**: dropping any returned future leaves the store consistent (a set either
///   happened or did not).
/// - Objects may disappear at any time (capacity eviction, TTL, operator); callers treat
///   every object as a cache entry, never as the only copy.
/// - Names are `[0-9a-f/]` strings of at most 256 bytes (kvtier uses
///   `<fingerprint hex>/<page key hex>`).
#[async_trait]
pub trait Store: Send + Sync + fmt::Debug + 'static {
    /// The backend's kind (`file`, `memory`, `rocksdb`, `s3`, `remote`), for metrics and logs.
    fn kind(&self) -> &'static str;

    /// The object, or `None` when absent.
    async fn get(&self, name: &str) -> Result<Option<Bytes>, StorageError>;

    /// Stores `head ‖ body` under `name`, atomically. Two parts so a framed page is written
    /// straight from its header and payload buffers, without concatenating them first.
    async fn set(&self, name: &str, head: Bytes, body: Bytes) -> Result<(), StorageError>;

    /// Whether the object exists.
    async fn exists(&self, name: &str) -> Result<bool, StorageError>;

    /// Removes the object if present.
    async fn delete(&self, name: &str) -> Result<(), StorageError>;

    /// Removes every object of this store (its directory, database, or bucket prefix) and
    /// returns how many it removed. Sets that run concurrently may land either side of it.
    /// No default: a backend that cannot enumerate its objects says so with an error.
    async fn clear(&self) -> Result<u64, StorageError>;

    /// How many of `names`, from the first, exist (stops at the first absent one). Backends
    /// with a batch API override this; the default asks one by one.
    async fn exists_prefix(&self, names: &[String]) -> Result<usize, StorageError> {
        for (i, n) in names.iter().enumerate() {
            if !self.exists(n).await? {
                return Ok(i);
            }
        }
        Ok(names.len())
    }

    /// Reads object `name`, returning its first `split` bytes (fewer if it is shorter) and
    /// the length of the rest, which goes to `sink` in order (`write_at` with increasing
    /// offsets from 0). `None` when absent. Backends that can stream (file) override this so a
    /// page lands in its destination without a page-sized intermediate buffer; the default
    /// reads the whole object with [`Store::get`] and hands the rest over in one piece. A sink
    /// error stops the read and is returned as [`StorageError::Refused`].
    async fn read_into(
        &self,
        name: &str,
        split: usize,
        sink: Arc<dyn ObjectSink>,
    ) -> Result<Option<(Bytes, u64)>, StorageError> {
        let Some(obj) = self.get(name).await? else {
            return Ok(None);
        };
        let at = split.min(obj.len());
        let rest = obj.slice(at..);
        let len = rest.len() as u64;
        sink.take(rest).map_err(StorageError::Refused)?;
        Ok(Some((obj.slice(..at), len)))
    }

    /// Current statistics.
    fn stats(&self) -> StoreStats;

    /// The objects it removed on its own (capacity or quota evictions) since the last call,
    /// for kvtierd's L3 events. Backends that never remove objects themselves (S3, and
    /// `remote`, whose peer's store does its own) return none.
    fn take_removed(&self) -> Removed;
}

/// What a backend hands [`ObjectSink::fill_at`]: fills the destination it is given, all of it.
pub type Fill<'a> = &'a mut dyn FnMut(&mut [u8]) -> Result<(), String>;

/// Why [`ObjectSink::append_from`] stopped: the source failed, or the sink refused.
#[derive(Debug)]
pub enum SinkReadError {
    /// Reading the source failed.
    Io(std::io::Error),
    /// The sink refused the bytes, and why.
    Sink(String),
}

/// Where [`Store::read_into`] puts the bytes after the split: a slot of a shared-memory pool,
/// for instance. Called from whatever thread the backend reads on.
///
/// A backend delivers the rest in one of four ways, whichever costs it least: `take` when it
/// already holds the whole rest in memory (no copy where the sink can keep the bytes),
/// `append_from` to have the sink read a file's rest into memory it has not zeroed (one
/// copy, no zeroing), `fill_at` to read straight into the sink's memory (no intermediate
/// buffer), or `write_at` chunk by chunk from a buffer of its own. Offsets start at 0 and
/// only increase.
pub trait ObjectSink: Send + Sync {
    /// Stores `bytes` at `offset`; an error (no room, revoked) stops the read.
    fn write_at(&self, offset: u64, bytes: &[u8]) -> Result<(), String>;

    /// Takes the whole rest at once; the default copies it in with `write_at(0, ..)`.
    fn take(&self, rest: Bytes) -> Result<(), String> {
        self.write_at(0, &rest)
    }

    /// Hands the sink's own `len` bytes at `offset` to `fill`, which must fill all of them,
    /// and returns its result; `None` when the sink's memory cannot be handed out (shared
    /// memory that Rust must not reference, say), and the backend uses `write_at` instead.
    fn fill_at(&self, _offset: u64, _len: usize, _fill: Fill<'_>) -> Option<Result<(), String>> {
        None
    }

    /// Reads the rest of an object, `len` bytes by its size, from `src` to its end into
    /// memory the sink owns, without zeroing that memory first (a buffer's spare capacity),
    /// hands what landed to `seen` (the caller's checksum), and returns how many bytes came.
    /// `None` when the sink cannot (its memory is shared, or `len` exceeds what it expects):
    /// the backend then uses `fill_at` or `write_at`. Saves the zeroing a page-sized buffer
    /// would need before `fill_at` could lend it: about a tenth of a 2 MiB read here
    /// (`kvtier-bench --only l3_file --diag`).
    fn append_from(
        &self,
        _offset: u64,
        _len: u64,
        _src: &mut dyn std::io::Read,
        _seen: &mut dyn FnMut(&[u8]),
    ) -> Option<Result<u64, SinkReadError>> {
        None
    }
}

/// Checks an object name against the contract.
pub fn check_name(name: &str) -> Result<(), StorageError> {
    let ok = !name.is_empty()
        && name.len() <= 256
        && !name.starts_with('/')
        && !name.contains("//")
        && name
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b) || b == b'/');
    if ok {
        Ok(())
    } else {
        Err(StorageError::Invalid(format!(
            "object name {name:?} is not [0-9a-f/]{{1,256}} without empty segments"
        )))
    }
}

#[cfg(test)]
mod removed_log_tests {
    use super::*;

    #[test]
    fn a_full_log_says_it_overflowed_instead_of_growing() {
        let mut log = RemovedLog::default();
        log.push("a/1");
        assert_eq!(log.take().names, vec!["a/1".to_string()]);
        for i in 0..=REMOVED_LOG {
            log.push(&format!("a/{i:x}"));
        }
        let r = log.take();
        assert!(r.overflowed && r.names.is_empty());
        assert_eq!(log.take(), Removed::default(), "taking starts a new log");
    }
}
