//! The agent in engine-cache mode (the engine keeps its own prefix cache: vLLM), end to end
//! with real processes: kvtierd, agents, and this test as the engines. Pages are a pure
//! function of their keys, so every load is checked byte for byte.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::*;
use kvtier_proto::v1;
use kvtier_proto::v1::PrefetchPolicy;

/// Not a test: the entry point of the kvtierd child processes the tests start.
#[test]
#[ignore = "entry point of test daemons"]
fn daemon_entry() {
    assert!(daemon_child(), "run by the tests, not by hand");
}

fn code(e: kvtier_client::ClientError) -> (tonic::Code, String) {
    match e {
        kvtier_client::ClientError::Status(s) => (s.code(), s.message().to_string()),
        e => panic!("not a status: {e}"),
    }
}

#[test]
fn pages_saved_by_one_worker_load_into_anothers_pages_byte_exact_under_load() {
    let d = dir("ec-two");
    let _kvtierd = daemon(&d, &["l2.pool_pages=512", "l3.backend=none"]);
    let spec = mha(0, 1);
    rt().block_on(async {
        let a1 = agent(&d, "ec1", &[]);
        let a2 = agent(&d, "ec2", &[]);
        let mut e1 = Engine::start_cache(&a1, spec.clone(), 256, "ec1").await;
        let mut e2 = Engine::start_cache(&a2, spec.clone(), 256, "ec2").await;
        e1.wait_connected().await;
        e2.wait_connected().await;
        // 16 prompts of 8 pages; each pair shares its first 4 pages. Worker 1 "computes"
        // each into its own pages and saves them from 16 tasks at once.
        let prompts: Vec<Vec<u32>> = (0..16u32)
            .map(|i| {
                let mut t = tokens(100 + i / 2, 4);
                t.extend(tokens(200 + i, 4));
                t
            })
            .collect();
        let mut tasks = Vec::new();
        for (i, t) in prompts.iter().enumerate() {
            let ks = keys(&spec, t);
            let pages: Vec<u32> = (0..8).map(|j| (i * 8 + j) as u32).collect();
            for (k, &p) in ks.iter().zip(&pages) {
                e1.compute(p, k);
            }
            let mut c = e1.client.clone();
            let t = t.clone();
            tasks.push(tokio::spawn(async move {
                c.save_pages(&t, None, 0, pages).await.unwrap()
            }));
        }
        let (mut stored, mut present) = (0, 0);
        for t in tasks {
            let r = t.await.unwrap();
            assert_eq!((r.failed, r.skipped), (0, 0), "{r:?}");
            assert_eq!(r.stored + r.present, 8, "{r:?}");
            stored += r.stored;
            present += r.present;
        }
        // 8 shared prefixes of 4 pages + 16 tails of 4: each distinct page copied once.
        assert_eq!((stored, stored + present), (8 * 4 + 16 * 4, 128));
        // Worker 1 reuses its pages at once (the engine's allocator): L2 holds copies.
        for p in 0..128 {
            e1.wipe(p);
        }
        // Worker 2 has each prompt's first page itself (its own prefix cache), and asks for
        // the rest; then loads it into scattered pages of its own, from 16 tasks at once.
        let mut tasks = Vec::new();
        for (i, t) in prompts.iter().enumerate() {
            let mut c = e2.client.clone();
            let t = t.clone();
            let pages: Vec<u32> = (0..7).map(|j| (255 - (i * 7 + j)) as u32).collect();
            tasks.push(tokio::spawn(async move {
                let l = c.lookup_pages(&t, None, 1).await.unwrap();
                assert_eq!((l.l2_pages, l.l3_pages, l.total_pages), (7, 0, 8));
                let n = c
                    .load_pages(&t, None, 1, pages.clone(), PrefetchPolicy::Unspecified)
                    .await
                    .unwrap();
                (t, pages, n)
            }));
        }
        for t in tasks {
            let (t, pages, n) = t.await.unwrap();
            assert_eq!(n, 7);
            let ks = keys(&spec, &t);
            for (k, &p) in ks[1..].iter().zip(&pages) {
                assert!(e2.holds(p, k), "page {p} differs from what was saved");
            }
        }
        // A prompt nobody saved: a miss, nothing loaded, counted as missing.
        let fresh = tokens(999, 3);
        let l = e2.client.lookup_pages(&fresh, None, 0).await.unwrap();
        assert_eq!((l.l2_pages, l.l3_pages), (0, 0));
        let n = e2
            .client
            .load_pages(&fresh, None, 0, vec![0, 1, 2], PrefetchPolicy::Unspecified)
            .await
            .unwrap();
        assert_eq!(n, 0);
        let page = a2.metrics_page();
        assert_eq!(
            metric(&page, "kvtier_agent_load_back_pages_total"),
            16.0 * 7.0
        );
        assert_eq!(
            metric(
                &page,
                "kvtier_agent_load_failed_pages_total{reason=\"missing\"}"
            ),
            3.0
        );
        assert_eq!(
            metric(&page, "kvtier_agent_match_pages_total{tier=\"device\"}"),
            16.0
        );
        let page = a1.metrics_page();
        assert_eq!(
            metric(
                &page,
                "kvtier_agent_backup_pages_total{outcome=\"stored\",policy=\"write_through\"}"
            ),
            f64::from(stored)
        );
    });
}

