//! The L2 host-tier index: which page key sits in which slot of a pool, in which state, pinned
//! by whom, and which page to evict next.
//!
//! Pages go through two phases: [`HostIndex::reserve`] creates them `Writing` (invisible to
//! lookups and readers), the writer copies the bytes into the slot, and [`HostIndex::commit`]
//! makes them `Ready`. Nothing is ever visible before it is fully written.
//!
//! Each entry links to its parent (the page before it in its sequence, if that page was
//! indexed when this one was created) and counts its resident children. Links name a slot and
//! the slot's generation, which changes whenever the slot is freed, so a link to a page that
//! has since left (even if its key came back in another slot) is dead: a child counts toward
//! exactly the parent it was created under. Only ready, unpinned pages are eviction
//! candidates, ordered by the configured [`EvictionPolicy`] inside classes that depend on the
//! storage tier below ([`L3Mode`]):
//!
//! - no L3 ([`L3Mode::Absent`]): leaves only, so a prefix is never evicted from under a page
//!   that needs it;
//! - L3 attached ([`L3Mode::Up`]): only pages L3 holds, leaves first, then interior pages (the
//!   prefix stays reachable through L3, and a sequence longer than the pool can pass through
//!   it);
//! - L3 attached but failing ([`L3Mode::Down`]): as `Up`, then leaves L3 does not hold. Those
//!   are lost to the node, and counted ([`HostIndexStats::unwritten_evictions`]).
//!
//! For the storage tier below, each entry carries an [`L3Mark`]. A page being written to L3
//! is pinned (so its slot cannot be reused mid-copy), and [`HostIndex::flush_candidates`] hands
//! out the coldest pages L3 does not hold yet, so with L3 attached a page's slot is freed only
//! after its write landed, under every write policy.
//!
//! Pages clients wrote that L3 does not hold yet are *dirty*. While L3 is up, a write
//! reservation ([`HostIndex::reserve`]) that would take the pool past its dirty limit
//! ([`HostIndex::set_dirty_limit`]) is refused like a full pool: the writers wait for L3 (the
//! backpressure) while the rest of the pool keeps clean pages that readers hit and
//! prefetches ([`HostIndex::reserve_clean`]) can still make room among.
//!
//! Memory: an index is sized for tens of millions of pages. Entries sit in one array by slot
//! (slots are dense `0..capacity`) and hold their key; the key table ([`KeyTable`]) stores
//! only slot numbers; the eviction and flush orders ([`order`]) group the pages one operation
//! touched under one ordered-map entry. An entry's rank is not stored: it is recomputed from
//! the entry's metadata, which never changes while the entry is filed (see `touch`). The
//! index never touches page bytes.
//!
//! Where things are: the entries, slots, links, pins and eviction order here; the L3 side
//! (modes, dirty limit, write marks) in `l3.rs`; tenants' counts and quotas in `quota.rs`;
//! the operator's bulk moves in `operator.rs`; slots leased to writers before they know their
//! keys in `lease.rs`; the invariant check in `check.rs`. The
//! model-based property test is `tests/host_index_model.rs`.

mod changes;
mod check;
mod l3;
mod lease;
mod operator;
mod order;
mod quota;
pub use changes::{IndexChange, SnapshotPages};
pub use l3::{L3Mark, L3Mode};
pub use lease::Landed;
pub use operator::Cleared;
pub use quota::TenantUse;

use order::Order;

/// Eviction class of a candidate, lowest first. See the module docs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum Class {
    /// A leaf that may go (held by L3, or there is no L3).
    Leaf,
    /// An interior page L3 holds.
    Interior,
    /// A leaf L3 does not hold while L3 is attached: only when L3 is down.
    Unwritten,
}

use crate::Error;
use crate::key_map::KeyTable;
use crate::keys::PageKey;
use crate::policy::{EntryMeta, EvictionPolicy, PolicyKind, Rank};
use crate::slots::SlotAllocator;

/// Identity of whoever reserved or pinned a page (a daemon session).
pub type OwnerId = u64;

/// Life-cycle state of an indexed page.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PageState {
    /// Reserved; its owner is copying bytes in. Invisible to lookups and readers.
    Writing,
    /// Committed: readable by anyone who pins it.
    Ready,
}

/// What [`HostIndex::reserve`] decided for one key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reserve {
    /// A fresh slot for the caller to fill and then commit.
    Reserved(u32),
    /// Already indexed (ready, or being written by someone): nothing to copy.
    Present,
    /// No slot could be freed: the pool is full of pinned pages, pages being written, pages
    /// that may not leave yet (see [`L3Mode`]) or prefixes of other pages.
    NoSpace,
}

/// A link to one incarnation of a slot: dead once the slot's generation moves on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Link {
    slot: u32,
    generation: u32,
}

/// No link (`slot` is never a real slot: capacities are below `u32::MAX`).
const NO_LINK: Link = Link {
    slot: u32::MAX,
    generation: 0,
};

/// One indexed page. 88 bytes (checked below); see the module docs for what is not stored
/// here.
#[derive(Clone, Debug)]
struct Entry {
    key: PageKey,
    owner: OwnerId,
    last_access: u64,
    created: u64,
    /// Pins that reached the page (saturating).
    hits: u32,
    pins: u32,
    /// Resident children linked to this incarnation.
    children: u32,
    parent: Link,
    state: PageState,
    l3: L3Mark,
    /// Written by a client and not yet held by L3 (counted in `stats.dirty`).
    dirty: bool,
    /// The class under which the entry is filed in `candidates`, at its current rank.
    filed: Option<Class>,
    /// Filed in `flushable`, at its current rank.
    flush_filed: bool,
}

const _: () = assert!(std::mem::size_of::<Option<Entry>>() <= 88);

impl Entry {
    /// A new, unpinned entry created at tick `now`, not known to L3.
    fn new(key: PageKey, parent: Link, state: PageState, owner: OwnerId, now: u64) -> Self {
        Self {
            key,
            owner,
            last_access: now,
            created: now,
            hits: 0,
            pins: 0,
            children: 0,
            parent,
            state,
            l3: L3Mark::None,
            dirty: false,
            filed: None,
            flush_filed: false,
        }
    }

