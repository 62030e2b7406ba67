//! The L2 page protocol, daemon side: lookup, reserve → commit (or abort), leased slots →
//! commit_leased, acquire → release, per session. A page is visible to other sessions only once committed, and a
//! pinned page is never evicted or overwritten. Committed pages become L3 write jobs per the
//! write policy (`l3_writes.rs`).

use std::time::Instant;

use kvtier_core::host_index::{L3Mark, L3Mode, Landed, OwnerId, PageState, Reserve};
use kvtier_core::{PageKey, SessionId, WritePolicy};

use super::{HostState, Job, L2Pool, Session, SlotPins, StateError};

/// Most slots one session may hold leased: enough for a decode step's pages, small against
/// any pool a lease is worth it in.
pub(super) const MAX_LEASE: usize = 16;

/// A pool leases at most one slot per session for this many slots it has: a small pool
/// (a test's, a tiny model's) leases none, and its writers reserve as before.
pub(super) const LEASE_POOL_SHARE: usize = 64;

/// What [`HostState::commit_leased`] did.
#[derive(Debug)]
pub struct LeasedCommit {
    /// One per key.
    pub landed: Vec<Landed>,
    /// Slots newly leased to the session.
    pub granted: Vec<u32>,
    /// Pages evicted to make room (a tenant's quota, the new lease).
    pub evicted: usize,
    /// L3 writes write-through asks for.
    pub jobs: Vec<Job>,
}

/// Leases `owner` more slots of `pool`, up to `want` held (at most [`MAX_LEASE`], and one per
/// [`LEASE_POOL_SHARE`] slots of the pool); none while kvtierd takes no new pages. Returns
/// the new slots and the keys evicted for them.
fn top_up(
    pool: &mut L2Pool,
    owner: OwnerId,
    want: usize,
    admitting: bool,
    room: usize,
) -> (Vec<u32>, Vec<PageKey>) {
    let held_now = pool.index.leases_of(owner);
    let cap = want
        .min(MAX_LEASE)
        .min(pool.index.stats().capacity as usize / LEASE_POOL_SHARE)
        .min(held_now + room);
    if !admitting || cap == 0 {
        return (Vec::new(), Vec::new());
    }
    let held = pool.index.leases_of(owner);
    if held >= cap {
        return (Vec::new(), Vec::new());
    }
    let (granted, evicted) = pool.index.lease(owner, cap - held);
    pool.handed_out(granted.iter().copied());
    (granted, evicted)
}

impl HostState {
    /// Leading keys ready in the session's pool.
    pub fn lookup(
        &mut self,
        id: SessionId,
        keys: &[PageKey],
        now: Instant,
    ) -> Result<usize, StateError> {
        let (_, pool) = self.session_pool(id, now)?;
        Ok(pool.index.lookup(keys))
    }

    /// With no session: how many leading `keys` are ready in the pool of layout `fp` that
    /// `tenant`'s sessions use (its own pool when it has one, never another's), and which
    /// are, each on its own. Nothing held: (0, all false).
    pub fn locate(
        &self,
        fp: &kvtier_core::LayoutFingerprint,
        tenant: &str,
        keys: &[PageKey],
    ) -> (usize, Vec<bool>) {
        match self.pools.get(&self.tenants.pool_of(fp, tenant).0) {
            Some(p) => (
                p.index.lookup(keys),
                keys.iter()
                    .map(|k| matches!(p.index.get(k), Some((_, PageState::Ready))))
                    .collect(),
            ),
            None => (0, vec![false; keys.len()]),
        }
    }

    /// Which of `keys` are ready in the session's pool, each on its own (L2 may hold a page
    /// whose prefix left it for L3).
    pub fn ready_mask(
        &mut self,
        id: SessionId,
        keys: &[PageKey],
        now: Instant,
    ) -> Result<Vec<bool>, StateError> {
        let (_, pool) = self.session_pool(id, now)?;
        Ok(keys
            .iter()
            .map(|k| matches!(pool.index.get(k), Some((_, PageState::Ready))))
            .collect())
    }

