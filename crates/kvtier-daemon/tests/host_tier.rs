//! kvtierd's host tier end to end: a real daemon process, real client processes, real shared
//! memory and sockets.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::*;
use fnv::digest;
use kvtier_client::{HostClient, Reserved};
use kvtier_core::PageKey;
use kvtier_proto::v1;

/// A dependency-free digest of pages (FNV-1a over all bytes), to compare across processes.
mod fnv {
    pub(crate) fn digest(chunks: &[Vec<u8>]) -> u64 {
        let mut h = 0xcbf2_9ce4_8422_2325u64;
        for c in chunks {
            for &b in c {
                h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
            }
        }
        h
    }
}

/// Asserts a request failed with `code` and a message containing `needle`.
fn check<T: std::fmt::Debug>(
    r: Result<tonic::Response<T>, tonic::Status>,
    code: tonic::Code,
    needle: &str,
) {
    let e = r.expect_err("the request should be refused");
    assert_eq!(e.code(), code, "{}", e.message());
    assert!(
        e.message().contains(needle),
        "{:?} lacks {needle:?}",
        e.message()
    );
}

/// Acquires `keys`, copies the pages out, releases (the client's page protocol); returns
/// the bytes read.
async fn load(c: &mut HostClient, s: &kvtier_client::Session, keys: &[PageKey]) -> Vec<Vec<u8>> {
    let slots = c.acquire(s.id, keys).await.unwrap();
    let page = s.layout.page_bytes();
    let mut out = Vec::new();
    c.load_pages(
        s.id,
        &keys[..slots.len()],
        &slots,
        Duration::from_secs(10),
        |slots| {
            let out = &mut out;
            async move {
                for slot in slots {
                    let mut b = vec![0u8; page];
                    s.pool.read(slot, 0, &mut b)?;
                    out.push(b);
                }
                Ok::<_, kvtier_shm::ShmError>(())
            }
        },
    )
    .await
    .unwrap();
    out
}

/// The child side of the multi-process tests. Does nothing unless started by `spawn_child`.
#[test]
#[ignore = "runs only as a child process of the other tests"]
fn child_entry() {
    let Ok(role) = std::env::var("KVT_CHILD_ROLE") else {
        return;
    };
    let socket = std::env::var("KVT_CHILD_SOCKET").unwrap();
    rt().block_on(async move {
        let mut c = HostClient::connect(&socket).await.unwrap();
        let s = c
            .register(&format!("child-{role}"), &layout("m"))
            .await
            .unwrap();
        match role.as_str() {
            "reader" => {
                let keys = chain(1, 64);
                let bytes = load(&mut c, &s, &keys).await;
                println!("RESULT pages={} digest={}", bytes.len(), digest(&bytes));
                c.close(s.id).await.unwrap();
            }
            "holder" => {
                let keys = chain(2, 8);
                store(&mut c, &s, &keys).await;
                let pinned = c.acquire(s.id, &keys).await.unwrap();
                let reserved = c.reserve(s.id, Some(&keys[7]), &chain(3, 4)).await.unwrap();
                println!(
                    "RESULT holding pins={} reserved={}",
                    pinned.len(),
                    reserved
                        .iter()
                        .filter(|r| matches!(r, Reserved::Slot(_)))
                        .count()
                );
                // Hold everything until killed.
                tokio::time::sleep(Duration::from_secs(600)).await;
            }
            other => panic!("unknown role {other}"),
        }
    });
}