    fn meta(&self) -> EntryMeta {
        EntryMeta {
            last_access: self.last_access,
            created: self.created,
            hits: u64::from(self.hits),
            priority: 0,
        }
    }

    fn idle(&self) -> bool {
        self.state == PageState::Ready && self.pins == 0
    }
}

/// Counters a daemon exports.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostIndexStats {
    /// Slots in the pool.
    pub capacity: u32,
    /// Pages committed and readable.
    pub ready: u32,
    /// Pages reserved and being written.
    pub writing: u32,
    /// Pages with at least one pin.
    pub pinned: u32,
    /// Sum of all pin counts.
    pub pins: u64,
    /// Pages evicted since start.
    pub evictions: u64,
    /// Of those, pages L3 did not hold (there was no L3, or it was down): gone from the
    /// node's shared tiers.
    pub unwritten_evictions: u64,
    /// Pages evicted unwritten because the admission filter declined them (`l3.admission`):
    /// given up by choice, not lost to a missing or failing L3.
    pub declined_evictions: u64,
    /// Pages clients wrote (reserved, committed) that L3 does not hold yet.
    pub dirty: u32,
    /// Slots leased to writers ([`HostIndex::lease`]): no page yet, counted toward the dirty
    /// limit.
    pub leased: u32,
}

/// The index of one pool class.
pub struct HostIndex {
    table: KeyTable,
    entries: Vec<Option<Entry>>,
    /// Per slot: bumped each time the slot is freed (see [`Link`]).
    generations: Vec<u32>,
    alloc: SlotAllocator,
    policy: Box<dyn EvictionPolicy>,
    candidates: Order<(Class, Rank)>,
    /// Ready, unpinned pages not yet in L3, coldest first (flushing order). Empty while
    /// there is no L3 (nothing would read it).
    flushable: Order<Rank>,
    l3_mode: L3Mode,
    /// Most dirty pages while L3 is attached.
    dirty_limit: u32,
    /// Tracked tenants: their page counts, quotas and own eviction orders.
    quotas: quota::Quotas,
    clock: u64,
    stats: HostIndexStats,
    /// Changes to what is readable, while recorded ([`Self::record_changes`]).
    changes: Option<Vec<IndexChange>>,
    /// Slots leased to writers, with no entry yet.
    leases: lease::Leases,
    /// Per slot: the last check that saw it, and the current check's stamp (finds a key
    /// named twice in one call without sorting or hashing).
    seen: Vec<u32>,
    stamp: u32,
}

impl std::fmt::Debug for HostIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostIndex")
            .field("policy", &self.policy.kind())
            .field("stats", &self.stats)
            .finish()
    }
}

fn bad_key(field: &'static str, i: usize, key: &PageKey, why: &str) -> Error {
    Error::InvalidField {
        field,
        reason: format!("keys[{i}] ({}): {why}", key.to_hex()),
    }
}

/// The key in an occupied slot (what the key table hashes and compares).
fn key_at(entries: &[Option<Entry>], slot: u32) -> PageKey {
    match &entries[slot as usize] {
        Some(e) => e.key,
        None => unreachable!("the key table names empty slot {slot}"),
    }
}

impl HostIndex {
    /// An empty index over `capacity` slots, evicting by `policy`.
    pub fn new(capacity: u32, policy: PolicyKind) -> Self {
        let capacity = capacity.min(u32::MAX - 1);
        Self {
            table: KeyTable::with_capacity(capacity as usize),
            entries: vec![None; capacity as usize],
            generations: vec![0; capacity as usize],
            seen: vec![0; capacity as usize],
            stamp: 0,
            alloc: SlotAllocator::new(capacity),
            policy: policy.build(),
            candidates: Order::new(capacity),
            flushable: Order::new(capacity),
            l3_mode: L3Mode::Absent,
            dirty_limit: capacity,
            quotas: quota::Quotas::default(),
            clock: 0,
            stats: HostIndexStats {
                capacity,
                ..HostIndexStats::default()
            },
            changes: None,
            leases: lease::Leases::default(),
        }
    }

    /// Current counters.
    pub fn stats(&self) -> HostIndexStats {
        self.stats
    }