    /// How many more slots session `id` may hold open (reserved and not committed, or
    /// leased and not landed). While tenancy is on, what writers may take (the dirty limit
    /// while L3 drains it, else the pool) is budgeted per session and per tenant, counting
    /// every slot each holds either way: one writer that reserves or leases and never
    /// commits cannot take it all from the others. (Without tenants every writer is one
    /// trust domain, as for everything else: the whole of it.)
    fn writer_room(&self, id: SessionId) -> usize {
        let Ok(me) = self.sessions.get(id) else {
            return 0;
        };
        let Some(pool) = self.pools.get(&me.pool) else {
            return 0;
        };
        let holds = |s: &Session| s.writing + pool.index.leases_of(s.owner);
        let base = match pool.index.l3_mode() {
            L3Mode::Up => pool.index.dirty_limit(),
            _ => pool.index.stats().capacity,
        };
        if self.tenants.is_empty() {
            return (base as usize).saturating_sub(holds(me));
        }
        let budget = ((f64::from(base) * self.reserve_share).ceil() as usize).max(1);
        let tenant_holds: usize = self
            .sessions
            .values()
            .filter(|s| s.tenant == me.tenant && s.pool == me.pool)
            .map(holds)
            .sum();
        budget
            .saturating_sub(holds(me))
            .min(budget.saturating_sub(tenant_holds))
    }

    /// Reserves slots for the keys not present.
    pub fn reserve(
        &mut self,
        id: SessionId,
        parent: Option<PageKey>,
        keys: &[PageKey],
        now: Instant,
    ) -> Result<(Vec<Reserve>, usize), StateError> {
        self.admitting("new pages")?;
        let room = self.writer_room(id);
        let (session, pool) = self.session_pool(id, now)?;
        let (mode, lost) = (pool.index.l3_mode(), pool.index.stats().unwritten_evictions);
        let (out, evicted) = pool
            .index
            .reserve_at_most(session.owner, parent, keys, room);
        pool.handed_out(out.iter().filter_map(|r| match r {
            Reserve::Reserved(s) => Some(*s),
            _ => None,
        }));
        let lost_after = pool.index.stats().unwritten_evictions;
        let mut dedup = 0;
        let mut reserved = 0;
        let mut no_space = 0;
        for r in &out {
            match r {
                Reserve::Reserved(_) => reserved += 1,
                Reserve::Present => dedup += 1,
                Reserve::NoSpace => no_space += 1,
            }
        }
        session.writing += reserved;
        let c = &mut self.counters;
        c.reserve_calls += 1;
        c.dedup_pages += dedup;
        c.reserved_pages += reserved as u64;
        c.no_space_pages += no_space;
        self.count_lost(mode, lost, lost_after);
        Ok((out, evicted.len()))
    }

    /// Makes reserved pages visible, then tops the session's slot lease up toward
    /// `lease_want` (see [`MAX_LEASE`]). Returns the L3 writes write-through asks for, the
    /// slots newly leased, and how many pages were evicted for them.
    pub fn commit(
        &mut self,
        id: SessionId,
        keys: &[PageKey],
        lease_want: usize,
        now: Instant,
    ) -> Result<(Vec<Job>, Vec<u32>, usize), StateError> {
        let admitting = self.admitting("new pages").is_ok();
        let (write, epoch) = (self.l3.write(), self.l3.epoch());
        // What it commits no longer counts against it.
        let room = self.writer_room(id) + keys.len();
        let (session, pool) = self.session_pool(id, now)?;
        let slots = pool.index.commit(session.owner, keys)?;
        pool.committed_at(keys, &slots);
        session.writing = session.writing.saturating_sub(keys.len());
        let (jobs, admission) = Self::stored_jobs(write, epoch, pool, keys);
        let (mode, lost) = (pool.index.l3_mode(), pool.index.stats().unwritten_evictions);
        let (granted, evicted) = top_up(pool, session.owner, lease_want, admitting, room);
        let lost_after = pool.index.stats().unwritten_evictions;
        self.counters.commit_calls += 1;
        self.counters.committed_pages += keys.len() as u64;
        self.count_admission(admission);
        self.count_lost(mode, lost, lost_after);
        Ok((jobs, granted, evicted.len()))
    }

