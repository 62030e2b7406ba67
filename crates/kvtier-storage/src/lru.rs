//! What the local backends (file, rocksdb) share: the size-bounded LRU index that keeps
//! their capacity bound (accounting only; the backend deletes what it returns), the clock it
//! runs on, and the hand-off of blocking I/O to tokio's blocking pool.

use std::collections::{BTreeSet, HashMap, HashSet};

use kvtier_core::TenantTag;
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

/// What one tenant holds in a backend, and its quota (see [`crate::StoreStats::tenants`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TenantBytes {
    /// The tenant, by the tag its objects' keys start with.
    pub tag: TenantTag,
    /// Its objects.
    pub objects: u64,
    /// Their bytes.
    pub bytes: u64,
    /// Most bytes it may hold (0: no quota, counted only).
    pub quota: u64,
    /// Its own objects evicted to keep it within its quota.
    pub evictions: u64,
}

/// One tracked tenant: its usage and its own LRU order.
#[derive(Debug, Default)]
struct Group {
    usage: TenantBytes,
    lru: BTreeSet<(u64, String)>,
}

/// Object sizes and last-access times, ordered for eviction; per tracked tenant too, so a
/// tenant past its byte quota evicts its own least recently used objects, never another's.
#[derive(Debug, Default)]
pub(crate) struct Index {
    /// name → (bytes, last access in ns since the epoch)
    pub(crate) entries: HashMap<String, (u64, u64)>,
    lru: BTreeSet<(u64, String)>,
    pub(crate) bytes: u64,
    pub(crate) evictions: u64,
    pub(crate) delete_failures: u64,
    groups: HashMap<TenantTag, Group>,
    /// While a store rebuilds the index from what is on disk, beside writers already
    /// serving: the names writers inserted or removed meanwhile. Their word is newer than
    /// the disk listing's (an object evicted, its file not yet deleted, must not come back).
    since_open: Option<HashSet<String>>,
    /// What eviction took, for [`crate::Store::take_removed`].
    pub(crate) removed: crate::RemovedLog,
}

impl Index {
    /// An empty index that tracks the tenants of `quotas` (tag, most bytes; 0: unbounded).
    pub(crate) fn with_quotas(quotas: &[(TenantTag, u64)]) -> Self {
        let mut ix = Self::default();
        for &(tag, quota) in quotas {
            let usage = TenantBytes {
                tag,
                quota,
                ..TenantBytes::default()
            };
            ix.groups.insert(
                tag,
                Group {
                    usage,
                    lru: BTreeSet::new(),
                },
            );
        }
        ix
    }

    fn group(&mut self, name: &str) -> Option<&mut Group> {
        if self.groups.is_empty() {
            return None;
        }
        self.groups.get_mut(&TenantTag::of_object_name(name)?)
    }

    /// Refuses an object larger than its tenant's whole quota.
    pub(crate) fn check_quota(&self, name: &str, size: u64) -> Result<(), StorageError> {
        let Some(g) = TenantTag::of_object_name(name).and_then(|t| self.groups.get(&t)) else {
            return Ok(());
        };
        if g.usage.quota > 0 && size > g.usage.quota {
            return Err(StorageError::NoSpace(format!(
                "object of {size} bytes exceeds the quota of tenant tag {} ({} bytes)",
                g.usage.tag.to_hex(),
                g.usage.quota
            )));
        }
        Ok(())
    }

    /// Per tracked tenant: what it holds and its quota, by tag.
    pub(crate) fn tenants(&self) -> Vec<TenantBytes> {
        let mut v: Vec<TenantBytes> = self.groups.values().map(|g| g.usage.clone()).collect();
        v.sort_by_key(|t| t.tag);
        v
    }

    /// Starts a rebuild from the disk listing ([`Self::found`]) beside serving writers.
    pub(crate) fn start_rebuild(&mut self) {
        self.since_open = Some(HashSet::new());
    }

    /// Ends the rebuild.
    pub(crate) fn end_rebuild(&mut self) {
        self.since_open = None;
    }

