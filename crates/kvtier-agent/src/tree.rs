//! Tree mode: the agent is the engine's prefix cache, a radix tree of page keys over the
//! engine's device pages (SGLang-style engines, and any engine that lets the agent decide
//! what stays on the device).
//!
//! Per request the engine matches its prompt (the cached device prefix is locked under a
//! handle, and the tiers below are asked how far they continue it), may prefetch L3 pages
//! into L2, loads L2 pages back into device pages it lends, inserts what it computed, and
//! releases the handle. Device → L2 backups and eviction are [`Backups`].

use std::sync::Arc;
use std::time::Instant;

use futures::StreamExt;
use kvtier_client::PrefetchOptions;
use kvtier_client::{ClientError, Evicted, Handle as HandleId, Inserted, Loaded, Match};
use kvtier_core::PageKey;
use kvtier_device::Fence;
use kvtier_proto::ApiError;
use kvtier_proto::v1;

use crate::backup::{BackupWorker, Backups};
use crate::l2::L2;
use crate::link::is_link_error;
use crate::owner::Caller;
use crate::shared::{Handle, Shared, State, check_page_list};

/// The progress of a prefetch the engine opened, as kvtierd reports it.
pub(crate) type Progress =
    futures::stream::BoxStream<'static, Result<v1::PrefetchProgress, tonic::Status>>;

/// The tree mode's calls.
pub(crate) struct TreeMode {
    s: Arc<Shared>,
    l2: L2,
    backups: Arc<Backups>,
}

impl TreeMode {
    pub(crate) fn new(s: Arc<Shared>, l2: L2) -> (Self, BackupWorker) {
        let (backups, worker) = Backups::new(s.clone(), l2.clone());
        (
            Self {
                s,
                l2,
                backups: Arc::new(backups),
            },
            worker,
        )
    }

    /// The mode's backups (their workers run beside the service).
    pub(crate) fn backups(&self) -> Arc<Backups> {
        self.backups.clone()
    }

    /// The pool's page size, if it is registered in tree mode and `caller` owns it.
    pub(crate) fn page_size(&self, caller: &Caller) -> Result<usize, ApiError> {
        Ok(self.s.lock().tree_pool(caller)?.pool.layout().page_size())
    }

    /// Checks engine-lent pages: in range, distinct, and (when `free`) not held by the tree.
    fn check_pages(
        st: &State,
        caller: &Caller,
        field: &str,
        pages: &[u32],
        free: bool,
    ) -> Result<(), ApiError> {
        let n = st.tree_pool(caller)?.pool.num_pages();
        check_page_list(n, field, pages, |p| free && st.in_tree[p as usize])
    }

    /// `Match`: locks the cached device prefix of `keys` under a new handle, and asks L2 and
    /// L3 how far they continue it.
    pub(crate) async fn match_prefix(
        &self,
        caller: &Caller,
        keys: Vec<PageKey>,
        started: Instant,
    ) -> Result<Match, ApiError> {
        let s = &self.s;
        let (handle, device, selective) = {
            let mut st = s.lock();
            st.tree_pool(caller)?;
            let m = st.tree.match_prefix(&keys);
            st.tree
                .lock(m.device_node)
                .map_err(|e| ApiError::Internal(e.to_string()))?;
            let hot = !m.device_values.is_empty()
                && st
                    .tree
                    .view(m.device_node)
                    .is_ok_and(|v| !v.backed_up && s.policy().on_hit(v.meta.hits));
            let h = st.handle_ids.next();
            st.handles.insert(
                h,
                Handle {
                    node: m.device_node,
                    keys: keys.clone(),
                    device: m.device_values.clone(),
                    prefetch: None,
                },
            );
            (h, m.device_values, hot.then_some(m.device_node))
        };
        if let Some(node) = selective {
            self.backups.enqueue(node).await;
        }
        let dev = device.len();
        let (l2, l3) = self.l2.tiers(&keys[dev..]).await;
        s.metrics.count_match(keys.len(), dev, l2, l3, started);
        Ok(Match {
            handle: HandleId(handle),
            device_pages: device,
            l2_pages: l2 as u32,
            l3_pages: l3 as u32,
            total_pages: keys.len() as u32,
        })
    }

    /// The handle's device prefix now (empty once released).
    fn device_prefix(&self, handle: u64) -> Vec<u32> {
        self.s
            .lock()
            .handles
            .get(&handle)
            .map(|h| h.device.clone())
            .unwrap_or_default()
    }

