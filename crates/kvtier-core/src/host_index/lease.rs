//! Slot leases: free slots a writer holds before it knows which pages will go in them, so a
//! small write is one copy and one call ([`HostIndex::commit_leased`]) instead of reserve,
//! copy and commit.
//!
//! A leased slot has no entry and no key: nothing can read it, evict it or hand it to anyone
//! else. It counts toward the dirty limit (its page will be dirty) and is taken like a
//! reservation's slot, evicting by policy when none is free. [`HostIndex::commit_leased`]
//! turns the slots the writer filled into ready pages in one step, in prefix order. A page
//! already indexed leaves its slot leased (the writer copied for nothing, and may reuse it).
//! [`HostIndex::end_leases`] frees what an owner still holds when its session ends.

use std::collections::HashMap;

use super::{Entry, HostIndex, OwnerId, PageState};
use crate::Error;
use crate::keys::PageKey;

/// Slots leased, by slot.
pub(super) type Leases = HashMap<u32, OwnerId>;

/// What [`HostIndex::commit_leased`] did with one page.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Landed {
    /// Its slot now holds it, ready.
    Stored,
    /// Already indexed: its slot stays leased.
    Present,
    /// Its tenant is at its quota with nothing of its own that may leave; so is every later
    /// page of the call (a page whose prefix is missing is unreachable). Its slot stays leased.
    NoRoom,
}

impl HostIndex {
    /// Slots `owner` holds leased.
    pub fn leases_of(&self, owner: OwnerId) -> usize {
        self.leases.values().filter(|&&o| o == owner).count()
    }

    /// Leases up to `n` more slots to `owner`, evicting by policy to make room and never past
    /// the dirty limit while L3 is up. Returns the slots and the keys evicted for them.
    pub fn lease(&mut self, owner: OwnerId, n: usize) -> (Vec<u32>, Vec<PageKey>) {
        let throttled = self.l3_mode == super::L3Mode::Up;
        let mut slots = Vec::with_capacity(n);
        let mut evicted = Vec::new();
        while slots.len() < n {
            if throttled && self.stats.dirty + self.stats.leased >= self.dirty_limit {
                break;
            }
            let Some(s) = self.alloc_evicting(&mut evicted) else {
                break;
            };
            self.leases.insert(s, owner);
            self.stats.leased += 1;
            slots.push(s);
        }
        (slots, evicted)
    }

    /// Lands `keys` (in prefix order, `parent` before the first) from the leased `slots` the
    /// owner copied them into: each page not indexed yet becomes ready in its slot, dirty until
    /// L3 holds it. All-or-nothing on its input: a slot not leased by `owner`, named twice, or
    /// a count that differs from the keys' changes nothing. Returns one [`Landed`] per key, and
    /// the keys evicted to keep a tenant within its quota.
    pub fn commit_leased(
        &mut self,
        owner: OwnerId,
        parent: Option<PageKey>,
        keys: &[PageKey],
        slots: &[u32],
    ) -> Result<(Vec<Landed>, Vec<PageKey>), Error> {
        if keys.len() != slots.len() {
            return Err(Error::InvalidField {
                field: "slots",
                reason: format!("{} slots for {} keys", slots.len(), keys.len()),
            });
        }
        for (i, s) in slots.iter().enumerate() {
            let why = if self.leases.get(s) != Some(&owner) {
                "not leased by this session"
            } else if slots[..i].contains(s) {
                "named twice"
            } else {
                continue;
            };
            return Err(Error::InvalidField {
                field: "slots",
                reason: format!("slots[{i}] ({s}): {why}"),
            });
        }
        let now = self.tick();
        let mut out = Vec::with_capacity(keys.len());
        let mut evicted = Vec::new();
        let mut parent = self.link_to_key(parent);
        for (key, &slot) in keys.iter().zip(slots) {
            if let Some(s) = self.slot_of(key) {
                out.push(Landed::Present);
                parent = self.link_to(s);
                continue;
            }
            // Counted first, so making room cannot take the page's own parent.
            self.adjust_children(parent, 1);
            if !self.quota_room(key, &mut evicted) {
                self.adjust_children(parent, -1);
                out.resize(keys.len(), Landed::NoRoom);
                break;
            }
            self.leases.remove(&slot);
            self.stats.leased -= 1;
            let mut e = Entry::new(*key, parent, PageState::Ready, owner, now);
            e.dirty = true;
            self.place(slot, e);
            self.stats.ready += 1;
            self.stats.dirty += 1;
            self.refresh(slot);
            self.log_stored(slot);
            out.push(Landed::Stored);
            parent = self.link_to(slot);
        }
        Ok((out, evicted))
    }

