//! kvtier-agent end to end on the cpu device, with real processes: kvtierd, one or two
//! agents, and this test as the engine (its KV pool in shared memory). Pages are a pure
//! function of their keys, so "bit-identical to recomputing" is checked byte for byte.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::*;
use kvtier_client::{Handle, Loaded};
use kvtier_proto::v1;

/// Not a test: the entry point of the kvtierd child processes the tests start.
#[test]
#[ignore = "entry point of test daemons"]
fn daemon_entry() {
    assert!(daemon_child(), "run by the tests, not by hand");
}

#[test]
fn write_policies_back_up_exactly_what_they_should_when_they_should() {
    let d = dir("policies");
    let _kvtierd = daemon(&d, &["l2.pool_pages=256"]);
    let spec = mha(0, 1);
    let sock = d.join("kvtierd.sock");
    rt().block_on(async {
        // write_through: every inserted page, without being asked.
        let a = agent(&d, "wt", &["cache.write_policy=write_through"]);
        let mut e = Engine::start(&a, spec.clone(), 64, "wt").await;
        e.wait_connected().await;
        let t = tokens(1, 4);
        let ks = keys(&spec, &t);
        assert_eq!(l2_pages(&sock, &spec, &ks).await, 0);
        let r = e.prefill_and_insert(&t, &[0, 1, 2, 3]).await;
        assert_eq!((r.inserted, r.duplicate_pages.len()), (4, 0));
        wait_l2(&sock, &spec, &ks, 4).await;
        drop(e);
        drop(a);

        // write_through_selective (threshold 2): nothing on insert or the first hit; the
        // second hit backs the page up.
        let a = agent(
            &d,
            "wts",
            &[
                "cache.write_policy=write_through_selective",
                "cache.write_threshold=2",
            ],
        );
        let mut e = Engine::start(&a, spec.clone(), 64, "wts").await;
        e.wait_connected().await;
        let t = tokens(2, 4);
        let ks = keys(&spec, &t);
        e.prefill_and_insert(&t, &[4, 5, 6, 7]).await;
        let m = e.do_match(&t).await;
        assert_eq!(m.device_pages, vec![4, 5, 6, 7]);
        e.client.release(m.handle).await.unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(
            l2_pages(&sock, &spec, &ks).await,
            0,
            "backed up before the threshold"
        );
        let m = e.do_match(&t).await;
        wait_l2(&sock, &spec, &ks, 4).await;
        e.client.release(m.handle).await.unwrap();
        drop(e);
        drop(a);

        // write_back: nothing until eviction, and evict returns only after the pages are
        // committed in L2.
        let a = agent(&d, "wb", &["cache.write_policy=write_back"]);
        let mut e = Engine::start(&a, spec.clone(), 64, "wb").await;
        e.wait_connected().await;
        let t = tokens(3, 4);
        let ks = keys(&spec, &t);
        e.prefill_and_insert(&t, &[8, 9, 10, 11]).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(
            l2_pages(&sock, &spec, &ks).await,
            0,
            "write_back wrote early"
        );
        let ev = e.client.evict(4).await.unwrap();
        let mut freed = ev.pages.clone();
        freed.sort_unstable();
        assert_eq!((freed, ev.backed_up, ev.lost), (vec![8, 9, 10, 11], 4, 0));
        assert_eq!(
            l2_pages(&sock, &spec, &ks).await,
            4,
            "evicted before the backup landed"
        );
        // The engine reuses those pages; a later request loads the prefix back from L2,
        // bit-identical.
        for p in 8..12 {
            e.wipe(p);
        }
        let m = e.do_match(&t).await;
        assert_eq!((m.device_pages.len(), m.l2_pages), (0, 4));
        let lb = e
            .client
            .load_back(m.handle, vec![20, 21, 22, 23, 24])
            .await
            .unwrap();
        assert_eq!((lb.loaded, lb.unused_pages.clone()), (4, vec![24]));
        assert_eq!(lb.device_pages, vec![20, 21, 22, 23]);
        for (k, p) in ks.iter().zip(20..24) {
            assert!(
                e.holds(p, k),
                "loaded page {p} differs from the computed one"
            );
        }
        let page = a.metrics_page();
        assert_eq!(
            metric(
                &page,
                "kvtier_agent_backup_pages_total{outcome=\"stored\",policy=\"write_back\"}"
            ),
            4.0
        );
        assert_eq!(metric(&page, "kvtier_agent_load_back_pages_total"), 4.0);
    });
}

