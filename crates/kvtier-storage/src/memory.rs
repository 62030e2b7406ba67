//! `memory`: objects in a hash map, with an optional capacity bound (FIFO eviction). For
//! tests and for trying kvtier without a disk.

use parking_lot::Mutex;
use std::collections::{HashMap, VecDeque};

use async_trait::async_trait;
use bytes::{Bytes, BytesMut};

use crate::{Removed, StorageError, Store, StoreStats, check_name};

#[derive(Debug, Default)]
struct Inner {
    objects: HashMap<String, Bytes>,
    order: VecDeque<String>,
    bytes: u64,
    evictions: u64,
    removed: crate::RemovedLog,
}

/// An in-memory store.
#[derive(Debug, Default)]
pub struct MemoryStore {
    inner: Mutex<Inner>,
    capacity: u64,
}

impl MemoryStore {
    /// An unbounded store.
    pub fn new() -> Self {
        Self::default()
    }

    /// A store holding at most `capacity` bytes (oldest objects evicted first).
    pub fn with_capacity(capacity: u64) -> Self {
        Self {
            capacity,
            ..Self::default()
        }
    }

    fn lock(&self) -> parking_lot::MutexGuard<'_, Inner> {
        self.inner.lock()
    }

    /// Replaces an object's bytes without any checks, to simulate corruption in tests.
    pub fn tamper(&self, name: &str, f: impl FnOnce(&mut Vec<u8>)) -> bool {
        let mut g = self.lock();
        match g.objects.get_mut(name) {
            Some(b) => {
                let mut v = b.to_vec();
                f(&mut v);
                *b = Bytes::from(v);
                true
            }
            None => false,
        }
    }
}

#[async_trait]
impl Store for MemoryStore {
    fn kind(&self) -> &'static str {
        "memory"
    }

    async fn get(&self, name: &str) -> Result<Option<Bytes>, StorageError> {
        check_name(name)?;
        Ok(self.lock().objects.get(name).cloned())
    }

    async fn set(&self, name: &str, head: Bytes, body: Bytes) -> Result<(), StorageError> {
        check_name(name)?;
        let mut obj = BytesMut::with_capacity(head.len() + body.len());
        obj.extend_from_slice(&head);
        obj.extend_from_slice(&body);
        let obj = obj.freeze();
        let len = obj.len() as u64;
        if self.capacity > 0 && len > self.capacity {
            return Err(StorageError::NoSpace(format!(
                "object of {len} bytes exceeds the capacity of {}",
                self.capacity
            )));
        }
        let mut g = self.lock();
        if let Some(old) = g.objects.insert(name.to_string(), obj) {
            g.bytes -= old.len() as u64;
        } else {
            g.order.push_back(name.to_string());
        }
        g.bytes += len;
        while self.capacity > 0 && g.bytes > self.capacity {
            let Some(victim) = g.order.pop_front() else {
                break;
            };
            if let Some(o) = g.objects.remove(&victim) {
                g.bytes -= o.len() as u64;
                g.evictions += 1;
                g.removed.push(&victim);
            }
        }
        Ok(())
    }

    async fn exists(&self, name: &str) -> Result<bool, StorageError> {
        check_name(name)?;
        Ok(self.lock().objects.contains_key(name))
    }

    async fn delete(&self, name: &str) -> Result<(), StorageError> {
        check_name(name)?;
        let mut g = self.lock();
        if let Some(o) = g.objects.remove(name) {
            g.bytes -= o.len() as u64;
            g.order.retain(|n| n != name);
        }
        Ok(())
    }

    async fn clear(&self) -> Result<u64, StorageError> {
        let mut g = self.lock();
        let n = g.objects.len() as u64;
        g.objects.clear();
        g.order.clear();
        g.bytes = 0;
        Ok(n)
    }

    fn take_removed(&self) -> Removed {
        self.lock().removed.take()
    }

    fn stats(&self) -> StoreStats {
        let g = self.lock();
        StoreStats {
            objects: g.objects.len() as u64,
            bytes: g.bytes,
            capacity: self.capacity,
            evictions: g.evictions,
            delete_failures: 0,
            tenants: Vec::new(),
        }
    }
}
