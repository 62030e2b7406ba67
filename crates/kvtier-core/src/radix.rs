//! The agent's prefix cache: a compressed radix tree at page granularity.
//!
//! The tree follows SGLang's `RadixCache` / `HiRadixCache`:
//! - edges are runs of pages, labelled `K` (in the agent, the page key, so namespaces are kept
//!   apart by construction and a comparison is 32 bytes, not `page_size` tokens);
//! - each page carries a device value `V` (the engine's page slot) while it is on the device;
//! - [`RadixTree::match_prefix`] splits a node when a match ends inside it, so the returned node
//!   covers exactly the matched prefix and stays valid when the tree changes around it;
//! - [`RadixTree::insert`] reports how many leading pages were already on the device, so the
//!   engine frees its duplicate slots, and re-attaches device slots to pages that had been
//!   evicted to the host;
//! - locks ([`RadixTree::lock`]) count active users and propagate to the root; evictable and
//!   protected sizes are kept incrementally;
//! - eviction candidates are kept in ordered sets (device leaves; host-only leaves), updated on
//!   every change, so [`RadixTree::evict`] never scans the tree.
//!
//! Invariants (checked by [`RadixTree::validate`] in the property tests):
//! 1. device-resident nodes form a subtree containing the root (a page on the device has its
//!    whole prefix on the device);
//! 2. backed-up nodes form a subtree containing the root, and every node not on the device is
//!    backed up (a node that is neither is removed);
//! 3. a locked node's ancestors are locked at least as often;
//! 4. the pages of one node always share their metadata, since nodes never merge and splits copy.
//!
//! Where things are: nodes, matching, inserting, locks and eviction here; the backed-up marks
//! in `backups.rs`; the invariant check in `check.rs`. The model-based property test is in
//! `tests/`.

mod backups;
mod check;

use std::collections::{BTreeSet, HashMap};
use std::hash::Hash;

use crate::Error;
use crate::policy::{EntryMeta, EvictionPolicy, PolicyKind, Rank};

/// A handle to a tree node. Generation-checked: a handle to a removed node is refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct NodeId {
    idx: u32,
    generation: u32,
}

const ROOT: u32 = 0;

struct Node<K, V> {
    parent: u32,
    children: HashMap<K, u32>,
    keys: Vec<K>,
    /// Device values, one per page; `None` once evicted from the device.
    values: Option<Vec<V>>,
    backed_up: bool,
    lock: u32,
    meta: EntryMeta,
    device_children: u32,
    /// Present in the device candidate set under this rank.
    device_rank: Option<Rank>,
    /// Present in the host-only candidate set under this rank.
    host_rank: Option<Rank>,
}

struct Slot<K, V> {
    generation: u32,
    node: Option<Node<K, V>>,
}

/// The outcome of [`RadixTree::match_prefix`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Match<V> {
    /// Device values of the device-resident prefix, one per page.
    pub device_values: Vec<V>,
    /// The node ending the device-resident prefix (the root when it is empty). Lock this.
    pub device_node: NodeId,
    /// Pages after the device prefix that the tree believes are backed up in the host tier.
    pub host_pages: usize,
    /// The node ending the whole match (device and host parts).
    pub last_node: NodeId,
}

impl<V> Match<V> {
    /// Pages on the device.
    pub fn device_pages(&self) -> usize {
        self.device_values.len()
    }
}

/// The outcome of [`RadixTree::insert`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Inserted {
    /// Leading pages that were already on the device: the caller's values for them are
    /// duplicates and the caller frees them.
    pub already_on_device: usize,
    /// Pages that were known to the host tier only and now take the caller's device values.
    pub revived: usize,
    /// The node ending the inserted sequence.
    pub node: NodeId,
}

/// A node's pages that left a tier.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Evicted<K, V> {
    /// The node the pages were (stale once the node is removed; still names it for callers
    /// that kept its id).
    pub node: NodeId,
    /// Labels of the pages, in order.
    pub keys: Vec<K>,
    /// Their device values, now free (empty for host-only eviction).
    pub values: Vec<V>,
    /// Whether the pages were backed up (they stay known to the tree as host pages).
    pub backed_up: bool,
}