    /// Lands pages a session copied into its leased slots, then tops its lease up toward
    /// `want` (see [`MAX_LEASE`]; nothing while draining). Returns what became of each key,
    /// the newly leased slots, the pages evicted, and the L3 writes write-through asks for.
    pub fn commit_leased(
        &mut self,
        id: SessionId,
        parent: Option<PageKey>,
        keys: &[PageKey],
        slots: &[u32],
        want: usize,
        now: Instant,
    ) -> Result<LeasedCommit, StateError> {
        let admitting = self.admitting("new pages").is_ok();
        let (write, epoch) = (self.l3.write(), self.l3.epoch());
        // The leased slots it lands no longer count against it.
        let room = self.writer_room(id) + slots.len();
        let (session, pool) = self.session_pool(id, now)?;
        let (mode, lost) = (pool.index.l3_mode(), pool.index.stats().unwritten_evictions);
        let (landed, mut evicted) = pool
            .index
            .commit_leased(session.owner, parent, keys, slots)?;
        let stored: Vec<PageKey> = keys
            .iter()
            .zip(&landed)
            .filter(|(_, l)| **l == Landed::Stored)
            .map(|(k, _)| *k)
            .collect();
        pool.committed(&stored);
        let (jobs, admission) = Self::stored_jobs(write, epoch, pool, &stored);
        let (granted, more) = top_up(pool, session.owner, want, admitting, room);
        evicted.extend(more);
        let lost_after = pool.index.stats().unwritten_evictions;
        let c = &mut self.counters;
        c.commit_calls += u64::from(!keys.is_empty());
        c.committed_pages += stored.len() as u64;
        c.dedup_pages += landed.iter().filter(|l| **l == Landed::Present).count() as u64;
        c.no_space_pages += landed.iter().filter(|l| **l == Landed::NoRoom).count() as u64;
        self.count_admission(admission);
        self.count_lost(mode, lost, lost_after);
        Ok(LeasedCommit {
            landed,
            granted,
            evicted: evicted.len(),
            jobs,
        })
    }

    /// The L3 writes the write policy asks for when `keys` were stored in `pool`, once the
    /// pool's admission filter heard of them (only while an L3 is attached); and how many
    /// the filter admitted and declined.
    fn stored_jobs(
        write: Option<WritePolicy>,
        epoch: u64,
        pool: &mut L2Pool,
        keys: &[PageKey],
    ) -> (Vec<Job>, (u64, u64)) {
        let Some(p) = write.filter(|_| !keys.is_empty() && !pool.writes_own_l3) else {
            return (Vec::new(), (0, 0));
        };
        let (admitted, declined) = pool.admit_stored(keys);
        let n = admitted.len() as u64;
        if !p.on_store() || admitted.is_empty() {
            return (Vec::new(), (n, declined));
        }
        let queued = pool.index.queue_for_l3(&admitted);
        (Self::jobs(pool, queued, epoch), (n, declined))
    }

    /// Counts the admission filter's decisions (admitted, declined).
    fn count_admission(&mut self, (admitted, declined): (u64, u64)) {
        self.counters.admitted_pages += admitted;
        self.counters.declined_pages += declined;
    }

    /// Frees reserved pages.
    pub fn abort(
        &mut self,
        id: SessionId,
        keys: &[PageKey],
        now: Instant,
    ) -> Result<(), StateError> {
        let (session, pool) = self.session_pool(id, now)?;
        pool.index.abort(session.owner, keys)?;
        session.writing = session.writing.saturating_sub(keys.len());
        Ok(())
    }

