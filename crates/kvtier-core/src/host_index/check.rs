//! The index's invariants, checked in full against the entries (the unit tests and the
//! model-based property test call it after every step).

use super::{HostIndex, HostIndexStats, L3Mark, PageState};

impl HostIndex {
    /// Checks every count, link and order against the entries. `O(n)`; for tests.
    pub fn validate(&self) -> Result<(), String> {
        let mut s = HostIndexStats {
            capacity: self.stats.capacity,
            evictions: self.stats.evictions,
            unwritten_evictions: self.stats.unwritten_evictions,
            declined_evictions: self.stats.declined_evictions,
            ..HostIndexStats::default()
        };
        let mut children = vec![0u32; self.entries.len()];
        let (mut filed, mut flush_filed) = (0, 0);
        for (slot, e) in self.entries.iter().enumerate() {
            let Some(e) = e else {
                if self.leases.contains_key(&(slot as u32)) {
                    s.leased += 1;
                    if !self.alloc.is_allocated(slot as u32) {
                        return Err(format!("slot {slot} leased but free"));
                    }
                    continue;
                }
                if self.alloc.is_allocated(slot as u32) {
                    return Err(format!("slot {slot} allocated but empty"));
                }
                continue;
            };
            if self.leases.contains_key(&(slot as u32)) {
                return Err(format!("slot {slot} leased but holds a page"));
            }
            if self.slot_of(&e.key) != Some(slot as u32) || !self.alloc.is_allocated(slot as u32) {
                return Err(format!("slot {slot} is not mapped or not allocated"));
            }
            match e.state {
                PageState::Ready => s.ready += 1,
                PageState::Writing => s.writing += 1,
            }
            if e.dirty {
                if e.l3 == L3Mark::Persisted {
                    return Err(format!("slot {slot}: dirty but held by L3"));
                }
                s.dirty += 1;
            }
            if e.pins > 0 {
                s.pinned += 1;
                s.pins += u64::from(e.pins);
            }
            if let Some(p) = self.live(e.parent) {
                if p as usize == slot || self.entries[p as usize].is_none() {
                    return Err(format!(
                        "slot {slot}: live link to slot {p}, which is not a parent"
                    ));
                }
                children[p as usize] += 1;
            }
            let rank = self.policy.rank(&e.meta());
            let want = self.class(e);
            if want != e.filed
                || want.is_some_and(|c| !self.candidates.contains((c, rank), slot as u32))
            {
                return Err(format!("slot {slot}: candidate order is stale"));
            }
            let want_flush = self.flushes(e);
            if want_flush != e.flush_filed
                || (want_flush && !self.flushable.contains(rank, slot as u32))
            {
                return Err(format!("slot {slot}: flush order is stale"));
            }
            filed += usize::from(e.filed.is_some());
            flush_filed += usize::from(e.flush_filed);
            if e.l3 == L3Mark::Declined && (e.state != PageState::Ready || e.dirty) {
                return Err(format!("slot {slot}: declined but not ready, or dirty"));
            }
            if e.l3 == L3Mark::Queued && e.pins == 0 {
                return Err(format!("slot {slot}: queued for L3 but not pinned"));
            }
        }
        for (slot, e) in self.entries.iter().enumerate() {
            if let Some(e) = e
                && e.children != children[slot]
            {
                return Err(format!(
                    "slot {slot} counts {} children, {} link to it",
                    e.children, children[slot]
                ));
            }
        }
        if s != self.stats || self.table.len() as u32 != s.ready + s.writing {
            return Err(format!("stats walked {s:?} but kept {:?}", self.stats));
        }
        if self.candidates.len() != filed || self.flushable.len() != flush_filed {
            return Err("candidate or flush order holds removed entries".into());
        }
        self.validate_quotas()
    }
}
