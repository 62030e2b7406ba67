//! Pools nobody uses go: a pool of a layout no session is registered to, with no pin, no
//! reservation, no prefetch and no page L3 still lacks, is removed once it has been unused
//! for `l2.idle_pool_ttl`, or at once when a new layout needs its place past `l2.max_pools`.
//! Its memory and its file in kvtierd's pool directory are given back; a later session of that layout
//! gets a new, empty pool (what L3 holds is found there again). Without L3, the pages it held
//! are counted as lost (`no_l3`), as any eviction without L3 is.
//!
//! A pool whose file a client shrank or grew goes too, sessions and all
//! ([`HostState::retire_damaged_pools`]): it is of no use to anyone who maps it.

use std::time::Instant;

use kvtier_core::host_index::L3Mode;
use kvtier_core::{LayoutFingerprint, SessionId};

use super::HostState;

impl HostState {
    /// Whether pool `fp` can go now: no client's session on it (kvtierd's own sessions do
    /// not keep a pool: they end with it), nothing pinned, reserved or prefetching, and
    /// (while L3 is attached, for a pool whose pages L2's writer writes) nothing L3 lacks.
    fn reclaimable(&self, fp: &LayoutFingerprint) -> bool {
        let Some(p) = self.pools.get(fp) else {
            return false;
        };
        let s = p.index.stats();
        let in_use = self.sessions.values().any(|x| x.pool == *fp && !x.own);
        let unwritten = !p.writes_own_l3 && self.l3_mode() != L3Mode::Absent && s.dirty > 0;
        !in_use
            && s.pinned == 0
            && s.writing == 0
            && s.leased == 0
            && p.prefetch_held == 0
            && !unwritten
    }

    /// Removes the pools unused for `l2.idle_pool_ttl` (with `make_room`: also the least
    /// recently used reclaimable pool, whatever its age). Returns how many went.
    pub(super) fn reclaim_pools(&mut self, now: Instant, make_room: bool) -> usize {
        self.reclaim_pools_where(now, make_room, |_| true)
    }

    /// [`Self::reclaim_pools`] among the pools `which` names.
    pub(super) fn reclaim_pools_where(
        &mut self,
        now: Instant,
        make_room: bool,
        which: impl Fn(&super::L2Pool) -> bool,
    ) -> usize {
        let ttl = self.pools.idle_ttl();
        let mut idle: Vec<(Instant, LayoutFingerprint)> = self
            .pools
            .values()
            .filter(|p| which(p) && self.reclaimable(&p.key))
            .map(|p| (p.last_used, p.key))
            .collect();
        idle.sort();
        let mut gone = 0;
        for (i, (used, fp)) in idle.into_iter().enumerate() {
            let expired = !ttl.is_zero() && now.saturating_duration_since(used) >= ttl;
            if !(expired || (make_room && i == 0)) {
                continue;
            }
            // kvtierd's own sessions on it end with it (their owner opens a new one).
            let own: Vec<SessionId> = self
                .sessions
                .iter()
                .filter(|(_, s)| s.pool == fp && s.own)
                .map(|(&id, _)| id)
                .collect();
            for id in own {
                let _ = self.close(id);
            }
            // Its last changes, then the pool itself goes: one CLEARED for its layout.
            self.publish_changes();
            let Some(pool) = self.pools.remove(&fp) else {
                continue;
            };
            // A tenant's own pool: a CLEARED of that tenant's pages alone (none for
            // kvtierd's own pages, which routers never heard of).
            let tenant = self.own_pool_tenant(&pool);
            if !pool.writes_own_l3 {
                self.events.cleared(Some(pool.layout.fingerprint()), tenant);
            }
            let s = pool.index.stats();
            if pool.writes_own_l3 {
                // Its owner's pages L3 lacks (it did not mark them held there).
                self.counters.lost_no_l3 += u64::from(s.dirty);
            } else if self.l3_mode() == L3Mode::Absent {
                self.counters.lost_no_l3 += u64::from(s.ready);
            }
            self.counters.pools_reclaimed += 1;
            gone += 1;
            tracing::info!(
                fingerprint = %fp,
                model = %pool.layout.spec().model_id,
                pages = s.ready,
                idle = ?now.saturating_duration_since(used),
                "removed a pool no session uses"
            );
            // Its file goes with the last reference (the sealer may hold one a moment).
            pool.shm.unlink();
        }
        gone
    }

    /// Retires every pool whose file another holder of its descriptor shrank or grew (a
    /// file-backed pool: a memfd's size is sealed), or that a copy found shrunk: no mapping of
    /// it shows its pages any more, and every client that maps it afresh would be refused.
    /// Its sessions end (their clients register again and get a new pool), its pages go
    /// (those L3 lacks counted lost, `pool_damaged`), and no write of it is retried. Runs
    /// with the lease sweep, and before the pool door hands a pool out. Returns how many.
    pub fn retire_damaged_pools(&mut self) -> usize {
        let damaged: Vec<LayoutFingerprint> = self
            .pools
            .values()
            .filter(|p| !p.shm.file_intact())
            .map(|p| p.key)
            .collect();
        for fp in &damaged {
            let sessions: Vec<SessionId> = self
                .sessions
                .iter()
                .filter(|(_, s)| s.pool == *fp)
                .map(|(&id, _)| id)
                .collect();
            for &id in &sessions {
                // The session exists: it was just listed.
                let _ = self.close(id);
            }
            self.publish_changes();
            let Some(pool) = self.pools.remove(fp) else {
                continue;
            };
            let tenant = self.own_pool_tenant(&pool);
            self.events.cleared(Some(pool.layout.fingerprint()), tenant);
            let s = pool.index.stats();
            let lost = if self.l3_mode() == L3Mode::Absent {
                s.ready
            } else {
                s.dirty
            };
            self.counters.lost_pool_damaged += u64::from(lost);
            self.counters.pools_damaged += 1;
            tracing::error!(
                fingerprint = %fp,
                model = %pool.layout.spec().model_id,
                sessions = sessions.len(),
                lost,
                "retired a pool whose file a client shrank or grew: its sessions register \
                 again into a new pool"
            );
            pool.shm.unlink();
        }
        damaged.len()
    }
}
