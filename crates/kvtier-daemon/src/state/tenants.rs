//! The tenants L2 tracks, a component of [`HostState`](super::HostState): each named
//! tenant (and the default one, `""`) with its tag and L2 page quota, and whether named
//! tenants get pools of their own (`l2.tenant_pools`). It decides which pool a tenant's
//! session uses and whose pages a pool can hold; the state applies the quotas to the pools.

use kvtier_config::tenants::TenantQuota;
use kvtier_core::{LayoutFingerprint, TenantScope, TenantTag};

use super::pool_key;

/// One tracked tenant.
#[derive(Debug, Clone)]
pub(crate) struct Tracked {
    pub(crate) name: String,
    pub(crate) tag: TenantTag,
    /// Most pages it holds in each pool (`None`: no bound).
    pub(crate) quota: Option<u32>,
}

/// What one tenant may see of one pool's pages ([`TenantTable::sees`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Sees {
    /// None: another tenant's own pool (its pages are never even looked at).
    Nothing,
    /// Every page: an operator's view.
    All,
    /// The pages of this tenant: a shared pool's, or the tenant's own pool's (filtered all
    /// the same: a pool a crash takeover adopted may hold pages from before
    /// `l2.tenant_pools` was turned on).
    Only(TenantTag),
}

/// The tracked tenants (empty: tenancy is off).
#[derive(Debug)]
pub(crate) struct TenantTable {
    tracked: Vec<Tracked>,
    /// A pool per named tenant and layout (`l2.tenant_pools`).
    own_pools: bool,
}

impl TenantTable {
    pub(crate) fn new(own_pools: bool) -> Self {
        Self {
            tracked: Vec::new(),
            own_pools,
        }
    }

    /// Tracks `tenants` (`[tenants]`, resolved), in their order.
    pub(crate) fn set(&mut self, tenants: &[TenantQuota]) {
        self.tracked = tenants
            .iter()
            .map(|q| Tracked {
                name: q.name.clone(),
                tag: TenantScope::new(&q.name).tag(),
                quota: q.l2_pages,
            })
            .collect();
    }

    /// Whether tenancy is off.
    pub(crate) fn is_empty(&self) -> bool {
        self.tracked.is_empty()
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = &Tracked> {
        self.tracked.iter()
    }

    /// How many named tenants there are (the default tenant is not).
    pub(crate) fn named(&self) -> usize {
        self.tracked.iter().filter(|t| !t.name.is_empty()).count()
    }

    /// The key of the pool a session of `tenant` with layout `fp` uses: the tenant's own
    /// (a named tenant, with `l2.tenant_pools`), else the layout's, which every tenant's
    /// sessions share. The bool says whether it is the tenant's own.
    pub(crate) fn pool_of(
        &self,
        fp: &LayoutFingerprint,
        tenant: &str,
    ) -> (LayoutFingerprint, bool) {
        let own =
            self.own_pools && !tenant.is_empty() && self.tracked.iter().any(|t| t.name == tenant);
        if own {
            (pool_key(fp, tenant), true)
        } else {
            (*fp, false)
        }
    }

    /// What `viewer` may see of the pool `key` of layout `fp` (`None`: every tenant's
    /// pages). What a tenant's events snapshot lists: nothing of another tenant's own pool,
    /// its own pages of any other.
    pub(crate) fn sees(
        &self,
        viewer: Option<TenantTag>,
        key: &LayoutFingerprint,
        fp: &LayoutFingerprint,
    ) -> Sees {
        let Some(viewer) = viewer else {
            return Sees::All;
        };
        match self.only_tenant_of(key, fp) {
            Some(only) if only != viewer => Sees::Nothing,
            _ => Sees::Only(viewer),
        }
    }

    /// The tag of the one tenant whose pages the pool `key` (of layout `fp`) can hold: a
    /// named tenant's own pool's, or, while named tenants have their own pools, the
    /// layout's pool, which then holds the default tenant's alone. `None` when every
    /// tenant's pages share the pool (no tenants named, or `l2.tenant_pools = false`).
    pub(crate) fn only_tenant_of(
        &self,
        key: &LayoutFingerprint,
        fp: &LayoutFingerprint,
    ) -> Option<TenantTag> {
        if key == fp {
            return (self.own_pools && self.named() > 0).then(|| TenantScope::new("").tag());
        }
        self.tracked
            .iter()
            .find(|t| *key == pool_key(fp, &t.name))
            .map(|t| t.tag)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::state::testing::tenant as quota;

    #[test]
    fn a_named_tenant_has_its_own_pool_only_with_tenant_pools() {
        let fp = LayoutFingerprint([3; 16]);
        for own_pools in [true, false] {
            let mut t = TenantTable::new(own_pools);
            t.set(&[quota(""), quota("acme")]);
            let (key, own) = t.pool_of(&fp, "acme");
            assert_eq!(own, own_pools);
            assert_eq!(key == fp, !own_pools);
            // The default tenant and an unknown name use the layout's pool.
            assert_eq!(t.pool_of(&fp, ""), (fp, false));
            assert_eq!(t.pool_of(&fp, "globex"), (fp, false));
            // Whose pages each pool holds.
            let acme = TenantScope::new("acme").tag();
            let default = TenantScope::new("").tag();
            if own_pools {
                assert_eq!(t.only_tenant_of(&key, &fp), Some(acme));
                assert_eq!(t.only_tenant_of(&fp, &fp), Some(default));
            } else {
                assert_eq!(t.only_tenant_of(&fp, &fp), None);
            }
        }
        // No named tenant: the layout's pool is everyone's.
        let mut t = TenantTable::new(true);
        t.set(&[quota("")]);
        assert_eq!(t.only_tenant_of(&fp, &fp), None);
    }

    #[test]
    fn a_tenant_sees_its_own_pages_and_nothing_of_another_tenants_own_pool() {
        let fp = LayoutFingerprint([3; 16]);
        let acme = TenantScope::new("acme").tag();
        let globex = TenantScope::new("globex").tag();
        let default = TenantScope::new("").tag();
        let mut t = TenantTable::new(true);
        t.set(&[quota(""), quota("acme"), quota("globex")]);
        let acme_pool = pool_key(&fp, "acme");
        assert_eq!(t.sees(Some(acme), &acme_pool, &fp), Sees::Only(acme));
        assert_eq!(t.sees(Some(globex), &acme_pool, &fp), Sees::Nothing);
        assert_eq!(t.sees(Some(default), &acme_pool, &fp), Sees::Nothing);
        // The layout's pool holds the default tenant's pages alone (or, adopted after a
        // crash from a run without tenant pools, others' too: filtered).
        assert_eq!(t.sees(Some(default), &fp, &fp), Sees::Only(default));
        assert_eq!(t.sees(Some(acme), &fp, &fp), Sees::Nothing);
        // An operator sees everything.
        assert_eq!(t.sees(None, &acme_pool, &fp), Sees::All);
        // Shared pools: each tenant its own pages.
        let mut shared = TenantTable::new(false);
        shared.set(&[quota(""), quota("acme")]);
        assert_eq!(shared.sees(Some(acme), &fp, &fp), Sees::Only(acme));
        assert_eq!(shared.sees(Some(default), &fp, &fp), Sees::Only(default));
    }
}
