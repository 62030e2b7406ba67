//! Who a caller of kvtierd is. Every call has one role:
//!
//! | role | who |
//! |---|---|
//! | operator | on the Unix socket: kvtierd's own uid, `[server.admin]`'s uids and gids; anywhere: `server.admin_token` |
//! | peer | `server.peer_token` (another kvtierd's `l3.remote.token`) |
//! | tenant | a `[tenants.*]` uid, gid or token |
//! | default tenant | every other admitted caller (tenant `""`; over TCP, `server.token`) |
//! | unauthenticated | over TCP where `server.token` is set, a caller with no token kvtierd knows |
//!
//! With no `[tenants]` and no `server.peer_token`, every admitted caller is one trust domain
//! (each can already write any key through HostTier), so ObjectStorage is served to the
//! default tenant too; naming a tenant or a peer token closes it to them. A tenant's uid or gid
//! makes a Unix peer that tenant even where `[server.admin]` would list it (the config check
//! refuses such overlaps, and start-up refuses a tenant with kvtierd's own uid).
//!
//! Which role may use which method is not decided here: it is the row of the method in
//! `kvtier_server::doors`, enforced by the guard layer every gRPC server of kvtierd carries
//! ([`Roles::guard`] gives it this daemon's way of resolving callers). A refused call never
//! reaches the service, and is counted in `kvtier_server_forbidden_calls_total{service}`.
//! The pool door (`pool_door.rs`, not gRPC) resolves its peer's role here too
//! ([`Roles::resolve`]) and hands a session's pool only to the operator or the session's
//! tenant.

use std::sync::Arc;

use kvtier_config::ConfigError;
use kvtier_config::daemon::DaemonConfig;
use kvtier_config::roles::AdminAccess;
use kvtier_config::tenants::Tenants;
use kvtier_config::tls::constant_time_eq;
use kvtier_server::doors::{Listener, Who};
use kvtier_server::guard::{self, Guard, GuardMetrics};
use tonic::Request;
use tonic::codegen::http::HeaderMap;

/// The role of one call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Role {
    /// kvtierd's operator: every service.
    Operator,
    /// Another kvtierd using this one as its storage tier.
    Peer,
    /// An engine or agent of the named tenant (`""`: the default tenant).
    Tenant(String),
}

/// A Unix-socket peer's credentials, as SO_PEERCRED gave them.
#[derive(Debug, Clone, Copy)]
pub struct UnixPeer {
    /// Its effective uid.
    pub uid: u32,
    /// Its primary gid.
    pub gid: u32,
}

/// The role rules of one daemon.
#[derive(Debug, Clone)]
pub struct Roles {
    tenants: Arc<Tenants>,
    admin: AdminAccess,
    own_uid: u32,
    admin_token: Option<String>,
    peer_token: Option<String>,
    /// `server.token`: the default tenant over TCP.
    default_token: Option<String>,
}

impl Roles {
    /// The rules of `cfg` with its resolved `tenants`, for a daemon running as `own_uid`.
    /// Refuses a tenant that claims `own_uid`: its engines would be kvtierd's operator.
    pub fn new(cfg: &DaemonConfig, tenants: Tenants, own_uid: u32) -> Result<Self, ConfigError> {
        let owner = tenants.of_peer(own_uid, u32::MAX);
        if !owner.is_empty() {
            return Err(ConfigError::invalid(
                format!("tenants.{owner}.uids"),
                format!(
                    "lists {own_uid}, the uid kvtierd runs as, which is its operator's; run \
                     the tenant's engines under another uid"
                ),
            ));
        }
        Ok(Self {
            tenants: Arc::new(tenants),
            admin: cfg.server.admin.clone(),
            own_uid,
            admin_token: Some(cfg.server.admin_token.expose().to_string())
                .filter(|t| !t.is_empty()),
            peer_token: cfg.server.peer_token()?,
            default_token: cfg.server.tcp_token()?,
        })
    }

    /// No tenants, no tokens, this process's uid the operator, refusals counted nowhere: the
    /// rules until a daemon sets its own.
    pub fn open() -> Self {
        Self {
            tenants: Arc::new(Tenants::default()),
            admin: AdminAccess::default(),
            own_uid: rustix::process::geteuid().as_raw(),
            admin_token: None,
            peer_token: None,
            default_token: None,
        }
    }

    /// The tenants.
    pub fn tenants(&self) -> &Arc<Tenants> {
        &self.tenants
    }