    /// Slots free without evicting.
    pub fn free_slots(&self) -> u32 {
        self.alloc.available()
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    fn entry(&self, slot: u32) -> &Entry {
        match &self.entries[slot as usize] {
            Some(e) => e,
            None => unreachable!("mapped slot {slot} has no entry"),
        }
    }

    fn entry_mut(&mut self, slot: u32) -> &mut Entry {
        match &mut self.entries[slot as usize] {
            Some(e) => e,
            None => unreachable!("mapped slot {slot} has no entry"),
        }
    }

    /// The slot holding `key`.
    fn slot_of(&self, key: &PageKey) -> Option<u32> {
        let entries = &self.entries;
        self.table.get(key, |s| key_at(entries, s))
    }

    /// A link to the page now in `slot`.
    fn link_to(&self, slot: u32) -> Link {
        Link {
            slot,
            generation: self.generations[slot as usize],
        }
    }

    /// A link to the page `key` names, if indexed (else no link).
    fn link_to_key(&self, key: Option<PageKey>) -> Link {
        key.and_then(|k| self.slot_of(&k))
            .map_or(NO_LINK, |s| self.link_to(s))
    }

    /// The slot a link names, if that incarnation is still there.
    fn live(&self, link: Link) -> Option<u32> {
        (link != NO_LINK && self.generations.get(link.slot as usize) == Some(&link.generation))
            .then_some(link.slot)
    }

    /// The eviction class of an entry, if it is a candidate at all.
    fn class(&self, e: &Entry) -> Option<Class> {
        if !e.idle() {
            return None;
        }
        let leaf = e.children == 0;
        let held = e.l3 == L3Mark::Persisted;
        match self.l3_mode {
            // A page the admission filter declined leaves as it would with no L3.
            L3Mode::Absent => leaf.then_some(Class::Leaf),
            L3Mode::Up | L3Mode::Down if e.l3 == L3Mark::Declined => leaf.then_some(Class::Leaf),
            L3Mode::Up | L3Mode::Down => match (held, leaf) {
                (true, true) => Some(Class::Leaf),
                (true, false) => Some(Class::Interior),
                (false, true) => Some(Class::Unwritten),
                (false, false) => None,
            },
        }
    }

    /// Whether an entry belongs in the flush order.
    fn flushes(&self, e: &Entry) -> bool {
        self.l3_mode != L3Mode::Absent && e.idle() && e.l3 == L3Mark::None
    }

    /// Takes the entry out of both orders (at its current rank).
    fn unfile(&mut self, slot: u32) {
        let e = self.entry(slot);
        let (filed, flush) = (e.filed, e.flush_filed);
        if filed.is_none() && !flush {
            return;
        }
        let (rank, key) = (self.policy.rank(&e.meta()), e.key);
        if let Some(c) = filed {
            self.candidates.remove((c, rank), slot);
            self.quotas.unfile(&key, (c, rank), slot);
        }
        if flush {
            self.flushable.remove(rank, slot);
        }
        let e = self.entry_mut(slot);
        e.filed = None;
        e.flush_filed = false;
    }

    /// Files the entry where its state says it belongs, moving it if it is filed elsewhere.
    /// Its metadata must not have changed since it was filed (see [`Self::touch`]).
    fn refresh(&mut self, slot: u32) {
        let e = self.entry(slot);
        let (want, want_flush) = (self.class(e), self.flushes(e));
        if (want, want_flush) == (e.filed, e.flush_filed) {
            return;
        }
        self.unfile(slot);
        let e = self.entry(slot);
        let (rank, key) = (self.policy.rank(&e.meta()), e.key);
        if let Some(c) = want {
            self.candidates.insert((c, rank), slot);
            self.quotas.file(&key, (c, rank), slot);
        }
        if want_flush {
            self.flushable.insert(rank, slot);
        }
        let e = self.entry_mut(slot);
        e.filed = want;
        e.flush_filed = want_flush;
    }

    /// Changes an entry, metadata included: out of the orders, changed, filed again.
    fn touch(&mut self, slot: u32, f: impl FnOnce(&mut Entry)) {
        self.unfile(slot);
        f(self.entry_mut(slot));
        self.refresh(slot);
    }

    fn adjust_children(&mut self, parent: Link, delta: i32) {
        if let Some(slot) = self.live(parent) {
            let e = self.entry_mut(slot);
            e.children = e.children.saturating_add_signed(delta);
            self.refresh(slot);
        }
    }

    /// Removes an entry whatever its state, freeing its slot.
    fn remove(&mut self, slot: u32) -> Entry {
        self.unfile(slot);
        let key = self.entry(slot).key;
        let entries = &self.entries;
        self.table.remove(&key, |s| key_at(entries, s));
        let e = match self.entries[slot as usize].take() {
            Some(e) => e,
            None => unreachable!("removing empty slot {slot}"),
        };
        self.quotas.removed(&e.key);
        let g = &mut self.generations[slot as usize];
        *g = g.wrapping_add(1);
        match e.state {
            PageState::Ready => {
                self.stats.ready -= 1;
                self.log_removed(e.key);
            }
            PageState::Writing => self.stats.writing -= 1,
        }
        if e.dirty {
            self.stats.dirty -= 1;
        }
        if let Err(err) = self.alloc.free(slot) {
            unreachable!("index and allocator disagree: {err}");
        }
        self.adjust_children(e.parent, -1);
        e
    }

    /// Evicts the lowest-ranked candidate the mode allows; returns its key.
    fn evict_one(&mut self) -> Option<PageKey> {
        let ((class, _), slot) = self.candidates.first()?;
        if class == Class::Unwritten && self.l3_mode != L3Mode::Down {
            return None;
        }
        Some(self.evict_slot(slot))
    }

    /// Evicts the candidate in `slot`, counting it; returns its key.
    fn evict_slot(&mut self, slot: u32) -> PageKey {
        self.stats.evictions += 1;
        let e = self.remove(slot);
        match e.l3 {
            L3Mark::Persisted => {}
            L3Mark::Declined => self.stats.declined_evictions += 1,
            L3Mark::None | L3Mark::Queued => self.stats.unwritten_evictions += 1,
        }
        e.key
    }

    /// A free slot, evicting by policy (keys pushed to `evicted`) until one is; `None` when
    /// nothing more may leave.
    fn alloc_evicting(&mut self, evicted: &mut Vec<PageKey>) -> Option<u32> {
        loop {
            if let Some(s) = self.alloc.alloc() {
                return Some(s);
            }
            evicted.push(self.evict_one()?);
        }
    }

    /// Evicts up to `n` pages by policy and [`L3Mode`]. Returns their keys.
    pub fn evict(&mut self, n: usize) -> Vec<PageKey> {
        std::iter::from_fn(|| self.evict_one()).take(n).collect()
    }

    /// The number of leading `keys` that are ready. No pin, no touch.
    pub fn lookup(&self, keys: &[PageKey]) -> usize {
        keys.iter()
            .take_while(|k| {
                self.slot_of(k)
                    .is_some_and(|s| self.entry(s).state == PageState::Ready)
            })
            .count()
    }

    /// The key of the page before `key` in its sequence, if `key` is indexed and that page
    /// was indexed when `key` was created and still is (the same incarnation).
    pub fn parent(&self, key: &PageKey) -> Option<PageKey> {
        let s = self.slot_of(key)?;
        self.live(self.entry(s).parent).map(|p| self.entry(p).key)
    }

    /// Places a new entry in a free `slot` and indexes its key.
    fn place(&mut self, slot: u32, e: Entry) {
        let key = e.key;
        self.entries[slot as usize] = Some(e);
        self.table.insert(&key, slot);
        self.quotas.placed(&key);
    }

    /// Indexes a page taken over from a dead daemon's pool: ready, unpinned, under `parent`
    /// (counted as its child when indexed), and dirty: L3 is not known to hold it, so the
    /// writer asks L3 before it writes it. Takes a free slot and never evicts. Returns the
    /// slot the caller must fill before anyone can read it (adoption runs before the daemon
    /// serves), or `None` when `key` is indexed already or no slot is free.
    pub fn adopt(&mut self, key: PageKey, parent: Option<PageKey>) -> Option<u32> {
        if self.slot_of(&key).is_some() {
            return None;
        }
        let slot = self.alloc.alloc()?;
        let now = self.tick();
        let link = self.link_to_key(parent);
        let mut e = Entry::new(key, link, PageState::Ready, 0, now);
        e.dirty = true;
        self.place(slot, e);
        self.stats.ready += 1;
        self.stats.dirty += 1;
        self.adjust_children(link, 1);
        self.refresh(slot);
        self.log_stored(slot);
        Some(slot)
    }

    /// Removes `key` if it is ready, pinned by nobody and the parent of no indexed page (a
    /// page its writer replaces); returns its freed slot. Not counted as an eviction.
    pub fn remove_idle(&mut self, key: &PageKey) -> Option<u32> {
        let s = self.slot_of(key)?;
        let e = self.entry(s);
        if e.state != PageState::Ready || e.pins > 0 || e.children > 0 {
            return None;
        }
        self.remove(s);
        Some(s)
    }

    /// The slot and state of `key`, if indexed.
    pub fn get(&self, key: &PageKey) -> Option<(u32, PageState)> {
        self.slot_of(key).map(|s| (s, self.entry(s).state))
    }

    /// Reserves slots for a client to write the keys not already indexed, in order.
    /// `parent` is the key of the page before `keys[0]` (`None` when `keys` starts a
    /// sequence). After the first key that gets no slot, every later key is `NoSpace` too: a
    /// page whose prefix is missing is unreachable. Evicts by policy to make room; the
    /// returned keys are what was evicted. The pages are dirty until L3 holds them, and with
    /// L3 attached none is reserved past the dirty limit.
    pub fn reserve(
        &mut self,
        owner: OwnerId,
        parent: Option<PageKey>,
        keys: &[PageKey],
    ) -> (Vec<Reserve>, Vec<PageKey>) {
        self.reserve_as(owner, parent, keys, true, usize::MAX)
    }

    /// [`Self::reserve`], handing out at most `max_new` slots: the keys after the last one
    /// that fits are `NoSpace` (a writer's budget of open reservations).
    pub fn reserve_at_most(
        &mut self,
        owner: OwnerId,
        parent: Option<PageKey>,
        keys: &[PageKey],
        max_new: usize,
    ) -> (Vec<Reserve>, Vec<PageKey>) {
        self.reserve_as(owner, parent, keys, true, max_new)
    }

    /// [`Self::reserve`] for pages whose bytes come from L3 (a prefetch): they are clean, so
    /// the dirty limit does not apply.
    pub fn reserve_clean(
        &mut self,
        owner: OwnerId,
        parent: Option<PageKey>,
        keys: &[PageKey],
    ) -> (Vec<Reserve>, Vec<PageKey>) {
        self.reserve_as(owner, parent, keys, false, usize::MAX)
    }

    fn reserve_as(
        &mut self,
        owner: OwnerId,
        parent: Option<PageKey>,
        keys: &[PageKey],
        dirty: bool,
        max_new: usize,
    ) -> (Vec<Reserve>, Vec<PageKey>) {
        let mut handed = 0usize;
        // Only while L3 is up can dirty pages become clean: only then do writers wait.
        let throttled = dirty && self.l3_mode == L3Mode::Up;
        let now = self.tick();
        let mut out = Vec::with_capacity(keys.len());
        let mut evicted = Vec::new();
        // Taken before any eviction below, so a parent evicted to make room (with L3
        // attached, interior pages may go) leaves a dead link, never one to its slot's reuse.
        let mut parent = self.link_to_key(parent);
        for key in keys {
            if let Some(s) = self.slot_of(key) {
                out.push(Reserve::Present);
                parent = self.link_to(s);
                continue;
            }
            if handed >= max_new
                || (throttled && self.stats.dirty + self.stats.leased >= self.dirty_limit)
            {
                out.resize(keys.len(), Reserve::NoSpace);
                break;
            }
            handed += 1;
            // Count the child before allocating, so eviction cannot take its own parent
            // while there is no L3.
            self.adjust_children(parent, 1);
            // A tenant at its quota makes room among its own pages, never another's; then
            // a free slot, evicting by policy if there is none.
            let slot = if self.quota_room(key, &mut evicted) {
                self.alloc_evicting(&mut evicted)
            } else {
                None
            };
            let Some(slot) = slot else {
                self.adjust_children(parent, -1);
                out.resize(keys.len(), Reserve::NoSpace);
                break;
            };
            let mut e = Entry::new(*key, parent, PageState::Writing, owner, now);
            e.dirty = dirty;
            self.place(slot, e);
            self.stats.writing += 1;
            if dirty {
                self.stats.dirty += 1;
            }
            out.push(Reserve::Reserved(slot));
            parent = self.link_to(slot);
        }
        (out, evicted)
    }

    /// Checks that every key is being written by `owner`, naming the first that is not.
    fn check_writing(&mut self, owner: OwnerId, keys: &[PageKey]) -> Result<Vec<u32>, Error> {
        // A fresh stamp for this call (all marks cleared when it wraps).
        self.stamp = self.stamp.wrapping_add(1);
        if self.stamp == 0 {
            self.seen.fill(0);
            self.stamp = 1;
        }
        let mut slots = Vec::with_capacity(keys.len());
        for (i, k) in keys.iter().enumerate() {
            let s = match self.slot_of(k) {
                Some(s)
                    if self.entry(s).state == PageState::Writing
                        && self.entry(s).owner == owner =>
                {
                    s
                }
                Some(_) => return Err(bad_key("keys", i, k, "not reserved by this session")),
                None => return Err(bad_key("keys", i, k, "not reserved")),
            };
            // A key named twice would be committed (or freed) twice: refused whole.
            let seen = &mut self.seen[s as usize];
            if *seen == self.stamp {
                return Err(bad_key("keys", i, k, "named more than once"));
            }
            *seen = self.stamp;
            slots.push(s);
        }
        Ok(slots)
    }

    /// Makes reserved pages ready, returning their slots in key order. All-or-nothing: if any
    /// key is not being written by `owner`, nothing changes.
    pub fn commit(&mut self, owner: OwnerId, keys: &[PageKey]) -> Result<Vec<u32>, Error> {
        let slots = self.check_writing(owner, keys)?;
        let now = self.tick();
        for &s in &slots {
            self.touch(s, |e| {
                e.state = PageState::Ready;
                e.last_access = now;
            });
            self.stats.writing -= 1;
            self.stats.ready += 1;
            self.log_stored(s);
        }
        Ok(slots)
    }

    /// Makes reserved pages ready and pins each once, in one step (no instant in which they
    /// are ready but evictable), marking them persisted when they came from L3. How a
    /// prefetch lands pages it loaded. All-or-nothing like [`Self::commit`].
    pub fn commit_pinned(
        &mut self,
        owner: OwnerId,
        keys: &[PageKey],
        persisted: bool,
    ) -> Result<Vec<u32>, Error> {
        let slots = self.check_writing(owner, keys)?;
        let now = self.tick();
        for &s in &slots {
            if persisted {
                self.clean(s);
            }
            self.add_pin(s);
            self.touch(s, |e| {
                e.state = PageState::Ready;
                e.last_access = now;
                if persisted {
                    e.l3 = L3Mark::Persisted;
                }
            });
            self.stats.writing -= 1;
            self.stats.ready += 1;
            self.log_stored(s);
        }
        Ok(slots)
    }

    /// Drops reservations, freeing their slots. All-or-nothing like [`Self::commit`].
    pub fn abort(&mut self, owner: OwnerId, keys: &[PageKey]) -> Result<(), Error> {
        let slots = self.check_writing(owner, keys)?;
        // Children first, so parents' child counts fall before they are removed.
        for s in slots.into_iter().rev() {
            self.remove(s);
        }
        Ok(())
    }

    /// The slots whose entries satisfy `pred`, in slot order.
    fn slots_where(&self, pred: impl Fn(&Entry) -> bool) -> Vec<u32> {
        self.entries
            .iter()
            .enumerate()
            .filter_map(|(s, e)| e.as_ref().filter(|e| pred(e)).map(|_| s as u32))
            .collect()
    }

    /// Frees every page `owner` is still writing (its session ended). Returns how many.
    pub fn abort_owner(&mut self, owner: OwnerId) -> usize {
        let slots = self.slots_where(|e| e.state == PageState::Writing && e.owner == owner);
        for &s in &slots {
            self.remove(s);
        }
        slots.len()
    }

    /// Pins the longest ready prefix of `keys` and returns its slots, in order. Pinned pages
    /// are never evicted.
    pub fn acquire(&mut self, keys: &[PageKey]) -> Vec<u32> {
        let mut slots = Vec::with_capacity(keys.len());
        for k in keys {
            match self.slot_of(k) {
                Some(s) if self.entry(s).state == PageState::Ready => slots.push(s),
                _ => break,
            }
        }
        let now = self.tick();
        for &s in &slots {
            self.pin(s, now);
        }
        slots
    }

    /// Pins `key` if it is ready (as [`Self::acquire`] does for one key) and returns its slot.
    pub fn acquire_one(&mut self, key: &PageKey) -> Option<u32> {
        let s = self.slot_of(key)?;
        if self.entry(s).state != PageState::Ready {
            return None;
        }
        let now = self.tick();
        self.pin(s, now);
        Some(s)
    }

    /// Adds one pin to the entry in `slot`, counted in the stats. Re-filing is the caller's
    /// (unfiling needs only the entry's filed marks and metadata, which this leaves alone).
    fn add_pin(&mut self, slot: u32) {
        let e = self.entry_mut(slot);
        e.pins += 1;
        if e.pins == 1 {
            self.stats.pinned += 1;
        }
        self.stats.pins += 1;
    }

    fn pin(&mut self, s: u32, now: u64) {
        self.add_pin(s);
        self.touch(s, |e| {
            e.last_access = now;
            e.hits = e.hits.saturating_add(1);
        });
    }

    /// Drops one pin from each key. All-or-nothing: a key that is not pinned changes nothing.
    pub fn release(&mut self, keys: &[PageKey]) -> Result<(), Error> {
        let slots = self.pinned_slots(keys)?;
        self.release_slots(&slots)
            .map_err(|i| bad_key("keys", i, &keys[i], "not pinned"))
    }

    /// The slot of each of `keys`, every one pinned: what [`Self::release_slots`] takes (a
    /// pinned page keeps its slot until its last pin goes). The error names the first key
    /// not in the pool or not pinned.
    pub fn pinned_slots(&self, keys: &[PageKey]) -> Result<Vec<u32>, Error> {
        keys.iter()
            .enumerate()
            .map(|(i, k)| match self.slot_of(k) {
                Some(s) if self.entry(s).pins > 0 => Ok(s),
                Some(_) => Err(bad_key("keys", i, k, "not pinned")),
                None => Err(bad_key("keys", i, k, "not in the pool")),
            })
            .collect()
    }

    /// Drops one pin from the page in each of `slots` (from [`Self::acquire`] or
    /// [`Self::pinned_slots`]). All-or-nothing: on a slot with no pin left (one named more
    /// often than it is pinned, or empty), nothing changes and its position is the error.
    pub fn release_slots(&mut self, slots: &[u32]) -> Result<(), usize> {
        // Unpin in place, undoing on the first slot that cannot be released, so no map of
        // counts is built per call. A pinned entry is filed nowhere, so changing its pins
        // needs no unfiling.
        let mut failed = None;
        for (i, &s) in slots.iter().enumerate() {
            match self.entries.get_mut(s as usize) {
                Some(Some(e)) if e.pins > 0 => {
                    e.pins -= 1;
                    if e.pins == 0 {
                        self.stats.pinned -= 1;
                    }
                }
                _ => {
                    failed = Some(i);
                    break;
                }
            }
        }
        if let Some(i) = failed {
            for &s in &slots[..i] {
                let e = self.entry_mut(s);
                e.pins += 1;
                if e.pins == 1 {
                    self.stats.pinned += 1;
                }
            }
            return Err(i);
        }
        self.stats.pins -= slots.len() as u64;
        for &s in slots {
            self.refresh(s);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: u8) -> PageKey {
        PageKey([i; 32])
    }

    fn keys(r: std::ops::Range<u8>) -> Vec<PageKey> {
        r.map(key).collect()
    }

    #[test]
    fn a_commit_or_abort_naming_a_key_twice_is_refused_whole() {
        let mut ix = HostIndex::new(8, PolicyKind::Lru);
        let ks = keys(1..3);
        ix.reserve(1, None, &ks);
        for twice in [vec![ks[0], ks[1], ks[0]], vec![ks[1], ks[1]]] {
            let e = ix.commit(1, &twice).unwrap_err();
            assert!(e.to_string().contains("more than once"), "{e}");
            let e = ix.abort(1, &twice).unwrap_err();
            assert!(e.to_string().contains("more than once"), "{e}");
            assert_eq!((ix.stats().writing, ix.stats().ready), (2, 0));
            ix.validate().unwrap();
        }
        assert_eq!(ix.take_changes().len(), 0, "nothing was published");
        ix.commit(1, &ks).unwrap();
        assert_eq!((ix.stats().writing, ix.stats().ready), (0, 2));
        ix.validate().unwrap();
    }

    #[test]
    fn a_release_naming_a_key_twice_needs_two_pins_and_fails_whole() {
        let mut ix = HostIndex::new(8, PolicyKind::Lru);
        let ks = keys(1..3);
        ix.reserve(1, None, &ks);
        ix.commit(1, &ks).unwrap();
        ix.acquire(&ks);
        ix.acquire(&ks[..1]);
        // keys[0] has two pins, keys[1] one: releasing keys[1] twice fails, changing nothing.
        let twice = [ks[0], ks[1], ks[1]];
        assert!(ix.release(&twice).is_err());
        assert_eq!((ix.stats().pins, ix.stats().pinned), (3, 2));
        ix.validate().unwrap();
        ix.release(&[ks[0], ks[0], ks[1]]).unwrap();
        assert_eq!((ix.stats().pins, ix.stats().pinned), (0, 0));
        ix.validate().unwrap();
        assert!(ix.release(&ks[..1]).is_err());
    }

    #[test]
    fn releases_by_slot_are_all_or_nothing_and_say_which_slot() {
        let mut ix = HostIndex::new(8, PolicyKind::Lru);
        let ks = keys(1..4);
        ix.reserve(1, None, &ks);
        ix.commit(1, &ks).unwrap();
        let slots = ix.acquire(&ks[..2]);
        // keys[2] is held but not pinned, and a key not held at all: named with their reasons.
        let e = ix.pinned_slots(&ks).unwrap_err().to_string();
        assert!(e.contains("keys[2]") && e.contains("not pinned"), "{e}");
        let e = ix.pinned_slots(&[ks[0], key(9)]).unwrap_err().to_string();
        assert!(
            e.contains("keys[1]") && e.contains("not in the pool"),
            "{e}"
        );
        assert_eq!(ix.pinned_slots(&ks[..2]).unwrap(), slots);
        // A slot named more often than it is pinned, or one with no page: nothing changes.
        let (unpinned, _) = ix.get(&ks[2]).unwrap();
        for bad in [
            vec![slots[0], slots[1], slots[1]],
            vec![slots[0], unpinned],
            vec![slots[0], 99],
        ] {
            assert_eq!(ix.release_slots(&bad), Err(bad.len() - 1));
            assert_eq!((ix.stats().pins, ix.stats().pinned), (2, 2));
            ix.validate().unwrap();
        }
        ix.release_slots(&slots).unwrap();
        assert_eq!((ix.stats().pins, ix.stats().pinned), (0, 0));
        ix.validate().unwrap();
        // Unpinned, the pages can be evicted again.
        ix.reserve(1, None, &keys(10..18));
        assert_eq!(ix.get(&ks[0]), None);
    }

    #[test]
    fn nothing_is_visible_before_commit() {
        let mut ix = HostIndex::new(8, PolicyKind::Lru);
        let ks = keys(1..4);
        let (r, _) = ix.reserve(1, None, &ks);
        assert!(r.iter().all(|r| matches!(r, Reserve::Reserved(_))));
        assert_eq!(ix.lookup(&ks), 0);
        assert!(ix.acquire(&ks).is_empty());
        // Another writer is told the pages are present (dedup), and cannot commit them.
        assert_eq!(ix.reserve(2, None, &ks).0, vec![Reserve::Present; 3]);
        assert!(
            ix.commit(2, &ks)
                .unwrap_err()
                .to_string()
                .contains("keys[0]")
        );
        ix.commit(1, &ks).unwrap();
        assert_eq!(ix.lookup(&ks), 3);
        assert_eq!(ix.acquire(&ks).len(), 3);
        ix.validate().unwrap();
    }

    #[test]
    fn a_child_counts_toward_the_parent_it_was_created_under_only() {
        let (a0, a1, b) = (key(1), key(2), key(3));
        let mut ix = HostIndex::new(8, PolicyKind::Lru);
        ix.set_l3_mode(L3Mode::Up);
        ix.reserve(1, None, &[a0, a1]);
        ix.commit(1, &[a0, a1]).unwrap();
        assert_eq!(ix.parent(&a1), Some(a0));
        for (k, _) in ix.queue_for_l3(&[a0, a1]) {
            ix.finish_l3(&k, true);
        }
        // With L3 up an interior page may leave while its (pinned) child stays.
        assert_eq!(ix.acquire(&[a0, a1]).len(), 2);
        ix.release(&[a0]).unwrap();
        assert_eq!(ix.evict(1), vec![a0]);
        assert_eq!(ix.parent(&a1), None, "the link died with its parent");
        // a0 comes back in another incarnation, with a child of its own.
        ix.set_l3_mode(L3Mode::Absent);
        ix.reserve(1, None, &[a0, b]);
        ix.commit(1, &[a0, b]).unwrap();
        assert_eq!((ix.parent(&b), ix.parent(&a1)), (Some(a0), None));
        ix.release(&[a1]).unwrap();
        ix.validate().unwrap();
        // The old child leaving must not uncount the new one: a0 stays until b is gone.
        assert_eq!(ix.evict(1), vec![a1]);
        ix.validate().unwrap();
        assert_eq!(ix.evict(2), vec![b, a0]);
    }

    #[test]
    fn eviction_takes_leaves_and_spares_pins_and_prefixes() {
        let mut ix = HostIndex::new(4, PolicyKind::Lru);
        let a = keys(1..4); // a chain of three
        ix.reserve(1, None, &a);
        ix.commit(1, &a).unwrap();
        let pinned = ix.acquire(&a[..1]);
        assert_eq!(pinned.len(), 1);
        // Need two slots for a new chain: one free, then evict the leaf a[2] (never a[0] or
        // a[1], which have resident children).
        let b = keys(10..12);
        let (r, evicted) = ix.reserve(1, None, &b);
        assert!(matches!(
            r[..],
            [Reserve::Reserved(_), Reserve::Reserved(_)]
        ));
        assert_eq!(evicted, vec![a[2]]);
        ix.commit(1, &b).unwrap();
        // a[0] is pinned and b is a fresh chain; after b's leaf and a[1], nothing is left.
        let evicted = ix.evict(10);
        assert!(!evicted.contains(&a[0]));
        assert_eq!(ix.lookup(&a), 1);
        ix.release(&a[..1]).unwrap();
        assert!(
            ix.release(&a[..1])
                .unwrap_err()
                .to_string()
                .contains("not pinned")
        );
        ix.validate().unwrap();
    }

    #[test]
    fn no_space_cuts_the_rest_and_abort_frees() {
        let mut ix = HostIndex::new(2, PolicyKind::Fifo);
        let ks = keys(1..5);
        let (r, _) = ix.reserve(7, None, &ks);
        assert!(matches!(
            r[..],
            [
                Reserve::Reserved(_),
                Reserve::Reserved(_),
                Reserve::NoSpace,
                Reserve::NoSpace
            ]
        ));
        assert!(ix.abort(8, &ks[..2]).is_err());
        assert_eq!(ix.stats().writing, 2);
        assert_eq!(ix.abort_owner(7), 2);
        assert_eq!(ix.free_slots(), 2);
        ix.validate().unwrap();
    }

    #[test]
    fn commit_pinned_lands_pages_pinned_and_persisted() {
        let mut ix = HostIndex::new(3, PolicyKind::Lru);
        ix.set_l3_mode(L3Mode::Up);
        let ks = keys(1..3);
        ix.reserve(9, None, &ks);
        assert!(
            ix.commit_pinned(8, &ks, true).is_err(),
            "another owner's pages"
        );
        assert_eq!(ix.stats().writing, 2);
        let slots = ix.commit_pinned(9, &ks, true).unwrap();
        assert_eq!(slots.len(), 2);
        assert_eq!(
            (ix.stats().ready, ix.stats().pinned, ix.stats().pins),
            (2, 2, 2)
        );
        // Pinned: nothing can be evicted, even though both are persisted.
        assert!(ix.evict(2).is_empty());
        ix.release(&ks).unwrap();
        // Persisted, so they may be evicted once unpinned (leaf first), and no L3 write is
        // asked for.
        assert!(ix.queue_for_l3(&ks).is_empty());
        assert_eq!(ix.evict(2), vec![ks[1], ks[0]]);
        assert_eq!(ix.stats().unwritten_evictions, 0);
        ix.validate().unwrap();
    }

    #[test]
    fn with_l3_only_written_pages_leave_and_a_long_chain_passes_through() {
        let mut ix = HostIndex::new(4, PolicyKind::Lru);
        ix.set_l3_mode(L3Mode::Up);
        // A chain longer than the pool: the first four fill it.
        let ks = keys(1..7);
        let (r, _) = ix.reserve(1, None, &ks);
        assert_eq!(
            r.iter()
                .filter(|r| matches!(r, Reserve::Reserved(_)))
                .count(),
            4
        );
        ix.commit(1, &ks[..4]).unwrap();
        // Nothing is in L3 yet: nothing may leave, the rest of the chain waits.
        assert!(ix.evict(4).is_empty());
        assert_eq!(ix.reserve(1, Some(ks[3]), &ks[4..]).0[0], Reserve::NoSpace);
        // Written: interior pages (reachable through L3) make room for the tail.
        let queued = ix.flush_candidates(10);
        assert_eq!(queued.len(), 4);
        for (k, _) in &queued {
            ix.finish_l3(k, true);
        }
        let (r, evicted) = ix.reserve(1, Some(ks[3]), &ks[4..]);
        assert!(r.iter().all(|r| matches!(r, Reserve::Reserved(_))), "{r:?}");
        assert_eq!(evicted.len(), 2);
        assert!(evicted.iter().all(|k| ks[..4].contains(k)), "{evicted:?}");
        assert_eq!(ix.stats().unwritten_evictions, 0);
        ix.validate().unwrap();
    }

    #[test]
    fn writers_stop_at_the_dirty_limit_and_prefetches_do_not() {
        let mut ix = HostIndex::new(8, PolicyKind::Lru);
        ix.set_l3_mode(L3Mode::Up);
        ix.set_dirty_limit(3);
        let a = keys(1..6);
        let (r, _) = ix.reserve(1, None, &a);
        assert_eq!(
            r.iter()
                .filter(|r| matches!(r, Reserve::Reserved(_)))
                .count(),
            3
        );
        assert_eq!(r[3..], [Reserve::NoSpace, Reserve::NoSpace]);
        assert_eq!(ix.stats().dirty, 3);
        // A prefetch brings clean pages: the limit does not apply, and landing them (from
        // L3) leaves them clean.
        let b = keys(10..13);
        let (r, _) = ix.reserve_clean(2, None, &b);
        assert!(r.iter().all(|r| matches!(r, Reserve::Reserved(_))));
        ix.commit_pinned(2, &b, true).unwrap();
        assert_eq!(ix.stats().dirty, 3);
        // Once L3 holds the written pages, writers may go on.
        ix.commit(1, &a[..3]).unwrap();
        for (k, _) in ix.queue_for_l3(&a[..3]) {
            ix.finish_l3(&k, true);
        }
        assert_eq!(ix.stats().dirty, 0);
        let (r, _) = ix.reserve(1, Some(a[2]), &a[3..]);
        assert!(r.iter().all(|r| matches!(r, Reserve::Reserved(_))), "{r:?}");
        assert_eq!(ix.stats().dirty, 2);
        ix.validate().unwrap();
        // Without L3, or with L3 down, there is no limit: nothing could clean the pages, and
        // writers must not wait for what cannot come.
        for mode in [L3Mode::Absent, L3Mode::Down] {
            let mut ix = HostIndex::new(4, PolicyKind::Lru);
            ix.set_l3_mode(mode);
            ix.set_dirty_limit(0);
            let (r, _) = ix.reserve(1, None, &keys(20..22));
            assert!(
                r.iter().all(|r| matches!(r, Reserve::Reserved(_))),
                "{mode:?}: {r:?}"
            );
            assert_eq!(ix.stats().dirty, 2);
            ix.validate().unwrap();
        }
    }

    #[test]
    fn unwritten_pages_leave_only_while_l3_is_down_and_are_counted() {
        let mut ix = HostIndex::new(2, PolicyKind::Lru);
        ix.set_l3_mode(L3Mode::Up);
        let a = keys(1..3);
        ix.reserve(1, None, &a);
        ix.commit(1, &a).unwrap();
        let b = keys(10..11);
        assert_eq!(ix.reserve(1, None, &b).0, vec![Reserve::NoSpace]);
        ix.set_l3_mode(L3Mode::Down);
        // Leaves only: a[0] is a[1]'s prefix.
        let (r, evicted) = ix.reserve(1, None, &b);
        assert!(matches!(r[..], [Reserve::Reserved(_)]));
        assert_eq!(evicted, vec![a[1]]);
        assert_eq!(ix.stats().unwritten_evictions, 1);
        ix.validate().unwrap();
        // Without L3 every eviction leaves the node, counted the same way.
        ix.commit(1, &b).unwrap();
        ix.set_l3_mode(L3Mode::Absent);
        assert_eq!(ix.evict(2).len(), 2);
        assert_eq!(ix.stats().unwritten_evictions, 3);
        ix.validate().unwrap();
    }

    #[test]
    fn only_an_idle_childless_ready_page_is_removed_and_its_slot_freed() {
        let mut ix = HostIndex::new(4, PolicyKind::Lru);
        let a = keys(1..3);
        ix.reserve(1, None, &a);
        assert_eq!(ix.remove_idle(&a[1]), None, "a page being written");
        ix.commit(1, &a).unwrap();
        assert_eq!(ix.remove_idle(&a[0]), None, "a parent");
        ix.acquire(&a[1..]);
        assert_eq!(ix.remove_idle(&a[1]), None, "a pinned page");
        ix.release(&a[1..]).unwrap();
        let free = ix.free_slots();
        assert!(ix.remove_idle(&a[1]).is_some());
        assert_eq!(ix.free_slots(), free + 1);
        assert_eq!(ix.lookup(&a), 1);
        assert_eq!(ix.stats().evictions, 0);
        ix.validate().unwrap();
    }

    #[test]
    fn declined_pages_leave_as_leaves_unwritten_counted_apart_and_readmitted_ones_are_written() {
        let mut ix = HostIndex::new(3, PolicyKind::Lru);
        ix.set_l3_mode(L3Mode::Up);
        let a = keys(1..4);
        ix.reserve(1, None, &a);
        ix.commit(1, &a).unwrap();
        assert_eq!(ix.stats().dirty, 3);
        // a[2] and a[1] declined: not dirty, never flushed; a[0] stays to be written.
        assert!(ix.decline_l3(&a[2]) && ix.decline_l3(&a[1]));
        assert!(!ix.decline_l3(&a[2]), "declined twice");
        assert_eq!(ix.stats().dirty, 1);
        assert_eq!(ix.unpersisted(), 1);
        assert_eq!(ix.unwritten_keys(), vec![a[0]]);
        ix.validate().unwrap();
        // Room for one page: the declined leaf leaves, counted apart from lost pages. The
        // declined interior page a[1] stays while its child is there.
        let b = keys(10..11);
        let (r, evicted) = ix.reserve(1, None, &b);
        assert!(matches!(r[..], [Reserve::Reserved(_)]), "{r:?}");
        assert_eq!(evicted, vec![a[2]]);
        assert_eq!(ix.stats().declined_evictions, 1);
        assert_eq!(ix.stats().unwritten_evictions, 0);
        ix.validate().unwrap();
        // Seen again: a[1] is admitted, dirty and flushable again, and written like any page.
        assert!(ix.readmit_l3(&a[1]));
        assert!(!ix.readmit_l3(&a[1]), "readmitted twice");
        assert_eq!(ix.stats().dirty, 3);
        let queued = ix.queue_for_l3(&a[1..2]);
        assert_eq!(queued.len(), 1);
        ix.finish_l3(&a[1], true);
        assert_eq!(ix.l3_info(&a[1]).unwrap().1, L3Mark::Persisted);
        // A page L3 holds or is writing is never declined.
        assert!(!ix.decline_l3(&a[1]));
        ix.validate().unwrap();
        // A clear gives declined pages up by choice too: not counted as unwritten (lost).
        let mut ix = HostIndex::new(3, PolicyKind::Lru);
        ix.set_l3_mode(L3Mode::Up);
        let c = keys(20..22);
        ix.reserve(1, None, &c);
        ix.commit(1, &c).unwrap();
        assert!(ix.decline_l3(&c[1]));
        let cleared = ix.clearable();
        assert_eq!(cleared.unwritten, ix.unwritten());
        let before = ix.unwritten();
        assert_eq!(before, 1);
        let (gone, _) = ix.clear();
        assert_eq!((gone.pages, gone.unwritten), (2, before));
        ix.validate().unwrap();
    }
}