#[test]
fn calls_named_by_parent_key_carry_only_their_pages_and_agree_with_whole_prompt_calls() {
    use kvtier_client::PromptTokens;
    let d = dir("ec-parent");
    let _kvtierd = daemon(&d, &["l2.pool_pages=256", "l3.backend=none"]);
    let spec = mha(0, 1);
    rt().block_on(async {
        let a1 = agent(&d, "ep1", &[]);
        let a2 = agent(&d, "ep2", &[]);
        let mut e1 = Engine::start_cache(&a1, spec.clone(), 64, "ep1").await;
        let mut e2 = Engine::start_cache(&a2, spec.clone(), 64, "ep2").await;
        e1.wait_connected().await;
        e2.wait_connected().await;
        // 12 pages and a partial 13th.
        let t = tokens(4242, 12);
        let mut t = t;
        t.extend([1, 2, 3]);
        let ks = keys(&spec, &t);
        assert_eq!(ks.len(), 12);
        // The first lookup sends the prompt and gets every page's key back.
        let l = e1.client.lookup_with_keys(&t, None, 0, true).await.unwrap();
        assert_eq!((l.l2_pages, l.total_pages), (0, 12));
        assert_eq!(l.keys, ks, "the agent's keys are the hash spec's");
        // Without want_keys none come back.
        let l = e1.client.lookup_pages(&t, None, 0).await.unwrap();
        assert!(l.keys.is_empty());
        for (p, k) in ks.iter().enumerate() {
            e1.compute(p as u32, k);
        }
        // Pages 0..4 with the whole prefix, then 4..12 named by page 3's key: only their
        // tokens travel.
        let r = e1
            .client
            .save_pages(&t[..64], None, 0, (0..4).collect())
            .await
            .unwrap();
        assert_eq!(r.stored, 4, "{r:?}");
        let after = |page: usize| PromptTokens::After {
            parent: ks[page - 1],
            tokens: &t[page * 16..],
        };
        let r = e1
            .client
            .save_pages(after(4), None, 4, (4..12).collect())
            .await
            .unwrap();
        assert_eq!((r.stored, r.failed), (8, 0), "{r:?}");
        // A lookup by parent answers for the pages after it, and their keys.
        let l = e1
            .client
            .lookup_with_keys(after(4), None, 4, true)
            .await
            .unwrap();
        assert_eq!((l.l2_pages, l.total_pages), (8, 12));
        assert_eq!(l.keys, ks[4..].to_vec());
        // Another worker loads pages 2..12 by parent: byte for byte what was saved.
        let pages: Vec<u32> = (20..30).collect();
        let n = e2
            .client
            .load_pages(
                after(2),
                None,
                2,
                pages.clone(),
                PrefetchPolicy::Unspecified,
            )
            .await
            .unwrap();
        assert_eq!(n, 10);
        for (k, &p) in ks[2..].iter().zip(&pages) {
            assert!(e2.holds(p, k), "page {p} differs from what was saved");
        }
        // A parent key that is not the prompt's names other pages: a miss, never its data.
        let wrong = PromptTokens::After {
            parent: ks[5],
            tokens: &t[2 * 16..],
        };
        let l = e2.client.lookup_pages(wrong, None, 2).await.unwrap();
        assert_eq!((l.l2_pages, l.l3_pages), (0, 0));
        // A parent for page 0, which has none, is refused, naming the field.
        let first = PromptTokens::After {
            parent: ks[0],
            tokens: &t[..],
        };
        let (c, m) = code(e2.client.lookup_pages(first, None, 0).await.unwrap_err());
        assert_eq!(c, tonic::Code::InvalidArgument);
        assert!(m.contains("parent_key"), "{m}");
        // Spans are checked against the prompt the parent continues: 3 pages from page 10
        // run past its 12.
        let (c, m) = code(
            e2.client
                .load_pages(
                    after(10),
                    None,
                    10,
                    vec![40, 41, 42],
                    PrefetchPolicy::Unspecified,
                )
                .await
                .unwrap_err(),
        );
        assert_eq!(c, tonic::Code::InvalidArgument);
        assert!(m.contains("12 full pages"), "{m}");
    });
}

