//! What an operator does to L2 as a whole (kvtierd's admin calls): clear the pools, forget
//! what L3 held once L3 was cleared, flush every page L3 lacks, and drain before a stop.

use kvtier_core::{LayoutFingerprint, PageKey};

use super::HostState;
use super::StateError;

/// What a clear of L2 removed (or, for a dry run, would remove).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ClearedL2 {
    /// Pages removed.
    pub pages: u64,
    /// Of those, pages L3 did not hold: gone from the node.
    pub unwritten: u64,
    /// Pages kept because they are in use (being written, pinned, queued for L3).
    pub kept: u64,
}

/// Where a drain stands.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DrainReport {
    /// Whether the daemon is draining.
    pub draining: bool,
    /// Ready pages L3 does not hold yet.
    pub unwritten: u64,
    /// Pages reserved and not yet committed or aborted (writes in flight).
    pub writing: u64,
    /// Live sessions.
    pub sessions: u64,
    /// Whether an L3 tier is attached.
    pub l3_attached: bool,
    /// Whether it is failing (breaker open).
    pub l3_down: bool,
}

/// The pages a flush waits for: those L3 lacked when it began, per pool.
#[derive(Debug, Default)]
pub struct FlushWait {
    keys: Vec<(LayoutFingerprint, Vec<PageKey>)>,
}

impl FlushWait {
    /// Pages still to be written.
    pub fn left(&self) -> u64 {
        self.keys.iter().map(|(_, k)| k.len() as u64).sum()
    }
}

/// What the operator has set running on the whole node, a component of [`HostState`]: a
/// drain, and flushes in progress. It calls nothing; the state asks it.
#[derive(Debug, Default)]
pub(crate) struct OperatorFlags {
    /// Draining (`kvtierctl drain`): no new sessions, writes or prefetches; every page L3
    /// lacks is written.
    draining: bool,
    /// Flushes in progress (`kvtierctl flush`): while any is, every page L3 lacks is
    /// written, not only those of pools running short of free slots.
    flushes: u32,
}

impl OperatorFlags {
    /// Refuses `what` while draining.
    pub(crate) fn admitting(&self, what: &str) -> Result<(), StateError> {
        if self.draining {
            return Err(StateError::Draining(format!(
                "kvtierd is draining (kvtierctl drain): it takes no {what}; \
                 `kvtierctl drain --cancel` resumes"
            )));
        }
        Ok(())
    }

    /// Whether every page L3 lacks is to be written now (a drain or a flush runs), not
    /// only those of pools short of free slots.
    pub(crate) fn writes_everything(&self) -> bool {
        self.draining || self.flushes > 0
    }
}

impl HostState {
    /// Refuses `what` while draining.
    pub(super) fn admitting(&self, what: &str) -> Result<(), StateError> {
        self.operator.admitting(what)
    }

    /// Removes every page of every pool that is not in use, or (`dry_run`) counts what that
    /// would remove. Pages L3 did not hold are counted as lost (`reason="cleared"`).
    pub fn clear_l2(&mut self, dry_run: bool) -> ClearedL2 {
        let mut out = ClearedL2::default();
        for pool in self.pools.values_mut() {
            let c = if dry_run {
                pool.index.clearable()
            } else {
                let (c, slots) = pool.index.clear();
                // Their crash records go too: a cleared page must not come back after a
                // restart.
                pool.handed_out(slots);
                c
            };
            out.pages += u64::from(c.pages);
            out.unwritten += u64::from(c.unwritten);
            out.kept += u64::from(c.kept);
        }
        if !dry_run {
            self.counters.cleared_pages += out.pages;
            self.counters.lost_cleared += out.unwritten;
        }
        out
    }

    /// L3 was cleared: no page is held by it any more, and writes or loads that began
    /// before do not count as holding. Returns how many pages were marked held.
    pub fn forget_l3(&mut self) -> u64 {
        self.l3.cleared();
        self.pools
            .values_mut()
            .map(|p| u64::from(p.index.forget_l3()))
            .sum()
    }

    /// Starts or ends draining: while on, no new sessions, reservations or prefetches are
    /// taken, and the flusher writes every page L3 lacks.
    pub fn set_draining(&mut self, on: bool) {
        self.operator.draining = on;
    }

    /// Whether the daemon is draining.
    pub fn draining(&self) -> bool {
        self.operator.draining
    }

    /// Where a drain stands.
    pub fn drain_report(&self) -> DrainReport {
        let mut r = DrainReport {
            draining: self.operator.draining,
            sessions: self.sessions.len() as u64,
            l3_attached: self.l3.write().is_some(),
            l3_down: self.l3.is_down(),
            ..DrainReport::default()
        };
        // kvtierd's own pools write L3 themselves: nothing of theirs waits for the writer.
        for p in self.pools.values().filter(|p| !p.writes_own_l3) {
            r.unwritten += u64::from(p.index.unwritten());
            r.writing += u64::from(p.index.stats().writing);
        }
        r
    }