#[test]
fn a_prefix_computed_by_one_worker_is_loaded_by_another_bit_identical() {
    let d = dir("two");
    // A short lease: heartbeats (which carry the agents' reports) every 200 ms.
    let _kvtierd = daemon(&d, &["l2.pool_pages=256", "sessions.ttl=600ms"]);
    let spec = mha(0, 1);
    rt().block_on(async {
        let a1 = agent(&d, "w1", &[]);
        let a2 = agent(&d, "w2", &["server.unix.mode=0660"]);
        // The engine sockets carry [server.unix]'s mode (the peer check is kvtier-server's,
        // shared with kvtierd and tested in kvtier-daemon's unix_access.rs).
        for (a, want) in [(&a1, 0o600), (&a2, 0o660)] {
            use std::os::unix::fs::PermissionsExt as _;
            let m = std::fs::metadata(&a.socket).unwrap().permissions().mode();
            assert_eq!(m & 0o777, want, "{}", a.socket.display());
        }
        let mut e1 = Engine::start(&a1, spec.clone(), 64, "w1").await;
        let mut e2 = Engine::start(&a2, spec.clone(), 64, "w2").await;
        e1.wait_connected().await;
        e2.wait_connected().await;
        let t = tokens(10, 6);
        let ks = keys(&spec, &t);
        e1.prefill_and_insert(&t, &[10, 11, 12, 13, 14, 15]).await;
        wait_l2(&d.join("kvtierd.sock"), &spec, &ks, 6).await;
        // Worker 2 has never seen the request: nothing on its device, all six in L2. A
        // longer request shares the prefix.
        let mut longer = t.clone();
        longer.extend(tokens(11, 2));
        let m = e2.do_match(&longer).await;
        assert_eq!((m.device_pages.len(), m.l2_pages, m.total_pages), (0, 6, 8));
        let lb = e2
            .client
            .load_back(m.handle, vec![40, 41, 42, 43, 44, 45])
            .await
            .unwrap();
        assert_eq!(lb.loaded, 6);
        for (k, p) in ks.iter().zip(40..46) {
            assert!(e2.holds(p, k), "page {p} loaded by worker 2 differs");
        }
        // Now it is on worker 2's device: a new match finds it there, locked again.
        e2.client.release(m.handle).await.unwrap();
        let m = e2.do_match(&t).await;
        assert_eq!(m.device_pages, vec![40, 41, 42, 43, 44, 45]);
        // Inserting the full computed request on worker 2 reports the six as duplicates.
        let r = e2
            .prefill_and_insert(&longer, &[50, 51, 52, 53, 54, 55, 56, 57])
            .await;
        assert_eq!(r.duplicate_pages, vec![50, 51, 52, 53, 54, 55]);
        assert_eq!(r.inserted, 2);
        // kvtierd's view shows each worker by session, from the reports on heartbeats.
        let mut c =
            kvtier_client::HostClient::connect(&d.join("kvtierd.sock").display().to_string())
                .await
                .unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let st = c.stats().await.unwrap();
            let w2 = st
                .sessions
                .iter()
                .find(|s| s.name == "w2")
                .and_then(|s| s.report);
            if let Some(r) = w2
                && r.load_back_pages == 6
            {
                assert_eq!((r.l2_hit_pages, r.device_hit_pages), (6, 6));
                assert_eq!(r.device_pages, 8);
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "no report from w2: {st:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let status = tokio::task::spawn_blocking({
            let socket = d.join("kvtierd.sock").display().to_string();
            move || kvtier_ctl::status(kvtier_ctl::StatusArgs { socket }).unwrap()
        })
        .await
        .unwrap();
        assert!(status.contains("loaded back 6"), "{status}");
    });
}

