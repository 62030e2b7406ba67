//! Per-tenant page counts and quotas of one pool.
//!
//! A page's tenant is the [`TenantTag`] its key starts with (see [`crate::tenant`]), so the
//! index needs no tenant beside the key. Only tags the daemon tracks are counted; a tracked
//! tag with a quota also keeps its own eviction order (a copy of the pool's candidate order
//! restricted to its pages), so a tenant at its quota evicts its own coldest page without a
//! scan and never another tenant's. With no tag tracked (tenancy off) every hook returns at
//! once.

use std::collections::HashMap;

use super::order::Order;
use super::{Class, HostIndex, L3Mode};
use crate::PageKey;
use crate::policy::Rank;
use crate::tenant::TenantTag;

/// What one tenant holds of a pool, and what its quota did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TenantUse {
    /// Pages of the tenant in the pool (being written or ready).
    pub pages: u32,
    /// Most pages it may hold (`None`: no quota).
    pub quota: Option<u32>,
    /// Its own pages evicted because it was at its quota.
    pub quota_evictions: u64,
    /// Pages it could not reserve: at its quota with none of its own pages evictable.
    pub quota_refusals: u64,
}

#[derive(Debug)]
struct Tracked {
    usage: TenantUse,
    /// The tenant's eviction candidates; only with a quota.
    order: Option<Order<(Class, Rank)>>,
}

/// The tracked tenants of a pool.
#[derive(Debug, Default)]
pub(super) struct Quotas {
    tenants: HashMap<TenantTag, Tracked>,
}

impl Quotas {
    fn get(&mut self, key: &PageKey) -> Option<&mut Tracked> {
        if self.tenants.is_empty() {
            return None;
        }
        self.tenants.get_mut(&TenantTag::of(key))
    }

    pub(super) fn placed(&mut self, key: &PageKey) {
        if let Some(t) = self.get(key) {
            t.usage.pages += 1;
        }
    }

    pub(super) fn removed(&mut self, key: &PageKey) {
        if let Some(t) = self.get(key) {
            t.usage.pages -= 1;
        }
    }

    pub(super) fn file(&mut self, key: &PageKey, at: (Class, Rank), slot: u32) {
        if let Some(o) = self.get(key).and_then(|t| t.order.as_mut()) {
            o.insert(at, slot);
        }
    }

    pub(super) fn unfile(&mut self, key: &PageKey, at: (Class, Rank), slot: u32) {
        if let Some(o) = self.get(key).and_then(|t| t.order.as_mut()) {
            o.remove(at, slot);
        }
    }

    /// Whether a new page of `key`'s tenant would take it past its quota.
    pub(super) fn at_quota(&mut self, key: &PageKey) -> bool {
        self.get(key)
            .is_some_and(|t| t.usage.quota.is_some_and(|q| t.usage.pages >= q))
    }

    pub(super) fn first(&self, tag: TenantTag) -> Option<((Class, Rank), u32)> {
        self.tenants.get(&tag)?.order.as_ref()?.first()
    }

    pub(super) fn counted(&mut self, tag: TenantTag, evicted: bool) {
        if let Some(t) = self.tenants.get_mut(&tag) {
            if evicted {
                t.usage.quota_evictions += 1;
            } else {
                t.usage.quota_refusals += 1;
            }
        }
    }
}

impl HostIndex {
    /// Counts the pages of tenant `tag` from now on, and holds it to at most `quota` pages
    /// (`None`: counted, unbounded). Pages the pool holds already are counted and filed at
    /// once (`O(pool)`: a set-up call). Lowering a quota below what the tenant holds evicts
    /// nothing now: its next reservation makes room among its own pages.
    pub fn set_tenant_quota(&mut self, tag: TenantTag, quota: Option<u32>) {
        let capacity = self.stats.capacity;
        let slots: Vec<u32> = self
            .table
            .slots()
            .filter(|&s| TenantTag::of(&self.entry(s).key) == tag)
            .collect();
        // Out of the orders under the old settings, back in under the new ones.
        for &s in &slots {
            self.unfile(s);
        }
        let t = self.quotas.tenants.entry(tag).or_insert(Tracked {
            usage: TenantUse::default(),
            order: None,
        });
        t.usage.quota = quota;
        t.usage.pages = slots.len() as u32;
        t.order = quota.map(|_| Order::new(capacity));
        for &s in &slots {
            self.refresh(s);
        }
    }

    /// What tenant `tag` holds and what its quota did; `None` when it is not tracked.
    pub fn tenant_usage(&self, tag: TenantTag) -> Option<TenantUse> {
        self.quotas.tenants.get(&tag).map(|t| t.usage)
    }

    /// Checks each tracked tenant's count and order against the entries (for `validate`).
    pub(super) fn validate_quotas(&self) -> Result<(), String> {
        for (tag, t) in &self.quotas.tenants {
            let (mut pages, mut filed) = (0u32, 0usize);
            for e in self.entries.iter().flatten() {
                if TenantTag::of(&e.key) == *tag {
                    pages += 1;
                    filed += usize::from(e.filed.is_some());
                }
            }
            let ordered = t.order.as_ref().map_or(filed, Order::len);
            if pages != t.usage.pages || ordered != filed {
                return Err(format!(
                    "tenant {}: counts {} pages and orders {ordered}, the entries say {pages} \
                     and {filed}",
                    tag.to_hex(),
                    t.usage.pages
                ));
            }
        }
        Ok(())
    }

