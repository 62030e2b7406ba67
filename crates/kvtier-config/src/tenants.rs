//! `[tenants.<name>]`: who is which tenant. A session is bound to one tenant when it
//! registers: over a Unix socket by its peer uid or primary gid, over TCP by the bearer
//! token it presents. Each named tenant's page keys are scoped (`kvtier_core::TenantScope`),
//! so tenants never see each other's pages in any tier. A caller that matches no tenant is the
//! default tenant `""`, scoped apart from every named one.
//!
//! The tables are read from the config file only (they are a map, so no environment
//! variable or `--set` names them).

use std::collections::BTreeMap;

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::{ConfigError, Secret};

/// The commented `[tenants]` block of kvtierd's default file.
#[macro_export]
macro_rules! tenants_default_toml {
    () => {
        r#"
[tenants]
# Named tenants, one table each, in the config file only, e.g.
#   [tenants.acme]
#   uids = [1001]           # Unix-socket peers with these uids ...
#   gids = [2001]           # ... or these primary gids are acme
#   token_file = "/etc/kvtier/acme.token"   # TCP callers presenting this token are acme
#   l2_pages = 100000       # most pages acme holds in each L2 pool (one per layout); 0: none
#   l3_bytes = "200GiB"     # most bytes acme holds in L3 (file and rocksdb backends); 0: none
# A session belongs to the tenant it matches when it registers (no match: the default
# tenant). Its page keys are scoped to its tenant in L2 and L3, so equal prompts of two
# tenants never share or read each other's pages; a client whose hash self-test names
# another tenant (namespace.tenant) is refused with PERMISSION_DENIED. Tenant tokens are
# accepted by the TCP listener like server.token. Names: 1 to 64 of A-Z a-z 0-9 _ . -
# A tenant at a quota evicts its own least recently used pages, never another tenant's;
# usage and quotas are in `kvtierctl status` and kvtier_tenant_* metrics.
"#
    };
}

/// One `[tenants.<name>]` table.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct TenantConfig {
    /// Unix-socket peer uids that are this tenant.
    pub uids: Vec<u32>,
    /// Unix-socket peer primary gids that are this tenant.
    pub gids: Vec<u32>,
    /// Bearer token of this tenant's TCP callers. Never printed.
    pub token: Secret,
    /// A file holding the token, instead of `token`.
    #[serde(
        deserialize_with = "crate::units::empty_is_none",
        skip_serializing_if = "Option::is_none"
    )]
    pub token_file: Option<PathBuf>,
    /// Most pages the tenant may hold in each L2 pool (one pool per layout); 0: no quota.
    pub l2_pages: u32,
    /// Most bytes the tenant may hold in L3 (file and rocksdb backends); 0: no quota.
    pub l3_bytes: crate::ByteSize,
}

/// One tenant's quotas (`None`: unbounded, usage still counted).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TenantQuota {
    /// The tenant (`""`: the default tenant, which has no quota).
    pub name: String,
    /// Most pages per L2 pool.
    pub l2_pages: Option<u32>,
    /// Most L3 bytes.
    pub l3_bytes: Option<u64>,
    /// Its Unix-socket uids (given its own pools' files, `l2.tenant_pools`).
    pub uids: Vec<u32>,
    /// Its Unix-socket gids.
    pub gids: Vec<u32>,
}

/// The tenants, by name, with their tokens read.
#[derive(Debug, Clone, Default)]
pub struct Tenants {
    by_uid: BTreeMap<u32, String>,
    by_gid: BTreeMap<u32, String>,
    by_token: Vec<(String, String)>,
    quotas: Vec<TenantQuota>,
}

