//! The index's side of the storage tier below (L3): what eviction may do with pages L3 does
//! not hold ([`L3Mode`]), the dirty limit that holds writers back while L3 catches up, and
//! each page's way to L3 ([`L3Mark`]): queued by the write policy or handed to a flush,
//! pinned while its write runs, and marked held once it landed.

use super::{HostIndex, PageState};
use crate::PageKey;

/// What eviction may do with pages the storage tier below (L3) does not hold.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum L3Mode {
    /// There is no L3: ready, unpinned leaves are evicted by policy.
    #[default]
    Absent,
    /// L3 is attached: a page leaves only once L3 holds it (leaves first, then interior
    /// pages, which stay reachable through L3).
    Up,
    /// L3 is attached but failing (its breaker is open): pages L3 holds go first, then
    /// leaves it does not (lost to the node, counted).
    Down,
}

/// Where a page stands with the storage tier below L2.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum L3Mark {
    /// Not known to be in L3.
    None,
    /// A write to L3 is queued or in flight (the page is pinned meanwhile).
    Queued,
    /// L3 holds it (written, or found there).
    Persisted,
    /// The admission filter turned it away from L3 (`l3.admission`): it leaves L2 unwritten
    /// as it would with no L3 (a leaf, by policy), counted in
    /// [`super::HostIndexStats::declined_evictions`]. Admitted later, it is `None` again.
    Declined,
}

impl HostIndex {
    /// Sets what eviction may do with pages L3 does not hold ([`L3Mode::Absent`] at first).
    /// Switching between `Up` and `Down` costs nothing; attaching or detaching L3 re-files
    /// every page.
    pub fn set_l3_mode(&mut self, mode: L3Mode) {
        let refile = (self.l3_mode == L3Mode::Absent) != (mode == L3Mode::Absent);
        self.l3_mode = mode;
        if refile {
            let slots: Vec<u32> = self.table.slots().collect();
            for s in slots {
                self.refresh(s);
            }
        }
    }

    /// The current [`L3Mode`].
    pub fn l3_mode(&self) -> L3Mode {
        self.l3_mode
    }

    /// Sets the most dirty pages (written by clients, not yet in L3) the pool holds while
    /// L3 is up; the whole pool at first. Write reservations beyond it are refused
    /// (`NoSpace`) until writes to L3 land.
    pub fn set_dirty_limit(&mut self, pages: u32) {
        self.dirty_limit = pages;
    }

    /// The dirty limit.
    pub fn dirty_limit(&self) -> u32 {
        self.dirty_limit
    }

    pub(super) fn clean(&mut self, slot: u32) {
        let e = self.entry_mut(slot);
        if e.dirty {
            e.dirty = false;
            self.stats.dirty -= 1;
        }
    }

    /// Pins ready `keys` for an L3 write and marks them queued; skips keys that are absent,
    /// not ready, or already queued or persisted. Returns `(key, slot)` of those pinned.
    pub fn queue_for_l3(&mut self, keys: &[PageKey]) -> Vec<(PageKey, u32)> {
        let mut out = Vec::new();
        for k in keys {
            let Some(s) = self.slot_of(k) else { continue };
            let e = self.entry_mut(s);
            if e.state != PageState::Ready || e.l3 != L3Mark::None {
                continue;
            }
            e.l3 = L3Mark::Queued;
            self.add_pin(s);
            self.refresh(s);
            out.push((*k, s));
        }
        out
    }

    /// The coldest `n` pages not yet in L3, queued and pinned for writing (the flush that
    /// keeps evictable slots available under every write policy). None without L3.
    pub fn flush_candidates(&mut self, n: usize) -> Vec<(PageKey, u32)> {
        let keys: Vec<PageKey> = self
            .flushable
            .iter()
            .take(n)
            .map(|(_, s)| self.entry(s).key)
            .collect();
        self.queue_for_l3(&keys)
    }

    /// Ends an L3 write started by [`Self::queue_for_l3`]: unpins the page and marks it
    /// persisted (`landed`) or not (to be tried again later). The page may have been
    /// re-created meanwhile only if it was unpinned, which a queued page never is.
    pub fn finish_l3(&mut self, key: &PageKey, landed: bool) {
        let Some(s) = self.slot_of(key) else { return };
        let e = self.entry_mut(s);
        if e.l3 != L3Mark::Queued {
            return;
        }
        e.l3 = if landed {
            L3Mark::Persisted
        } else {
            L3Mark::None
        };
        e.pins -= 1;
        let unpinned = e.pins == 0;
        self.stats.pins -= 1;
        if unpinned {
            self.stats.pinned -= 1;
        }
        if landed {
            self.clean(s);
        }
        self.refresh(s);
    }

    /// Records that L3 already holds `key` (found there, or loaded from there).
    pub fn mark_persisted(&mut self, key: &PageKey) {
        if let Some(s) = self.slot_of(key)
            && self.entry(s).l3 == L3Mark::None
        {
            self.entry_mut(s).l3 = L3Mark::Persisted;
            self.clean(s);
            self.refresh(s);
        }
    }

    /// Marks `key` (ready, not in L3 nor on its way) as turned away from L3 by the admission
    /// filter: it is no longer dirty, never flushed, and evicted as a leaf. Says whether it
    /// was marked.
    pub fn decline_l3(&mut self, key: &PageKey) -> bool {
        let Some(s) = self.slot_of(key) else {
            return false;
        };
        let e = self.entry(s);
        if e.state != PageState::Ready || e.l3 != L3Mark::None {
            return false;
        }
        self.entry_mut(s).l3 = L3Mark::Declined;
        self.clean(s);
        self.refresh(s);
        true
    }

    /// Undoes [`Self::decline_l3`]: the filter admitted `key` after all (seen again), so it
    /// is written to L3 like any page not there yet. Says whether it was declined.
    pub fn readmit_l3(&mut self, key: &PageKey) -> bool {
        let Some(s) = self.slot_of(key) else {
            return false;
        };
        if self.entry(s).l3 != L3Mark::Declined {
            return false;
        }
        let e = self.entry_mut(s);
        e.l3 = L3Mark::None;
        e.dirty = true;
        self.stats.dirty += 1;
        self.refresh(s);
        true
    }

    /// Hit count and L3 mark of `key`.
    pub fn l3_info(&self, key: &PageKey) -> Option<(u64, L3Mark)> {
        self.slot_of(key).map(|s| {
            let e = self.entry(s);
            (u64::from(e.hits), e.l3)
        })
    }

    /// Pages ready and not yet in L3 (what write-back still has to write); 0 without L3.
    pub fn unpersisted(&self) -> usize {
        self.flushable.len()
    }
}