    /// Whether a new page of `key`'s tenant fits its quota, after evicting the tenant's own
    /// coldest pages (keys pushed to `evicted`) while it is at it. Counts each eviction, or
    /// the refusal when none of its pages may leave.
    pub(super) fn quota_room(&mut self, key: &PageKey, evicted: &mut Vec<PageKey>) -> bool {
        let tag = TenantTag::of(key);
        while self.quotas.at_quota(key) {
            let own = self.evict_own(tag);
            self.quotas.counted(tag, own.is_some());
            match own {
                Some(k) => evicted.push(k),
                None => return false,
            }
        }
        true
    }

    /// Evicts the coldest page of tenant `tag` the [`L3Mode`] lets go; its key.
    fn evict_own(&mut self, tag: TenantTag) -> Option<PageKey> {
        let ((class, _), slot) = self.quotas.first(tag)?;
        if class == Class::Unwritten && self.l3_mode != L3Mode::Down {
            return None;
        }
        Some(self.evict_slot(slot))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host_index::Reserve;
    use crate::{PolicyKind, TenantScope};

    fn keys(tenant: &str, r: std::ops::Range<u8>) -> Vec<PageKey> {
        let s = TenantScope::new(tenant);
        r.map(|i| s.apply(&PageKey([i; 32]))).collect()
    }

    /// Writes each key as a sequence of its own (all leaves) and commits it.
    fn write(ix: &mut HostIndex, owner: u64, ks: &[PageKey]) -> Vec<Reserve> {
        ks.iter()
            .map(|k| {
                let (r, _) = ix.reserve(owner, None, std::slice::from_ref(k));
                if matches!(r[0], Reserve::Reserved(_)) {
                    ix.commit(owner, std::slice::from_ref(k)).unwrap();
                }
                r[0]
            })
            .collect()
    }

    #[test]
    fn a_tenant_at_its_quota_evicts_its_own_coldest_pages_only() {
        let (acme, globex) = (
            TenantScope::new("acme").tag(),
            TenantScope::new("globex").tag(),
        );
        let mut ix = HostIndex::new(32, PolicyKind::Lru);
        let (a, g) = (keys("acme", 0..12), keys("globex", 0..8));
        write(&mut ix, 1, &g);
        write(&mut ix, 2, &a[..3]);
        // Set up with pages already there: they are counted at once.
        ix.set_tenant_quota(acme, Some(4));
        ix.set_tenant_quota(globex, None);
        assert_eq!(ix.tenant_usage(acme).unwrap().pages, 3);
        assert_eq!(ix.tenant_usage(globex).unwrap().pages, 8);
        ix.validate().unwrap();
        write(&mut ix, 2, &a[3..12]);
        ix.validate().unwrap();
        let u = ix.tenant_usage(acme).unwrap();
        assert_eq!((u.pages, u.quota, u.quota_evictions), (4, Some(4), 8));
        // Its four newest stayed; the pool had room, yet only acme's own pages left.
        assert_eq!(ix.lookup(&a[8..12]), 4);
        assert_eq!(ix.lookup(&a[..1]), 0);
        assert_eq!(ix.tenant_usage(globex).unwrap().pages, 8);
        assert!(g.iter().all(|k| ix.lookup(std::slice::from_ref(k)) == 1));
        assert_eq!(ix.stats().ready, 12);
        assert!(ix.free_slots() > 0);

        // All of acme's pages pinned: it cannot make room and is refused; nobody else pays.
        assert_eq!(ix.acquire(&a[8..12]).len(), 4);
        let r = write(&mut ix, 2, &keys("acme", 20..21));
        assert_eq!(r, vec![Reserve::NoSpace]);
        let u = ix.tenant_usage(acme).unwrap();
        assert_eq!((u.pages, u.quota_refusals), (4, 1));
        assert_eq!(ix.tenant_usage(globex).unwrap().pages, 8);
        ix.release(&a[8..12]).unwrap();
        assert_eq!(write(&mut ix, 2, &keys("acme", 20..21)).len(), 1);
        assert_eq!(ix.tenant_usage(acme).unwrap().pages, 4);

        // Lifting the quota: acme grows past 4; an untracked tenant is not counted.
        ix.set_tenant_quota(acme, None);
        write(&mut ix, 2, &keys("acme", 30..34));
        assert_eq!(ix.tenant_usage(acme).unwrap().pages, 8);
        assert_eq!(ix.tenant_usage(TenantScope::new("initech").tag()), None);
        ix.validate().unwrap();
    }

    #[test]
    fn a_quota_chain_keeps_its_prefix_without_l3() {
        // Without L3 only leaves leave, so a tenant whose quota is full of one chain cannot
        // grow it, rather than cutting the chain's own prefix.
        let acme = TenantScope::new("acme").tag();
        let mut ix = HostIndex::new(16, PolicyKind::Lru);
        ix.set_tenant_quota(acme, Some(3));
        let a = keys("acme", 0..5);
        let (r, _) = ix.reserve(1, None, &a);
        assert!(matches!(r[2], Reserve::Reserved(_)));
        assert_eq!(r[3..], [Reserve::NoSpace, Reserve::NoSpace]);
        ix.commit(1, &a[..3]).unwrap();
        assert_eq!(ix.lookup(&a), 3);
        ix.validate().unwrap();
    }
}
