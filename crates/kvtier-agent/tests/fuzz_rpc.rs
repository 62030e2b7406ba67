//! Property-based fuzzing of every kvtier-agent gRPC method against a live agent and kvtierd:
//! valid engine requests (a real handle, real tokens and device pages) mutated at the byte
//! level, sent many at once. The agent must answer each with a reply or a clean refusal
//! (never `Internal` from its own code, never `Unknown`: a panic), stay up, and the pages it
//! backed up to L2 stay byte-identical. Bounded by `PROPTEST_CASES` (default 100) of 16 calls.
#![allow(missing_docs)]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;
#[path = "../../kvtier-daemon/tests/common/mutate.rs"]
mod mutate;

use common::*;
use kvtier_client::raw::Shape;
use kvtier_proto::v1;
use prost::Message as _;

/// Not a test: the entry point of the kvtierd child processes the tests start.
#[test]
#[ignore = "entry point of test daemons"]
fn daemon_entry() {
    assert!(daemon_child(), "run by the tests, not by hand");
}

fn packed(tokens: &[u32]) -> bytes::Bytes {
    tokens.iter().flat_map(|t| t.to_le_bytes()).collect()
}

/// Every method of the agent, with a valid seed request.
fn methods(
    spec: &kvtier_core::LayoutSpec,
    handle: u64,
    toks: &[u32],
    fresh: &[u32],
) -> Vec<mutate::Method> {
    use Shape::*;
    let m = v1::MatchRequest {
        tokens: toks.to_vec(),
        ..Default::default()
    };
    let ins = v1::InsertRequest {
        packed_tokens: packed(fresh),
        device_pages: (40..40 + (fresh.len() / 16) as u32).collect(),
        ..Default::default()
    };
    let seeds: Vec<(&'static str, Shape, Vec<u8>)> = vec![
        (
            "/kvtier.v1.Agent/RegisterPool",
            Unary,
            v1::RegisterPoolRequest {
                layout: Some(spec.into()),
                num_token_slots: 64 * 16,
                device: Some(v1::register_pool_request::Device::Cpu(v1::CpuPool {
                    memory: vec![7; 16],
                    ..Default::default()
                })),
                engine_cache: false,
            }
            .encode_to_vec(),
        ),
        ("/kvtier.v1.Agent/Match", Unary, m.encode_to_vec()),
        (
            "/kvtier.v1.Agent/MatchBatch",
            Unary,
            v1::MatchBatchRequest {
                requests: vec![m.clone(), m.clone()],
            }
            .encode_to_vec(),
        ),
        (
            "/kvtier.v1.Agent/LoadBack",
            Unary,
            v1::LoadBackRequest {
                handle,
                free_pages: (50..56).collect(),
            }
            .encode_to_vec(),
        ),
        (
            "/kvtier.v1.Agent/Prefetch",
            ServerStream,
            v1::AgentPrefetchRequest {
                handle,
                policy: v1::PrefetchPolicy::BestEffort as i32,
                hints: None,
            }
            .encode_to_vec(),
        ),
        ("/kvtier.v1.Agent/Insert", Unary, ins.encode_to_vec()),
        (
            "/kvtier.v1.Agent/InsertBatch",
            Unary,
            v1::InsertBatchRequest {
                requests: vec![ins.clone()],
            }
            .encode_to_vec(),
        ),
        (
            "/kvtier.v1.Agent/Release",
            Unary,
            v1::AgentReleaseRequest { handle }.encode_to_vec(),
        ),
        (
            "/kvtier.v1.Agent/ReleaseBatch",
            Unary,
            v1::ReleaseBatchRequest {
                handles: vec![handle, handle + 1],
            }
            .encode_to_vec(),
        ),
        (
            "/kvtier.v1.Agent/Evict",
            Unary,
            v1::EvictRequest { pages: 2 }.encode_to_vec(),
        ),
        (
            "/kvtier.v1.Agent/AgentStats",
            Unary,
            v1::AgentStatsRequest {}.encode_to_vec(),
        ),
        (
            "/kvtier.v1.Agent/Lookup",
            Unary,
            v1::PagesLookupRequest {
                packed_tokens: packed(toks),
                namespace: None,
                start_page: 1,
                want_keys: true,
                ..Default::default()
            }
            .encode_to_vec(),
        ),
        (
            "/kvtier.v1.Agent/Lookup",
            Unary,
            v1::PagesLookupRequest {
                packed_tokens: packed(&toks[16..]),
                start_page: 1,
                parent_key: vec![7; 32],
                ..Default::default()
            }
            .encode_to_vec(),
        ),
        (
            "/kvtier.v1.Agent/Load",
            Unary,
            v1::LoadPagesRequest {
                packed_tokens: packed(toks),
                start_page: 1,
                device_pages: (50..53).collect(),
                ..Default::default()
            }
            .encode_to_vec(),
        ),
        (
            "/kvtier.v1.Agent/Save",
            Unary,
            v1::SavePagesRequest {
                packed_tokens: packed(fresh),
                start_page: 0,
                device_pages: (40..40 + (fresh.len() / 16) as u32).collect(),
                ..Default::default()
            }
            .encode_to_vec(),
        ),
        (
            "/kvtier.v1.Agent/SaveBatch",
            Unary,
            v1::SaveBatchRequest {
                requests: vec![v1::SavePagesRequest {
                    packed_tokens: packed(fresh),
                    start_page: 0,
                    device_pages: (40..40 + (fresh.len() / 16) as u32).collect(),
                    ..Default::default()
                }],
            }
            .encode_to_vec(),
        ),
        (
            "/kvtier.v1.Agent/Cancel",
            Unary,
            v1::CancelRequest {
                call_ids: vec!["call-1".into(), "call-2".into()],
            }
            .encode_to_vec(),
        ),
    ];
    seeds
        .into_iter()
        .map(|(path, shape, msg)| (path, shape, vec![msg]))
        .collect()
}