#[test]
fn two_processes_share_pages_and_nothing_is_visible_before_commit() {
    let d = Daemon::start("share", &["l2.pool_pages=128"]);
    let reader = |d: &Daemon| {
        let (mut child, rx) = spawn_child("reader", &d.socket, &[]);
        let line = wait_line(&rx, "RESULT", Duration::from_secs(30));
        assert!(child.wait().unwrap().success());
        line
    };
    rt().block_on(async {
        let mut c = HostClient::connect(&d.target()).await.unwrap();
        let s = c.register("writer", &layout("m")).await.unwrap();
        let keys = chain(1, 64);
        // Reserve and write, but do not commit: another process sees nothing.
        let r = c.reserve(s.id, None, &keys).await.unwrap();
        let mut written = Vec::new();
        for (k, r) in keys.iter().zip(&r) {
            let Reserved::Slot(slot) = r else {
                panic!("{r:?}")
            };
            let b = page_bytes(k, s.layout.page_bytes());
            s.pool.write(*slot, 0, &b).unwrap();
            written.push(b);
        }
        assert_eq!(reader(&d), "RESULT pages=0 digest=14695981039346656037");
        assert_eq!(c.lookup(s.id, &keys).await.unwrap(), 0);
        c.commit(s.id, &keys).await.unwrap();
        // After commit the other process reads exactly the bytes written.
        assert_eq!(
            reader(&d),
            format!("RESULT pages=64 digest={}", digest(&written))
        );
        // A second writer of the same pages is told they are present (cross-worker dedup).
        let s2 = c.register("writer-2", &layout("m")).await.unwrap();
        let again = c.reserve(s2.id, None, &keys).await.unwrap();
        assert!(again.iter().all(|r| *r == Reserved::Present));
        let stats = c.stats().await.unwrap();
        assert_eq!(stats.dedup_pages, 64);
        assert_eq!(stats.pools.len(), 1);
        assert_eq!(stats.pools[0].ready_pages, 64);
    });
}

#[test]
fn the_client_page_protocol_aborts_a_failed_copy_and_keeps_only_released_reads() {
    use kvtier_client::PageError;
    let d = Daemon::start("protocol", &["l2.pool_pages=16"]);
    rt().block_on(async {
        let mut c = HostClient::connect(&d.target()).await.unwrap();
        let s = c.register("writer", &layout("m")).await.unwrap();
        let keys = chain(7, 8);
        let t = Duration::from_secs(10);
        let (pool, ks, page) = (&s.pool, &keys, s.layout.page_bytes());
        // A copy that fails half-way: its reservations are aborted, so nothing is visible
        // and the slots are free for the next writer, not held until the lease ends.
        let r = c
            .store_pages(s.id, None, &keys, t, |mine| async move {
                assert_eq!(mine.len(), 8, "every page gets a slot");
                pool.write(mine[0].1, 0, b"half").unwrap();
                Err("the device went away")
            })
            .await;
        assert!(
            matches!(r, Err(PageError::Copy("the device went away"))),
            "{r:?}"
        );
        assert_eq!(c.lookup(s.id, &keys).await.unwrap(), 0);
        let stats = c.stats().await.unwrap();
        assert_eq!(stats.pools[0].writing_pages, 0, "{stats:?}");
        // Stored for real: held counts every page, copied those this call wrote.
        store(&mut c, &s, &keys[..4]).await;
        let r = c
            .store_pages(s.id, None, &keys, t, |mine| async move {
                for (i, slot) in mine {
                    pool.write(slot, 0, &page_bytes(&ks[i], page)).unwrap();
                }
                Ok::<_, ()>(())
            })
            .await
            .unwrap();
        assert_eq!((r.held, r.copied), (8, 4));
        assert_eq!(load(&mut c, &s, &keys).await.len(), 8);
        // A read whose release fails is not to be kept: the pins may have been lost (here,
        // released already), and the error says so.
        let slots = c.acquire(s.id, &keys).await.unwrap();
        c.release(s.id, &keys).await.unwrap();
        let s2 = c.register("gone", &layout("m")).await.unwrap();
        c.close(s2.id).await.unwrap();
        let r = c
            .load_pages(s2.id, &keys, &slots, t, |_| async { Ok::<_, ()>(()) })
            .await;
        assert!(matches!(r, Err(PageError::Daemon(_))), "{r:?}");
    });
}

