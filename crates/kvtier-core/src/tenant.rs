//! Where a tenant's pages live in kvtierd's tiers.
//!
//! A session bound to a named tenant (by its peer uid or its bearer token) has every page key
//! it names mapped, at the daemon's gRPC edge, to
//! `SHA-256(TENANT_SCOPE_TAG ‖ SHA-256(TENANT_SCOPE_TAG ‖ name) ‖ key)` before the L2 index or
//! L3 sees it. Equal tokens under two tenants therefore never meet in any tier, and no
//! request can name another tenant's page: finding a key that maps onto one is a SHA-256
//! preimage. The default tenant ("") is the identity, so keys stay SGLang-compatible.
//!
//! Every scoped preimage is 22 + 32 + 32 = 86 bytes long, 2 mod 4, so it is never a page-key
//! preimage (a multiple of 4 bytes: see docs/hash-spec.md).

use sha2::{Digest, Sha256};

use crate::PageKey;

/// Domain-separation tag of the scope's preimages.
pub const TENANT_SCOPE_TAG: &[u8] = b"kvtier/tenant-scope/v1";

/// The key mapping of one named tenant; `None` from [`TenantScope::new`] is the default
/// tenant, whose keys are unchanged.
#[derive(Clone)]
pub struct TenantScope {
    /// SHA-256 already fed the tag and the tenant's digest: cloned per key.
    prefix: Sha256,
}

impl std::fmt::Debug for TenantScope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TenantScope")
    }
}

impl TenantScope {
    /// The scope of tenant `name`; `None` for the default tenant (`""`).
    pub fn new(name: &str) -> Option<Self> {
        if name.is_empty() {
            return None;
        }
        let id = Sha256::new()
            .chain_update(TENANT_SCOPE_TAG)
            .chain_update(name.as_bytes())
            .finalize();
        Some(Self {
            prefix: Sha256::new()
                .chain_update(TENANT_SCOPE_TAG)
                .chain_update(id),
        })
    }

    /// The daemon-side key of the tenant's page `key`.
    pub fn apply(&self, key: &PageKey) -> PageKey {
        PageKey(
            self.prefix
                .clone()
                .chain_update(key.as_bytes())
                .finalize()
                .into(),
        )
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
    use super::*;

    #[test]
    fn tenants_map_equal_keys_apart_and_the_default_is_the_identity() {
        assert!(TenantScope::new("").is_none());
        let k = PageKey([7; 32]);
        let (a, b) = (
            TenantScope::new("acme").unwrap(),
            TenantScope::new("globex").unwrap(),
        );
        assert_ne!(a.apply(&k), b.apply(&k));
        assert_ne!(a.apply(&k), k);
        assert_eq!(a.apply(&k), TenantScope::new("acme").unwrap().apply(&k));
        // The documented preimage, byte for byte.
        let id: [u8; 32] = Sha256::digest([TENANT_SCOPE_TAG, b"acme"].concat()).into();
        let pre = [TENANT_SCOPE_TAG, &id[..], &k.0[..]].concat();
        assert_eq!(pre.len() % 4, 2);
        assert_eq!(a.apply(&k).0, <[u8; 32]>::from(Sha256::digest(&pre)));
        let mut ks = [k, PageKey([8; 32])];
        a.apply_all(&mut ks);
        assert_eq!(ks[0], a.apply(&k));
    }
}
