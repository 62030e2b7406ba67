//! Where a tenant's pages live in kvtierd's tiers, and how each tier tells whose a page is.
//!
//! While tenancy is on (`[tenants]` names any tenant), every session is bound to a tenant
//! when it registers (a named one by its peer uid or bearer token, else the default tenant
//! `""`), and every page key it names is mapped, at the daemon's gRPC edge, to
//!
//! ```text
//! scoped = tag ‖ SHA-256(TENANT_SCOPE_TAG ‖ id ‖ key)[8..32]
//! id     = SHA-256(TENANT_SCOPE_TAG ‖ name)
//! tag    = id[0..8]
//! ```
//!
//! before the L2 index or L3 sees it. So:
//! - equal tokens under two tenants never meet in any tier;
//! - no request names another tenant's page: every key any caller sends goes through its own
//!   tenant's mapping (the default tenant's too), so naming a page of tenant B from tenant A
//!   takes a preimage of A's mapping onto B's tag and 192 bits of hash;
//! - every tier can tell a page's tenant from its key alone ([`TenantTag::of`]): the L2
//!   index and the file and RocksDB backends keep per-tenant quotas by it, with no tenant
//!   carried beside the key and nothing lost across a restart. Keys that were stored before
//!   tenancy was turned on carry no tenant's tag (but for a 2^-64 chance each).
//!
//! With tenancy off, keys are used as given (SGLang-compatible) and there are no quotas.
//! Every scoped preimage is 22 + 32 + 32 = 86 bytes long, 2 mod 4, so it is never a page-key
//! preimage (a multiple of 4 bytes: see docs/hash-spec.md).

use sha2::{Digest, Sha256};

use crate::PageKey;

/// Domain-separation tag of the scope's preimages.
pub const TENANT_SCOPE_TAG: &[u8] = b"kvtier/tenant-scope/v1";

/// The first 8 bytes of every key of one tenant (big-endian): how the tiers attribute pages.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TenantTag(pub u64);

impl TenantTag {
    /// The tag a key carries (meaningful for scoped keys).
    pub fn of(key: &PageKey) -> Self {
        let mut b = [0u8; 8];
        b.copy_from_slice(&key.0[..8]);
        Self(u64::from_be_bytes(b))
    }

    /// The tag of an L3 object name `<fingerprint hex>/<page key hex>` (see
    /// `kvtier_storage::format::object_name`); `None` for a name of another shape.
    pub fn of_object_name(name: &str) -> Option<Self> {
        let (_, key) = name.rsplit_once('/')?;
        if key.len() != 64 {
            return None;
        }
        u64::from_str_radix(key.get(..16)?, 16).ok().map(Self)
    }

    /// The tag as 16 hex digits (the start of the tenant's object names' key part).
    pub fn to_hex(self) -> String {
        format!("{:016x}", self.0)
    }
}

/// The key mapping of one tenant (the default tenant `""` included) while tenancy is on.
#[derive(Clone)]
pub struct TenantScope {
    /// SHA-256 already fed the tag and the tenant's id: cloned per key.
    prefix: Sha256,
    tag: [u8; 8],
}

impl std::fmt::Debug for TenantScope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TenantScope({:016x})", u64::from_be_bytes(self.tag))
    }
}

impl TenantScope {
    /// The scope of tenant `name` (`""`: the default tenant).
    pub fn new(name: &str) -> Self {
        let id: [u8; 32] = Sha256::new()
            .chain_update(TENANT_SCOPE_TAG)
            .chain_update(name.as_bytes())
            .finalize()
            .into();
        let mut tag = [0u8; 8];
        tag.copy_from_slice(&id[..8]);
        Self {
            prefix: Sha256::new()
                .chain_update(TENANT_SCOPE_TAG)
                .chain_update(id),
            tag,
        }
    }

    /// The tag every key of this tenant starts with.
    pub fn tag(&self) -> TenantTag {
        TenantTag(u64::from_be_bytes(self.tag))
    }

    /// The daemon-side key of the tenant's page `key`.
    pub fn apply(&self, key: &PageKey) -> PageKey {
        let mut out: [u8; 32] = self
            .prefix
            .clone()
            .chain_update(key.as_bytes())
            .finalize()
            .into();
        out[..8].copy_from_slice(&self.tag);
        PageKey(out)
    }

    /// [`Self::apply`] to every key, in place.
    pub fn apply_all(&self, keys: &mut [PageKey]) {
        for k in keys {
            *k = self.apply(k);
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_scope_is_the_formula_routing_md_gives_routers() {
        use sha2::{Digest, Sha256};
        let key = PageKey([3; 32]);
        let id: [u8; 32] = Sha256::new()
            .chain_update(b"kvtier/tenant-scope/v1")
            .chain_update(b"acme")
            .finalize()
            .into();
        let mut want: [u8; 32] = Sha256::new()
            .chain_update(b"kvtier/tenant-scope/v1")
            .chain_update(id)
            .chain_update(key.as_bytes())
            .finalize()
            .into();
        want[..8].copy_from_slice(&id[..8]);
        assert_eq!(TenantScope::new("acme").apply(&key), PageKey(want));
    }

    use super::*;

    #[test]
    fn tenants_map_equal_keys_apart_and_every_key_carries_its_tenants_tag() {
        let k = PageKey([7; 32]);
        let (a, b, d) = (
            TenantScope::new("acme"),
            TenantScope::new("globex"),
            TenantScope::new(""),
        );
        assert_ne!(a.apply(&k), b.apply(&k));
        assert_ne!(d.apply(&k), k, "the default tenant is scoped too");
        assert_ne!(a.apply(&k), d.apply(&k));
        assert_eq!(a.apply(&k), TenantScope::new("acme").apply(&k));
        // The documented preimage and tag, byte for byte.
        let id: [u8; 32] = Sha256::digest([TENANT_SCOPE_TAG, b"acme"].concat()).into();
        let pre = [TENANT_SCOPE_TAG, &id[..], &k.0[..]].concat();
        assert_eq!(pre.len() % 4, 2);
        let h: [u8; 32] = Sha256::digest(&pre).into();
        assert_eq!(a.apply(&k).0[8..], h[8..]);
        assert_eq!(a.apply(&k).0[..8], id[..8]);
        for s in [&a, &b, &d] {
            assert_eq!(TenantTag::of(&s.apply(&k)), s.tag());
            assert_eq!(TenantTag::of(&s.apply(&PageKey([9; 32]))), s.tag());
        }
        assert_ne!(a.tag(), b.tag());
        let mut ks = [k, PageKey([8; 32])];
        a.apply_all(&mut ks);
        assert_eq!(ks[0], a.apply(&k));
    }

    #[test]
    fn object_names_give_the_tag_of_their_key() {
        let key = TenantScope::new("acme").apply(&PageKey([1; 32]));
        let name = format!("{}/{}", "ab".repeat(16), key.to_hex());
        assert_eq!(
            TenantTag::of_object_name(&name),
            Some(TenantScope::new("acme").tag())
        );
        assert_eq!(TenantTag::of_object_name("abc"), None);
        assert_eq!(TenantTag::of_object_name("ab/cd"), None);
        assert_eq!(TenantScope::new("acme").tag().to_hex().len(), 16);
    }
}