    /// Frees every slot `owner` holds leased (its session ended). Returns how many.
    pub fn end_leases(&mut self, owner: OwnerId) -> usize {
        let mine: Vec<u32> = self
            .leases
            .iter()
            .filter(|&(_, &o)| o == owner)
            .map(|(&s, _)| s)
            .collect();
        for &s in &mine {
            self.leases.remove(&s);
            self.stats.leased -= 1;
            if let Err(err) = self.alloc.free(s) {
                unreachable!("index and allocator disagree: {err}");
            }
        }
        mine.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::PolicyKind;
    use crate::host_index::{L3Mode, Reserve};

    fn key(i: u8) -> PageKey {
        PageKey([i; 32])
    }

    #[test]
    fn a_leased_slot_holds_nothing_until_committed_and_then_reads_like_a_reserved_one() {
        let mut ix = HostIndex::new(4, PolicyKind::Lru);
        let (slots, evicted) = ix.lease(1, 2);
        assert_eq!((slots.len(), evicted.len()), (2, 0));
        assert_eq!((ix.stats().leased, ix.free_slots()), (2, 2));
        ix.validate().unwrap();
        // Nobody else gets a leased slot: a reservation takes the other two, then no room.
        let (r, _) = ix.reserve(2, None, &[key(10), key(11), key(12)]);
        assert_eq!(r[2], Reserve::NoSpace);
        assert!(!matches!(r[0], Reserve::Reserved(s) if slots.contains(&s)));
        ix.abort(2, &[key(10), key(11)]).unwrap();

        let (landed, _) = ix
            .commit_leased(1, None, &[key(1), key(2)], &slots)
            .unwrap();
        assert_eq!(landed, vec![Landed::Stored, Landed::Stored]);
        assert_eq!(ix.lookup(&[key(1), key(2)]), 2);
        assert_eq!(ix.get(&key(2)), Some((slots[1], PageState::Ready)));
        assert_eq!(ix.parent(&key(2)), Some(key(1)));
        let s = ix.stats();
        assert_eq!((s.leased, s.ready, s.dirty), (0, 2, 2));
        ix.validate().unwrap();
    }

    #[test]
    fn a_present_page_keeps_its_slot_leased_and_bad_slots_change_nothing() {
        let mut ix = HostIndex::new(8, PolicyKind::Lru);
        let (r, _) = ix.reserve(2, None, &[key(1)]);
        assert!(matches!(r[0], Reserve::Reserved(_)));
        ix.commit(2, &[key(1)]).unwrap();
        let (slots, _) = ix.lease(1, 3);
        let (other, _) = ix.lease(2, 1);

        for (bad, field) in [
            (vec![slots[0], slots[0]], "named twice"),
            (vec![slots[0], other[0]], "not leased by this session"),
            (vec![slots[0], 7_000], "not leased by this session"),
        ] {
            let e = ix
                .commit_leased(1, None, &[key(1), key(2)], &bad)
                .unwrap_err();
            assert!(e.to_string().contains(field), "{e}");
        }
        assert!(ix.commit_leased(1, None, &[key(1)], &slots).is_err());
        assert_eq!(ix.stats().leased, 4);
        ix.validate().unwrap();

        let (landed, _) = ix
            .commit_leased(1, None, &[key(1), key(2)], &slots[..2])
            .unwrap();
        assert_eq!(landed, vec![Landed::Present, Landed::Stored]);
        assert_eq!(ix.parent(&key(2)), Some(key(1)));
        assert_eq!(ix.leases_of(1), 2, "the present page's slot stays leased");
        assert_eq!(ix.end_leases(1), 2);
        assert_eq!((ix.leases_of(1), ix.leases_of(2)), (0, 1));
        ix.validate().unwrap();
    }

    #[test]
    fn leases_evict_by_policy_and_stop_at_the_dirty_limit() {
        let mut ix = HostIndex::new(4, PolicyKind::Lru);
        let (r, _) = ix.reserve(2, None, &[key(1), key(2), key(3), key(4)]);
        assert!(r.iter().all(|r| matches!(r, Reserve::Reserved(_))));
        ix.commit(2, &[key(1), key(2), key(3), key(4)]).unwrap();
        // No L3: leaves may go, and the lease makes room like a reservation does.
        let (slots, evicted) = ix.lease(1, 2);
        assert_eq!((slots.len(), evicted.len()), (2, 2));
        ix.validate().unwrap();
        ix.end_leases(1);

        let mut ix = HostIndex::new(8, PolicyKind::Lru);
        ix.set_l3_mode(L3Mode::Up);
        ix.set_dirty_limit(3);
        let (r, _) = ix.reserve(2, None, &[key(1)]);
        assert!(matches!(r[0], Reserve::Reserved(_)));
        let (slots, _) = ix.lease(1, 8);
        assert_eq!(
            slots.len(),
            2,
            "one dirty page and two leased reach the limit of 3"
        );
        let (r, _) = ix.reserve(2, Some(key(1)), &[key(2)]);
        assert_eq!(
            r[0],
            Reserve::NoSpace,
            "leased slots count toward the dirty limit"
        );
        ix.validate().unwrap();
    }
}