#[test]
fn mla_ranks_share_one_copy_and_mha_ranks_do_not() {
    let d = dir("tp");
    let kvtierd = daemon(&d, &["l2.pool_pages=256"]);
    rt().block_on(async {
        // MLA: the latent is the same on every rank, so the layouts (and keys) coincide.
        let r0 = agent(&d, "mla0", &[]);
        let r1 = agent(&d, "mla1", &[]);
        let mut e0 = Engine::start(&r0, mla(0, 2), 32, "mla0").await;
        let mut e1 = Engine::start(&r1, mla(1, 2), 32, "mla1").await;
        e0.wait_connected().await;
        e1.wait_connected().await;
        let t = tokens(20, 4);
        let ks = keys(&mla(0, 2), &t);
        e0.prefill_and_insert(&t, &[0, 1, 2, 3]).await;
        wait_l2(&d.join("kvtierd.sock"), &mla(0, 2), &ks, 4).await;
        let m = e1.do_match(&t).await;
        assert_eq!(m.l2_pages, 4, "rank 1 does not see rank 0's MLA pages");
        // Rank 1 computing the same pages stores no second copy: L2 reports them present.
        e1.prefill_and_insert(&t, &[5, 6, 7, 8]).await;
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            let p = r1.metrics_page();
            let present = metric(
                &p,
                "kvtier_agent_backup_pages_total{outcome=\"present\",policy=\"write_through\"}",
            );
            if present == 4.0 {
                assert_eq!(
                    metric(
                        &p,
                        "kvtier_agent_backup_pages_total{outcome=\"stored\",policy=\"write_through\"}"
                    ),
                    0.0
                );
                break;
            }
            assert!(std::time::Instant::now() < deadline, "no dedup seen");
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        let page = kvtierd.metrics_page();
        assert_eq!(metric(&page, "kvtier_l2_pages_total{op=\"committed\"}"), 4.0);

        // MHA: each rank holds its own heads: same tokens, different layouts, no sharing.
        let h0 = agent(&d, "mha0", &[]);
        let h1 = agent(&d, "mha1", &[]);
        let mut f0 = Engine::start(&h0, mha(0, 2), 32, "mha0").await;
        let mut f1 = Engine::start(&h1, mha(1, 2), 32, "mha1").await;
        f0.wait_connected().await;
        f1.wait_connected().await;
        f0.prefill_and_insert(&t, &[0, 1, 2, 3]).await;
        wait_l2(&d.join("kvtierd.sock"), &mha(0, 2), &keys(&mha(0, 2), &t), 4).await;
        let m = f1.do_match(&t).await;
        assert_eq!(m.l2_pages, 0, "MHA rank 1 was offered rank 0's heads");
    });
}

/// Loads the handle's L2 pages into `free` device pages.
async fn load_back(e: &mut Engine, handle: Handle, free: Vec<u32>) -> Loaded {
    e.client.load_back(handle, free).await.unwrap()
}

#[test]
fn a_dead_daemon_costs_misses_and_the_agent_reconnects() {
    let d = dir("dead");
    let mut kvtierd = daemon(&d, &["l2.pool_pages=128", "l3.backend=none"]);
    let spec = mha(0, 1);
    rt().block_on(async {
        let a = agent(&d, "w", &[]);
        let mut e = Engine::start(&a, spec.clone(), 64, "dead").await;
        e.wait_connected().await;
        let t = tokens(30, 4);
        let ks = keys(&spec, &t);
        e.prefill_and_insert(&t, &[0, 1, 2, 3]).await;
        wait_l2(&d.join("kvtierd.sock"), &spec, &ks, 4).await;
        // Evict from the device: the pages are now in L2 only.
        let ev = e.client.evict(4).await.unwrap();
        assert_eq!(ev.pages.len(), 4);
        // Sealed (checksummed and recorded beside the pool) before the crash, so the next
        // kvtierd may take them over.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while metric(&kvtierd.metrics_page(), "kvtier_l2_sealed_pages_total") < 4.0 {
            assert!(std::time::Instant::now() < deadline, "pages never sealed");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        kvtierd.kill();
        // L1 keeps serving; the host tier counts as a miss; load-back loads nothing and
        // hands every page back.
        let t2 = tokens(31, 2);
        e.prefill_and_insert(&t2, &[10, 11]).await;
        let m = e.do_match(&t2).await;
        assert_eq!(m.device_pages, vec![10, 11]);
        let m = e.do_match(&t).await;
        assert_eq!((m.device_pages.len(), m.l2_pages), (0, 0));
        let lb = load_back(&mut e, m.handle, vec![20, 21, 22, 23]).await;
        assert_eq!((lb.loaded, lb.unused_pages.len()), (0, 4));
        for p in 20..24 {
            assert!(
                !e.holds(p, &ks[(p - 20) as usize]),
                "a page appeared from nowhere"
            );
        }
        // A new daemon takes over the dead one's pool (its pages verified): the agent
        // re-registers, finds them in L2 again, and loads exactly what it stored.
        let _kvtierd = daemon(&d, &["l2.pool_pages=128", "l3.backend=none"]);
        e.wait_connected().await;
        let m = e.do_match(&t).await;
        assert_eq!((m.device_pages.len(), m.l2_pages), (0, 4));
        let lb = load_back(&mut e, m.handle, vec![20, 21, 22, 23]).await;
        assert_eq!(lb.loaded, 4);
        for p in 20..24 {
            assert!(
                e.holds(p, &ks[(p - 20) as usize]),
                "page {p} is not what was stored before the crash"
            );
        }
        // And backups work again.
        let t3 = tokens(32, 2);
        e.prefill_and_insert(&t3, &[30, 31]).await;
        wait_l2(&d.join("kvtierd.sock"), &spec, &keys(&spec, &t3), 2).await;
    });
}