#[test]
fn modes_refuse_each_others_calls_and_bad_spans_are_named() {
    let d = dir("ec-bad");
    let _kvtierd = daemon(&d, &["l2.pool_pages=64", "l3.backend=none"]);
    let spec = mha(0, 1);
    rt().block_on(async {
        let a = agent(&d, "ecb", &[]);
        let mut tree = Engine::start(&a, spec.clone(), 16, "ecb-tree").await;
        let t = tokens(5, 3);
        let e = tree.client.lookup_pages(&t, None, 0).await.unwrap_err();
        let (c, m) = code(e);
        assert_eq!(c, tonic::Code::FailedPrecondition);
        assert!(m.contains("Match"), "{m}");
        drop(tree);
        let mut e = Engine::start_cache(&a, spec.clone(), 16, "ecb").await;
        let err = e.client.match_prefix(&t, None).await.unwrap_err();
        let (c, m) = code(err);
        assert_eq!(c, tonic::Code::FailedPrecondition);
        assert!(m.contains("Lookup, Load and Save"), "{m}");
        let err = e
            .client
            .release(kvtier_client::Handle(1))
            .await
            .unwrap_err();
        assert_eq!(code(err).0, tonic::Code::FailedPrecondition);
        let cases: Vec<(u32, Vec<u32>, &str)> = vec![
            (4, vec![], "start_page"),
            (1, vec![0, 1, 2], "device_pages"),
            (0, vec![3, 3], "device_pages[1]"),
            (0, vec![16], "device_pages[0]"),
        ];
        for (start, pages, field) in cases {
            for save in [false, true] {
                let err = if save {
                    e.client
                        .save_pages(&t, None, start, pages.clone())
                        .await
                        .unwrap_err()
                } else {
                    e.client
                        .load_pages(&t, None, start, pages.clone(), PrefetchPolicy::Unspecified)
                        .await
                        .unwrap_err()
                };
                let (c, m) = code(err);
                assert_eq!(c, tonic::Code::InvalidArgument, "{m}");
                assert!(m.starts_with(field), "{field}: {m}");
            }
        }
        let req = e.client.request(v1::LoadPagesRequest {
            packed_tokens: vec![1, 2, 3].into(),
            ..Default::default()
        });
        let err = e.client.raw().load(req).await.unwrap_err();
        assert!(err.message().contains("packed_tokens"), "{}", err.message());
        let req = e.client.request(v1::LoadPagesRequest {
            policy: 99,
            ..Default::default()
        });
        let err = e.client.raw().load(req).await.unwrap_err();
        assert!(err.message().contains("policy"), "{}", err.message());
        // Without the owner token RegisterPool returned, the pool is not served.
        let err = e
            .client
            .raw()
            .load(v1::LoadPagesRequest::default())
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::NotFound, "{}", err.message());
        assert!(
            err.message().contains("kvtier-pool-owner"),
            "{}",
            err.message()
        );
        // The agent serves on after all of it.
        assert!(e.stats().await.pool_registered);
    });
    // write_back needs eviction callbacks the engine never gives: refused at registration.
    let a = agent(&d, "ecwb", &["cache.write_policy=write_back"]);
    rt().block_on(async {
        let mut c = kvtier_client::AgentClient::connect(&a.socket.display().to_string())
            .await
            .unwrap();
        let layout = kvtier_core::Layout::new(spec.clone()).unwrap();
        let pool = kvtier_core::DevicePool::new(layout, 16 * 16).unwrap();
        let region = kvtier_shm::ShmRegion::memfd("ecwb", pool.total_bytes()).unwrap();
        let err = c
            .register_engine_cache(
                &spec,
                16 * 16,
                kvtier_client::PoolMemory::Cpu {
                    fd: std::sync::Arc::new(region.fd().try_clone_to_owned().unwrap()),
                },
            )
            .await
            .unwrap_err();
        let (code, m) = code(err);
        assert_eq!(code, tonic::Code::FailedPrecondition);
        assert!(m.contains("write_back"), "{m}");
    });
}