/// A read-only view of one node.
#[derive(Clone, Copy, Debug)]
pub struct NodeView<'a, K, V> {
    /// Page labels of this node.
    pub keys: &'a [K],
    /// Device values, if on the device.
    pub values: Option<&'a [V]>,
    /// Whether the host tier holds these pages.
    pub backed_up: bool,
    /// Active locks.
    pub lock: u32,
    /// Policy metadata.
    pub meta: EntryMeta,
}

/// A page-granular radix tree mapping sequences of page labels `K` to device values `V`.
pub struct RadixTree<K, V> {
    slots: Vec<Slot<K, V>>,
    free: Vec<u32>,
    policy: Box<dyn EvictionPolicy>,
    clock: u64,
    device_set: BTreeSet<(Rank, u32)>,
    host_set: BTreeSet<(Rank, u32)>,
    device_pages: usize,
    protected_pages: usize,
    host_only_pages: usize,
    nodes: usize,
}

impl<K, V> std::fmt::Debug for RadixTree<K, V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RadixTree")
            .field("policy", &self.policy.kind())
            .field("nodes", &self.nodes)
            .field("device_pages", &self.device_pages)
            .field("protected_pages", &self.protected_pages)
            .field("host_only_pages", &self.host_only_pages)
            .finish()
    }
}

impl<K: Clone + Eq + Hash, V: Copy> RadixTree<K, V> {
    /// An empty tree evicting by `policy`.
    pub fn new(policy: PolicyKind) -> Self {
        Self::with_policy(policy.build())
    }

    /// An empty tree evicting by a custom policy object.
    pub fn with_policy(policy: Box<dyn EvictionPolicy>) -> Self {
        let root = Node {
            parent: ROOT,
            children: HashMap::new(),
            keys: Vec::new(),
            values: Some(Vec::new()),
            backed_up: true,
            lock: 0,
            meta: EntryMeta::default(),
            device_children: 0,
            device_rank: None,
            host_rank: None,
        };
        Self {
            slots: vec![Slot {
                generation: 0,
                node: Some(root),
            }],
            free: Vec::new(),
            policy,
            clock: 0,
            device_set: BTreeSet::new(),
            host_set: BTreeSet::new(),
            device_pages: 0,
            protected_pages: 0,
            host_only_pages: 0,
            nodes: 1,
        }
    }

    /// The eviction policy in use.
    pub fn policy(&self) -> PolicyKind {
        self.policy.kind()
    }

    /// Pages on the device.
    pub fn device_pages(&self) -> usize {
        self.device_pages
    }

    /// Device pages no lock protects: what [`Self::evict`] can free.
    pub fn evictable_pages(&self) -> usize {
        self.device_pages - self.protected_pages
    }

    /// Device pages under at least one lock.
    pub fn protected_pages(&self) -> usize {
        self.protected_pages
    }

    /// Pages known only as backed up in the host tier.
    pub fn host_only_pages(&self) -> usize {
        self.host_only_pages
    }

    /// Nodes, including the root.
    pub fn node_count(&self) -> usize {
        self.nodes
    }

    /// The root's handle (the empty prefix).
    pub fn root(&self) -> NodeId {
        NodeId {
            idx: ROOT,
            generation: self.slots[ROOT as usize].generation,
        }
    }

    fn node(&self, idx: u32) -> &Node<K, V> {
        match &self.slots[idx as usize].node {
            Some(n) => n,
            None => unreachable!("internal index {idx} names a free slot"),
        }
    }

    fn node_mut(&mut self, idx: u32) -> &mut Node<K, V> {
        match &mut self.slots[idx as usize].node {
            Some(n) => n,
            None => unreachable!("internal index {idx} names a free slot"),
        }
    }

    fn id(&self, idx: u32) -> NodeId {
        NodeId {
            idx,
            generation: self.slots[idx as usize].generation,
        }
    }

