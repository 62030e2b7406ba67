//! Tenants (`[tenants]`): sessions bound by bearer token (TCP) or peer uid (Unix socket),
//! page keys scoped per tenant in L2 and L3, and a client that claims another tenant's
//! namespace refused. Real daemon, real clients, many tenants' writes at once.
#![allow(missing_docs)]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::*;
use kvtier_client::{HostClient, TcpSecurity};
use kvtier_proto::v1;

fn token(t: &str) -> TcpSecurity {
    TcpSecurity {
        token: Some(t.to_string()),
        ..TcpSecurity::default()
    }
}

/// Writes `bytes[i]` as page `keys[i]` (reserve, copy, commit).
async fn write(
    c: &mut HostClient,
    s: &kvtier_client::Session,
    keys: &[kvtier_core::PageKey],
    bytes: &[Vec<u8>],
) {
    let r = c.reserve(s.id, None, keys).await.unwrap();
    for (i, r) in r.iter().enumerate() {
        match r {
            kvtier_client::Reserved::Slot(slot) => s.pool.write(*slot, 0, &bytes[i]).unwrap(),
            other => panic!("page {i} was not reserved: {other:?}"),
        }
    }
    c.commit(s.id, keys).await.unwrap();
}

/// Reads the pages `keys` as `s` sees them.
async fn read(
    c: &mut HostClient,
    s: &kvtier_client::Session,
    keys: &[kvtier_core::PageKey],
) -> Vec<Vec<u8>> {
    let slots = c.acquire(s.id, keys).await.unwrap();
    let out = slots
        .iter()
        .map(|slot| {
            let mut b = vec![0u8; s.layout.page_bytes()];
            s.pool.read(*slot, 0, &mut b).unwrap();
            b
        })
        .collect();
    c.release(s.id, &keys[..slots.len()]).await.unwrap();
    out
}

#[test]
fn equal_keys_of_two_tenants_never_meet_in_l2_or_l3() {
    let uid = rustix::process::geteuid().as_raw();
    let name = "tenants";
    let dir = std::env::temp_dir().join(format!("kvtierd-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("kvtierd.toml"),
        format!(
            "[tenants.acme]\ntoken = \"tok-acme\"\n\n[tenants.globex]\ntoken = \"tok-globex\"\n\n\
             [tenants.local]\nuids = [{uid}]\n"
        ),
    )
    .unwrap();
    let d = Daemon::start_in(
        dir,
        &[
            "server.tcp=127.0.0.1:0",
            "server.tcp_insecure=true",
            "l2.pool_pages=64",
        ],
    );
    let tcp = format!("http://{}", d.tcp);
    let spec = layout("tenants");
    let keys = chain(5, 8);
    rt().block_on(async {
        let mut a = HostClient::connect_with(&tcp, &token("tok-acme"))
            .await
            .unwrap();
        let mut g = HostClient::connect_with(&tcp, &token("tok-globex"))
            .await
            .unwrap();
        let mut u = HostClient::connect(&d.target()).await.unwrap();
        let (sa, sg, su) = (
            a.register("acme-worker", &spec).await.unwrap(),
            g.register("globex-worker", &spec).await.unwrap(),
            u.register("local-worker", &spec).await.unwrap(),
        );
        let len = sa.layout.page_bytes();
        let bytes = |seed: u64| -> Vec<Vec<u8>> {
            (0..keys.len() as u64)
                .map(|i| seeded_bytes(seed * 100 + i, len))
                .collect()
        };
        let (ba, bg, bu) = (bytes(1), bytes(2), bytes(3));

        // Acme stores the pages; nobody else sees them.
        write(&mut a, &sa, &keys, &ba).await;
        assert_eq!(a.lookup(sa.id, &keys).await.unwrap(), keys.len());
        assert_eq!(
            g.lookup(sg.id, &keys).await.unwrap(),
            0,
            "globex sees acme's pages"
        );
        assert_eq!(
            u.lookup(su.id, &keys).await.unwrap(),
            0,
            "a Unix-socket tenant sees acme's pages"
        );

        // The other two store the same keys with their own bytes, at once: three copies.
        tokio::join!(
            write(&mut g, &sg, &keys, &bg),
            write(&mut u, &su, &keys, &bu)
        );
        assert_eq!(read(&mut a, &sa, &keys).await, ba);
        assert_eq!(read(&mut g, &sg, &keys).await, bg);
        assert_eq!(read(&mut u, &su, &keys).await, bu);

        // L3 holds three objects per key (write_through), and each tenant's storage lookup
        // finds its own after L2 forgets them.
        eventually("24 pages in L3", Duration::from_secs(20), || {
            l3_files(&d.dir) == 24
        });
        let ch = kvtier_client::connect(&d.target()).await.unwrap();
        kvtier_proto::v1::admin_client::AdminClient::new(ch)
            .clear(v1::ClearRequest {
                tier: v1::Tier::Host as i32,
                dry_run: false,
            })
            .await
            .unwrap();
        for (c, s) in [(&mut a, &sa), (&mut g, &sg), (&mut u, &su)] {
            assert_eq!(
                c.lookup_tiers(s.id, &keys, true).await.unwrap(),
                (0, keys.len())
            );
        }
        // A caller that is no tenant (TCP without a tenant token) finds nothing of theirs.
        let mut n = HostClient::connect(&tcp).await.unwrap();
        let sn = n.register("no-tenant", &spec).await.unwrap();
        assert_eq!(n.lookup_tiers(sn.id, &keys, true).await.unwrap(), (0, 0));

        // kvtierctl's view: each session with its tenant.
        let stats = u.stats().await.unwrap();
        let tenant_of = |n: &str| {
            stats
                .sessions
                .iter()
                .find(|s| s.name == n)
                .map(|s| s.tenant.clone())
                .unwrap()
        };
        assert_eq!(
            (
                tenant_of("acme-worker"),
                tenant_of("globex-worker"),
                tenant_of("local-worker")
            ),
            ("acme".into(), "globex".into(), "local".into())
        );

        // A client whose hash self-test claims another tenant's namespace is refused.
        let l = kvtier_core::Layout::new(spec.clone()).unwrap();
        let ns = kvtier_core::Namespace {
            tenant: "globex".into(),
            ..Default::default()
        };
        let e = a
            .raw()
            .register(v1::RegisterRequest {
                name: "claims-globex".into(),
                layout: Some((&spec).into()),
                hash_self_test: Some(kvtier_client::self_test(l.page_size(), &ns).unwrap()),
                expected_layout: Some((&l).into()),
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e}");
        assert!(
            e.message().contains("globex") && e.message().contains("acme"),
            "{e}"
        );
        // Its own tenant's namespace is fine.
        let own = kvtier_core::Namespace {
            tenant: "acme".into(),
            ..Default::default()
        };
        a.raw()
            .register(v1::RegisterRequest {
                name: "claims-acme".into(),
                layout: Some((&spec).into()),
                hash_self_test: Some(kvtier_client::self_test(l.page_size(), &own).unwrap()),
                expected_layout: Some((&l).into()),
            })
            .await
            .unwrap();
    });
}