#[test]
fn a_killed_agent_leaves_no_pins_behind() {
    let d = dir("killed");
    let kvtierd = daemon(&d, &["l2.pool_pages=128", "sessions.ttl=500ms"]);
    let spec = mha(0, 1);
    rt().block_on(async {
        let mut a = agent(&d, "victim", &[]);
        let mut e = Engine::start(&a, spec.clone(), 64, "killed").await;
        e.wait_connected().await;
        let t = tokens(40, 8);
        e.prefill_and_insert(&t, &[0, 1, 2, 3, 4, 5, 6, 7]).await;
        wait_l2(&d.join("kvtierd.sock"), &spec, &keys(&spec, &t), 8).await;
        a.kill();
        let mut c =
            kvtier_client::HostClient::connect(&d.join("kvtierd.sock").display().to_string())
                .await
                .unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let st = c.stats().await.unwrap();
            if st.sessions.is_empty() {
                assert!(
                    st.pools.iter().all(|p| p.pins == 0 && p.writing_pages == 0),
                    "{st:?}"
                );
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the dead agent's session lingers"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
    drop(kvtierd);
}

#[test]
fn bad_engine_input_is_refused_by_field() {
    let d = dir("bad");
    let _kvtierd = daemon(&d, &["l2.pool_pages=64"]);
    rt().block_on(async {
        let a = agent(&d, "w", &[]);
        let ch = kvtier_client::connect(&a.socket.display().to_string())
            .await
            .unwrap();
        let mut raw = v1::agent_client::AgentClient::new(ch);
        // Nothing registered yet.
        let e = raw
            .r#match(v1::MatchRequest {
                tokens: tokens(1, 1),
                namespace: None,
                packed_tokens: Default::default(),
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::NotFound);
        assert!(e.message().contains("RegisterPool"), "{}", e.message());
        // No memory, or a ticket the memory door never gave.
        for (memory, why) in [(vec![], "required"), (vec![9u8; 16], "no deposit")] {
            let e = raw
                .register_pool(v1::RegisterPoolRequest {
                    layout: Some((&mha(0, 1)).into()),
                    num_token_slots: 1024,
                    device: Some(v1::register_pool_request::Device::Cpu(v1::CpuPool {
                        memory,
                        ..Default::default()
                    })),
                    engine_cache: false,
                })
                .await
                .unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument);
            assert!(e.message().contains("cpu.memory"), "{}", e.message());
            assert!(e.message().contains(why), "{}", e.message());
        }
        let e = raw
            .register_pool(v1::RegisterPoolRequest {
                layout: Some((&mha(0, 1)).into()),
                num_token_slots: 1000,
                device: None,
                engine_cache: false,
            })
            .await
            .unwrap_err();
        assert!(e.message().contains("num_token_slots"), "{}", e.message());
        // A CUDA pool's map is checked before any handle is opened (so on any machine): the
        // wrong number of per-buffer handles, sizes without pieces, a piece past its allocation,
        // pieces that do not add up to a page, overlapping pieces. A good map on a machine without a GPU says so.
        let layers = mha(0, 1).num_layers as u64;
        let run_bytes = {
            let l = kvtier_core::Layout::new(mha(0, 1)).unwrap();
            l.run_bytes() as u64
        };
        let pages = 1024 / u64::from(mha(0, 1).page_size);
        let good_pieces = |gap: u64| -> Vec<v1::PagePiece> {
            (0..2 * layers)
                .map(|i| v1::PagePiece {
                    allocation: 0,
                    offset: i * (pages * run_bytes + gap),
                    page_stride: run_bytes,
                    length: run_bytes,
                })
                .collect()
        };
        let whole = 2 * layers * pages * run_bytes;
        let cuda =
            |handles: usize, sizes: Vec<u64>, pieces: Vec<v1::PagePiece>| v1::RegisterPoolRequest {
                layout: Some((&mha(0, 1)).into()),
                num_token_slots: 1024,
                device: Some(v1::register_pool_request::Device::Cuda(v1::CudaPool {
                    device_ordinal: 0,
                    ipc_handles: vec![vec![0u8; 64]; handles],
                    allocation_bytes: sizes,
                    pieces,
                })),
                engine_cache: false,
            };
        let mut overlapping = good_pieces(0);
        overlapping[3].offset = overlapping[2].offset + run_bytes;
        let overlapping_cpu = overlapping.clone();
        for (req, field) in [
            (cuda(3, vec![], vec![]), "cuda.ipc_handles"),
            (cuda(1, vec![whole], vec![]), "cuda.allocation_bytes"),
            (cuda(1, vec![], good_pieces(0)), "cuda.allocation_bytes"),
            (cuda(1, vec![whole - 1], good_pieces(0)), "cuda.pieces["),
            (
                cuda(1, vec![whole], good_pieces(0)[1..].to_vec()),
                "cuda.pieces",
            ),
            (cuda(1, vec![whole], overlapping), "overlaps pieces[2]"),
        ] {
            let e = raw.register_pool(req).await.unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument, "{}", e.message());
            assert!(e.message().contains(field), "{field}: {}", e.message());
        }
        // The same map over the engine's CPU allocations (descriptors deposited at the
        // memory door): checked as CUDA's, and each file must hold what the map says it uses.
        let door = std::path::PathBuf::from(
            kvtier_client::AgentClient::connect(&a.socket.display().to_string())
                .await
                .unwrap()
                .stats()
                .await
                .unwrap()
                .memory_socket,
        );
        let short = kvtier_shm::ShmRegion::memfd("short", whole as usize - 1).unwrap();
        let deposit = |n: usize| {
            let fds: Vec<_> = (0..n).map(|_| short.fd()).collect();
            kvtier_shm::memory_door::deposit(&door, &fds, Duration::from_secs(5))
                .unwrap()
                .to_vec()
        };
        let cpu = |memory: Vec<u8>, sizes: Vec<u64>, pieces: Vec<v1::PagePiece>| {
            v1::RegisterPoolRequest {
                layout: Some((&mha(0, 1)).into()),
                num_token_slots: 1024,
                device: Some(v1::register_pool_request::Device::Cpu(v1::CpuPool {
                    memory,
                    allocation_bytes: sizes,
                    pieces,
                })),
                engine_cache: false,
            }
        };
        // The map is checked before the deposit is taken: one ticket serves every refusal
        // up to the last.
        let t = deposit(1);
        for (req, field) in [
            (cpu(t.clone(), vec![whole], vec![]), "cpu.allocation_bytes"),
            (
                cpu(t.clone(), vec![], good_pieces(0)),
                "cpu.pieces[0].region",
            ),
            (
                cpu(t.clone(), vec![whole - 1], good_pieces(0)),
                "cpu.pieces[",
            ),
            (
                cpu(t.clone(), vec![whole], overlapping_cpu.clone()),
                "overlaps pieces[2]",
            ),
            (
                cpu(t.clone(), vec![1; 1025], good_pieces(0)),
                "cpu.allocation_bytes",
            ),
            // A file shorter than the map says.
            (
                cpu(t.clone(), vec![whole], good_pieces(0)),
                "cpu.allocations[0]",
            ),
            // Taken by the request before: a ticket serves one registration.
            (cpu(t.clone(), vec![whole], good_pieces(0)), "no deposit"),
        ] {
            let e = raw.register_pool(req).await.unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument, "{}", e.message());
            assert!(e.message().contains(field), "{field}: {}", e.message());
        }
        // One deposit at a time (a uid's newest replaces its older one): more descriptors
        // than allocations, and than the layer-first file's one; a layer-first file shorter
        // than the pool.
        type Case = (usize, Vec<u64>, Vec<v1::PagePiece>, &'static str);
        let cases: Vec<Case> = vec![
            (
                2,
                vec![whole],
                good_pieces(0),
                "2 descriptors deposited for 1",
            ),
            (2, vec![], vec![], "2 descriptors deposited for 1"),
            (1, vec![], vec![], "expected at least"),
        ];
        for (n, sizes, pieces, field) in cases {
            let e = raw
                .register_pool(cpu(deposit(n), sizes, pieces))
                .await
                .unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument, "{}", e.message());
            assert!(e.message().contains(field), "{field}: {}", e.message());
        }
        // A newer deposit of the same uid replaces the older: the older ticket is gone.
        let older = deposit(1);
        let _newer = deposit(1);
        let e = raw
            .register_pool(cpu(older, vec![], vec![]))
            .await
            .unwrap_err();
        assert!(e.message().contains("no deposit"), "{}", e.message());
        if !kvtier_device::cuda::driver_present() {
            let e = raw
                .register_pool(cuda(1, vec![whole + 2 * layers * 512], good_pieces(512)))
                .await
                .unwrap_err();
            assert_eq!(e.code(), tonic::Code::FailedPrecondition);
            assert!(e.message().contains("libcuda"), "{}", e.message());
        }

        let mut e = Engine::start(&a, mha(0, 1), 16, "bad").await;
        let t = tokens(50, 3);
        let cases: Vec<(v1::InsertRequest, &str)> = vec![
            (
                v1::InsertRequest {
                    tokens: t.clone(),
                    namespace: None,
                    device_pages: vec![0, 1],
                    packed_tokens: Default::default(),
                },
                "device_pages",
            ),
            (
                v1::InsertRequest {
                    tokens: t.clone(),
                    namespace: None,
                    device_pages: vec![0, 1, 2],
                    packed_tokens: vec![1, 0, 0, 0].into(),
                },
                "packed_tokens",
            ),
            (
                v1::InsertRequest {
                    tokens: Vec::new(),
                    namespace: None,
                    device_pages: vec![0, 1, 2],
                    packed_tokens: vec![1; 50 * 4 + 3].into(),
                },
                "packed_tokens",
            ),
            (
                v1::InsertRequest {
                    tokens: t.clone(),
                    namespace: None,
                    device_pages: vec![0, 1, 16],
                    packed_tokens: Default::default(),
                },
                "device_pages[2]",
            ),
            (
                v1::InsertRequest {
                    tokens: t.clone(),
                    namespace: None,
                    device_pages: vec![0, 1, 1],
                    packed_tokens: Default::default(),
                },
                "device_pages[2]",
            ),
        ];
        for (req, field) in cases {
            // The wire request as sent: the typed client could not even express some.
            let req = e.client.request(req);
            let err = e.client.raw().insert(req).await.unwrap_err();
            assert_eq!(err.code(), tonic::Code::InvalidArgument);
            assert!(err.message().contains(field), "{field}: {}", err.message());
        }
        // Nothing was inserted by the refused calls.
        let m = e.do_match(&t).await;
        assert!(m.device_pages.is_empty());
        // A page the tree holds is not free for load-back, and unknown handles are refused.
        e.prefill_and_insert(&t, &[0, 1, 2]).await;
        // The typed client sends packed tokens; the varint field names the same prefix.
        let req = e.client.request(v1::MatchRequest {
            tokens: t.clone(),
            namespace: None,
            packed_tokens: Default::default(),
        });
        let varint = e.client.raw().r#match(req).await.unwrap().into_inner();
        assert_eq!(varint.device_pages, vec![0, 1, 2]);
        e.client.release(Handle(varint.handle)).await.unwrap();
        let err = e.client.load_back(m.handle, vec![1]).await.unwrap_err();
        assert_eq!(err.code(), Some(tonic::Code::InvalidArgument));
        assert!(err.to_string().contains("free_pages[0]"), "{err}");
        let err = e.client.release(Handle(999_999)).await.unwrap_err();
        assert_eq!(err.code(), Some(tonic::Code::InvalidArgument));
        assert!(err.to_string().contains("handle"), "{err}");
        // Inserting a page the tree already holds under another key is refused.
        let err = e
            .client
            .insert(tokens(51, 1), None, vec![2])
            .await
            .unwrap_err();
        assert!(err.to_string().contains("device_pages[0]"), "{err}");
        // Partial trailing pages are never cached: 20 tokens are one full page.
        let r = e
            .client
            .insert(tokens(52, 2)[..20].to_vec(), None, vec![5])
            .await
            .unwrap();
        assert_eq!(r.inserted, 1);
    });
}