    /// The role of a caller from its Unix-socket credentials (`None` over TCP) and the bearer
    /// token it presented, if any.
    pub fn resolve(&self, unix: Option<UnixPeer>, bearer: Option<&str>) -> Role {
        if let Some(b) = bearer {
            let is = |t: &Option<String>| {
                t.as_ref()
                    .is_some_and(|t| constant_time_eq(t.as_bytes(), b.as_bytes()))
            };
            if is(&self.admin_token) {
                return Role::Operator;
            }
            if is(&self.peer_token) {
                return Role::Peer;
            }
        }
        match unix {
            Some(p) => {
                let tenant = self.tenants.of_peer(p.uid, p.gid);
                if !tenant.is_empty() {
                    return Role::Tenant(tenant.to_string());
                }
                if self.admin.admits(self.own_uid, p.uid, p.gid) {
                    return Role::Operator;
                }
                Role::Tenant(String::new())
            }
            None => Role::Tenant(
                bearer
                    .map(|b| self.tenants.of_token(b).to_string())
                    .unwrap_or_default(),
            ),
        }
    }

    /// The role a bearer token alone gives, wherever it is presented: the operator (the admin
    /// token), a peer, a named tenant (its token) or the default tenant (`server.token`);
    /// `None` for a token that is none of these. Every token is compared in constant time.
    pub fn of_token(&self, token: &str) -> Option<Role> {
        let is = |t: &Option<String>| {
            t.as_ref()
                .is_some_and(|t| constant_time_eq(t.as_bytes(), token.as_bytes()))
        };
        let (admin, peer, default) = (
            is(&self.admin_token),
            is(&self.peer_token),
            is(&self.default_token),
        );
        let tenant = self.tenants.of_token(token);
        if admin {
            Some(Role::Operator)
        } else if peer {
            Some(Role::Peer)
        } else if !tenant.is_empty() {
            Some(Role::Tenant(tenant.to_string()))
        } else if default {
            Some(Role::Tenant(String::new()))
        } else {
            None
        }
    }

    /// The role of the caller of `req`.
    pub fn of<T>(&self, req: &Request<T>) -> Role {
        self.of_parts(req.extensions(), req.metadata().as_ref())
    }

    /// The role of a caller from what its connection and call carry: the Unix peer's
    /// credentials (in `ext`) and its bearer token (in `headers`).
    fn of_parts(&self, ext: &tonic::Extensions, headers: &HeaderMap) -> Role {
        let unix = guard::unix_uid(ext).map(|(uid, gid)| UnixPeer { uid, gid });
        self.resolve(unix, guard::bearer(headers))
    }

    /// Whether every admitted caller is one trust domain: no tenant named and no peer token
    /// set (each caller can already write any key through HostTier).
    pub fn one_trust_domain(&self) -> bool {
        !self.tenants.any() && self.peer_token.is_none()
    }

    /// The guard of a gRPC server of kvtierd's (see `kvtier_server::doors`): on the Unix
    /// socket (`tcp_token_required: None`) callers are who their uid and token make them;
    /// over TCP, where `server.token` is set, a caller without a token kvtierd knows is
    /// unauthenticated.
    pub fn guard(
        self: &Arc<Self>,
        tcp_token_required: Option<bool>,
        metrics: &GuardMetrics,
    ) -> Guard {
        let roles = self.clone();
        let resolve: guard::Resolve = match tcp_token_required {
            None => Arc::new(move |ext, headers| roles.of_parts(ext, headers).who()),
            Some(required) => Arc::new(move |_, headers| {
                let token = guard::bearer(headers);
                match token.and_then(|t| roles.of_token(t)) {
                    Some(role) => role.who(),
                    None if required => Who::Unauthenticated,
                    None => roles.resolve(None, token).who(),
                }
            }),
        };
        let listener = match tcp_token_required {
            None => Listener::Control,
            Some(_) => Listener::ControlTcp,
        };
        Guard::new(listener, resolve, self.one_trust_domain(), metrics)
    }

    /// Whether `role` sees every tenant's sessions and usage (Stats, WatchMetrics), not only
    /// its own.
    pub fn sees_all(&self, role: &Role) -> bool {
        match role {
            Role::Operator | Role::Peer => true,
            Role::Tenant(_) => !self.tenants.any(),
        }
    }

    /// The one tenant whose sessions, usage, metric series and pages `role` may see (Stats,
    /// WatchMetrics, WatchEvents); `None` when it sees every tenant's.
    pub fn only_tenant<'r>(&self, role: &'r Role) -> Option<&'r str> {
        (!self.sees_all(role)).then(|| role.tenant())
    }
}

impl Role {
    /// Its column in the doors table.
    pub fn who(&self) -> Who {
        match self {
            Role::Operator => Who::Operator,
            Role::Peer => Who::Peer,
            Role::Tenant(t) if t.is_empty() => Who::DefaultTenant,
            Role::Tenant(_) => Who::Tenant,
        }
    }

    /// The role in words, for errors and logs.
    pub fn describe(&self) -> String {
        match self {
            Role::Operator => "the operator".into(),
            Role::Peer => "a peer kvtierd".into(),
            Role::Tenant(t) if t.is_empty() => "the default tenant".into(),
            Role::Tenant(t) => format!("tenant {t:?}"),
        }
    }