    fn resolve(&self, id: NodeId) -> Result<u32, Error> {
        match self.slots.get(id.idx as usize) {
            Some(slot) if slot.generation == id.generation && slot.node.is_some() => Ok(id.idx),
            _ => Err(Error::StaleHandle(format!(
                "{id:?} does not name a live node"
            ))),
        }
    }

    /// A read-only view of a node.
    pub fn view(&self, id: NodeId) -> Result<NodeView<'_, K, V>, Error> {
        let n = self.node(self.resolve(id)?);
        Ok(NodeView {
            keys: &n.keys,
            values: n.values.as_deref(),
            backed_up: n.backed_up,
            lock: n.lock,
            meta: n.meta,
        })
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    fn alloc(&mut self, node: Node<K, V>) -> u32 {
        self.nodes += 1;
        if let Some(idx) = self.free.pop() {
            let slot = &mut self.slots[idx as usize];
            slot.node = Some(node);
            idx
        } else {
            self.slots.push(Slot {
                generation: 0,
                node: Some(node),
            });
            (self.slots.len() - 1) as u32
        }
    }

    fn release_slot(&mut self, idx: u32) {
        let slot = &mut self.slots[idx as usize];
        slot.node = None;
        slot.generation = slot.generation.wrapping_add(1);
        self.free.push(idx);
        self.nodes -= 1;
    }

    /// Re-files a node in the candidate sets after any change to its state or metadata.
    fn refresh(&mut self, idx: u32) {
        if idx == ROOT {
            return;
        }
        let n = self.node(idx);
        let unlocked = n.lock == 0;
        let device_ok = unlocked && n.values.is_some() && n.device_children == 0;
        let host_ok = unlocked && n.values.is_none() && n.children.is_empty();
        let rank = self.policy.rank(&n.meta);
        let (old_d, old_h) = (n.device_rank, n.host_rank);
        let new_d = device_ok.then_some(rank);
        let new_h = host_ok.then_some(rank);
        if old_d != new_d {
            if let Some(r) = old_d {
                self.device_set.remove(&(r, idx));
            }
            if let Some(r) = new_d {
                self.device_set.insert((r, idx));
            }
        }
        if old_h != new_h {
            if let Some(r) = old_h {
                self.host_set.remove(&(r, idx));
            }
            if let Some(r) = new_h {
                self.host_set.insert((r, idx));
            }
        }
        let n = self.node_mut(idx);
        n.device_rank = new_d;
        n.host_rank = new_h;
    }

    /// Splits node `idx` after its first `at` pages. The new node (returned) takes the head and
    /// becomes the parent of `idx`, which keeps the tail, its children and its identity, so
    /// handles to `idx` still cover the same prefix.
    fn split(&mut self, idx: u32, at: usize) -> u32 {
        let (head_keys, head_values, parent, meta, lock, backed_up, has_values) = {
            let n = self.node_mut(idx);
            debug_assert!(at > 0 && at < n.keys.len());
            let tail = n.keys.split_off(at);
            let head_keys = std::mem::replace(&mut n.keys, tail);
            let head_values = n.values.as_mut().map(|v| {
                let tail = v.split_off(at);
                std::mem::replace(v, tail)
            });
            (
                head_keys,
                head_values,
                n.parent,
                n.meta,
                n.lock,
                n.backed_up,
                n.values.is_some(),
            )
        };
        let first_tail = self.node(idx).keys[0].clone();
        let first_head = head_keys[0].clone();
        let mid = self.alloc(Node {
            parent,
            children: HashMap::from([(first_tail, idx)]),
            keys: head_keys,
            values: head_values,
            backed_up,
            lock,
            meta,
            device_children: u32::from(has_values),
            device_rank: None,
            host_rank: None,
        });
        self.node_mut(idx).parent = mid;
        self.node_mut(parent).children.insert(first_head, mid);
        self.refresh(mid);
        mid
    }

    /// Length of the common prefix of a node's keys and `keys`.
    fn common(node_keys: &[K], keys: &[K]) -> usize {
        node_keys
            .iter()
            .zip(keys)
            .take_while(|(a, b)| a == b)
            .count()
    }

