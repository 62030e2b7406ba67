//! `[server.admin]`: who is kvtierd's operator on its Unix socket. Together with
//! `server.admin_token` (the operator over TCP, or on the socket from any admitted uid) and
//! `server.peer_token` (another kvtierd using this one as its storage tier), it decides the
//! role of every caller: operator, peer or tenant. The daemon's `roles` module applies it.

use std::collections::BTreeMap;

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::ConfigError;
use crate::tenants::TenantConfig;

/// The commented `[server.admin]` table of kvtierd's default file, as a literal for
/// `concat!`.
#[macro_export]
macro_rules! admin_default_toml {
    () => {
        r#"
[server.admin]
# The operator on the Unix socket: who may call kvtier.v1.Admin (kvtierctl tier, config,
# clear, flush, drain), the storage tier's ObjectStorage service, and see every tenant's
# sessions in Stats. kvtierd's own uid always is; list more uids, or primary gids, here.
# Every other admitted peer (an engine, an agent) is a tenant and is refused those calls
# with PERMISSION_DENIED, unless it presents "authorization: Bearer <server.admin_token>".
# A uid or gid may not be both an operator and a tenant's ([tenants.*] uids / gids).
allow_uids = []
allow_gids = []
# The directory under which AttachBackend may open a file or rocksdb backend (kvtierctl
# backend attach file.path=...), besides the paths kvtierd's own configuration names.
# Empty: data_dir. A path outside it is refused, so no caller can point the storage tier (and
# its clears) at a directory of its choosing.
attach_root = ""
"#
    };
}

/// `[server.admin]`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct AdminAccess {
    /// Unix-socket peer uids that are operators, besides kvtierd's own.
    pub allow_uids: Vec<u32>,
    /// Unix-socket peer primary gids that are operators.
    pub allow_gids: Vec<u32>,
    /// Where AttachBackend may open file and rocksdb backends (unset: `data_dir`).
    #[serde(
        deserialize_with = "crate::units::empty_is_none",
        skip_serializing_if = "Option::is_none"
    )]
    pub attach_root: Option<PathBuf>,
}

impl AdminAccess {
    /// Whether a Unix-socket peer with `uid` and primary `gid` is an operator of a server
    /// running as `own`.
    pub fn admits(&self, own: u32, uid: u32, gid: u32) -> bool {
        uid == own || self.allow_uids.contains(&uid) || self.allow_gids.contains(&gid)
    }

    /// Refuses an id that is both an operator's and a tenant's: which one the peer is would
    /// depend on the order of the checks.
    pub fn validate(&self, tenants: &BTreeMap<String, TenantConfig>) -> Result<(), ConfigError> {
        for (name, t) in tenants {
            for (ours, theirs, key) in [
                (&self.allow_uids, &t.uids, "allow_uids"),
                (&self.allow_gids, &t.gids, "allow_gids"),
            ] {
                if let Some(id) = ours.iter().find(|id| theirs.contains(id)) {
                    return Err(ConfigError::invalid(
                        format!("server.admin.{key}"),
                        format!(
                            "{id} is also tenant {name:?}'s; an id is an operator's or a \
                             tenant's, not both"
                        ),
                    ));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_listed_and_group_peers_are_operators_and_shared_ids_are_refused() {
        let a = AdminAccess {
            allow_uids: vec![5],
            allow_gids: vec![50],
            ..AdminAccess::default()
        };
        assert!(a.admits(1, 1, 99));
        assert!(a.admits(1, 5, 99));
        assert!(a.admits(1, 7, 50));
        assert!(!a.admits(1, 7, 99));
        let mut tenants = BTreeMap::new();
        tenants.insert(
            "acme".to_string(),
            TenantConfig {
                gids: vec![50],
                ..TenantConfig::default()
            },
        );
        let e = a.validate(&tenants).unwrap_err().to_string();
        assert!(
            e.contains("server.admin.allow_gids") && e.contains("acme"),
            "{e}"
        );
        tenants.get_mut("acme").unwrap().gids = vec![51];
        a.validate(&tenants).unwrap();
    }
}