    /// Pins the longest ready prefix for the session; returns the slots, and the L3 writes
    /// write-through-selective asks for (pages whose hit count reached the threshold).
    pub fn acquire(
        &mut self,
        id: SessionId,
        keys: &[PageKey],
        now: Instant,
    ) -> Result<(Vec<u32>, Vec<Job>), StateError> {
        let (write, epoch) = (self.l3.write(), self.l3.epoch());
        let (session, pool) = self.session_pool(id, now)?;
        let slots = pool.index.acquire(keys);
        let hit = &keys[..slots.len()];
        for &s in &slots {
            *session.pins.entry(s).or_insert(0) += 1;
        }
        let (jobs, readmitted) = match write.filter(|_| !pool.writes_own_l3) {
            Some(p) => {
                // A page the admission filter declined and now admits, seen again, is
                // written like any page not in L3 yet: at once under write_through.
                let readmitted = pool.admit_served(hit);
                let mut hot: Vec<PageKey> = hit
                    .iter()
                    .filter(|k| {
                        pool.index
                            .l3_info(k)
                            .is_some_and(|(hits, l3)| l3 == L3Mark::None && p.on_hit(hits))
                    })
                    .copied()
                    .collect();
                if p.on_store() {
                    hot.extend_from_slice(&readmitted);
                }
                let queued = pool.index.queue_for_l3(&hot);
                (Self::jobs(pool, queued, epoch), readmitted.len() as u64)
            }
            None => (Vec::new(), 0),
        };
        self.count_admission((readmitted, 0));
        self.counters.acquire_calls += 1;
        self.counters.acquired_pages += slots.len() as u64;
        Ok((slots, jobs))
    }