#[test]
fn selective_saves_what_was_asked_for_again_and_l3_pages_load_through_a_prefetch() {
    let d = dir("ec-sel");
    // A small L2 in front of the file L3: saved pages go on to L3 and are evicted from L2
    // (prefetches may hold half of it, 8 pages: enough for the 6 loaded back).
    let _kvtierd = daemon(&d, &["l2.pool_pages=16", "prefetch.timeout_max=5s"]);
    let spec = mha(0, 1);
    rt().block_on(async {
        let a = agent(
            &d,
            "ecs",
            &[
                "cache.write_policy=write_through_selective",
                "cache.write_threshold=2",
            ],
        );
        let mut e = Engine::start_cache(&a, spec.clone(), 64, "ecs").await;
        e.wait_connected().await;
        let t = tokens(7, 6);
        let ks = keys(&spec, &t);
        for (k, p) in ks.iter().zip(0..) {
            e.compute(p, k);
        }
        // Never asked for before: not saved, counted as skipped.
        let r = e.client.save_pages(&t, None, 0, (0..6).collect()).await.unwrap();
        assert_eq!((r.stored, r.skipped), (0, 6), "{r:?}");
        // Asked for twice (the first four pages by a shorter prompt): those four reach the
        // threshold, the last two do not.
        e.client.lookup_pages(&t, None, 0).await.unwrap();
        e.client.lookup_pages(&t[..64], None, 0).await.unwrap();
        let r = e.client.save_pages(&t, None, 0, (0..6).collect()).await.unwrap();
        assert_eq!((r.stored, r.present, r.skipped, r.failed), (4, 0, 2, 0), "{r:?}");
        e.client.lookup_pages(&t, None, 0).await.unwrap();
        let r = e.client.save_pages(&t, None, 4, vec![4, 5]).await.unwrap();
        assert_eq!((r.stored, r.skipped), (2, 0), "{r:?}");
        // Push them out of the 16-page L2 with other prompts, saved as write_through would.
        for i in 0..6u32 {
            let o = tokens(50 + i, 4);
            for (k, p) in keys(&spec, &o).iter().zip(10..) {
                e.compute(p, k);
            }
            for _ in 0..2 {
                e.client.lookup_pages(&o, None, 0).await.unwrap();
            }
            let r = e.client.save_pages(&o, None, 0, (10..14).collect()).await.unwrap();
            assert_eq!(r.stored + r.present, 4, "{r:?}");
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        let l = loop {
            let l = e.client.lookup_pages(&t, None, 0).await.unwrap();
            if l.l2_pages == 0 && l.l3_pages == 6 {
                break l;
            }
            assert!(std::time::Instant::now() < deadline, "never in L3 only: {l:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        assert_eq!(l.total_pages, 6);
        let pages: Vec<u32> = (30..36).collect();
        let n = e
            .client
            .load_pages(&t, None, 0, pages.clone(), PrefetchPolicy::WaitComplete)
            .await
            .unwrap();
        assert_eq!(n, 6);
        for (k, &p) in ks.iter().zip(&pages) {
            assert!(e.holds(p, k), "page {p} from L3 differs");
        }
        let page = a.metrics_page();
        assert_eq!(
            metric(
                &page,
                "kvtier_agent_backup_pages_total{outcome=\"skipped\",policy=\"write_through_selective\"}"
            ),
            8.0
        );
    });
}

#[test]
fn a_dead_daemon_makes_loads_miss_and_saves_fail_counted_never_hang() {
    let d = dir("ec-dead");
    let mut kvtierd = daemon(&d, &["l2.pool_pages=64", "l3.backend=none"]);
    let spec = mha(0, 1);
    rt().block_on(async {
        let a = agent(&d, "ecd", &["cache.evict_wait=300ms"]);
        let mut e = Engine::start_cache(&a, spec.clone(), 32, "ecd").await;
        e.wait_connected().await;
        let t = tokens(9, 4);
        for (k, p) in keys(&spec, &t).iter().zip(0..) {
            e.compute(p, k);
        }
        let r = e
            .client
            .save_pages(&t, None, 0, (0..4).collect())
            .await
            .unwrap();
        assert_eq!(r.stored, 4);
        kvtierd.kill();
        let started = std::time::Instant::now();
        let n = e
            .client
            .load_pages(&t, None, 0, (10..14).collect(), PrefetchPolicy::Unspecified)
            .await
            .unwrap();
        assert_eq!(n, 0);
        let other = tokens(10, 2);
        let r = e
            .client
            .save_pages(&other, None, 0, vec![20, 21])
            .await
            .unwrap();
        assert_eq!((r.stored, r.failed), (0, 2), "{r:?}");
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{:?}",
            started.elapsed()
        );
        let page = a.metrics_page();
        assert_eq!(
            metric(
                &page,
                "kvtier_agent_lost_pages_total{reason=\"daemon_unreachable\"}"
            ),
            2.0
        );
        assert_eq!(
            metric(
                &page,
                "kvtier_agent_load_failed_pages_total{reason=\"daemon_unreachable\"}"
            ),
            4.0
        );
    });
}

#[test]
fn a_step_saves_every_request_in_one_batch_continuations_in_order_and_a_bad_request_refuses_it_all()
{
    use kvtier_client::{PromptTokens, SaveRequest};
    let d = dir("ec-batch");
    let _kvtierd = daemon(&d, &["l2.pool_pages=512", "l3.backend=none"]);
    let spec = mha(0, 1);
    rt().block_on(async {
        let a = agent(&d, "ecb", &[]);
        let mut e = Engine::start_cache(&a, spec.clone(), 256, "ecb").await;
        e.wait_connected().await;
        // 12 prompts of 6 pages, each computed into its own 6 pages.
        let prompts: Vec<Vec<u32>> = (0..12u32).map(|i| tokens(300 + i, 6)).collect();
        let ks: Vec<_> = prompts.iter().map(|t| keys(&spec, t)).collect();
        for (i, k) in ks.iter().enumerate() {
            for (j, k) in k.iter().enumerate() {
                e.compute((i * 6 + j) as u32, k);
            }
        }
        let pages = |i: usize, from: usize, to: usize| -> Vec<u32> {
            (from..to).map(|j| (i * 6 + j) as u32).collect()
        };
        // One step: every prompt's first 3 pages; prompt 0's last 3 named after its page 2
        // (the same request split in two: it must run after the first part); prompt 1
        // twice (two requests with one prompt: the second finds its pages there).
        let mut batch: Vec<SaveRequest<'_>> = prompts
            .iter()
            .enumerate()
            .map(|(i, t)| SaveRequest {
                tokens: PromptTokens::Whole(&t[..48]),
                namespace: None,
                start_page: 0,
                device_pages: pages(i, 0, 3),
                selected: None,
            })
            .collect();
        batch.push(SaveRequest {
            tokens: PromptTokens::After {
                parent: ks[0][2],
                tokens: &prompts[0][48..],
            },
            namespace: None,
            start_page: 3,
            device_pages: pages(0, 3, 6),
            selected: None,
        });
        batch.push(batch[1].clone());
        let r = e.client.save_batch(&batch).await.unwrap();
        assert_eq!(r.len(), 14);
        for s in &r {
            assert_eq!(
                (s.failed, s.skipped, s.stored + s.present),
                (0, 0, 3),
                "{s:?}"
            );
        }
        assert_eq!(r.iter().map(|s| s.stored).sum::<u32>(), 12 * 3 + 3);
        assert_eq!(r[1].stored + r[13].stored, 3, "prompt 1 is copied once");
        // Everything saved loads back byte for byte into other pages (the engine reused its
        // own at once).
        for p in 0..72 {
            e.wipe(p);
        }
        let n = e
            .client
            .load_pages(
                &prompts[0],
                None,
                0,
                (100..106).collect(),
                PrefetchPolicy::Unspecified,
            )
            .await
            .unwrap();
        assert_eq!(n, 6, "prompt 0's two parts form one prefix in L2");
        for (k, p) in ks[0].iter().zip(100..106) {
            assert!(e.holds(p, k), "page {p} differs from what was saved");
        }
        for i in 1..12 {
            let dst: Vec<u32> = (110..113).collect();
            let n = e
                .client
                .load_pages(
                    &prompts[i][..48],
                    None,
                    0,
                    dst.clone(),
                    PrefetchPolicy::Unspecified,
                )
                .await
                .unwrap();
            assert_eq!(n, 3);
            for (k, &p) in ks[i].iter().zip(&dst) {
                assert!(
                    e.holds(p, k),
                    "prompt {i}: page {p} differs from what was saved"
                );
            }
        }
        let page = a.metrics_page();
        assert_eq!(
            metric(
                &page,
                "kvtier_agent_backup_pages_total{outcome=\"stored\",policy=\"write_through\"}"
            ),
            f64::from(12 * 3 + 3)
        );
        // A batch with one malformed request (a page outside the pool) is refused whole,
        // naming it, before any page moves.
        let fresh = tokens(900, 2);
        let fk = keys(&spec, &fresh);
        e.compute(200, &fk[0]);
        e.compute(201, &fk[1]);
        let good = SaveRequest {
            tokens: PromptTokens::Whole(&fresh),
            namespace: None,
            start_page: 0,
            device_pages: vec![200, 201],
            selected: None,
        };
        let bad = SaveRequest {
            device_pages: vec![202, 9_999],
            ..good.clone()
        };
        let (c, m) = code(e.client.save_batch(&[good.clone(), bad]).await.unwrap_err());
        assert_eq!(c, tonic::Code::InvalidArgument);
        assert!(m.contains("requests[1].device_pages"), "{m}");
        let l = e.client.lookup_pages(&fresh, None, 0).await.unwrap();
        assert_eq!(l.l2_pages, 0, "nothing of a refused batch was saved");
        // Too many requests in one call: refused, naming the limit.
        let many = vec![good.clone(); 4097];
        let (c, m) = code(e.client.save_batch(&many).await.unwrap_err());
        assert_eq!(c, tonic::Code::InvalidArgument);
        assert!(m.contains("requests") && m.contains("4096"), "{m}");
        // And the good request alone goes through.
        let r = e.client.save_batch(&[good]).await.unwrap();
        assert_eq!(r[0].stored, 2);
    });
}

#[test]
fn saves_issued_right_after_registration_all_reach_l2() {
    // The engine saves the pages of its first requests as soon as register_kv_caches
    // returns; the agent's kvtierd session must be up by then (or the saves wait for it),
    // never count them lost to a link that was still coming up.
    let d = dir("ec-first");
    let _kvtierd = daemon(&d, &["l2.pool_pages=256", "l3.backend=none"]);
    let spec = mha(0, 1);
    rt().block_on(async {
        for round in 0..3 {
            let name = format!("ecf{round}");
            let a = agent(&d, &name, &["daemon.reconnect_min=50ms"]);
            let mut e = Engine::start_cache(&a, spec.clone(), 64, &name).await;
            let t = tokens(700 + round, 8);
            let ks = keys(&spec, &t);
            let pages: Vec<u32> = (0..8).collect();
            for (k, &p) in ks.iter().zip(&pages) {
                e.compute(p, k);
            }
            let r = e.client.save_pages(&t, None, 0, pages).await.unwrap();
            assert_eq!((r.failed, r.stored + r.present), (0, 8), "{r:?}");
            let lost = metric(
                &a.metrics_page(),
                "kvtier_agent_lost_pages_total{reason=\"daemon_unreachable\"}",
            );
            assert_eq!(lost, 0.0);
        }
    });
}

#[test]
fn tp_ranks_save_the_pages_the_lookup_selected_though_only_rank_0_sees_lookups() {
    // vLLM with TP = 2: the scheduler looks up through rank 0's agent only; rank 1's agent
    // never counts a lookup. With the selection carried to every rank's Save, both store the
    // same pages (before: rank 0 stored them, rank 1 skipped them all).
    let d = dir("ec-tp");
    let _kvtierd = daemon(&d, &["l2.pool_pages=64", "l3.backend=none"]);
    let sets = [
        "cache.write_policy=write_through_selective",
        "cache.write_threshold=2",
    ];
    rt().block_on(async {
        let a0 = agent(&d, "tp0", &sets);
        let a1 = agent(&d, "tp1", &sets);
        let mut e0 = Engine::start_cache(&a0, mha(0, 2), 16, "tp0").await;
        let mut e1 = Engine::start_cache(&a1, mha(1, 2), 16, "tp1").await;
        let t = tokens(300, 5);
        let short = &t[..3 * 16];
        // Once for the whole prompt, once for its first three pages.
        let first = e0.client.lookup_pages(&t, None, 0).await.unwrap();
        assert_eq!(first.save_pages, Some(0));
        let l = e0.client.lookup_pages(short, None, 0).await.unwrap();
        assert_eq!(l.save_pages, Some(3));
        let pages: Vec<u32> = (0..5).collect();
        let mut stored = Vec::new();
        for (e, spec) in [(&mut e0, mha(0, 2)), (&mut e1, mha(1, 2))] {
            for (k, &p) in keys(&spec, &t).iter().zip(&pages) {
                e.compute(p, k);
            }
            let r = e
                .client
                .save_selected(&t, None, 0, pages.clone(), l.save_pages)
                .await
                .unwrap();
            assert_eq!((r.failed, r.skipped), (0, 2), "{r:?}");
            stored.push(r.stored + r.present);
        }
        assert_eq!(stored, vec![3, 3]);
        // Without the selection rank 1 decides by its own (empty) counts: nothing.
        let r = e1.client.save_pages(&t, None, 3, vec![3, 4]).await.unwrap();
        assert_eq!((r.stored, r.skipped), (0, 2), "{r:?}");
        // Under write_through every page is saved and Lookup selects nothing (unset).
        let a2 = agent(&d, "tpw", &[]);
        let mut e2 = Engine::start_cache(&a2, mha(0, 1), 16, "tpw").await;
        assert_eq!(
            e2.client
                .lookup_pages(&t, None, 0)
                .await
                .unwrap()
                .save_pages,
            None
        );
    });
}

#[test]
fn decode_step_saves_land_in_leased_slots_with_one_kvtierd_call_each() {
    // A decode step completes one page per request: the agent copies it into an L2 slot its
    // session holds leased and lands it with CommitLeased, no Reserve. Another worker loads
    // every page byte for byte, and the lease goes with the agent's session.
    use kvtier_client::PromptTokens;
    let d = dir("ec-lease");
    let kvtierd = daemon(&d, &["l2.pool_pages=1024", "l3.backend=none"]);
    let spec = mha(0, 1);
    let socket = d.join("kvtierd.sock").display().to_string();
    rt().block_on(async {
        let a1 = agent(&d, "el1", &[]);
        let a2 = agent(&d, "el2", &[]);
        let mut e1 = Engine::start_cache(&a1, spec.clone(), 64, "el1").await;
        let mut e2 = Engine::start_cache(&a2, spec.clone(), 64, "el2").await;
        e1.wait_connected().await;
        e2.wait_connected().await;
        let t = tokens(9090, 20);
        let ks = keys(&spec, &t);
        for (p, k) in ks.iter().enumerate() {
            e1.compute(p as u32, k);
        }
        // The prompt: reserved, and its commit leases slots for what follows.
        let r = e1
            .client
            .save_pages(&t[..64], None, 0, (0..4).collect())
            .await
            .unwrap();
        assert_eq!(r.stored, 4, "{r:?}");
        let mut c = kvtier_client::HostClient::connect(&socket).await.unwrap();
        let reserves = c.stats().await.unwrap().reserve_calls;
        // Sixteen decode steps, one page each, named by the page before.
        for page in 4..20usize {
            let after = PromptTokens::After {
                parent: ks[page - 1],
                tokens: &t[page * 16..(page + 1) * 16],
            };
            let r = e1
                .client
                .save_pages(after, None, page as u32, vec![page as u32])
                .await
                .unwrap();
            assert_eq!((r.stored, r.failed), (1, 0), "{r:?}");
        }
        assert_eq!(
            c.stats().await.unwrap().reserve_calls,
            reserves,
            "one-page saves reserved instead of using the lease"
        );
        let leased = || {
            metric(
                &kvtierd.metrics_page(),
                "kvtier_l2_pool_pages{state=\"leased\"}",
            )
        };
        assert!(leased() > 0.0);
        let pages: Vec<u32> = (30..50).collect();
        let n = e2
            .client
            .load_pages(&t[..], None, 0, pages.clone(), PrefetchPolicy::Unspecified)
            .await
            .unwrap();
        assert_eq!(n, 20);
        for (k, &p) in ks.iter().zip(&pages) {
            assert!(e2.holds(p, k), "page {p} differs from what was saved");
        }
        drop(e1);
        drop(a1);
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while leased() > 0.0 {
            assert!(
                std::time::Instant::now() < deadline,
                "the stopped agent's lease was never freed"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
}