#[test]
fn an_agent_killed_mid_backup_leaves_only_whole_pages() {
    let d = dir("midbackup");
    let _kvtierd = daemon(&d, &["l2.pool_pages=1024", "sessions.ttl=400ms"]);
    let spec = mha(0, 1);
    let t = tokens(60, 512);
    let ks = keys(&spec, &t);
    rt().block_on(async {
        let mut a = agent(&d, "victim", &[]);
        let mut e = Engine::start(&a, spec.clone(), 600, "midbackup").await;
        e.wait_connected().await;
        let pages: Vec<u32> = (0..512).collect();
        e.prefill_and_insert(&t, &pages).await;
        // The backup of 512 pages has just been queued: kill the agent while it runs.
        a.kill();
        drop(e);
        // Whatever L2 shows once the dead session is reclaimed is a prefix of whole,
        // correct pages: a second worker loads it and compares every byte.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let b = agent(&d, "survivor", &[]);
        let mut f = Engine::start(&b, spec.clone(), 600, "survivor").await;
        f.wait_connected().await;
        let m = f.do_match(&t).await;
        let n = m.l2_pages;
        let lb = f
            .client
            .load_back(m.handle, (0..n).collect())
            .await
            .unwrap();
        assert_eq!(lb.loaded, n);
        for (k, p) in ks.iter().zip(0..n) {
            assert!(
                f.holds(p, k),
                "page {p} from the killed agent's backup is wrong"
            );
        }
        let mut c =
            kvtier_client::HostClient::connect(&d.join("kvtierd.sock").display().to_string())
                .await
                .unwrap();
        let st = c.stats().await.unwrap();
        assert!(st.pools.iter().all(|p| p.writing_pages == 0), "{st:?}");
    });
}