    /// Drops the session's pins on `keys`. All-or-nothing.
    pub fn release(
        &mut self,
        id: SessionId,
        keys: &[PageKey],
        now: Instant,
    ) -> Result<(), StateError> {
        let (session, pool) = self.session_pool(id, now)?;
        // The keys' slots (each pinned by someone, or the error names the key), then the
        // session's pins on them taken in place, undone on the first it does not hold (a
        // repeated key needs as many pins as it appears), so no map is built per call; then
        // the index's.
        let slots = pool.index.pinned_slots(keys)?;
        let undo = |pins: &mut SlotPins, taken: &[u32]| {
            for s in taken {
                *pins.entry(*s).or_insert(0) += 1;
            }
        };
        for (i, s) in slots.iter().enumerate() {
            match session.pins.get_mut(s) {
                Some(n) if *n > 0 => {
                    *n -= 1;
                    if *n == 0 {
                        session.pins.remove(s);
                    }
                }
                _ => {
                    undo(&mut session.pins, &slots[..i]);
                    return Err(StateError::invalid(
                        format!("keys[{i}]"),
                        format!("{} is not pinned by this session", keys[i].to_hex()),
                    ));
                }
            }
        }
        // The session held every pin, so the index has them: a refusal here means the two
        // disagree.
        if let Err(i) = pool.index.release_slots(&slots) {
            undo(&mut session.pins, &slots);
            return Err(StateError::Internal(format!(
                "keys[{i}] ({}): pinned by the session but not in the index",
                keys[i].to_hex()
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::time::Instant;

    use kvtier_core::{AdmissionKind, PageKey};

    use crate::state::testing::{keys, state, state_with};

    #[test]
    fn a_release_is_all_or_nothing_and_a_repeated_key_needs_a_pin_per_mention() {
        let (mut st, id) = state();
        let ks = keys(3);
        let now = Instant::now();
        st.reserve(id, None, &ks, now).unwrap();
        st.commit(id, &ks, 0, now).unwrap();
        // k1 pinned twice, k2 once, k3 not at all.
        st.acquire(id, &ks[..2], now).unwrap();
        st.acquire(id, &ks[..1], now).unwrap();
        // The session's pins by key (the first byte of each), through their slots.
        let pins = |st: &crate::state::HostState| {
            let s = st.sessions().find(|(sid, _)| **sid == id).unwrap().1;
            let index = &st.pools().next().unwrap().index;
            let key_in = |slot: u32| ks.iter().find(|k| index.get(k).unwrap().0 == slot);
            let mut v: Vec<_> = s
                .pins
                .iter()
                .map(|(&slot, n)| (key_in(slot).unwrap().0[0], *n))
                .collect();
            v.sort_unstable();
            v
        };
        assert_eq!(pins(&st), [(1, 2), (2, 1)]);
        // k3 is not held: nothing is released, and the error names it.
        let e = st.release(id, &ks, now).unwrap_err().to_string();
        assert!(e.contains("keys[2]"), "{e}");
        assert_eq!(pins(&st), [(1, 2), (2, 1)]);
        // k2 named twice but pinned once: refused whole as well.
        let e = st
            .release(id, &[ks[0], ks[1], ks[1]], now)
            .unwrap_err()
            .to_string();
        assert!(e.contains("keys[2]"), "{e}");
        assert_eq!(pins(&st), [(1, 2), (2, 1)]);
        // k1 twice and k2 once: every pin of the session goes.
        st.release(id, &[ks[0], ks[1], ks[0]], now).unwrap();
        assert_eq!(pins(&st), []);
        let e = st.release(id, &ks[..1], now).unwrap_err().to_string();
        assert!(e.contains("keys[0]"), "{e}");
        // Another session's pin is not this one's to drop.
        let other = st
            .register("u".into(), "", &crate::state::testing::tiny_layout(), now)
            .unwrap()
            .session_id;
        // (The L3 writes the commit queued hold pins of their own.)
        let before = st.totals().pins;
        st.acquire(other, &ks[2..], now).unwrap();
        let e = st.release(id, &ks[2..], now).unwrap_err().to_string();
        assert!(e.contains("not pinned by this session"), "{e}");
        assert_eq!(st.totals().pins, before + 1);
        st.release(other, &ks[2..], now).unwrap();
        assert_eq!(st.totals().pins, before);
    }

    #[test]
    fn the_admission_filter_keeps_first_stores_from_l3_and_writes_a_page_seen_again() {
        let now = Instant::now();
        // `all`: every committed page is written through, as before the filter.
        let (mut st, id) = state();
        let ks = keys(3);
        st.reserve(id, None, &ks, now).unwrap();
        assert_eq!(st.commit(id, &ks, 0, now).unwrap().0.len(), 3);
        assert_eq!(
            (st.counters.admitted_pages, st.counters.declined_pages),
            (3, 0)
        );
        for kind in [AdmissionKind::SeenTwice, AdmissionKind::TinyLfu] {
            let (mut st, id) = state_with(|cfg| {
                cfg.l3.admission = kind;
                cfg.l3.admission_window = 1024;
            });
            st.reserve(id, None, &ks, now).unwrap();
            let (jobs, _, _) = st.commit(id, &ks, 0, now).unwrap();
            assert!(jobs.is_empty(), "{kind}: first stores written");
            assert_eq!(st.counters.declined_pages, 3, "{kind}");
            // Declined pages are not dirty: writers are never held back for them.
            assert_eq!(st.totals().dirty, 0, "{kind}");
            // Hit: seen again, admitted, and written at once under write_through.
            let (slots, jobs) = st.acquire(id, &ks[..1], now).unwrap();
            assert_eq!((slots.len(), jobs.len()), (1, 1), "{kind}");
            assert_eq!(jobs[0].key, ks[0], "{kind}");
            assert_eq!(st.counters.admitted_pages, 1, "{kind}");
            st.finish_l3(&jobs[0], true);
            st.release(id, &ks[..1], now).unwrap();
            // The pool (16 slots) filled with pages seen once: the declined ones leave
            // unwritten, counted as declined and not as lost, with their bytes.
            let more: Vec<PageKey> = (100..120u8).map(|i| PageKey([i; 32])).collect();
            for k in &more {
                st.reserve(id, None, std::slice::from_ref(k), now).unwrap();
                st.commit(id, std::slice::from_ref(k), 0, now).unwrap();
            }
            let (declined, bytes) = st.declined();
            assert!(declined >= 4, "{kind}: {declined} declined pages evicted");
            let page = st.pools().next().unwrap().layout.page_bytes() as u64;
            assert_eq!(bytes, declined * page, "{kind}");
            assert_eq!(st.totals().unwritten_evictions, 0, "{kind}");
            assert_eq!(
                st.counters.lost_l3_down + st.counters.lost_no_l3,
                0,
                "{kind}"
            );
        }
    }
}