#[test]
fn killed_client_loses_pins_and_reservations_within_ttl() {
    // No L3: its writer pins pages while copying them, which would blur the pin counts here.
    let d = Daemon::start(
        "kill",
        &["l2.pool_pages=64", "sessions.ttl=500ms", "l3.backend=none"],
    );
    let (mut child, rx) = spawn_child("holder", &d.socket, &[]);
    let line = wait_line(&rx, "RESULT", Duration::from_secs(30));
    assert_eq!(line, "RESULT holding pins=8 reserved=4");
    let m = d.metrics();
    assert_eq!(metric(&m, "kvtier_l2_pins"), 8.0);
    assert_eq!(metric(&m, "kvtier_l2_pool_pages{state=\"writing\"}"), 4.0);
    assert_eq!(metric(&m, "kvtier_l2_sessions"), 1.0);
    signal(child.id(), libc::SIGKILL);
    child.wait().unwrap();
    eventually(
        "the dead session's lease to expire",
        Duration::from_secs(10),
        || {
            let m = d.metrics();
            metric(&m, "kvtier_l2_sessions") == 0.0
        },
    );
    let m = d.metrics();
    assert_eq!(metric(&m, "kvtier_l2_pins"), 0.0);
    assert_eq!(metric(&m, "kvtier_l2_pinned_pages"), 0.0);
    assert_eq!(metric(&m, "kvtier_l2_pool_pages{state=\"writing\"}"), 0.0);
    // Committed pages survive their writer; the reserved slots are free again.
    assert_eq!(metric(&m, "kvtier_l2_pool_pages{state=\"ready\"}"), 8.0);
    assert_eq!(metric(&m, "kvtier_l2_pool_pages{state=\"free\"}"), 56.0);
    assert_eq!(metric(&m, "kvtier_l2_expired_sessions_total"), 1.0);
    assert_eq!(metric(&m, "kvtier_l2_dropped_pins_total"), 8.0);
    assert_eq!(metric(&m, "kvtier_l2_dropped_reservations_total"), 4.0);
}

#[test]
fn eviction_honours_pins_under_every_policy_and_layouts_stay_apart() {
    for policy in ["lru", "lfu", "fifo", "mru", "filo", "priority", "slru"] {
        let d = Daemon::start(
            &format!("evict-{policy}"),
            // No L3: pages pinned by its writer would change what eviction may take.
            &[
                "l2.pool_pages=8",
                &format!("l2.eviction_policy={policy}"),
                "l3.backend=none",
            ],
        );
        rt().block_on(async {
            let mut c = HostClient::connect(&d.target()).await.unwrap();
            let s = c.register("w", &layout("m")).await.unwrap();
            let (a, b, fresh) = (chain(10, 4), chain(11, 4), chain(12, 4));
            let a_bytes = store(&mut c, &s, &a).await;
            store(&mut c, &s, &b).await;
            // Pin chain a; the pool is full, so storing a new chain must evict all of b.
            assert_eq!(c.acquire(s.id, &a).await.unwrap().len(), 4);
            store(&mut c, &s, &fresh).await;
            assert_eq!(
                c.lookup(s.id, &a).await.unwrap(),
                4,
                "{policy}: pinned chain evicted"
            );
            assert_eq!(c.lookup(s.id, &b).await.unwrap(), 0, "{policy}");
            assert_eq!(c.lookup(s.id, &fresh).await.unwrap(), 4, "{policy}");
            // With everything pinned or being written, a reserve finds no space, and says so.
            assert_eq!(c.acquire(s.id, &fresh).await.unwrap().len(), 4);
            let r = c.reserve(s.id, None, &chain(13, 2)).await.unwrap();
            assert_eq!(r, vec![Reserved::NoSpace; 2], "{policy}");
            c.release(s.id, &a).await.unwrap();
            assert_eq!(
                load(&mut c, &s, &a).await,
                a_bytes,
                "{policy}: bytes changed"
            );

            // Another layout gets its own pool: the same keys are new there.
            let other = c.register("w2", &layout("other-model")).await.unwrap();
            assert_ne!(other.pool_path, s.pool_path);
            assert_eq!(c.lookup(other.id, &a).await.unwrap(), 0);
            let r = c.reserve(other.id, None, &a).await.unwrap();
            assert!(
                r.iter().all(|r| matches!(r, Reserved::Slot(_))),
                "{policy}: {r:?}"
            );
            assert_eq!(c.stats().await.unwrap().pools.len(), 2);
        });
    }
}