#[test]
fn every_method_survives_mutated_engine_requests_sent_at_once() {
    let d = dir("fuzz");
    let _kvtierd = daemon(&d, &["l2.pool_pages=256", "prefetch.timeout_max=2s"]);
    let spec = mha(0, 1);
    let sock = d.join("kvtierd.sock");
    let rt = rt();
    let mut a = agent(&d, "fz", &[]);
    let toks = tokens(77, 6);
    let ks = keys(&spec, &toks);
    let handle = rt.block_on(async {
        let mut e = Engine::start(&a, spec.clone(), 64, "fz").await;
        e.wait_connected().await;
        e.prefill_and_insert(&toks, &(0..6).collect::<Vec<_>>())
            .await;
        wait_l2(&sock, &spec, &ks, ks.len()).await;
        let m = e.do_match(&toks).await;
        std::mem::forget(e); // keep its pool file registered for the run
        m.handle.0
    });
    let table = methods(&spec, handle, &toks, &tokens(78, 4));
    let target = a.socket.display().to_string();
    mutate::run_batches(&rt, &target, &table, 16, 100);
    assert!(a.child.try_wait().unwrap().is_none(), "the agent exited");
    // The agent still answers, and what it backed up is intact in L2, byte for byte.
    rt.block_on(async {
        let mut c = kvtier_client::AgentClient::connect(&target).await.unwrap();
        c.stats().await.unwrap();
        let mut h = kvtier_client::HostClient::connect(&sock.display().to_string())
            .await
            .unwrap();
        let s = h.register("checker", &spec).await.unwrap();
        let slots = h.acquire(s.id, &ks).await.unwrap();
        assert_eq!(slots.len(), ks.len(), "a backed-up page went missing");
        let mut buf = vec![0u8; s.layout.page_bytes()];
        for (slot, k) in slots.iter().zip(&ks) {
            s.pool.read(*slot, 0, &mut buf).unwrap();
            assert!(buf == page_bytes(k, buf.len()), "a backed-up page changed");
        }
        h.release(s.id, &ks).await.unwrap();
    });
    let _ = std::fs::remove_file(format!(
        "/dev/shm/kvtier-agent-test-{}-fz",
        std::process::id()
    ));
}