impl Tenants {
    /// Checks names, and that no uid, gid or token belongs to two tenants; reads token files.
    pub fn resolve(tables: &BTreeMap<String, TenantConfig>) -> Result<Self, ConfigError> {
        let mut t = Tenants::default();
        for (name, c) in tables {
            let key = |k: &str| format!("tenants.{name}.{k}");
            let ok = !name.is_empty()
                && name.len() <= 64
                && name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b));
            if !ok {
                return Err(ConfigError::invalid(
                    format!("tenants.{name}"),
                    "a tenant name is 1 to 64 of A-Z a-z 0-9 _ . -",
                ));
            }
            for (ids, map, k) in [
                (&c.uids, &mut t.by_uid, "uids"),
                (&c.gids, &mut t.by_gid, "gids"),
            ] {
                for id in ids {
                    if let Some(other) = map.insert(*id, name.clone()) {
                        return Err(ConfigError::invalid(
                            key(k),
                            format!("{id} is also listed by tenant {other:?}"),
                        ));
                    }
                }
            }
            t.quotas.push(TenantQuota {
                name: name.clone(),
                l2_pages: (c.l2_pages > 0).then_some(c.l2_pages),
                l3_bytes: (c.l3_bytes.0 > 0).then_some(c.l3_bytes.0),
                uids: c.uids.clone(),
                gids: c.gids.clone(),
            });
            if let Some(tok) =
                crate::tls::resolve_token(&c.token, c.token_file.as_deref(), &key("token"))?
            {
                if let Some((other, _)) = t.by_token.iter().find(|(_, x)| *x == tok) {
                    return Err(ConfigError::invalid(
                        key("token"),
                        format!("the same token as tenant {other:?}"),
                    ));
                }
                t.by_token.push((name.clone(), tok));
            }
        }
        if t.any() {
            t.quotas.insert(
                0,
                TenantQuota {
                    name: String::new(),
                    l2_pages: None,
                    l3_bytes: None,
                    uids: Vec::new(),
                    gids: Vec::new(),
                },
            );
        } else {
            t.quotas.clear();
        }
        Ok(t)
    }

    /// Every tenant while tenancy is on, the default tenant `""` first, with its quotas;
    /// empty while it is off.
    pub fn quotas(&self) -> &[TenantQuota] {
        &self.quotas
    }

    /// The first tenant with an L3 byte quota, if any (for the backend check).
    pub fn l3_quota(&self) -> Option<&str> {
        self.quotas
            .iter()
            .find(|q| q.l3_bytes.is_some())
            .map(|q| q.name.as_str())
    }

    /// Whether any tenant is named (without, tenancy is off and namespaces are free labels).
    pub fn any(&self) -> bool {
        !(self.by_uid.is_empty() && self.by_gid.is_empty() && self.by_token.is_empty())
    }

    /// The tenant of a Unix-socket peer; `""` when none claims it.
    pub fn of_peer(&self, uid: u32, gid: u32) -> &str {
        self.by_uid
            .get(&uid)
            .or_else(|| self.by_gid.get(&gid))
            .map_or("", String::as_str)
    }

    /// The tenant whose token is `token`; `""` when none.
    pub fn of_token(&self, token: &str) -> &str {
        // Every token is compared, in time independent of where they differ.
        self.by_token.iter().fold("", |found, (n, t)| {
            if crate::tls::constant_time_eq(t.as_bytes(), token.as_bytes()) {
                n.as_str()
            } else {
                found
            }
        })
    }

    /// Every tenant token (for the TCP listener's check).
    pub fn tokens(&self) -> impl Iterator<Item = &str> {
        self.by_token.iter().map(|(_, t)| t.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(uids: &[u32], gids: &[u32], token: &str) -> TenantConfig {
        TenantConfig {
            uids: uids.to_vec(),
            gids: gids.to_vec(),
            token: Secret(token.to_string()),
            token_file: None,
            ..TenantConfig::default()
        }
    }

    #[test]
    fn peers_and_tokens_find_their_tenant_and_clashes_are_named() {
        let mut m = BTreeMap::new();
        m.insert("acme".to_string(), table(&[1001], &[2001], "ta"));
        m.insert("globex".to_string(), table(&[1002], &[], "tb"));
        let t = Tenants::resolve(&m).unwrap();
        assert!(t.any());
        assert_eq!(t.of_peer(1001, 0), "acme");
        assert_eq!(t.of_peer(5, 2001), "acme");
        assert_eq!(t.of_peer(1002, 2001), "globex", "the uid decides first");
        assert_eq!(t.of_peer(5, 5), "");
        assert_eq!((t.of_token("tb"), t.of_token("tc")), ("globex", ""));
        assert_eq!(t.tokens().count(), 2);
        assert!(!Tenants::resolve(&BTreeMap::new()).unwrap().any());

        m.insert("initech".to_string(), table(&[1001], &[], ""));
        let e = Tenants::resolve(&m).unwrap_err().to_string();
        assert!(
            e.contains("tenants.initech.uids") && e.contains("acme"),
            "{e}"
        );
        m.insert("initech".to_string(), table(&[], &[], "ta"));
        let e = Tenants::resolve(&m).unwrap_err().to_string();
        assert!(e.contains("tenants.initech.token"), "{e}");
        m.remove("initech");
        m.insert("bad name".to_string(), table(&[], &[], ""));
        let e = Tenants::resolve(&m).unwrap_err().to_string();
        assert!(e.contains("tenants.bad name"), "{e}");
    }

    #[test]
    fn quotas_list_every_tenant_and_an_l3_quota_needs_an_indexed_backend() {
        let mut m = BTreeMap::new();
        m.insert("acme".to_string(), table(&[1001], &[], ""));
        m.get_mut("acme").unwrap().l2_pages = 64;
        m.get_mut("acme").unwrap().l3_bytes = crate::ByteSize(1 << 20);
        m.insert("globex".to_string(), table(&[1002], &[], ""));
        let t = Tenants::resolve(&m).unwrap();
        let q: Vec<_> = t
            .quotas()
            .iter()
            .map(|q| (q.name.as_str(), q.l2_pages, q.l3_bytes))
            .collect();
        assert_eq!(
            q,
            [
                ("", None, None),
                ("acme", Some(64), Some(1 << 20)),
                ("globex", None, None)
            ]
        );
        assert_eq!(t.l3_quota(), Some("acme"));
        assert!(
            Tenants::resolve(&BTreeMap::new())
                .unwrap()
                .quotas()
                .is_empty()
        );

        let toml = r#"
[l3]
backend = "s3"
[l3.s3]
bucket = "b"
[tenants.acme]
uids = [1001]
l3_bytes = "1MiB"
"#;
        let src = crate::Sources {
            file: Some(("kvtierd.toml".to_string(), toml.to_string())),
            ..crate::Sources::default()
        };
        let e = crate::daemon::DaemonConfig::load(&src)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("tenants.acme.l3_bytes") && e.contains("s3"),
            "{e}"
        );
    }
}