    /// Walks `keys` from the root, splitting the last node when the walk ends inside it, and
    /// returns the node indices of the path (root excluded) and the pages matched.
    fn walk(&mut self, keys: &[K]) -> (Vec<u32>, usize) {
        let mut path = Vec::new();
        let mut node = ROOT;
        let mut i = 0;
        while i < keys.len() {
            let Some(&child) = self.node(node).children.get(&keys[i]) else {
                break;
            };
            let c = Self::common(&self.node(child).keys, &keys[i..]);
            let len = self.node(child).keys.len();
            let child = if c < len { self.split(child, c) } else { child };
            path.push(child);
            i += c;
            node = child;
            if c < len {
                break;
            }
        }
        (path, i)
    }

    /// The longest cached prefix of `keys`: the device-resident part (values) and the host-only
    /// part after it. Touches the matched pages (recency, hit count). Locks nothing.
    pub fn match_prefix(&mut self, keys: &[K]) -> Match<V> {
        let now = self.tick();
        let (path, _) = self.walk(keys);
        let mut device_values = Vec::new();
        let mut device_node = ROOT;
        let mut host_pages = 0;
        let mut last = ROOT;
        for &idx in &path {
            let n = self.node_mut(idx);
            n.meta.last_access = now;
            n.meta.hits += 1;
            match &n.values {
                Some(v) if host_pages == 0 => {
                    device_values.extend_from_slice(v);
                    device_node = idx;
                }
                _ => host_pages += n.keys.len(),
            }
            last = idx;
            self.refresh(idx);
        }
        Match {
            device_values,
            device_node: self.id(device_node),
            host_pages,
            last_node: self.id(last),
        }
    }

    /// Read-only longest-prefix lookup: `(device pages, host-only pages)`. No split, no touch.
    pub fn peek_prefix(&self, keys: &[K]) -> (usize, usize) {
        let (mut device, mut host) = (0, 0);
        let mut node = ROOT;
        let mut i = 0;
        while i < keys.len() {
            let Some(&child) = self.node(node).children.get(&keys[i]) else {
                break;
            };
            let n = self.node(child);
            let c = Self::common(&n.keys, &keys[i..]);
            if n.values.is_some() && host == 0 {
                device += c;
            } else {
                host += c;
            }
            i += c;
            node = child;
            if c < n.keys.len() {
                break;
            }
        }
        (device, host)
    }

    /// Device values of the device-resident prefix of `keys`. No split, no touch.
    pub fn peek_device_values(&self, keys: &[K]) -> Vec<V> {
        let mut out = Vec::new();
        let mut node = ROOT;
        let mut i = 0;
        while i < keys.len() {
            let Some(&child) = self.node(node).children.get(&keys[i]) else {
                break;
            };
            let n = self.node(child);
            let c = Self::common(&n.keys, &keys[i..]);
            match &n.values {
                Some(v) => out.extend_from_slice(&v[..c]),
                None => break,
            }
            i += c;
            node = child;
            if c < n.keys.len() {
                break;
            }
        }
        out
    }

    /// Inserts `keys` with one device value per page.
    ///
    /// Pages already on the device keep their values: the first `already_on_device` of the
    /// caller's `values` are duplicates for the caller to free. Host-only pages on the path take
    /// the caller's values. New pages are added as a new leaf.
    pub fn insert(&mut self, keys: &[K], values: &[V]) -> Result<Inserted, Error> {
        if keys.len() != values.len() {
            return Err(Error::InvalidField {
                field: "values",
                reason: format!(
                    "{} values for {} pages; one value per page is required",
                    values.len(),
                    keys.len()
                ),
            });
        }
        let now = self.tick();
        let (path, matched) = self.walk(keys);
        let mut already = 0;
        let mut revived = 0;
        let mut offset = 0;
        for &idx in &path {
            let len = self.node(idx).keys.len();
            if self.node(idx).values.is_some() {
                already += len;
            } else {
                self.set_values(idx, values[offset..offset + len].to_vec());
                revived += len;
            }
            self.node_mut(idx).meta.last_access = now;
            self.refresh(idx);
            offset += len;
        }
        let mut last = path.last().copied().unwrap_or(ROOT);
        if matched < keys.len() {
            let parent = last;
            let new = self.alloc(Node {
                parent,
                children: HashMap::new(),
                keys: keys[matched..].to_vec(),
                values: None,
                backed_up: false,
                lock: 0,
                meta: EntryMeta {
                    last_access: now,
                    created: now,
                    hits: 0,
                    priority: 0,
                },
                device_children: 0,
                device_rank: None,
                host_rank: None,
            });
            self.node_mut(parent)
                .children
                .insert(keys[matched].clone(), new);
            self.set_values(new, values[matched..].to_vec());
            last = new;
        }
        Ok(Inserted {
            already_on_device: already,
            revived,
            node: self.id(last),
        })
    }

