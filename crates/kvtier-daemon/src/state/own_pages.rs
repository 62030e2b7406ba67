//! Pages kvtierd stores itself, through sessions of its own ([`HostState::register_own`]):
//! the SGLang object store's. They live in pools of their own ([`L2Pool::writes_own_l3`]),
//! indexed, evicted, counted, sealed and taken over after a crash like every L2 page; their
//! owner writes L3 itself and says so when it commits.

use std::time::Instant;

use kvtier_core::host_index::Reserve;
use kvtier_core::{PageKey, SessionId};

use super::{HostState, StateError};

/// Where a page kvtierd stores itself can go ([`HostState::reserve_own`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OwnSlot {
    /// This slot, reserved: fill it, then [`HostState::commit_own`].
    Placed(u32),
    /// A copy of the key is being written or read: it stays, nothing is reserved.
    Busy,
    /// No room now (or kvtierd is draining); no copy of the key is left.
    NoRoom,
}

/// What kvtierd's own pools hold.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct OwnUsage {
    /// Pages ready.
    pub pages: u64,
    /// Their bytes.
    pub bytes: u64,
    /// Pages evicted to make room, since their pools were made.
    pub evictions: u64,
}

impl HostState {
    /// A slot for `key` in own session `id`'s pool, to fill and then [`Self::commit_own`].
    /// With `replace`, a copy of `key` there that nobody reads is removed first (its
    /// writer's later bytes win); without, any copy of it makes this `Busy`.
    pub fn reserve_own(
        &mut self,
        id: SessionId,
        key: PageKey,
        replace: bool,
        now: Instant,
    ) -> Result<OwnSlot, StateError> {
        let gone = if replace {
            self.forget_own(id, key, now)?
        } else {
            let (_, pool) = self.session_pool(id, now)?;
            pool.index.get(&key).is_none()
        };
        if !gone {
            return Ok(OwnSlot::Busy);
        }
        if self.admitting("new pages").is_err() {
            return Ok(OwnSlot::NoRoom);
        }
        let (r, _) = self.reserve(id, None, &[key], now)?;
        Ok(match r.first() {
            Some(Reserve::Reserved(slot)) => OwnSlot::Placed(*slot),
            Some(Reserve::Present) => OwnSlot::Busy,
            _ => OwnSlot::NoRoom,
        })
    }

    /// Removes own session `id`'s copy of `key` unless someone writes or reads it; says
    /// whether no copy is left.
    pub fn forget_own(
        &mut self,
        id: SessionId,
        key: PageKey,
        now: Instant,
    ) -> Result<bool, StateError> {
        let (_, pool) = self.session_pool(id, now)?;
        if let Some(slot) = pool.index.remove_idle(&key) {
            // Its crash record goes with it: the old bytes must not come back.
            pool.handed_out([slot]);
        }
        Ok(pool.index.get(&key).is_none())
    }

    /// Makes own session `id`'s page `key` (filled since [`Self::reserve_own`]) visible,
    /// marked held by L3 when its owner wrote it there (`in_l3`).
    pub fn commit_own(
        &mut self,
        id: SessionId,
        key: PageKey,
        in_l3: bool,
        now: Instant,
    ) -> Result<(), StateError> {
        self.commit(id, &[key], 0, now)?;
        if in_l3 {
            let (_, pool) = self.session_pool(id, now)?;
            pool.index.mark_persisted(&key);
        }
        Ok(())
    }

    /// The layouts of kvtierd's own pools (a dead kvtierd's among them, taken over).
    pub fn own_layouts(&self) -> Vec<kvtier_core::Layout> {
        self.pools
            .values()
            .filter(|p| p.writes_own_l3)
            .map(|p| p.layout.clone())
            .collect()
    }

    /// What kvtierd's own pools hold now.
    pub fn own_usage(&self) -> OwnUsage {
        self.pools
            .values()
            .filter(|p| p.writes_own_l3)
            .fold(OwnUsage::default(), |u, p| {
                let s = p.index.stats();
                OwnUsage {
                    pages: u.pages + u64::from(s.ready),
                    bytes: u.bytes + u64::from(s.ready) * p.layout.page_bytes() as u64,
                    evictions: u.evictions + s.evictions,
                }
            })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::time::Instant;

    use kvtier_core::{DType, KvKind, Layout, LayoutSpec, PageKey};

    use super::OwnSlot;
    use crate::state::testing::{state, tiny_layout};

    fn object_layout(len: u32) -> Layout {
        Layout::new(LayoutSpec {
            model_id: "kvtierd/objects".into(),
            model_version: String::new(),
            dtype: DType::U8,
            num_layers: 1,
            kind: KvKind::State { elems: len },
            page_size: 1,
            tp_rank: 0,
            tp_size: 1,
        })
        .unwrap()
    }

    #[test]
    fn own_sessions_never_expire_keep_their_pool_size_and_leave_l3_alone() {
        let (mut st, _) = state();
        let t0 = Instant::now();
        let id = st
            .register_own("own".into(), "", &object_layout(100), 4, t0)
            .unwrap();
        // A client may not name a layout kvtierd's own.
        let e = st
            .register("c".into(), "", &object_layout(100), t0)
            .unwrap_err()
            .to_string();
        assert!(e.contains("layout.model_id"), "{e}");
        // Five objects in a pool of four: one evicted, none written by L2's writer.
        for i in 1..=5u8 {
            let OwnSlot::Placed(slot) = st.reserve_own(id, PageKey([i; 32]), true, t0).unwrap()
            else {
                panic!("object {i} not placed");
            };
            let shm = st.mapped_pool(id).unwrap().0;
            shm.write(slot, 0, &[i; 100]).unwrap();
            st.commit_own(id, PageKey([i; 32]), i % 2 == 0, t0).unwrap();
        }
        let u = st.own_usage();
        assert_eq!((u.pages, u.bytes, u.evictions), (4, 400, 1));
        assert_eq!(st.flush_jobs(64).len(), 0);
        assert_eq!(st.drain_report().unwritten, 0);
        // Object 1 (not in L3) was the one evicted: lost, counted; the rest are served.
        assert_eq!(st.counters.lost_no_l3, 1);
        let later = t0 + st.ttl() * 10;
        assert!(st.expire(later).iter().all(|s| *s != id));
        let (slots, jobs) = st.acquire(id, &[PageKey([2; 32])], later).unwrap();
        assert_eq!((slots.len(), jobs.len()), (1, 0));
        let mut buf = [0u8; 100];
        st.mapped_pool(id)
            .unwrap()
            .0
            .read(slots[0], 0, &mut buf)
            .unwrap();
        assert_eq!(buf, [2; 100]);
        // A copy being read is not replaced; once released, it is.
        assert_eq!(
            st.reserve_own(id, PageKey([2; 32]), true, later).unwrap(),
            OwnSlot::Busy
        );
        st.release(id, &[PageKey([2; 32])], later).unwrap();
        assert!(matches!(
            st.reserve_own(id, PageKey([2; 32]), true, later).unwrap(),
            OwnSlot::Placed(_)
        ));
        // Client pools are untouched by all this.
        assert!(st.pools().any(|p| p.layout == tiny_layout()));
    }
}