/// The typed client's batched calls, from several engine tasks at once: each prompt is
/// matched, inserted and released as its own, and a namespace sees only its own pages.
#[test]
fn batched_calls_from_concurrent_tasks_keep_each_prompt_apart() {
    let d = dir("batched");
    let _kvtierd = daemon(&d, &["l2.pool_pages=256"]);
    rt().block_on(async {
        let a = agent(&d, "w", &["cache.write_policy=write_through"]);
        // 4 tasks × 4 prompts × 2 pages, each task on its own 8 device pages.
        let e = Engine::start(&a, mha(0, 1), 64, "batched").await;
        let salted = kvtier_core::Namespace {
            cache_salt: "other-user".into(),
            ..Default::default()
        };
        // The engine computes every page before inserting it.
        for task in 0..4u32 {
            for p in 0..4 {
                let t = tokens(100 + task * 4 + p, 2);
                for (i, k) in keys(&mha(0, 1), &t).iter().enumerate() {
                    e.compute(task * 8 + p * 2 + i as u32, k);
                }
            }
        }
        let mut tasks = Vec::new();
        for task in 0..4u32 {
            let mut c = e.client.clone();
            let salted = salted.clone();
            let prompts: Vec<Vec<u32>> = (0..4).map(|p| tokens(100 + task * 4 + p, 2)).collect();
            let pages: Vec<Vec<u32>> = (0..4)
                .map(|p| vec![task * 8 + p * 2, task * 8 + p * 2 + 1])
                .collect();
            tasks.push(tokio::spawn(async move {
                let inserts = prompts
                    .iter()
                    .zip(&pages)
                    .map(|(t, p)| kvtier_client::Insert {
                        tokens: t.clone(),
                        namespace: None,
                        device_pages: p.clone(),
                    })
                    .collect();
                let ins = c.insert_batch(inserts).await.unwrap();
                assert!(
                    ins.iter()
                        .all(|i| i.inserted == 2 && i.duplicate_pages.is_empty())
                );
                // The same prompts, then each under another cache salt: hits, then misses.
                let mut asks: Vec<(Vec<u32>, Option<kvtier_core::Namespace>)> =
                    prompts.iter().map(|t| (t.clone(), None)).collect();
                asks.extend(prompts.iter().map(|t| (t.clone(), Some(salted.clone()))));
                let ms = c.match_batch(asks).await.unwrap();
                assert_eq!(ms.len(), 8);
                for (m, p) in ms[..4].iter().zip(&pages) {
                    assert_eq!(&m.device_pages, p);
                    assert_eq!(m.total_pages, 2);
                }
                assert!(ms[4..].iter().all(|m| m.device_pages.is_empty()));
                let handles: Vec<Handle> = ms.iter().map(|m| m.handle).collect();
                c.release_batch(&handles).await.unwrap();
                // Released handles are gone: a second release is refused by name.
                let err = c.release(handles[0]).await.unwrap_err();
                assert_eq!(err.code(), Some(tonic::Code::InvalidArgument));
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        // Once the write-through backups are done, no page is locked: every handle went.
        let mut c = e.client.clone();
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        let st = loop {
            let st = c.stats().await.unwrap();
            let settled = st.backups_in_flight == 0 && st.locked_pages == 0;
            if settled || std::time::Instant::now() > deadline {
                break st;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        assert_eq!(
            (st.device_pages, st.locked_pages, st.open_handles),
            (32, 0, 0)
        );
        // Every page holds what was computed into it: nothing was moved or mixed up.
        let mut e = e;
        for task in 0..4u32 {
            for p in 0..4 {
                let t = tokens(100 + task * 4 + p, 2);
                let m = e.do_match(&t).await;
                let ks = keys(&mha(0, 1), &t);
                assert_eq!(m.device_pages, vec![task * 8 + p * 2, task * 8 + p * 2 + 1]);
                for (&dp, k) in m.device_pages.iter().zip(&ks) {
                    assert!(e.holds(dp, k), "task {task} prompt {p}: page {dp}");
                }
                e.client.release(m.handle).await.unwrap();
            }
        }
    });
}

#[test]
fn a_backup_of_a_registration_the_engine_replaced_stores_nothing_it_reuses() {
    // kvtier-sim served wrong pages from L3 (review of stop 76): a worker registered its pool
    // again, taking every device page back, while write-through backups of the old
    // registration still waited for kvtierd. They then copied the pages the engine had
    // reused and stored them under the old keys (checksummed, so L3 served them as good).
    let d = dir("reregister");
    let spec = mha(0, 1);
    rt().block_on(async {
        // No kvtierd yet: the backups of what the engine inserts wait for it.
        let a = agent(&d, "w", &["cache.write_policy=write_through"]);
        let mut e = Engine::start(&a, spec.clone(), 64, "rereg").await;
        let t = tokens(70, 4);
        let ks = keys(&spec, &t);
        e.prefill_and_insert(&t, &[0, 1, 2, 3]).await;
        // The engine starts over on the same memory, and reuses the pages for other KV.
        let mem = kvtier_client::PoolMemory::Cpu {
            fd: std::sync::Arc::new(e.region.fd().try_clone_to_owned().unwrap()),
        };
        e.client.register_pool(&spec, 64 * 16, mem).await.unwrap();
        let other = keys(&spec, &tokens(71, 4));
        for (p, k) in (0..4).zip(&other) {
            e.compute(p, k);
        }
        // kvtierd comes: the old backups must store nothing (their pages are the engine's).
        let _kvtierd = daemon(&d, &["l2.pool_pages=128", "l3.backend=none"]);
        e.wait_connected().await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        let socket = d.join("kvtierd.sock");
        assert_eq!(
            l2_pages(&socket, &spec, &ks).await,
            0,
            "a backup of the old registration stored a page the engine had reused"
        );
        // The new registration backs up what it inserts, as ever.
        e.client
            .insert(tokens(71, 4), None, vec![0, 1, 2, 3])
            .await
            .unwrap();
        wait_l2(&socket, &spec, &other, 4).await;
    });
}