    /// Gives a node (not on the device) device values, keeping every count true.
    fn set_values(&mut self, idx: u32, values: Vec<V>) {
        let n = self.node_mut(idx);
        debug_assert!(n.values.is_none());
        let len = values.len();
        let locked = n.lock > 0;
        let parent = n.parent;
        // Off the device and backed up means it was counted as host-only until now.
        let was_host_only = n.backed_up;
        n.values = Some(values);
        self.device_pages += len;
        if locked {
            self.protected_pages += len;
        }
        if was_host_only {
            self.host_only_pages -= len;
        }
        self.node_mut(parent).device_children += 1;
        self.refresh(idx);
        self.refresh(parent);
    }

    /// Takes a node's device values away, keeping every count true.
    fn take_values(&mut self, idx: u32) -> Vec<V> {
        let n = self.node_mut(idx);
        let values = n.values.take().unwrap_or_default();
        let len = values.len();
        let locked = n.lock > 0;
        let parent = n.parent;
        self.device_pages -= len;
        if locked {
            self.protected_pages -= len;
        }
        self.node_mut(parent).device_children -= 1;
        values
    }

    /// Adds one lock to `id` and every ancestor. Locked device pages are never evicted.
    pub fn lock(&mut self, id: NodeId) -> Result<(), Error> {
        let mut idx = self.resolve(id)?;
        while idx != ROOT {
            let n = self.node_mut(idx);
            n.lock += 1;
            let first = n.lock == 1;
            let on_device = n.values.as_ref().map_or(0, Vec::len);
            let parent = n.parent;
            if first {
                self.protected_pages += on_device;
                self.refresh(idx);
            }
            idx = parent;
        }
        Ok(())
    }

    /// Removes one lock from `id` and every ancestor.
    pub fn unlock(&mut self, id: NodeId) -> Result<(), Error> {
        let start = self.resolve(id)?;
        if start != ROOT && self.node(start).lock == 0 {
            return Err(Error::StaleHandle(format!("{id:?} is not locked")));
        }
        let mut idx = start;
        while idx != ROOT {
            let n = self.node_mut(idx);
            n.lock -= 1;
            let last = n.lock == 0;
            let on_device = n.values.as_ref().map_or(0, Vec::len);
            let parent = n.parent;
            if last {
                self.protected_pages -= on_device;
                self.refresh(idx);
            }
            idx = parent;
        }
        Ok(())
    }

    /// Sets the caller priority of a node (for [`PolicyKind::Priority`]).
    pub fn set_priority(&mut self, id: NodeId, priority: i32) -> Result<(), Error> {
        let idx = self.resolve(id)?;
        self.node_mut(idx).meta.priority = priority;
        self.refresh(idx);
        Ok(())
    }

    /// The next device victims by policy, without changing anything: unlocked device leaves
    /// whose pages add up to at least `pages` (fewer if there are not enough leaves now). A
    /// `write_back` caller backs these up before calling [`Self::evict`].
    pub fn peek_victims(&self, pages: usize) -> Vec<NodeId> {
        let mut out = Vec::new();
        let mut sum = 0;
        for &(_, idx) in &self.device_set {
            if sum >= pages {
                break;
            }
            sum += self.node(idx).keys.len();
            out.push(self.id(idx));
        }
        out
    }

