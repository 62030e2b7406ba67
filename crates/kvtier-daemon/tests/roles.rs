//! Each caller has one role — operator, peer kvtierd or tenant — and each service its owner
//! (issue 39). The attacks a tenant made on main before roles existed, each tried again here
//! with real processes: another uid on the Unix socket (through `setpriv`, so the test needs
//! root, as CI runs), and another tenant's engine over TCP with its own token.
#![allow(missing_docs)]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::process::Command;
use std::time::Duration;

use common::*;
use kvtier_client::HostClient;
use kvtier_proto::v1;
use kvtier_storage::Store as _;
use kvtier_storage::remote::RemoteStore;

fn forbidden(d: &Daemon, service: &str) -> f64 {
    metric(
        &d.metrics(),
        &format!("kvtier_server_forbidden_calls_total{{service=\"{service}\"}}"),
    )
}

/// The gRPC code of a call's outcome, `OK` when it was served.
fn outcome<T>(r: Result<T, tonic::Status>) -> String {
    match r {
        Ok(_) => "OK".into(),
        Err(s) => format!("{:?}", s.code()),
    }
}

/// The child: every Admin call an engine should never make, one ObjectStorage read, and one
/// HostTier call it may make, each printed with its outcome.
#[test]
#[ignore = "run by the tests below as another uid"]
fn child_entry() {
    let Ok(socket) = std::env::var("KVT_CHILD_SOCKET") else {
        return;
    };
    let sec = std::env::var("KVT_CHILD_TOKEN")
        .map(|t| token(&t))
        .unwrap_or_default();
    rt().block_on(async move {
        let ch = kvtier_client::connect_with(&socket, &sec).await.unwrap();
        let mut admin = v1::admin_client::AdminClient::new(ch.clone());
        let config = outcome(admin.running_config(v1::RunningConfigRequest {}).await);
        let clear = outcome(
            admin
                .clear(v1::ClearRequest {
                    tier: v1::Tier::Storage as i32,
                    dry_run: false,
                })
                .await,
        );
        let drain = outcome(
            admin
                .drain(v1::DrainRequest {
                    action: v1::DrainAction::Start as i32,
                })
                .await,
        );
        let attach = outcome(
            admin
                .attach_backend(v1::AttachBackendRequest {
                    settings: vec!["l3.backend=file".into(), "l3.file.path=/tmp/planted".into()],
                })
                .await,
        );
        let mut objects = v1::object_storage_client::ObjectStorageClient::new(ch.clone());
        let object = outcome(
            objects
                .exists(v1::ExistsRequest {
                    names: vec!["ab/0123".into()],
                })
                .await,
        );
        let mut host = v1::host_tier_client::HostTierClient::new(ch);
        let stats = outcome(host.stats(v1::StatsRequest {}).await);
        println!(
            "RESULT config={config} clear={clear} drain={drain} attach={attach} \
             object={object} stats={stats}"
        );
    });
}

#[test]
fn admin_and_objects_are_refused_to_an_engine_of_another_uid_on_the_socket() {
    if !is_root() {
        eprintln!("skipped: starting a peer as another uid needs root");
        return;
    }
    let d = Daemon::start(
        "roles-uds",
        &[
            "l2.pool_pages=16",
            "server.unix.mode=0666",
            &format!("server.unix.allow_uids={NOBODY}"),
            "server.admin_token=tok-admin",
            "server.peer_token=tok-peer",
        ],
    );
    let socket = d.target();
    // An engine admitted to the socket is a tenant: the host tier serves it, nothing else.
    assert_eq!(
        as_nobody(&[("KVT_CHILD_SOCKET", &socket)]),
        "config=PermissionDenied clear=PermissionDenied drain=PermissionDenied \
         attach=PermissionDenied object=PermissionDenied stats=OK"
    );
    assert_eq!(forbidden(&d, "admin"), 4.0);
    assert_eq!(forbidden(&d, "object_storage"), 1.0);
    // Nothing it asked for happened: the daemon is not draining.
    rt().block_on(async {
        let ch = kvtier_client::connect(&d.target()).await.unwrap();
        let status = v1::admin_client::AdminClient::new(ch)
            .drain(v1::DrainRequest {
                action: v1::DrainAction::Status as i32,
            })
            .await
            .unwrap()
            .into_inner();
        assert!(!status.draining, "a tenant started a drain");
    });
    // The operator's token makes the same uid the operator; a peer's token a peer.
    let admin = as_nobody(&[
        ("KVT_CHILD_SOCKET", &socket),
        ("KVT_CHILD_TOKEN", "tok-admin"),
    ]);
    assert!(
        admin.starts_with("config=OK clear=")
            && admin.contains("object=")
            && admin.ends_with("stats=OK"),
        "{admin}"
    );
    assert!(!admin.contains("PermissionDenied"), "{admin}");
    let peer = as_nobody(&[
        ("KVT_CHILD_SOCKET", &socket),
        ("KVT_CHILD_TOKEN", "tok-peer"),
    ]);
    assert!(
        peer.starts_with("config=PermissionDenied") && peer.contains("object=OK"),
        "{peer}"
    );
    drop(d);

    // [server.admin] names the operator's uids.
    let d = Daemon::start(
        "roles-uds-admin",
        &[
            "l2.pool_pages=16",
            "server.unix.mode=0666",
            &format!("server.unix.allow_uids={NOBODY}"),
            &format!("server.admin.allow_uids={NOBODY}"),
        ],
    );
    let listed = as_nobody(&[("KVT_CHILD_SOCKET", &d.target())]);
    assert!(listed.starts_with("config=OK"), "{listed}");
}