    /// The tenant a session this caller registers belongs to: its own for a tenant, the
    /// default tenant for the operator and peers.
    pub fn tenant(&self) -> &str {
        match self {
            Role::Tenant(t) => t,
            Role::Operator | Role::Peer => "",
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use kvtier_config::Secret;
    use kvtier_config::tenants::TenantConfig;

    use super::*;

    fn roles(tenants: &[(&str, u32, &str)], admin_uids: &[u32], peer: &str) -> Roles {
        let mut cfg = DaemonConfig::default();
        cfg.server.admin_token = Secret("adm".into());
        cfg.server.peer_token = Secret(peer.into());
        cfg.server.token = Secret("dflt".into());
        cfg.server.admin.allow_uids = admin_uids.to_vec();
        let mut t = BTreeMap::new();
        for (name, uid, token) in tenants {
            t.insert(
                name.to_string(),
                TenantConfig {
                    uids: vec![*uid],
                    token: Secret(token.to_string()),
                    ..TenantConfig::default()
                },
            );
        }
        Roles::new(&cfg, Tenants::resolve(&t).unwrap(), 1000).unwrap()
    }

    fn unix(uid: u32) -> Option<UnixPeer> {
        Some(UnixPeer { uid, gid: 7 })
    }

    #[test]
    fn each_caller_has_one_role_and_tenants_are_never_operators() {
        let r = roles(&[("acme", 2001, "ta")], &[3000], "peer");
        // The socket: own uid and listed uids are operators; a tenant's uid is that tenant.
        assert_eq!(r.resolve(unix(1000), None), Role::Operator);
        assert_eq!(r.resolve(unix(3000), None), Role::Operator);
        assert_eq!(r.resolve(unix(2001), None), Role::Tenant("acme".into()));
        assert_eq!(r.resolve(unix(4000), None), Role::Tenant(String::new()));
        // Tokens raise a caller anywhere; a tenant's token over TCP is that tenant.
        assert_eq!(r.resolve(unix(2001), Some("adm")), Role::Operator);
        assert_eq!(r.resolve(None, Some("adm")), Role::Operator);
        assert_eq!(r.resolve(None, Some("peer")), Role::Peer);
        assert_eq!(r.resolve(None, Some("ta")), Role::Tenant("acme".into()));
        assert_eq!(r.resolve(None, Some("other")), Role::Tenant(String::new()));
        assert_eq!(r.resolve(None, None), Role::Tenant(String::new()));
        // A tenant's token on the socket does not make an operator's uid less.
        assert_eq!(r.resolve(unix(1000), Some("ta")), Role::Operator);
        // A token alone (the pool door's second question): only a known one gives a role.
        assert_eq!(r.of_token("adm"), Some(Role::Operator));
        assert_eq!(r.of_token("peer"), Some(Role::Peer));
        assert_eq!(r.of_token("ta"), Some(Role::Tenant("acme".into())));
        assert_eq!(r.of_token("dflt"), Some(Role::Tenant(String::new())));
        assert_eq!(r.of_token("other"), None);
    }

    #[test]
    fn roles_map_to_the_doors_columns_and_one_trust_domain_is_computed() {
        let r = roles(&[("acme", 2001, "ta")], &[], "");
        let acme = Role::Tenant("acme".into());
        let default = Role::Tenant(String::new());
        assert_eq!(
            [&Role::Operator, &Role::Peer, &acme, &default].map(Role::who),
            [Who::Operator, Who::Peer, Who::Tenant, Who::DefaultTenant]
        );
        assert!(!r.one_trust_domain());
        assert!(!r.sees_all(&acme) && r.sees_all(&Role::Operator));
        assert_eq!(r.only_tenant(&acme), Some("acme"));
        assert_eq!(r.only_tenant(&default), Some(""));
        assert_eq!(
            (r.only_tenant(&Role::Operator), r.only_tenant(&Role::Peer)),
            (None, None)
        );
        // No tenants, no peer token: the default tenant is everyone.
        let open = roles(&[], &[], "");
        assert!(open.one_trust_domain() && open.sees_all(&default));
        assert_eq!(open.only_tenant(&default), None);
        // A peer token ends the one trust domain.
        assert!(!roles(&[], &[], "peer").one_trust_domain());
    }

    #[test]
    fn a_tenant_with_kvtierds_own_uid_is_refused_at_start() {
        let mut t = BTreeMap::new();
        t.insert(
            "acme".to_string(),
            TenantConfig {
                uids: vec![1000],
                ..TenantConfig::default()
            },
        );
        let e = Roles::new(
            &DaemonConfig::default(),
            Tenants::resolve(&t).unwrap(),
            1000,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("tenants.acme.uids") && e.contains("1000"), "{e}");
    }
}