    /// Starts a flush: every page L3 lacks now is queued as the writer has room, until
    /// [`Self::end_flush`]. Returns those pages, to wait for with [`Self::flush_left`].
    pub fn begin_flush(&mut self) -> FlushWait {
        self.operator.flushes += 1;
        FlushWait {
            keys: self
                .pools
                .values()
                .filter(|p| !p.writes_own_l3)
                .map(|p| (p.key, p.index.unwritten_keys()))
                .filter(|(_, k)| !k.is_empty())
                .collect(),
        }
    }

    /// Drops the pages of `wait` that L3 holds now (or that left L2); returns how many are
    /// left.
    pub fn flush_left(&self, wait: &mut FlushWait) -> u64 {
        for (fp, keys) in &mut wait.keys {
            match self.pools.get(fp) {
                Some(p) => p.index.still_unwritten(keys),
                None => keys.clear(),
            }
        }
        wait.keys.retain(|(_, k)| !k.is_empty());
        wait.left()
    }

    /// Ends a flush begun with [`Self::begin_flush`].
    pub fn end_flush(&mut self) {
        self.operator.flushes = self.operator.flushes.saturating_sub(1);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::time::Instant;

    use super::*;

    use crate::state::testing::{keys, state};

    #[test]
    fn a_write_that_lands_after_l3_was_cleared_does_not_count_as_held() {
        let (mut st, id) = state();
        let ks = keys(4);
        st.reserve(id, None, &ks, Instant::now()).unwrap();
        let (jobs, ..) = st.commit(id, &ks, 0, Instant::now()).unwrap();
        assert_eq!(jobs.len(), 4);
        // Two writes land before the clear, two after it.
        for j in &jobs[..2] {
            st.finish_l3(j, true);
        }
        assert_eq!(st.drain_report().unwritten, 2);
        assert_eq!(st.forget_l3(), 2);
        for j in &jobs[2..] {
            st.finish_l3(j, true);
        }
        assert_eq!(
            st.drain_report().unwritten,
            4,
            "every page must be written again"
        );
        // A flush waits for them all and the flusher hands them out again.
        let mut wait = st.begin_flush();
        assert_eq!(wait.left(), 4);
        let again = st.flush_jobs(16);
        assert_eq!(again.len(), 4);
        for j in &again {
            st.finish_l3(j, true);
        }
        assert_eq!(st.flush_left(&mut wait), 0);
        st.end_flush();
    }

    #[test]
    fn draining_refuses_new_work_but_not_reads() {
        let (mut st, id) = state();
        let ks = keys(2);
        st.reserve(id, None, &ks, Instant::now()).unwrap();
        st.set_draining(true);
        let e = st
            .reserve(id, None, &keys(3)[2..], Instant::now())
            .unwrap_err();
        assert!(e.to_string().contains("draining"), "{e}");
        // Finishing work in flight is allowed, and reads go on.
        st.commit(id, &ks, 0, Instant::now()).unwrap();
        assert_eq!(st.lookup(id, &ks, Instant::now()).unwrap(), 2);
        let r = st.drain_report();
        assert_eq!(
            (r.draining, r.unwritten, r.writing, r.sessions),
            (true, 2, 0, 1)
        );
        st.set_draining(false);
        st.reserve(id, None, &keys(3)[2..], Instant::now()).unwrap();
    }

    #[test]
    fn clearing_counts_what_l3_lacked_as_lost() {
        let (mut st, id) = state();
        let ks = keys(3);
        st.reserve(id, None, &ks, Instant::now()).unwrap();
        let (jobs, ..) = st.commit(id, &ks, 0, Instant::now()).unwrap();
        st.finish_l3(&jobs[0], true);
        st.finish_l3(&jobs[1], false);
        // jobs[2] is still queued (pinned): it stays.
        let dry = st.clear_l2(true);
        assert_eq!(
            dry,
            ClearedL2 {
                pages: 2,
                unwritten: 1,
                kept: 1
            }
        );
        assert_eq!(st.counters.cleared_pages, 0, "a dry run counts nothing");
        assert_eq!(st.clear_l2(false), dry);
        assert_eq!(
            (st.counters.cleared_pages, st.counters.lost_cleared),
            (2, 1)
        );
        st.finish_l3(&jobs[2], true);
        assert_eq!(st.lookup(id, &ks[2..], Instant::now()).unwrap(), 1);
    }
}