    /// An object the rebuild found on disk: indexed unless a writer has inserted or removed
    /// it since the store opened. Whether it was added.
    pub(crate) fn found(&mut self, name: &str, size: u64, at: u64) -> bool {
        let touched = self.since_open.as_ref().is_some_and(|s| s.contains(name));
        if touched || self.entries.contains_key(name) {
            return false;
        }
        self.insert(name, size, at);
        true
    }

    fn note(&mut self, name: &str) {
        if let Some(s) = &mut self.since_open {
            s.insert(name.to_string());
        }
    }

    pub(crate) fn insert(&mut self, name: &str, size: u64, at: u64) {
        self.note(name);
        let old = self.entries.insert(name.to_string(), (size, at));
        if let Some((old_size, old_at)) = old {
            self.bytes -= old_size;
            self.lru.remove(&(old_at, name.to_string()));
        }
        self.bytes += size;
        self.lru.insert((at, name.to_string()));
        if let Some(g) = self.group(name) {
            if let Some((old_size, old_at)) = old {
                g.usage.bytes -= old_size;
                g.usage.objects -= 1;
                g.lru.remove(&(old_at, name.to_string()));
            }
            g.usage.bytes += size;
            g.usage.objects += 1;
            g.lru.insert((at, name.to_string()));
        }
    }

    pub(crate) fn remove(&mut self, name: &str) {
        self.note(name);
        if let Some((size, at)) = self.entries.remove(name) {
            self.bytes -= size;
            self.lru.remove(&(at, name.to_string()));
            if let Some(g) = self.group(name) {
                g.usage.bytes -= size;
                g.usage.objects -= 1;
                g.lru.remove(&(at, name.to_string()));
            }
        }
    }

    pub(crate) fn touch(&mut self, name: &str, at: u64) {
        if let Some(e) = self.entries.get_mut(name) {
            let old = e.1;
            e.1 = at;
            self.lru.remove(&(old, name.to_string()));
            self.lru.insert((at, name.to_string()));
            if let Some(g) = self.group(name) {
                g.lru.remove(&(old, name.to_string()));
                g.lru.insert((at, name.to_string()));
            }
        }
    }

    /// Takes least recently used objects out, sparing `keep`: first those of `keep`'s tenant
    /// while it is past its quota, then any until `bytes <= capacity`.
    pub(crate) fn victims(&mut self, capacity: u64, keep: &str) -> Vec<String> {
        let mut out = Vec::new();
        let tag = TenantTag::of_object_name(keep);
        while let Some(g) = tag.and_then(|t| self.groups.get_mut(&t))
            && g.usage.quota > 0
            && g.usage.bytes > g.usage.quota
        {
            let Some(first) = g.lru.iter().find(|(_, n)| n != keep).cloned() else {
                break;
            };
            g.usage.evictions += 1;
            self.remove(&first.1);
            self.evictions += 1;
            self.removed.push(&first.1);
            out.push(first.1);
        }
        while capacity > 0 && self.bytes > capacity {
            let Some(first) = self.lru.iter().find(|(_, n)| n != keep).cloned() else {
                break;
            };
            self.remove(&first.1);
            self.evictions += 1;
            self.removed.push(&first.1);
            out.push(first.1);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rebuild_never_brings_back_what_a_writer_evicted_meanwhile() {
        let mut ix = Index::default();
        ix.start_rebuild();
        // A writer stores and evicts `a` while the listing runs; the listing still sees
        // `a`'s file (deleted after the eviction) and `b`, which existed before the open.
        ix.insert("ab/a", 10, 1);
        ix.remove("ab/a");
        assert!(!ix.found("ab/a", 10, 1), "an evicted object came back");
        assert!(ix.found("ab/b", 20, 2));
        // A writer's newer copy wins over the listing's.
        ix.insert("ab/c", 30, 5);
        assert!(!ix.found("ab/c", 99, 3));
        ix.end_rebuild();
        assert_eq!((ix.entries.len(), ix.bytes), (2, 50));
        // After the rebuild, nothing is remembered.
        ix.remove("ab/b");
        assert!(ix.since_open.is_none());
    }
}