#[test]
fn bad_requests_are_refused_by_name_and_lose_nothing() {
    let d = Daemon::start("bad", &["l2.pool_pages=32", "server.max_batch=16"]);
    rt().block_on(async {
        let mut c = HostClient::connect(&d.target()).await.unwrap();
        let s = c.register("w", &layout("m")).await.unwrap();
        let keys = chain(20, 8);
        let bytes = store(&mut c, &s, &keys).await;
        let before = c.stats().await.unwrap();

        let short = vec![keys[0].0.to_vec(), vec![7u8; 31]];
        let raw = c.raw();
        use tonic::Code::{FailedPrecondition, InvalidArgument, NotFound};
        check(
            raw.lookup(v1::LookupRequest {
                packed_keys: Vec::new(),
                session_id: s.id.to_bytes().to_vec(),
                keys: short.clone(),
                include_storage: false,
                each_key: false,
            })
            .await,
            InvalidArgument,
            "keys[1]",
        );
        check(
            raw.reserve(v1::ReserveRequest {
                packed_keys: Vec::new(),
                session_id: s.id.to_bytes().to_vec(),
                keys: short.clone(),
                parent: vec![],
            })
            .await,
            InvalidArgument,
            "keys[1]",
        );
        // Packed keys: a length that is not a whole number of keys, and both forms at once.
        let mut packed = kvtier_proto::pack_keys(&keys[..2]);
        packed.pop();
        check(
            raw.acquire(v1::AcquireRequest {
                session_id: s.id.to_bytes().to_vec(),
                keys: vec![],
                packed_keys: packed,
            })
            .await,
            InvalidArgument,
            "packed_keys: 63 bytes",
        );
        check(
            raw.commit(v1::CommitRequest {
                session_id: s.id.to_bytes().to_vec(),
                keys: vec![keys[0].0.to_vec()],
                packed_keys: kvtier_proto::pack_keys(&keys[..1]),
                lease_want: 0,
            })
            .await,
            InvalidArgument,
            "not both",
        );
        check(
            raw.reserve(v1::ReserveRequest {
                packed_keys: Vec::new(),
                session_id: s.id.to_bytes().to_vec(),
                keys: vec![],
                parent: vec![1; 5],
            })
            .await,
            InvalidArgument,
            "parent",
        );
        check(
            raw.commit(v1::CommitRequest {
                packed_keys: Vec::new(),
                session_id: s.id.to_bytes().to_vec(),
                keys: short.clone(),
                lease_want: 0,
            })
            .await,
            InvalidArgument,
            "keys[1]",
        );
        check(
            raw.acquire(v1::AcquireRequest {
                packed_keys: Vec::new(),
                session_id: s.id.to_bytes().to_vec(),
                keys: short.clone(),
            })
            .await,
            InvalidArgument,
            "keys[1]",
        );
        check(
            raw.release(v1::ReleaseRequest {
                packed_keys: Vec::new(),
                session_id: s.id.to_bytes().to_vec(),
                keys: short,
            })
            .await,
            InvalidArgument,
            "keys[1]",
        );
        let many: Vec<Vec<u8>> = chain(21, 17).iter().map(|k| k.0.to_vec()).collect();
        check(
            raw.lookup(v1::LookupRequest {
                packed_keys: Vec::new(),
                session_id: s.id.to_bytes().to_vec(),
                keys: many,
                include_storage: false,
                each_key: false,
            })
            .await,
            InvalidArgument,
            "server.max_batch",
        );
        // Committing what was never reserved, releasing what is not pinned.
        let k0 = vec![keys[0].0.to_vec()];
        check(
            raw.commit(v1::CommitRequest {
                packed_keys: Vec::new(),
                session_id: s.id.to_bytes().to_vec(),
                keys: k0.clone(),
                lease_want: 0,
            })
            .await,
            InvalidArgument,
            "not reserved",
        );
        check(
            raw.release(v1::ReleaseRequest {
                packed_keys: Vec::new(),
                session_id: s.id.to_bytes().to_vec(),
                keys: k0.clone(),
            })
            .await,
            InvalidArgument,
            "not pinned",
        );
        // A forged id of this run (right epoch, guessed nonce), an id of another run, and
        // bytes that are no id at all.
        let mut forged = s.id.to_bytes().to_vec();
        forged[8] ^= 1;
        check(
            raw.lookup(v1::LookupRequest {
                packed_keys: Vec::new(),
                session_id: forged,
                keys: k0.clone(),
                include_storage: false,
                each_key: false,
            })
            .await,
            NotFound,
            "unknown or expired",
        );
        let mut earlier = s.id.to_bytes().to_vec();
        earlier[0] ^= 1;
        check(
            raw.acquire(v1::AcquireRequest {
                packed_keys: Vec::new(),
                session_id: earlier,
                keys: k0.clone(),
            })
            .await,
            NotFound,
            "another kvtierd run",
        );
        for bad in [vec![], vec![0u8; 8]] {
            check(
                raw.lookup(v1::LookupRequest {
                    packed_keys: Vec::new(),
                    session_id: bad,
                    keys: k0.clone(),
                    include_storage: false,
                    each_key: false,
                })
                .await,
                InvalidArgument,
                "session_id",
            );
        }
        // Registration: a contradictory layout, a wrong hash self-test, a wrong expectation.
        let mut bad_layout = v1::LayoutDescriptor::from(&layout("m"));
        bad_layout.kind = Some(v1::layout_descriptor::Kind::Mha(v1::MhaShape {
            kv_heads: 0,
            head_dim: 64,
        }));
        let mut test = kvtier_client::self_test(16, &Default::default()).unwrap();
        let good = v1::RegisterRequest {
            name: "x".into(),
            layout: Some((&layout("m")).into()),
            hash_self_test: Some(test.clone()),
            expected_layout: None,
        };
        check(
            raw.register(v1::RegisterRequest {
                layout: Some(bad_layout),
                ..good.clone()
            })
            .await,
            InvalidArgument,
            "layout.kv_heads",
        );
        check(
            raw.register(v1::RegisterRequest {
                hash_self_test: None,
                ..good.clone()
            })
            .await,
            InvalidArgument,
            "hash_self_test",
        );
        test.keys[1][0] ^= 1;
        check(
            raw.register(v1::RegisterRequest {
                hash_self_test: Some(test),
                ..good.clone()
            })
            .await,
            FailedPrecondition,
            "hash self-test failed at page 1",
        );
        let info = v1::LayoutInfo {
            page_bytes: 1,
            ..Default::default()
        };
        check(
            raw.register(v1::RegisterRequest {
                expected_layout: Some(info),
                ..good.clone()
            })
            .await,
            FailedPrecondition,
            "layout mismatch",
        );

        // A key named twice in a Commit or an Abort: refused whole, by name (committing or
        // freeing it twice would miscount the pool); the reservation stands and commits.
        let fresh = chain(22, 2);
        let r = c.reserve(s.id, None, &fresh).await.unwrap();
        assert_eq!(r.len(), 2);
        let twice = vec![
            fresh[0].0.to_vec(),
            fresh[1].0.to_vec(),
            fresh[0].0.to_vec(),
        ];
        let raw = c.raw();
        check(
            raw.commit(v1::CommitRequest {
                packed_keys: Vec::new(),
                session_id: s.id.to_bytes().to_vec(),
                keys: twice.clone(),
                lease_want: 0,
            })
            .await,
            InvalidArgument,
            "keys[2]",
        );
        check(
            raw.abort(v1::AbortRequest {
                packed_keys: Vec::new(),
                session_id: s.id.to_bytes().to_vec(),
                keys: twice,
            })
            .await,
            InvalidArgument,
            "more than once",
        );
        c.commit(s.id, &fresh).await.unwrap();

        // Nothing stored was lost or changed, and no pin leaked (the L3 writer's pins are
        // transient: wait for its queue to drain first).
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        let after = loop {
            let st = c.stats().await.unwrap();
            if st.l3.as_ref().is_none_or(|l| l.queued_pages == 0) {
                break st;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the L3 queue never drained"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        // The two pages committed above, and nothing else.
        assert_eq!(after.pools[0].ready_pages, before.pools[0].ready_pages + 2);
        assert_eq!(after.pools[0].pins, 0);
        assert_eq!(load(&mut c, &s, &keys).await, bytes);
    });
    let m = d.metrics();
    assert!(
        metric(
            &m,
            "kvtier_l2_requests_total{op=\"register\",outcome=\"invalid_argument\"}"
        ) >= 2.0
    );
}

#[test]
fn health_reflection_status_metrics_and_clean_shutdown() {
    let mut d = Daemon::start("ops", &["l2.pool_pages=16", "server.drain_timeout=1s"]);
    let pool_path = rt().block_on(async {
        assert_eq!(kvtier_client::health(&d.target()).await.unwrap(), "SERVING");
        // Server reflection lists our service and health.
        use tonic_reflection_client::*;
        let services = list_services(&d.target()).await;
        assert!(
            services.contains(&"kvtier.v1.HostTier".to_string()),
            "{services:?}"
        );
        assert!(
            services.contains(&"grpc.health.v1.Health".to_string()),
            "{services:?}"
        );

        let mut c = HostClient::connect(&d.target()).await.unwrap();
        let s = c.register("status-client", &layout("m")).await.unwrap();
        let keys = chain(30, 4);
        store(&mut c, &s, &keys).await;
        load(&mut c, &s, &keys).await;
        s.pool_path.clone()
    });
    // kvtierctl status shows the pool, the session and the usage.
    let status = kvtier_ctl::status(kvtier_ctl::StatusArgs { socket: d.target() }).unwrap();
    assert!(status.contains("health SERVING"), "{status}");
    assert!(
        status.contains("pools: 1") && status.contains("ready 4"),
        "{status}"
    );
    assert!(status.contains("status-client"), "{status}");
    // kvtierctl health: the health check of the container image and the Kubernetes probes.
    let args = |socket: String| kvtier_ctl::StatusArgs { socket };
    assert_eq!(kvtier_ctl::health(&args(d.target())).unwrap(), "SERVING\n");
    let gone = d.dir.join("no-such.sock").display().to_string();
    assert!(kvtier_ctl::health(&args(gone)).is_err());
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvtierd"))
        .arg("--print-default-config")
        .output()
        .unwrap();
    assert!(String::from_utf8(out.stdout).unwrap().contains("[l2]"));
    // Every documented metric of kvtierd is exported.
    let m = d.metrics();
    let documented: Vec<&str> = include_str!("../../../docs/metrics.md")
        .lines()
        .filter_map(|l| l.strip_prefix("| `")?.split('`').next())
        .filter(|n| n.starts_with("kvtier_") && !n.starts_with("kvtier_agent_"))
        // Per-tenant series exist only while tenancy is on: tests/tenants.rs checks them.
        .filter(|n| !n.starts_with("kvtier_tenant_"))
        .collect();
    assert!(documented.len() > 40, "{documented:?}");
    for name in documented {
        assert!(
            m.contains(&format!("# TYPE {name} ")),
            "{name} missing from /metrics"
        );
    }
    assert_eq!(metric(&m, "kvtier_l2_pool_pages{state=\"ready\"}"), 4.0);
    // SIGTERM: drains, removes the socket and unlinks the pool, even with a client that holds
    // its connection open and never answers (the drain deadline is 1s here).
    let _silent = std::os::unix::net::UnixStream::connect(&d.socket).unwrap();
    assert!(pool_path.exists());
    let t = std::time::Instant::now();
    assert!(d.stop(), "kvtierd exited with an error");
    assert!(
        t.elapsed() < Duration::from_secs(8),
        "shutdown took {:?}",
        t.elapsed()
    );
    assert!(!d.socket.exists(), "socket left behind");
    assert!(!pool_path.exists(), "pool file left behind");
}

/// A reflection client, enough to list services.
mod tonic_reflection_client {
    use tonic_reflection::pb::v1::ServerReflectionRequest;
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;

    pub(crate) async fn list_services(target: &str) -> Vec<String> {
        let ch = kvtier_client::connect(target).await.unwrap();
        let mut c = ServerReflectionClient::new(ch);
        let req = ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::ListServices(String::new())),
        };
        let mut stream = c
            .server_reflection_info(tokio_stream::iter(vec![req]))
            .await
            .unwrap()
            .into_inner();
        let resp = stream.message().await.unwrap().unwrap();
        match resp.message_response {
            Some(MessageResponse::ListServicesResponse(l)) => {
                l.service.into_iter().map(|s| s.name).collect()
            }
            other => panic!("unexpected reflection answer {other:?}"),
        }
    }
}

