//! The doors table (`kvtier_server::doors`) against what the processes really serve:
//! - every RPC of every proto file kvtierd and the agent serve (kvtier's, SGLang's, gRPC
//!   health and reflection) has a row, with the right kind, and every row has its RPC, so a
//!   method added without a row fails here;
//! - each (role, method) pair of kvtierd is called over TCP with each role's token (and with
//!   none, and a wrong one), on a daemon with tenants and a peer token and on one that is a
//!   single trust domain, and must be refused by the guard exactly when its row says so;
//! - SGLang's methods, through their relay, are served to an engine on the node.
#![allow(missing_docs)]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::HashSet;
use std::time::Duration;

use bytes::Bytes;
use common::*;
use kvtier_client::raw::{self, Shape};
use kvtier_server::doors::{self, DOORS, Kind, Server, Who};
use prost::Message as _;

/// Every RPC of the encoded descriptor set `fds`: (path, kind).
fn rpcs(fds: &[u8]) -> Vec<(String, Kind)> {
    let set = prost_types::FileDescriptorSet::decode(fds).unwrap();
    let mut out = Vec::new();
    for f in &set.file {
        let package = f.package();
        for s in &f.service {
            for m in &s.method {
                let kind = match (m.client_streaming(), m.server_streaming()) {
                    (false, false) => Kind::Unary,
                    (false, true) => Kind::ServerStream,
                    (true, false) => Kind::ClientStream,
                    (true, true) => Kind::BidiStream,
                };
                out.push((format!("/{package}.{}/{}", s.name(), m.name()), kind));
            }
        }
    }
    out
}

/// Which processes serve the service of `path` (the agent serves its own and health).
fn servers_of(path: &str) -> Vec<Server> {
    if path.starts_with("/kvtier.v1.Agent/") {
        vec![Server::Agent]
    } else if path.starts_with("/grpc.health.v1.") {
        vec![Server::Kvtierd, Server::Agent]
    } else {
        vec![Server::Kvtierd]
    }
}

#[test]
fn every_rpc_of_every_served_proto_has_one_row_and_every_row_an_rpc() {
    let mut served = HashSet::new();
    for fds in [
        kvtier_proto::FILE_DESCRIPTOR_SET,
        tonic_health::pb::FILE_DESCRIPTOR_SET,
        tonic_reflection::pb::v1::FILE_DESCRIPTOR_SET,
    ] {
        for (path, kind) in rpcs(fds) {
            for server in servers_of(&path) {
                let row = doors::method(server, &path).unwrap_or_else(|| {
                    panic!(
                        "{path} (served by {}) has no row in kvtier_server::doors::DOORS: \
                         add one naming who may call it, its bound and its owner",
                        server.name()
                    )
                });
                assert_eq!(row.kind, kind, "{path}: its row says {:?}", row.kind);
                served.insert((server, path.clone()));
            }
        }
    }
    for d in DOORS.iter().filter(|d| d.kind != Kind::Listener) {
        assert!(
            served.contains(&(d.server, d.name.to_string())),
            "the row of {} on {} names no RPC either serves",
            d.name,
            d.server.name()
        );
    }
}

/// Whether `r` is the guard's refusal (not the service's own answer).
fn refused_by_the_guard(r: &Result<Vec<Bytes>, tonic::Status>) -> bool {
    match r {
        Ok(_) => false,
        Err(s) => {
            s.code() == tonic::Code::Unauthenticated
                || (s.code() == tonic::Code::PermissionDenied
                    && s.message().contains("is not for it"))
                || (s.code() == tonic::Code::Unimplemented
                    && s.message().contains("serves no method"))
        }
    }
}

fn shape(kind: Kind) -> Shape {
    match kind {
        Kind::Unary => Shape::Unary,
        Kind::ServerStream => Shape::ServerStream,
        Kind::ClientStream => Shape::ClientStream,
        Kind::BidiStream => Shape::BidiStream,
        Kind::Listener => unreachable!("listeners take no calls"),
    }
}

/// Calls `path` with an empty request as the holder of `bearer` (none: no token); `true`
/// when the guard let it through. A call still running after a second passed the guard
/// (its refusals are immediate): a stream waiting for events.
async fn passes(tcp: &str, bearer: Option<&str>, path: &str, kind: Kind) -> bool {
    let call = async {
        match bearer {
            Some(t) => {
                let ch = kvtier_client::connect_with(tcp, &token(t)).await.unwrap();
                raw::call(ch, path, shape(kind), vec![Bytes::new()], 1).await
            }
            None => {
                let ch = kvtier_client::connect(tcp).await.unwrap();
                raw::call(ch, path, shape(kind), vec![Bytes::new()], 1).await
            }
        }
    };
    match tokio::time::timeout(Duration::from_secs(1), call).await {
        Ok(r) => !refused_by_the_guard(&r),
        Err(_) => true,
    }
}

