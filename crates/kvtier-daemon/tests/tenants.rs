//! Tenants (`[tenants]`): sessions bound by bearer token (TCP) or peer uid (Unix socket),
//! page keys scoped per tenant in L2 and L3, and a client that claims another tenant's
//! namespace refused. Real daemon, real clients, many tenants' writes at once.
#![allow(missing_docs)]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::*;
use kvtier_client::HostClient;
use kvtier_proto::v1;

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

/// A client of kvtierd's TCP listener `tcp` presenting token `t`.
async fn as_tenant(tcp: &str, t: &str) -> HostClient {
    HostClient::connect_with(tcp, &token(t)).await.unwrap()
}

/// A kvtierd whose config file is `toml`, with an insecure loopback TCP listener and a pool
/// of 64 pages.
fn start(name: &str, toml: &str) -> Daemon {
    let dir = std::env::temp_dir().join(format!("kvtierd-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("kvtierd.toml"), toml).unwrap();
    Daemon::start_in(
        dir,
        &[
            "server.tcp=127.0.0.1:0",
            "server.tcp_insecure=true",
            "server.token=tok-default",
            "server.admin_token=tok-admin",
            "l2.pool_pages=64",
        ],
    )
}

#[test]
fn a_tenant_sees_its_own_pages_of_a_pool_tenants_share_and_nothing_of_the_others() {
    let d = start(
        "stats-view",
        "[l2]\ntenant_pools = false\n\n[tenants.acme]\ntoken = \"tok-acme\"\n\n\
         [tenants.globex]\ntoken = \"tok-globex\"\n",
    );
    let tcp = format!("http://{}", d.tcp);
    let spec = layout("shared-view");
    rt().block_on(async {
        let mut a = as_tenant(&tcp, "tok-acme").await;
        let mut g = as_tenant(&tcp, "tok-globex").await;
        let sa = a.register("acme-worker", &spec).await.unwrap();
        let sg = g.register("globex-worker", &spec).await.unwrap();
        let len = sa.layout.page_bytes();
        let pages = |seed: u64, n: u64| -> Vec<Vec<u8>> {
            (0..n).map(|i| seeded_bytes(seed * 100 + i, len)).collect()
        };
        write(&mut a, &sa, &chain(1, 8), &pages(1, 8)).await;
        write(&mut g, &sg, &chain(2, 3), &pages(2, 3)).await;
        // One pool holds both tenants' pages: each sees its own count, not the other's.
        let seen = |s: v1::StatsResponse| -> Vec<(String, u32, u64)> {
            s.pools
                .iter()
                .map(|p| (p.model_id.clone(), p.ready_pages, p.evictions))
                .collect()
        };
        assert_eq!(
            seen(g.stats().await.unwrap()),
            vec![("shared-view".to_string(), 3, 0)]
        );
        assert_eq!(
            seen(a.stats().await.unwrap()),
            vec![("shared-view".to_string(), 8, 0)]
        );
        // The operator sees the whole pool.
        let all = HostClient::connect_with(&d.target(), &token("tok-admin"))
            .await
            .unwrap()
            .stats()
            .await
            .unwrap();
        assert_eq!(seen(all), vec![("shared-view".to_string(), 11, 0)]);
    });
}

#[test]
fn equal_keys_of_two_tenants_never_meet_in_l2_or_l3() {
    // This process is the "local" tenant on the Unix socket by its primary gid (its uid is
    // kvtierd's own, the operator's, which no tenant may claim).
    let gid = rustix::process::getegid().as_raw();
    let d = start(
        "tenants",
        &format!(
            "[tenants.acme]\ntoken = \"tok-acme\"\n\n[tenants.globex]\ntoken = \"tok-globex\"\n\n\
             [tenants.local]\ngids = [{gid}]\n"
        ),
    );
    let tcp = format!("http://{}", d.tcp);
    let spec = layout("tenants");
    let keys = chain(5, 8);
    rt().block_on(async {
        let mut a = as_tenant(&tcp, "tok-acme").await;
        let mut g = as_tenant(&tcp, "tok-globex").await;
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
        // The operator, by its token: the local tenant's engine may not clear.
        let ch = kvtier_client::connect_with(&d.target(), &token("tok-admin"))
            .await
            .unwrap();
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
        let mut n = as_tenant(&tcp, "tok-default").await;
        let sn = n.register("no-tenant", &spec).await.unwrap();
        assert_eq!(n.lookup_tiers(sn.id, &keys, true).await.unwrap(), (0, 0));
        // Nor by naming the keys acme's are stored under (the scope is a public function):
        // the default tenant's keys are scoped too, so they never land on another's.
        let mut forged = keys.clone();
        kvtier_core::TenantScope::new("acme").apply_all(&mut forged);
        assert_eq!(
            n.lookup_tiers(sn.id, &forged, true).await.unwrap(),
            (0, 0),
            "the default tenant reads acme's pages by their scoped keys"
        );

        // A tenant's view: its own sessions, usage and pools only.
        let own = u.stats().await.unwrap();
        assert!(
            own.sessions.iter().all(|s| s.tenant == "local") && !own.sessions.is_empty(),
            "{:?}",
            own.sessions
        );
        assert!(
            own.tenants.iter().all(|t| t.tenant == "local"),
            "{:?}",
            own.tenants
        );
        let samples = watch_once(&d.target(), None).await;
        assert!(
            !samples.iter().any(|s| s
                .labels
                .iter()
                .any(|l| l.name == "tenant" && l.value != "local")),
            "the local tenant watched another tenant's series"
        );
        let all = watch_once(&d.target(), Some("tok-admin")).await;
        assert!(all.iter().any(|s| {
            s.labels
                .iter()
                .any(|l| l.name == "tenant" && l.value == "acme")
        }));
        // The operator's view (kvtierctl): each session with its tenant.
        let stats = HostClient::connect_with(&d.target(), &token("tok-admin"))
            .await
            .unwrap()
            .stats()
            .await
            .unwrap();
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

/// One WatchMetrics snapshot from `target`, as the operator with `admin` or as this
/// process's own role without.
async fn watch_once(target: &str, admin: Option<&str>) -> Vec<v1::MetricSample> {
    let sec = admin.map(token).unwrap_or_default();
    let ch = kvtier_client::connect_with(target, &sec).await.unwrap();
    let mut stream = kvtier_proto::v1::host_tier_client::HostTierClient::new(ch)
        .watch_metrics(v1::WatchMetricsRequest { interval_ms: 100 })
        .await
        .unwrap()
        .into_inner();
    stream.message().await.unwrap().unwrap().samples
}

/// Writes the pages `keys` through `store` (which waits for room) on a connection of its own.
async fn store_on(tcp: String, tok: &'static str, name: String, keys: Vec<kvtier_core::PageKey>) {
    let mut c = HostClient::connect_with(&tcp, &token(tok)).await.unwrap();
    let s = c.register(&name, &layout("quota")).await.unwrap();
    store(&mut c, &s, &keys).await;
}

#[test]
fn a_tenant_at_its_quotas_evicts_only_its_own_pages_in_l2_and_l3() {
    let spec = layout("quota");
    let obj = kvtier_core::Layout::new(spec.clone()).unwrap().page_bytes() as u64 + 72;
    let d = start(
        "tenant-quota",
        &format!(
            "[metrics]\ntenant_series = true\n\n\
             [tenants.acme]\ntoken = \"tok-acme\"\nl2_pages = 8\nl3_bytes = {}\n\n\
             [tenants.globex]\ntoken = \"tok-globex\"\n",
            10 * obj
        ),
    );
    let tcp = format!("http://{}", d.tcp);
    // Acme writes 4 sequences of 8 pages and globex 2, all at once, each on its own
    // connection: 48 pages into a pool of 64, so only acme's quota can evict anything.
    let acme: Vec<Vec<_>> = (10..14).map(|s| chain(s, 8)).collect();
    let globex: Vec<Vec<_>> = (20..22).map(|s| chain(s, 8)).collect();
    rt().block_on(async {
        let mut tasks = Vec::new();
        for (i, k) in acme.iter().enumerate() {
            let f = store_on(tcp.clone(), "tok-acme", format!("acme-{i}"), k.clone());
            tasks.push(tokio::spawn(f));
        }
        for (i, k) in globex.iter().enumerate() {
            let f = store_on(tcp.clone(), "tok-globex", format!("globex-{i}"), k.clone());
            tasks.push(tokio::spawn(f));
        }
        for t in tasks {
            t.await.unwrap();
        }
    });
    let usage = |t: &str| -> v1::TenantUsage {
        rt().block_on(async {
            let mut c = HostClient::connect(&d.target()).await.unwrap();
            let s = c.stats().await.unwrap();
            s.tenants.into_iter().find(|u| u.tenant == t).unwrap()
        })
    };
    // L3 settles once the writer has written (and the quota trimmed) every page.
    eventually(
        "acme's L3 objects within quota",
        Duration::from_secs(30),
        || {
            let a = usage("acme");
            a.l3_bytes <= 10 * obj && a.l3_quota_evictions >= 22 && usage("globex").l3_objects == 16
        },
    );
    let a = usage("acme");
    assert!(a.l2_pages <= 8, "acme holds {} L2 pages", a.l2_pages);
    assert!(a.l2_quota_evictions >= 24, "{a:?}");
    assert_eq!((a.l2_quota_pages, a.l3_quota_bytes), (8, 10 * obj));
    let g = usage("globex");
    assert_eq!((g.l2_pages, g.l2_quota_evictions), (16, 0), "{g:?}");
    assert_eq!(
        (g.l3_objects, g.l3_bytes, g.l3_quota_evictions),
        (16, 16 * obj, 0)
    );
    assert_eq!(usage("").l2_pages, 0);
    // Every globex page is still in L2, byte for byte.
    rt().block_on(async {
        let mut c = as_tenant(&tcp, "tok-globex").await;
        let s = c.register("globex-reader", &spec).await.unwrap();
        for k in &globex {
            let want: Vec<_> = k
                .iter()
                .map(|k| page_bytes(k, s.layout.page_bytes()))
                .collect();
            assert_eq!(read(&mut c, &s, k).await, want);
        }
    });
    // The operator's views: kvtierctl status and the metrics.
    let out = kvtier_ctl::status(kvtier_ctl::StatusArgs { socket: d.target() }).unwrap();
    let line = out
        .lines()
        .find(|l| l.trim_start().starts_with("acme"))
        .unwrap();
    assert!(
        line.contains("quota 8 per pool") && line.contains("MiB"),
        "{out}"
    );
    assert!(out.contains("(default)") && out.contains("globex"), "{out}");
    let m = d.metrics();
    let documented: Vec<&str> = include_str!("../../../docs/metrics.md")
        .lines()
        .filter_map(|l| l.strip_prefix("| `")?.split('`').next())
        .filter(|n| n.starts_with("kvtier_tenant_"))
        .collect();
    assert_eq!(documented.len(), 6, "{documented:?}");
    for name in documented {
        assert!(
            m.contains(&format!("{name}{{")),
            "{name} missing from /metrics"
        );
    }
    assert_eq!(
        metric(&m, "kvtier_tenant_l3_quota_bytes{tenant=\"acme\"}"),
        (10 * obj) as f64
    );
    assert!(metric(&m, "kvtier_tenant_l2_pages{tenant=\"acme\"}") <= 8.0);
    assert_eq!(
        metric(&m, "kvtier_tenant_l2_pages{tenant=\"globex\"}"),
        16.0
    );
    assert_eq!(
        metric(&m, "kvtier_tenant_l2_quota_pages{tenant=\"acme\"}"),
        8.0
    );
    assert!(
        metric(
            &m,
            "kvtier_tenant_l2_quota_pages_total{outcome=\"evicted\",tenant=\"acme\"}"
        ) >= 24.0,
        "{m}"
    );
    assert_eq!(
        metric(&m, "kvtier_tenant_l3_bytes{tenant=\"globex\"}"),
        (16 * obj) as f64
    );
    assert!(
        metric(
            &m,
            "kvtier_tenant_l3_quota_evictions_total{tenant=\"acme\"}"
        ) >= 22.0
    );
}

/// A daemon with tenants acme and globex, by token, and its TCP address.
fn acme_and_globex(name: &str) -> (Daemon, String) {
    let d = start(
        name,
        "[tenants.acme]\ntoken = \"tok-acme\"\n\n[tenants.globex]\ntoken = \"tok-globex\"\n",
    );
    let tcp = format!("http://{}", d.tcp);
    (d, tcp)
}

#[test]
fn a_tenant_that_reserves_and_never_commits_cannot_block_the_others() {
    // 64 slots, a dirty limit of 32 (l2.dirty_fraction 0.5): each session, and each tenant,
    // may hold 16 reserved (l2.reserve_share 0.5).
    let (_d, tcp) = acme_and_globex("tenant-reserve");
    let spec = layout("reserve");
    rt().block_on(async {
        let reserved = |r: Vec<kvtier_client::Reserved>| {
            r.iter()
                .filter(|x| matches!(x, kvtier_client::Reserved::Slot(_)))
                .count()
        };
        let mut a = as_tenant(&tcp, "tok-acme").await;
        let sa = a.register("hog", &spec).await.unwrap();
        // Acme asks for the whole pool and never commits.
        let got = reserved(a.reserve(sa.id, None, &chain(1, 64)).await.unwrap());
        assert_eq!(got, 16, "one session's open reservations");
        let sa2 = a.register("hog-2", &spec).await.unwrap();
        let got = reserved(a.reserve(sa2.id, None, &chain(2, 8)).await.unwrap());
        assert_eq!(got, 0, "acme's second session is within acme's budget too");
        // Globex and the default tenant still write.
        let mut g = as_tenant(&tcp, "tok-globex").await;
        let sg = g.register("writer", &spec).await.unwrap();
        let keys = chain(3, 12);
        let got = reserved(g.reserve(sg.id, None, &keys).await.unwrap());
        assert_eq!(got, 12, "globex was blocked by acme's open reservations");
        g.commit(sg.id, &keys).await.unwrap();
        let mut n = as_tenant(&tcp, "tok-default").await;
        let sn = n.register("writer", &spec).await.unwrap();
        assert_eq!(
            reserved(n.reserve(sn.id, None, &chain(4, 4)).await.unwrap()),
            4
        );
        // Acme committing (or its session ending) gives its budget back.
        a.close(sa.id).await.unwrap();
        let got = reserved(a.reserve(sa2.id, None, &chain(2, 8)).await.unwrap());
        assert_eq!(got, 8, "acme's budget did not come back with its session");
    });
}

/// Issue 62: with shared pools (`l2.tenant_pools = false`), slots a tenant's sessions had
/// leased (for copies they land later) were not counted in its share: one tenant leased the
/// whole dirty limit, and another's reservations found no space. Every slot a session holds,
/// reserved or leased, now counts against its tenant's share.
#[test]
fn leased_slots_count_in_a_tenants_share() {
    // 64 slots, a dirty limit of 32: each tenant may hold 16, reserved or leased; a session
    // leases at most one slot per 64 of the pool.
    let d = start(
        "tenant-lease",
        "[l2]\ntenant_pools = false\n\n[tenants.acme]\ntoken = \"tok-acme\"\n\n\
         [tenants.globex]\ntoken = \"tok-globex\"\n",
    );
    let tcp = format!("http://{}", d.tcp);
    let spec = layout("leases");
    rt().block_on(async {
        let mut a = as_tenant(&tcp, "tok-acme").await;
        let mut leased = 0;
        let mut sessions = Vec::new();
        for i in 0..40 {
            let s = a.register(&format!("hoarder-{i}"), &spec).await.unwrap();
            leased += a.commit_leasing(s.id, &[], 16).await.unwrap().len();
            sessions.push(s);
        }
        assert_eq!(leased, 16, "acme leased past its share");
        let mut g = as_tenant(&tcp, "tok-globex").await;
        let sg = g.register("writer", &spec).await.unwrap();
        let keys = chain(3, 12);
        let got = g.reserve(sg.id, None, &keys).await.unwrap();
        let slots = got
            .iter()
            .filter(|x| matches!(x, kvtier_client::Reserved::Slot(_)))
            .count();
        assert_eq!(slots, 12, "globex was blocked by acme's leases: {got:?}");
        g.commit(sg.id, &keys).await.unwrap();
        drop(sessions);
    });
}

/// Issue 62: `l2.max_pools` is global, and a tenant that kept 8 layouts alive made every
/// other tenant's first registration fail. A named tenant's own pools are held to a share
/// (`l2.max_pools_per_tenant`; by default max_pools / (tenants + 1)): past it the tenant's
/// own idle pool gives its place, or the tenant is refused, and the others still register.
#[test]
fn a_tenant_cannot_keep_every_pool_place() {
    // 6 places, two tenants: 2 each by default.
    let d = start(
        "tenant-pools-share",
        "[l2]\nmax_pools = 6\nidle_pool_ttl = \"0s\"\n\n[tenants.acme]\ntoken = \"tok-acme\"\n\n\
         [tenants.globex]\ntoken = \"tok-globex\"\n",
    );
    let tcp = format!("http://{}", d.tcp);
    rt().block_on(async {
        let mut a = as_tenant(&tcp, "tok-acme").await;
        let held = [
            a.register("a0", &layout("acme-0")).await.unwrap(),
            a.register("a1", &layout("acme-1")).await.unwrap(),
        ];
        // Both in use: a third layout of acme's is refused, naming the share.
        let e = a.register("a2", &layout("acme-2")).await.unwrap_err();
        assert_eq!(e.code(), Some(tonic::Code::ResourceExhausted), "{e}");
        assert!(e.to_string().contains("max_pools_per_tenant"), "{e}");
        // Globex's first registrations are not.
        let mut g = as_tenant(&tcp, "tok-globex").await;
        g.register("g0", &layout("globex-0")).await.unwrap();
        g.register("g1", &layout("globex-1")).await.unwrap();
        // One of acme's pools idle: its new layout takes that place.
        a.close(held[0].id).await.unwrap();
        a.register("a2", &layout("acme-2")).await.unwrap();
    });
}

/// Issue 62: `/metrics` showed every tenant's name and usage to whoever could connect, the
/// manifests bound it to every address, and `--check-config` took that with tenants named.
/// Now the tenant series are shown only with `metrics.tenant_series`, an endpoint that shows
/// them off loopback needs `metrics.token`, and a token, when set, is asked of every scrape.
#[test]
fn metrics_show_tenants_only_when_asked_and_a_token_guards_the_endpoint() {
    let tenants = "[tenants.acme]\ntoken = \"tok-acme\"\n";
    // Off by default: no tenant's series.
    let d = start("metrics-quiet", tenants);
    let page = d.metrics();
    assert!(page.contains("kvtier_l2_pools"), "{page}");
    assert!(
        !page.contains("kvtier_tenant_"),
        "tenant series shown by default"
    );
    drop(d);
    // With a token: 401 without it or with another, the page with it.
    let d = start(
        "metrics-token",
        &format!("[metrics]\ntenant_series = true\ntoken = \"scrape-me\"\n\n{tenants}"),
    );
    let addr = d.metrics_url.strip_prefix("http://").unwrap();
    let (addr, _) = addr.split_once('/').unwrap();
    let get = |auth: Option<&str>| {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        let header = auth.map_or(String::new(), |a| format!("Authorization: Bearer {a}\r\n"));
        write!(s, "GET /metrics HTTP/1.0\r\nHost: {addr}\r\n{header}\r\n").unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    };
    assert!(get(None).starts_with("HTTP/1.0 401"), "{}", get(None));
    assert!(get(Some("guess")).starts_with("HTTP/1.0 401"));
    let page = get(Some("scrape-me"));
    assert!(page.starts_with("HTTP/1.0 200"), "{page}");
    assert!(
        page.contains("kvtier_tenant_l2_pages{tenant=\"acme\"}"),
        "{page}"
    );
    assert!(
        page.contains("kvtier_metrics_unauthorized_total 2"),
        "{page}"
    );
    drop(d);
    // Off loopback with the tenant series and no token: refused by --check-config, by name.
    let dir =
        std::env::temp_dir().join(format!("kvtierd-test-{}-metrics-open", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("kvtierd.toml"), tenants).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvtierd"))
        .current_dir(&dir)
        .args(["--config", "kvtierd.toml"])
        .args([
            "--set",
            "metrics.listen=0.0.0.0:9464",
            "--set",
            "metrics.tenant_series=true",
        ])
        .arg("--check-config")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("metrics.listen") && err.contains("metrics.token"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The pages a WatchEvents stream says are held, once it has been quiet for a while.
async fn watched(c: &mut HostClient) -> std::collections::BTreeSet<kvtier_core::PageKey> {
    use kvtier_core::events::EventKind;
    let mut w = c.watch_events(0, 0).await.unwrap();
    let mut held = std::collections::BTreeSet::new();
    while let Ok(Some(b)) = tokio::time::timeout(Duration::from_millis(300), w.next())
        .await
        .map(|r| r.unwrap())
    {
        for e in b.events {
            match e.kind {
                EventKind::Stored { key, .. } => {
                    held.insert(key);
                }
                EventKind::Removed { key } => {
                    held.remove(&key);
                }
                EventKind::Cleared { .. } | EventKind::Resync => held.clear(),
            }
        }
    }
    held
}

#[test]
fn a_tenant_watches_only_its_own_pages_and_the_operator_all() {
    let (_d, tcp) = acme_and_globex("tenant-events");
    let spec = layout("tenant-events");
    rt().block_on(async {
        let mut a = as_tenant(&tcp, "tok-acme").await;
        let mut g = as_tenant(&tcp, "tok-globex").await;
        let (sa, sg) = (
            a.register("acme-worker", &spec).await.unwrap(),
            g.register("globex-worker", &spec).await.unwrap(),
        );
        let len = sa.layout.page_bytes();
        let (ka, kg) = (chain(5, 4), chain(6, 3));
        let bytes = |n: usize| {
            (0..n as u64)
                .map(|i| seeded_bytes(i, len))
                .collect::<Vec<_>>()
        };
        write(&mut a, &sa, &ka, &bytes(4)).await;
        write(&mut g, &sg, &kg, &bytes(3)).await;
        // Each tenant hears of its own pages, by the keys kvtierd holds them under.
        let scoped = |t: &str, keys: &[kvtier_core::PageKey]| {
            let mut k = keys.to_vec();
            kvtier_core::TenantScope::new(t).apply_all(&mut k);
            k.into_iter().collect::<std::collections::BTreeSet<_>>()
        };
        assert_eq!(watched(&mut a).await, scoped("acme", &ka));
        assert_eq!(watched(&mut g).await, scoped("globex", &kg));
        // The operator hears of every page.
        let mut op = as_tenant(&tcp, "tok-admin").await;
        let all = watched(&mut op).await;
        assert_eq!(all.len(), 7);
        assert!(all.is_superset(&scoped("acme", &ka)) && all.is_superset(&scoped("globex", &kg)));

        // Acme's stream numbers acme's events itself: globex's writes between them leave no
        // gap to count, and its stream id is not the node's.
        let mut w = a.watch_events(0, 0).await.unwrap();
        let mut node = op.watch_events(0, 0).await.unwrap();
        let first = w.next().await.unwrap().unwrap();
        let node_id = node.next().await.unwrap().unwrap().stream_id;
        assert_ne!(first.stream_id, node_id);
        write(&mut g, &sg, &chain(7, 3), &bytes(3)).await;
        write(&mut a, &sa, &chain(8, 2), &bytes(2)).await;
        write(&mut g, &sg, &chain(9, 2), &bytes(2)).await;
        write(&mut a, &sa, &chain(10, 1), &bytes(1)).await;
        // Its 3 pages, each as L2 and (written through) L3 events: 6, numbered 1 to 6.
        let mut seqs: Vec<u64> = first.events.iter().map(|e| e.seq).collect();
        while let Ok(Some(b)) = tokio::time::timeout(Duration::from_millis(500), w.next())
            .await
            .map(|r| r.unwrap())
        {
            seqs.extend(b.events.iter().map(|e| e.seq));
        }
        let live: Vec<u64> = seqs.into_iter().filter(|s| *s > 0).collect();
        assert_eq!(
            live,
            (1..=6).collect::<Vec<_>>(),
            "acme's own numbers, one after another"
        );
    });
}

/// The CLEARED events a stream sends within `wait`: (layout, tenant tag) of each.
async fn clears_within(
    w: &mut kvtier_client::EventStream,
    wait: Duration,
) -> Vec<Option<kvtier_core::TenantTag>> {
    use kvtier_core::events::EventKind;
    let mut out = Vec::new();
    let until = tokio::time::Instant::now() + wait;
    while let Ok(Some(b)) = tokio::time::timeout_at(until, w.next())
        .await
        .map(|r| r.unwrap())
    {
        for e in b.events {
            if let EventKind::Cleared { tenant } = e.kind {
                out.push(tenant);
            }
        }
    }
    out
}

#[test]
fn a_tenants_own_pool_going_clears_its_pages_alone_in_every_stream() {
    // Review finding: globex's own pool going idle (or damaged) published a CLEARED of the
    // whole layout, which acme's stream showed too: acme's router forgot pages acme still
    // had, at globex's will.
    let (_d, tcp) = {
        let d = start(
            "tenant-clears",
            "[l2]\nidle_pool_ttl = \"50ms\"\n\n[sessions]\nttl = \"2s\"\n\n\
             [tenants.acme]\ntoken = \"tok-acme\"\n\n[tenants.globex]\ntoken = \"tok-globex\"\n",
        );
        let tcp = format!("http://{}", d.tcp);
        (d, tcp)
    };
    let spec = layout("tenant-clears");
    rt().block_on(async {
        let mut a = as_tenant(&tcp, "tok-acme").await;
        let mut g = as_tenant(&tcp, "tok-globex").await;
        let mut op = as_tenant(&tcp, "tok-admin").await;
        let sa = a.register("acme-worker", &spec).await.unwrap();
        let len = sa.layout.page_bytes();
        write(
            &mut a,
            &sa,
            &chain(11, 3),
            &[
                seeded_bytes(1, len),
                seeded_bytes(2, len),
                seeded_bytes(3, len),
            ],
        )
        .await;
        let mut wa = a.watch_events(0, 0).await.unwrap();
        let mut wo = op.watch_events(0, 0).await.unwrap();
        // Their snapshots first.
        clears_within(&mut wa, Duration::from_millis(300)).await;
        clears_within(&mut wo, Duration::from_millis(300)).await;
        let sg = g.register("globex-worker", &spec).await.unwrap();
        write(&mut g, &sg, &chain(12, 1), &[seeded_bytes(4, len)]).await;
        g.close(sg.id).await.unwrap();
        a.heartbeat(sa.id).await.unwrap();
        let globex = kvtier_core::TenantScope::new("globex").tag();
        let op_clears = clears_within(&mut wo, Duration::from_millis(1500)).await;
        assert_eq!(
            op_clears,
            [Some(globex)],
            "the operator hears globex's pool went"
        );
        assert!(
            clears_within(&mut wa, Duration::from_millis(200))
                .await
                .is_empty(),
            "acme's stream showed globex's pool going"
        );
        // Acme's pages are all still there.
        assert_eq!(a.lookup(sa.id, &chain(11, 3)).await.unwrap(), 3);
        // The layout's own pool holds only the default tenant's pages while named tenants
        // have pools of their own: its going is the default tenant's clear (second review).
        let mut n = as_tenant(&tcp, "tok-default").await;
        let sn = n.register("default-worker", &spec).await.unwrap();
        write(&mut n, &sn, &chain(13, 1), &[seeded_bytes(5, len)]).await;
        n.close(sn.id).await.unwrap();
        a.heartbeat(sa.id).await.unwrap();
        let default = kvtier_core::TenantScope::new("").tag();
        let op_clears = clears_within(&mut wo, Duration::from_millis(1500)).await;
        assert_eq!(op_clears, [Some(default)], "the default tenant's pool went");
        assert!(
            clears_within(&mut wa, Duration::from_millis(200))
                .await
                .is_empty(),
            "acme's stream showed the default tenant's pool going"
        );
        assert_eq!(a.lookup(sa.id, &chain(11, 3)).await.unwrap(), 3);
    });
}