    /// `LoadBack`: the pages after the handle's device prefix that L2 holds, into
    /// `free_pages` the engine lends; they join the tree, locked under the handle.
    pub(crate) async fn load_back(
        &self,
        caller: &Caller,
        handle: u64,
        free_pages: Vec<u32>,
        fence: &Fence,
    ) -> Result<Loaded, ApiError> {
        let t = Instant::now();
        let s = &self.s;
        let (keys, dev, prefetch, device, page_bytes) = {
            let mut st = s.lock();
            Self::check_pages(&st, caller, "free_pages", &free_pages, true)?;
            let e = st.tree_pool(caller)?;
            let (device, page_bytes) = (e.device.clone(), e.pool.layout().page_bytes());
            let h = st.handles.get_mut(&handle).ok_or_else(|| {
                ApiError::invalid("handle", format!("{handle} is unknown or released"))
            })?;
            (
                h.keys.clone(),
                h.device.len(),
                h.prefetch.take(),
                device,
                page_bytes,
            )
        };
        let unchanged = |device_pages: Vec<u32>| Loaded {
            loaded: 0,
            device_pages,
            unused_pages: free_pages.clone(),
        };
        let want = (keys.len() - dev).min(free_pages.len());
        let Some(linked) = s.link.current() else {
            return Ok(unchanged(self.device_prefix(handle)));
        };
        let mut c = linked.client.clone();
        if want == 0 {
            if let Some(id) = prefetch {
                self.l2
                    .call(&linked, c.release_prefetch(linked.session, &id))
                    .await;
            }
            return Ok(unchanged(self.device_prefix(handle)));
        }
        // Pin the pages in L2: through the prefetch when one is open (it waits per its
        // policy and pins what landed), else directly.
        let mut slots = match &prefetch {
            Some(id) => self
                .l2
                .call(&linked, c.take_prefetch(linked.session, id))
                .await
                .map(|(_, s)| s)
                .unwrap_or_default(),
            None => Vec::new(),
        };
        // kvtierd is a peer: never trust it to answer for more keys than were asked about.
        slots.truncate(keys.len() - dev);
        if slots.is_empty() {
            slots = self
                .l2
                .call(&linked, c.acquire(linked.session, &keys[dev..dev + want]))
                .await
                .unwrap_or_default();
        }
        let pinned = &keys[dev..dev + slots.len()];
        let n = match self
            .l2
            .read(&linked, &device, pinned, &slots, &free_pages[..want], fence)
            .await
        {
            Ok(n) if n > 0 => n,
            _ => return Ok(unchanged(self.device_prefix(handle))),
        };
        let mut st = s.lock();
        if !fence.is_open() {
            // The copy ended in time, but the engine gave up on the call since (kvtierd
            // slow to take the pins back): the pages are the engine's again, never the
            // tree's.
            drop(st);
            return Ok(unchanged(self.device_prefix(handle)));
        }
        let Some(h) = st.handles.get(&handle) else {
            // Released meanwhile: nothing to attach the pages to.
            return Ok(unchanged(Vec::new()));
        };
        let old = h.node;
        let mut values = h.device.clone();
        values.extend_from_slice(&free_pages[..n]);
        let ins = st
            .tree
            .insert(&keys[..dev + n], &values)
            .map_err(|e| ApiError::Internal(e.to_string()))?;
        // Pages another request loaded meanwhile: ours are duplicates, handed back.
        let dup_end = ins.already_on_device.max(dev).min(dev + n);
        let mut unused: Vec<u32> = free_pages[..dup_end - dev].to_vec();
        for &p in &free_pages[dup_end - dev..n] {
            st.in_tree[p as usize] = true;
        }
        unused.extend_from_slice(&free_pages[n..]);
        // They came from L2: the host tier has them.
        let _ = st.tree.mark_backed_up(ins.node);
        let _ = st.tree.lock(ins.node);
        let _ = st.tree.unlock(old);
        let device_pages = st.tree.peek_device_values(&keys[..dev + n]);
        if let Some(h) = st.handles.get_mut(&handle) {
            h.node = ins.node;
            h.device = device_pages.clone();
        }
        drop(st);
        let loaded = dev + n - dup_end;
        s.metrics.inserted_pages.inc_by(loaded as u64);
        s.count_loaded(loaded, page_bytes, t);
        Ok(Loaded {
            loaded: loaded as u32,
            device_pages,
            unused_pages: unused,
        })
    }