#[test]
fn a_tenant_cannot_read_forge_delete_or_probe_another_tenants_objects() {
    // The tenants' tables go in the config file.
    let dir = std::env::temp_dir().join(format!(
        "kvtierd-test-{}-roles-objects-t",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("kvtierd.toml"),
        "[tenants.acme]\ntoken = \"tok-acme\"\n\n[tenants.globex]\ntoken = \"tok-globex\"\n",
    )
    .unwrap();
    let d = Daemon::start_in(
        dir,
        &[
            "l2.pool_pages=32",
            "l3.backend=file",
            "l3.write_policy=write_through",
            "server.tcp=127.0.0.1:0",
            "server.tcp_insecure=true",
            "server.token=tok-default",
            "server.admin_token=tok-admin",
            "server.peer_token=tok-peer",
        ],
    );
    let tcp = format!("http://{}", d.tcp);
    rt().block_on(async {
        // Acme stores 4 pages; they reach L3 under acme's scoped keys.
        let mut a = HostClient::connect_with(&tcp, &token("tok-acme"))
            .await
            .unwrap();
        let s = a.register("acme-worker", &layout("roles")).await.unwrap();
        let keys = chain(9, 4);
        let bytes = store(&mut a, &s, &keys).await;
        eventually("4 objects in L3", Duration::from_secs(20), || {
            l3_files(&d.dir) == 4
        });
        let mut scoped = keys.clone();
        kvtier_core::TenantScope::new("acme").apply_all(&mut scoped);
        let names: Vec<String> = scoped
            .iter()
            .map(|k| kvtier_storage::format::object_name(&s.layout.fingerprint(), k))
            .collect();

        // Globex (and the default tenant) know the names, which come from public data, and
        // try every object call: each is refused, and counted.
        for tok in ["tok-globex", "tok-default"] {
            let other = RemoteStore::connect_with(&tcp, &token(tok)).unwrap();
            assert!(other.exists_prefix(&names).await.is_err(), "{tok} probed");
            assert!(other.exists(&names[0]).await.is_err(), "{tok} probed one");
            assert!(other.get(&names[0]).await.is_err(), "{tok} read");
            let forged = bytes::Bytes::from_static(b"POISONED-BY-GLOBEX");
            assert!(
                other
                    .set(&names[1], forged, bytes::Bytes::new())
                    .await
                    .is_err(),
                "{tok} forged"
            );
            assert!(other.delete(&names[2]).await.is_err(), "{tok} deleted");
        }
        assert_eq!(forbidden(&d, "object_storage"), 10.0);

        // Acme's objects are whole: the peer kvtierd (and the operator) read them intact.
        for tok in ["tok-peer", "tok-admin"] {
            let peer = RemoteStore::connect_with(&tcp, &token(tok)).unwrap();
            assert_eq!(
                peer.exists_prefix(&names).await.unwrap(),
                4,
                "{tok} misses an object"
            );
        }
        let peer = RemoteStore::connect_with(&tcp, &token("tok-peer")).unwrap();
        let stored = peer.get(&names[1]).await.unwrap().unwrap();
        assert_eq!(
            &stored[kvtier_storage::format::HEADER_LEN..],
            &bytes[1][..],
            "acme's page changed in L3"
        );
        kvtier_storage::conformance::round_trip(&peer).await;
        // And acme finds all 4 pages in L3 after L2 forgets them.
        let admin = kvtier_client::connect_with(&d.target(), &token("tok-admin"))
            .await
            .unwrap();
        v1::admin_client::AdminClient::new(admin)
            .clear(v1::ClearRequest {
                tier: v1::Tier::Host as i32,
                dry_run: false,
            })
            .await
            .unwrap();
        assert_eq!(a.lookup_tiers(s.id, &keys, true).await.unwrap(), (0, 4));
    });
}

#[test]
fn tcp_without_a_token_is_refused_even_on_loopback() {
    let dir = std::env::temp_dir().join(format!("kvtierd-test-{}-notoken", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_kvtierd"))
        .args(["--set", &format!("data_dir={}", dir.display())])
        .args([
            "--set",
            "server.tcp=127.0.0.1:0",
            "--set",
            "server.tcp_insecure=true",
            "--check-config",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("server.token"),
        "{err}"
    );
}

#[test]
fn stats_lists_at_most_a_thousand_sessions_and_counts_the_rest() {
    let d = Daemon::start("roles-stats", &["l2.pool_pages=16", "sessions.ttl=1h"]);
    rt().block_on(async {
        let mut c = HostClient::connect(&d.target()).await.unwrap();
        let spec = layout("many");
        let l = kvtier_core::Layout::new(spec.clone()).unwrap();
        for i in 0..1010 {
            c.raw()
                .register(v1::RegisterRequest {
                    name: format!("engine-{i}"),
                    layout: Some((&spec).into()),
                    hash_self_test: Some(
                        kvtier_client::self_test(l.page_size(), &Default::default()).unwrap(),
                    ),
                    expected_layout: Some((&l).into()),
                })
                .await
                .unwrap();
        }
        let s = c.stats().await.unwrap();
        assert_eq!((s.sessions.len(), s.sessions_omitted), (1000, 10));
        // The most recently seen are the ones listed.
        assert!(s.sessions.iter().any(|x| x.name == "engine-1009"));
        assert!(!s.sessions.iter().any(|x| x.name == "engine-0"));
    });
}