#[test]
fn tcp_listener_serves_the_same_service() {
    let d = Daemon::start(
        "tcp",
        &[
            "l2.pool_pages=8",
            "server.tcp=127.0.0.1:0",
            "server.tcp_insecure=true",
            "server.token=tcp-tok",
        ],
    );
    assert!(!d.tcp.is_empty());
    rt().block_on(async {
        let target = format!("http://{}", d.tcp);
        assert_eq!(kvtier_client::health(&target).await.unwrap(), "SERVING");
        let sec = kvtier_client::TcpSecurity {
            token: Some("tcp-tok".into()),
            ..Default::default()
        };
        let mut c = HostClient::connect_with(&target, &sec).await.unwrap();
        let s = c.register("over-tcp", &layout("m")).await.unwrap();
        let keys = chain(40, 2);
        let bytes = store(&mut c, &s, &keys).await;
        // The same pages through the Unix socket.
        let mut u = HostClient::connect(&d.target()).await.unwrap();
        let s2 = u.register("over-uds", &layout("m")).await.unwrap();
        assert_eq!(load(&mut u, &s2, &keys).await, bytes);
    });
}

#[test]
fn a_pool_too_big_for_shm_dir_is_refused_at_registration_not_a_crash_later() {
    // 1 PiB: more than any /dev/shm. The room is checked before a byte is allocated.
    let d = Daemon::start("no-room", &["l2.pool_bytes=1024TiB"]);
    rt().block_on(async {
        let mut c = HostClient::connect(&d.target()).await.unwrap();
        match c.register("w", &layout("m")).await {
            Err(kvtier_client::ClientError::Status(st)) => {
                assert_eq!(st.code(), tonic::Code::ResourceExhausted, "{st:?}");
                assert!(st.message().contains("l2.pool_bytes"), "{}", st.message());
            }
            other => panic!("expected ResourceExhausted, got {:?}", other.map(|s| s.id)),
        }
        assert_eq!(kvtier_client::health(&d.target()).await.unwrap(), "SERVING");
    });
    assert!(
        std::fs::read_dir("/dev/shm").unwrap().flatten().all(|e| !e
            .file_name()
            .to_string_lossy()
            .starts_with(&format!("kvtier-{}-", d.child.id()))),
        "a refused pool left its file behind"
    );
}

#[test]
fn bad_configuration_stops_kvtierd_naming_the_key() {
    for (args, key) in [
        (
            vec!["--set", "l2.eviction_policy=random"],
            "l2.eviction_policy",
        ),
        (vec!["--set", "sessions.ttl=forever"], "ttl"),
        (vec!["--set", "l2.pool_bytez=1G"], "l2.pool_bytez"),
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvtierd"))
            .args(&args)
            .env("KVTIER_DATA_DIR", std::env::temp_dir())
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?} was accepted");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(key), "{args:?}: {err}");
    }
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvtierd"))
        .env("KVTIER_L2_MAX_POOLS", "lots")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("KVTIER_L2_MAX_POOLS"));
}