    /// `Insert`: the engine's computed pages (`device_pages[i]` holds `keys[i]`) join the
    /// tree; the write policy may start their backup.
    pub(crate) async fn insert(
        &self,
        caller: &Caller,
        keys: &[PageKey],
        device_pages: &[u32],
    ) -> Result<Inserted, ApiError> {
        let s = &self.s;
        let (ins, tree_pages) = {
            let mut st = s.lock();
            Self::check_pages(&st, caller, "device_pages", device_pages, false)?;
            let tree_pages = st.tree.peek_device_values(keys);
            let known = tree_pages.len();
            for (i, &p) in device_pages.iter().enumerate().skip(known) {
                if st.in_tree[p as usize] {
                    return Err(ApiError::invalid(
                        format!("device_pages[{i}]"),
                        format!("page {p} already holds another cached page"),
                    ));
                }
            }
            let ins = st
                .tree
                .insert(keys, device_pages)
                .map_err(|e| ApiError::Internal(e.to_string()))?;
            for &p in &device_pages[ins.already_on_device..] {
                st.in_tree[p as usize] = true;
            }
            (ins, tree_pages)
        };
        let dup = ins.already_on_device;
        // The engine's own copies of pages the tree already holds; pages it passed that are
        // the tree's (its matched prefix) are not duplicates.
        let duplicate_pages: Vec<u32> = device_pages[..dup]
            .iter()
            .zip(&tree_pages)
            .filter(|(mine, tree)| mine != tree)
            .map(|(&mine, _)| mine)
            .collect();
        let inserted = keys.len() - dup;
        s.metrics.inserted_pages.inc_by(inserted as u64);
        if s.policy().on_store() && inserted > 0 {
            self.backups.enqueue(ins.node).await;
        }
        Ok(Inserted {
            duplicate_pages,
            inserted: inserted as u32,
        })
    }

    /// `Release`: unlocks the handle's prefix, and drops its prefetch.
    pub(crate) async fn release(&self, caller: &Caller, handle: u64) -> Result<(), ApiError> {
        let h = {
            let mut st = self.s.lock();
            st.tree_pool(caller)?;
            let h = st.handles.remove(&handle).ok_or_else(|| {
                ApiError::invalid("handle", format!("{handle} is unknown or already released"))
            })?;
            let _ = st.tree.unlock(h.node);
            h
        };
        if let Some(id) = h.prefetch
            && let Some(linked) = self.s.link.current()
        {
            let mut c = linked.client.clone();
            self.l2
                .call(&linked, c.release_prefetch(linked.session, &id))
                .await;
        }
        Ok(())
    }

    /// `Prefetch`: asks kvtierd to bring the handle's pages after its device prefix from L3
    /// into L2, per `policy`; the next LoadBack of the handle takes what landed.
    pub(crate) async fn prefetch(
        &self,
        caller: &Caller,
        handle: u64,
        policy: v1::PrefetchPolicy,
        hints: v1::PrefetchHints,
    ) -> Result<Progress, ApiError> {
        let s = &self.s;
        let (keys, dev) = {
            let st = s.lock();
            st.tree_pool(caller)?;
            let h = st.handles.get(&handle).ok_or_else(|| {
                ApiError::invalid("handle", format!("{handle} is unknown or released"))
            })?;
            if h.prefetch.is_some() {
                return Err(ApiError::invalid(
                    "handle",
                    "a prefetch is already open for it",
                ));
            }
            (h.keys.clone(), h.device.len())
        };
        let linked = s.link.current().ok_or_else(|| {
            ApiError::Unavailable("kvtierd is not connected; nothing to prefetch from".into())
        })?;
        let id = format!("h{handle}");
        let opts = PrefetchOptions {
            parent: dev.checked_sub(1).map(|i| keys[i]),
            policy,
            hints,
        };
        let mut c = linked.client.clone();
        let stream = match c.prefetch(linked.session, &id, &keys[dev..], opts).await {
            Ok(s) => s,
            Err(e) => {
                if is_link_error(&e) {
                    s.link.broken(&linked, &e);
                }
                return Err(match e {
                    ClientError::Status(s) => ApiError::FailedPrecondition(format!(
                        "kvtierd refused the prefetch: {}",
                        s.message()
                    )),
                    e => ApiError::Unavailable(e.to_string()),
                });
            }
        };
        if let Some(h) = s.lock().handles.get_mut(&handle) {
            h.prefetch = Some(id);
        }
        Ok(stream
            .map(|r| r.map_err(|s| tonic::Status::new(s.code(), s.message().to_string())))
            .boxed())
    }

    /// `Evict`: `n` device pages back to the engine, each backed up first unless L2 refuses.
    pub(crate) async fn evict(&self, caller: &Caller, n: usize) -> Result<Evicted, ApiError> {
        self.s.lock().tree_pool(caller)?;
        Ok(self.backups.evict(n).await)
    }
}