    /// Frees exactly `min(pages, evictable_pages())` device pages, lowest rank first, splitting
    /// the last victim so no more is evicted than asked. Backed-up pages stay in the tree as
    /// host pages; the rest are removed. Returns the victims in eviction order.
    pub fn evict(&mut self, pages: usize) -> Vec<Evicted<K, V>> {
        self.evict_while(pages, |_, _| true)
    }

    /// [`Self::evict`], stopping at the first victim (in policy order) for which
    /// `may_go(node, backed_up)` is false: how a caller that must back pages up before they
    /// leave evicts what is ready and learns, from [`Self::peek_victims`], what to back up
    /// next.
    pub fn evict_while(
        &mut self,
        pages: usize,
        mut may_go: impl FnMut(NodeId, bool) -> bool,
    ) -> Vec<Evicted<K, V>> {
        let mut out = Vec::new();
        let mut need = pages;
        while need > 0 {
            let Some(&(_, idx)) = self.device_set.first() else {
                break;
            };
            let node = self.id(idx);
            if !may_go(node, self.node(idx).backed_up) {
                break;
            }
            let len = self.node(idx).keys.len();
            if len > need {
                self.split(idx, len - need);
            }
            let values = self.take_values(idx);
            need -= values.len();
            let (backed_up, parent) = (self.node(idx).backed_up, self.node(idx).parent);
            let keys = if backed_up {
                self.host_only_pages += values.len();
                self.refresh(idx);
                self.node(idx).keys.clone()
            } else {
                self.remove_leaf(idx)
            };
            self.refresh(parent);
            out.push(Evicted {
                node,
                keys,
                values,
                backed_up,
            });
        }
        out
    }

    /// Forgets up to `pages` host-only pages (leaves first, by policy), e.g. when the tree's
    /// memory is bounded or the host tier reported them gone. Exact, like [`Self::evict`].
    pub fn evict_host(&mut self, pages: usize) -> Vec<Evicted<K, V>> {
        let mut out = Vec::new();
        let mut need = pages;
        while need > 0 {
            let Some(&(_, idx)) = self.host_set.first() else {
                break;
            };
            let node = self.id(idx);
            let len = self.node(idx).keys.len();
            if len > need {
                self.split(idx, len - need);
            }
            let parent = self.node(idx).parent;
            let keys = self.remove_leaf(idx);
            self.host_only_pages -= keys.len();
            need -= keys.len();
            self.refresh(parent);
            out.push(Evicted {
                node,
                keys,
                values: Vec::new(),
                backed_up: true,
            });
        }
        out
    }

