//! Writes to L3, as the state decides them: which committed pages become write jobs (the
//! write policy, or a flush), how L3 being down or cleared changes what eviction may give up,
//! and what a finished job records.

use std::sync::Arc;

use kvtier_core::host_index::L3Mode;
use kvtier_core::{LayoutFingerprint, PageKey, WritePolicy};
use kvtier_shm::ShmPool;

use super::{HostState, L2Pool};

/// One page for the L3 writer: chosen by the state (under the write policy, or by the
/// flusher), pinned in its slot until the writer reports how the write went.
#[derive(Debug)]
pub struct Job {
    /// Layout class (what L3 names the page by).
    pub fp: LayoutFingerprint,
    /// The L2 pool it is in ([`L2Pool::key`]).
    pub pool_key: LayoutFingerprint,
    /// Page key.
    pub key: PageKey,
    /// Slot holding the page (pinned until the job ends).
    pub slot: u32,
    /// The pool.
    pub pool: Arc<ShmPool>,
    /// Page bytes.
    pub len: usize,
    /// The L3 generation it was queued in: a write queued before L3 was cleared does not
    /// mark its page held when it lands (the clear may have removed it).
    pub epoch: u64,
}
impl HostState {
    pub(super) fn jobs(pool: &L2Pool, queued: Vec<(PageKey, u32)>, epoch: u64) -> Vec<Job> {
        queued
            .into_iter()
            .map(|(key, slot)| Job {
                fp: pool.layout.fingerprint(),
                pool_key: pool.key,
                key,
                slot,
                pool: pool.shm.clone(),
                len: pool.layout.page_bytes(),
                epoch,
            })
            .collect()
    }

    /// Whether pools keep slot tables (so a later kvtierd can take them over).
    pub fn seals_enabled(&self) -> bool {
        self.pools.seals_enabled()
    }

    /// The L2 → L3 write policy, while a tier is attached.
    pub fn write_policy(&self) -> Option<WritePolicy> {
        self.l3.write()
    }

    pub(super) fn l3_mode(&self) -> L3Mode {
        self.l3.mode()
    }

    pub(super) fn apply_l3_mode(&mut self) {
        let mode = self.l3_mode();
        for pool in self.pools.values_mut().filter(|p| !p.writes_own_l3) {
            pool.index.set_l3_mode(mode);
        }
    }

    /// Changes the L3 write policy (an L3 tier attached, swapped or detached). With a tier,
    /// a page leaves L2 only once L3 holds it; without, every pool evicts freely again.
    pub fn set_write(&mut self, write: Option<WritePolicy>) {
        self.l3.attach(write);
        self.apply_l3_mode();
    }

    /// Records whether the attached tier is failing. While it is, pages L3 does not hold may
    /// be evicted (counted as lost), so a dead backend never wedges L2.
    pub fn set_l3_down(&mut self, down: bool) {
        if self.l3.set_down(down) {
            if down {
                tracing::warn!(
                    "l3 is down: L2 may now evict pages it has not written (counted in kvtier_l2_lost_pages_total)"
                );
            } else {
                tracing::info!("l3 is back: L2 evicts only pages L3 holds");
            }
            self.apply_l3_mode();
        }
    }

    /// Counts pages an index evicted without L3 holding them (`before` is its count before
    /// the operation), by the reason of the current mode.
    pub(super) fn count_lost(&mut self, mode: L3Mode, before: u64, after: u64) {
        let n = after.saturating_sub(before);
        match mode {
            L3Mode::Absent => self.counters.lost_no_l3 += n,
            L3Mode::Up | L3Mode::Down => self.counters.lost_l3_down += n,
        }
    }

    /// Ends an L3 write queued in L3 generation `epoch`: unpins the page, and marks it
    /// persisted if the write landed and L3 was not cleared since.
    pub fn finish_l3(&mut self, job: &Job, landed: bool) {
        let landed = landed && job.epoch == self.l3.epoch();
        if let Some(p) = self.pools.get_mut(&job.pool_key) {
            p.index.finish_l3(&job.key, landed);
            if landed {
                let parent = p.index.parent(&job.key);
                self.l3_stored(job.fp, job.key, parent);
            }
        }
    }

    /// The coldest pages L3 does not hold yet, at most `batch` per pool, of every pool
    /// running short of free slots (of every pool while a flush or drain runs): under every
    /// write policy, what must be written before those slots can be reused.
    pub fn flush_jobs(&mut self, batch: usize) -> Vec<Job> {
        let mut out = Vec::new();
        if !self.l3.writable() {
            return out;
        }
        let all = self.operator.writes_everything();
        let epoch = self.l3.epoch();
        for pool in self.pools.values_mut() {
            let s = pool.index.stats();
            // Short of free slots, or half way to the dirty limit (where writers would wait).
            if all
                || pool.index.free_slots() < s.capacity / 4 + 1
                || s.dirty > pool.index.dirty_limit() / 2
            {
                let queued = pool.index.flush_candidates(batch);
                out.extend(Self::jobs(pool, queued, epoch));
            }
        }
        out
    }
}
