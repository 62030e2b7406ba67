//! What an operator does to the index as a whole (kvtierd's admin calls): clear it, forget
//! what L3 held after L3 was cleared, and count what is not in L3 yet. Kept apart from the
//! per-page life cycle in the parent module.

use super::{Entry, HostIndex, L3Mark, PageState};
use crate::keys::PageKey;

/// What [`HostIndex::clear`] removes (or would remove).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cleared {
    /// Ready, unpinned pages removed.
    pub pages: u32,
    /// Of those, pages L3 did not hold (and the admission filter had not declined): gone
    /// from the node's shared tiers.
    pub unwritten: u32,
    /// Pages kept because they are in use: being written, pinned by a reader, or queued for
    /// L3.
    pub kept: u32,
}

/// Ready and not held by L3 nor declined by the admission filter: what a flush or a drain
/// still has to write.
fn unwritten(e: &Entry) -> bool {
    e.state == PageState::Ready && matches!(e.l3, L3Mark::None | L3Mark::Queued)
}

/// Ready and pinned by nobody: what a clear removes.
fn idle(e: &Entry) -> bool {
    e.state == PageState::Ready && e.pins == 0
}

impl HostIndex {
    /// What [`Self::clear`] would remove now, without removing it.
    pub fn clearable(&self) -> Cleared {
        self.count_clear(&self.slots_where(idle))
    }

    fn count_clear(&self, slots: &[u32]) -> Cleared {
        Cleared {
            pages: slots.len() as u32,
            unwritten: slots.iter().filter(|&&s| unwritten(self.entry(s))).count() as u32,
            kept: (self.table.len() - slots.len()) as u32,
        }
    }

    /// Removes every ready, unpinned page, whatever the eviction order and L3 mode. Pages in
    /// use (being written, pinned by a reader or an L3 write) stay, so nobody reading or
    /// writing is disturbed. Returns the counts and the freed slots (whose crash records
    /// the caller invalidates). Not counted as evictions.
    pub fn clear(&mut self) -> (Cleared, Vec<u32>) {
        let slots = self.slots_where(idle);
        let counts = self.count_clear(&slots);
        for &s in &slots {
            self.remove(s);
        }
        (counts, slots)
    }

    /// Forgets that L3 holds any page: L3 was cleared. Persisted pages become unwritten
    /// again, so (with L3 attached) each is written before its slot is reused. Pages whose
    /// write is queued stay queued; the caller decides whether its outcome still counts.
    pub fn forget_l3(&mut self) -> u32 {
        let slots = self.slots_where(|e| e.l3 == L3Mark::Persisted);
        for &s in &slots {
            self.entry_mut(s).l3 = L3Mark::None;
            self.refresh(s);
        }
        slots.len() as u32
    }

    /// Ready pages L3 does not hold yet, pinned or not, queued or not: what a flush or a
    /// drain still has to write.
    pub fn unwritten(&self) -> u32 {
        self.entries
            .iter()
            .flatten()
            .filter(|e| unwritten(e))
            .count() as u32
    }

    /// Of `keys`, those still ready here and not held by L3 (what a flush that began with
    /// them still waits for).
    pub fn still_unwritten(&self, keys: &mut Vec<PageKey>) {
        keys.retain(|k| self.slot_of(k).is_some_and(|s| unwritten(self.entry(s))));
    }

    /// Keys of the ready pages L3 does not hold (the set a flush waits for).
    pub fn unwritten_keys(&self) -> Vec<PageKey> {
        self.entries
            .iter()
            .flatten()
            .filter(|e| unwritten(e))
            .map(|e| e.key)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::super::{HostIndex, L3Mode, Reserve};
    use super::*;
    use crate::policy::PolicyKind;

    fn key(i: u8) -> PageKey {
        PageKey([i; 32])
    }

    /// A chain of `n` committed pages from key 1.
    fn filled(n: u8) -> HostIndex {
        let mut ix = HostIndex::new(16, PolicyKind::Lru);
        let keys: Vec<PageKey> = (1..=n).map(key).collect();
        let (r, _) = ix.reserve(1, None, &keys);
        assert!(r.iter().all(|r| matches!(r, Reserve::Reserved(_))));
        ix.commit(1, &keys).unwrap();
        ix
    }

    #[test]
    fn clear_keeps_pages_in_use_and_counts_what_l3_lacked() {
        let mut ix = filled(6);
        ix.set_l3_mode(L3Mode::Up);
        // Page 1 is held by L3, page 2 pinned by a reader, page 3 queued for L3, page 7
        // being written.
        assert_eq!(ix.queue_for_l3(&[key(1)]).len(), 1);
        ix.finish_l3(&key(1), true);
        assert_eq!(ix.acquire(&[key(1), key(2)]).len(), 2);
        ix.release(&[key(1)]).unwrap();
        assert_eq!(ix.queue_for_l3(&[key(3)]).len(), 1);
        ix.reserve(2, Some(key(6)), &[key(7)]);
        let want = Cleared {
            pages: 4,
            unwritten: 3,
            kept: 3,
        };
        assert_eq!(ix.clearable(), want);
        let (got, slots) = ix.clear();
        assert_eq!((got, slots.len()), (want, 4));
        ix.validate().unwrap();
        assert_eq!(ix.lookup(&[key(1), key(2)]), 0, "the chain's head is gone");
        assert_eq!(ix.lookup(&[key(2)]), 1, "a pinned page stays");
        assert!(ix.get(&key(2)).is_some() && ix.get(&key(3)).is_some());
        assert_eq!(ix.stats().evictions, 0, "a clear is not an eviction");
        assert_eq!(ix.free_slots(), 16 - 3);
        // What was pinned finishes normally.
        ix.release(&[key(2)]).unwrap();
        ix.finish_l3(&key(3), true);
        ix.commit(2, &[key(7)]).unwrap();
        ix.validate().unwrap();
    }

    #[test]
    fn forgetting_l3_makes_persisted_pages_unwritten_again() {
        let mut ix = filled(4);
        ix.set_l3_mode(L3Mode::Up);
        for k in [key(1), key(2), key(3), key(4)] {
            assert_eq!(ix.queue_for_l3(&[k]).len(), 1);
            ix.finish_l3(&k, true);
        }
        assert_eq!(ix.unwritten(), 0);
        // With L3 holding everything, the whole chain may leave.
        assert_eq!(ix.evict(1).len(), 1);
        assert_eq!(ix.forget_l3(), 3);
        assert_eq!(ix.unwritten(), 3);
        let mut keys = ix.unwritten_keys();
        keys.sort();
        assert_eq!(keys.len(), 3);
        // Nothing L3 lacks may leave while L3 is up: it must be written first.
        assert!(ix.evict(3).is_empty());
        assert_eq!(ix.flush_candidates(8).len(), 3);
        for k in keys.clone() {
            ix.finish_l3(&k, true);
        }
        ix.still_unwritten(&mut keys);
        assert!(keys.is_empty());
        ix.validate().unwrap();
    }
}