/// Starts kvtierd with the config file `toml` and a loopback TCP listener that needs a token.
fn start(name: &str, toml: &str, sets: &[&str]) -> Daemon {
    let dir = std::env::temp_dir().join(format!("kvtierd-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("kvtierd.toml"), toml).unwrap();
    let mut all = vec![
        "server.tcp=127.0.0.1:0",
        "server.tcp_insecure=true",
        "server.token=tok-default",
        "server.admin_token=tok-admin",
        "l2.pool_pages=16",
        "l3.backend=memory",
    ];
    all.extend_from_slice(sets);
    Daemon::start_in(dir, &all)
}

/// Every kvtierd method served over TCP, called in every role; the guard's verdict must be
/// the row's.
fn every_role_meets_every_row(d: &Daemon, callers: &[(Who, Option<&str>)], one_domain: bool) {
    let tcp = format!("http://{}", d.tcp);
    let mut wrong = Vec::new();
    rt().block_on(async {
        for door in DOORS
            .iter()
            .filter(|r| r.on.contains(&doors::Listener::ControlTcp))
        {
            for &(who, bearer) in callers {
                let want = door.admits.admits(who, one_domain);
                let got = passes(&tcp, bearer, door.name, door.kind).await;
                if want != got {
                    wrong.push(format!(
                        "{} as {} ({bearer:?}): the row says {want}, the server {got}",
                        door.name,
                        who.describe()
                    ));
                }
            }
        }
        // A method no row names is refused even to the operator.
        assert!(
            !passes(
                &tcp,
                Some("tok-admin"),
                "/kvtier.v1.Admin/Format",
                Kind::Unary
            )
            .await,
            "an unknown method passed the guard"
        );
    });
    assert!(wrong.is_empty(), "{wrong:#?}");
}

#[test]
fn each_role_is_refused_or_served_each_method_as_its_row_says() {
    let d = start(
        "doors-tenants",
        "[tenants.acme]\ntoken = \"tok-acme\"\n",
        &["server.peer_token=tok-peer"],
    );
    every_role_meets_every_row(
        &d,
        &[
            (Who::Operator, Some("tok-admin")),
            (Who::Peer, Some("tok-peer")),
            (Who::Tenant, Some("tok-acme")),
            (Who::DefaultTenant, Some("tok-default")),
            (Who::Unauthenticated, None),
            (Who::Unauthenticated, Some("tok-guessed")),
        ],
        false,
    );
    // Refusals are counted by kind.
    let m = d.metrics();
    assert!(metric(&m, "kvtier_server_denied_calls_total") > 0.0);
    assert!(metric(&m, "kvtier_server_forbidden_calls_total{service=\"admin\"}") > 0.0);
    assert!(
        metric(
            &m,
            "kvtier_server_forbidden_calls_total{service=\"object_storage\"}"
        ) > 0.0
    );
}

#[test]
fn one_trust_domain_serves_the_storage_tier_to_the_default_tenant() {
    let d = start("doors-one-domain", "", &[]);
    every_role_meets_every_row(
        &d,
        &[
            (Who::Operator, Some("tok-admin")),
            (Who::DefaultTenant, Some("tok-default")),
            (Who::Unauthenticated, None),
        ],
        true,
    );
}

#[test]
fn sglangs_methods_are_served_to_an_engine_through_the_relay_and_nothing_else_is() {
    let d = Daemon::start("doors-sglang", &["sglang_rpc.enable=true"]);
    let path = d.dir.join("sglang-grpc.sock").display().to_string();
    rt().block_on(async {
        for door in DOORS.iter().filter(|r| r.name.starts_with("/sglang.")) {
            let ch = kvtier_client::connect(&path).await.unwrap();
            let r = raw::call(ch, door.name, shape(door.kind), vec![Bytes::new()], 1).await;
            assert!(!refused_by_the_guard(&r), "{}: {r:?}", door.name);
        }
        // kvtierd's other services are not on SGLang's socket: their rows do not name it.
        for other in ["/kvtier.v1.Admin/Clear", "/kvtier.v1.HostTier/Stats"] {
            let ch = kvtier_client::connect(&path).await.unwrap();
            let r = raw::call(ch, other, Shape::Unary, vec![], 1)
                .await
                .unwrap_err();
            assert_eq!(r.code(), tonic::Code::Unimplemented, "{other}: {r:?}");
        }
    });
}