    /// Unlinks a childless, unlocked node that holds no device values and frees its slot.
    fn remove_leaf(&mut self, idx: u32) -> Vec<K> {
        let n = self.node(idx);
        debug_assert!(n.children.is_empty() && n.lock == 0 && n.values.is_none());
        let (parent, d, h) = (n.parent, n.device_rank, n.host_rank);
        if let Some(r) = d {
            self.device_set.remove(&(r, idx));
        }
        if let Some(r) = h {
            self.host_set.remove(&(r, idx));
        }
        let keys = match self.slots[idx as usize].node.take() {
            Some(n) => n.keys,
            None => unreachable!("removing a free slot"),
        };
        self.node_mut(parent).children.remove(&keys[0]);
        self.release_slot(idx);
        keys
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tree() -> RadixTree<u32, u32> {
        RadixTree::new(PolicyKind::Lru)
    }

    #[test]
    fn match_splits_and_handles_survive() {
        let mut t = tree();
        let ins = t.insert(&[1, 2, 3, 4], &[10, 20, 30, 40]).unwrap();
        assert_eq!(ins.already_on_device, 0);
        t.lock(ins.node).unwrap();
        // A match ending inside the node splits it; the matched head is its own node.
        let m = t.match_prefix(&[1, 2, 9]);
        assert_eq!(m.device_values, [10, 20]);
        assert_eq!(t.view(m.device_node).unwrap().keys, [1, 2]);
        // The handle taken before the split still covers the whole sequence.
        assert_eq!(t.view(ins.node).unwrap().keys, [3, 4]);
        assert_eq!(t.protected_pages(), 4);
        t.unlock(ins.node).unwrap();
        assert_eq!(t.evictable_pages(), 4);
        t.validate().unwrap();
    }

    #[test]
    fn insert_reports_duplicates_and_revives_host_pages() {
        let mut t = tree();
        let a = t.insert(&[1, 2, 3], &[10, 20, 30]).unwrap();
        t.mark_backed_up(a.node).unwrap();
        // Evict the last page: it was backed up, so it stays as a host page.
        let ev = t.evict(1);
        assert_eq!(ev.len(), 1);
        assert_eq!(
            (ev[0].keys.as_slice(), ev[0].values.as_slice()),
            (&[3][..], &[30][..])
        );
        assert!(ev[0].backed_up);
        let m = t.match_prefix(&[1, 2, 3, 4]);
        assert_eq!((m.device_pages(), m.host_pages), (2, 1));
        // Re-inserting: two duplicates to free, one host page revived with the new slot.
        let r = t.insert(&[1, 2, 3, 4], &[11, 21, 31, 41]).unwrap();
        assert_eq!((r.already_on_device, r.revived), (2, 1));
        assert_eq!(
            t.match_prefix(&[1, 2, 3, 4]).device_values,
            [10, 20, 31, 41]
        );
        t.validate().unwrap();
    }

    #[test]
    fn unbacked_pages_are_removed_on_eviction_and_stale_handles_refused() {
        let mut t = tree();
        let a = t.insert(&[5, 6], &[50, 60]).unwrap();
        let freed: Vec<u32> = t.evict(10).into_iter().flat_map(|e| e.values).collect();
        assert_eq!(freed, [50, 60]);
        assert_eq!(t.node_count(), 1);
        assert!(matches!(t.lock(a.node), Err(Error::StaleHandle(_))));
        assert!(matches!(t.unlock(t.root()), Ok(())));
        let b = t.insert(&[7], &[70]).unwrap();
        assert!(matches!(t.unlock(b.node), Err(Error::StaleHandle(_))));
        assert!(t.insert(&[1, 2], &[1]).is_err());
    }

    #[test]
    fn locked_pages_are_never_evicted() {
        let mut t = tree();
        let a = t.insert(&[1, 2], &[1, 2]).unwrap();
        t.insert(&[1, 2, 3], &[9, 9, 3]).unwrap();
        t.lock(a.node).unwrap();
        let freed: usize = t.evict(100).iter().map(|e| e.values.len()).sum();
        assert_eq!(freed, 1);
        assert_eq!(t.device_pages(), 2);
        assert_eq!(t.peek_victims(1), Vec::<NodeId>::new());
    }

    #[test]
    fn partial_backups_mark_exactly_their_pages_even_after_splits() {
        let mut t = tree();
        let a = t.insert(&[1, 2, 3, 4, 5, 6], &[1, 2, 3, 4, 5, 6]).unwrap();
        t.lock(a.node).unwrap();
        // A backup planned the whole node; a request splits it meanwhile (after page 2).
        let m = t.match_prefix(&[1, 2]);
        assert_eq!(m.device_values, vec![1, 2]);
        // The backup stored pages 1 to 4: exactly those are marked, wherever the node ends.
        assert!(t.mark_backed_up_through(a.node, &4).unwrap());
        assert_eq!(
            t.unbacked_path(a.node)
                .unwrap()
                .iter()
                .flat_map(|&n| t.view(n).unwrap().keys.to_vec())
                .collect::<Vec<_>>(),
            vec![5, 6]
        );
        assert!(!t.mark_backed_up_through(a.node, &9).unwrap());
        t.unlock(a.node).unwrap();
        // Eviction keeps the marked pages as host pages and removes the rest.
        let evicted = t.evict_while(6, |_, backed_up| backed_up);
        assert!(evicted.is_empty(), "the unbacked leaf goes first by policy");
        let evicted = t.evict(6);
        let kept: Vec<u32> = evicted
            .iter()
            .filter(|e| e.backed_up)
            .flat_map(|e| e.keys.clone())
            .collect();
        assert_eq!(kept.len(), 4);
        t.validate().unwrap();
    }
}
