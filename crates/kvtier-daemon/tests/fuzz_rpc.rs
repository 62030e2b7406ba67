//! Property-based fuzzing of every kvtierd gRPC method against a live daemon: valid requests
//! (with a real session id and real page keys) mutated at the byte level, sent many at once.
//! The daemon must answer each with a reply or a clean refusal (never `Internal` from its own
//! code, never `Unknown`: a panic), stay up, and keep every stored page byte-identical.
//!
//! Bounded: a fixed number of cases (`PROPTEST_CASES`, default 200) of 24 calls each.
//! Destructive admin calls (Clear, Drain, Flush, AttachBackend, DetachBackend) are left out:
//! they empty tiers on purpose; their input checks are tested in admin.rs.
#![allow(missing_docs)]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;
#[path = "common/mutate.rs"]
mod mutate;

use common::*;
use kvtier_client::HostClient;
use kvtier_client::raw::Shape;
use kvtier_proto::v1;
use prost::Message as _;

/// Every method of kvtierd's Unix socket, with a valid seed request.
/// `sid` is the session the seeds use; `closing` the one the Close seed ends (so one Close
/// does not turn every later call into NotFound).
fn methods(
    sid: &[u8],
    closing: &[u8],
    keys: &[Vec<u8>],
    spec: &kvtier_core::LayoutSpec,
) -> Vec<mutate::Method> {
    use Shape::*;
    let enc = |m: &dyn Fn() -> Vec<u8>| vec![m()];
    let packed: Vec<u8> = keys.concat();
    let layout = kvtier_core::Layout::new(spec.clone()).unwrap();
    let sid = sid.to_vec();
    let k = keys.to_vec();
    vec![
        (
            "/kvtier.v1.HostTier/Register",
            Unary,
            enc(&|| {
                v1::RegisterRequest {
                    name: "fuzz".into(),
                    layout: Some(spec.into()),
                    hash_self_test: Some(
                        kvtier_client::self_test(layout.page_size(), &Default::default()).unwrap(),
                    ),
                    expected_layout: Some((&layout).into()),
                }
                .encode_to_vec()
            }),
        ),
        (
            "/kvtier.v1.HostTier/Heartbeat",
            Unary,
            enc(&|| {
                v1::HeartbeatRequest {
                    session_id: sid.clone(),
                    report: Some(v1::ClientReport {
                        matches: 3,
                        ..Default::default()
                    }),
                }
                .encode_to_vec()
            }),
        ),
        (
            "/kvtier.v1.HostTier/Close",
            Unary,
            enc(&|| {
                v1::CloseRequest {
                    session_id: closing.to_vec(),
                }
                .encode_to_vec()
            }),
        ),
        (
            "/kvtier.v1.HostTier/Lookup",
            Unary,
            enc(&|| {
                v1::LookupRequest {
                    session_id: sid.clone(),
                    keys: k.clone(),
                    include_storage: true,
                    each_key: true,
                    ..Default::default()
                }
                .encode_to_vec()
            }),
        ),
        (
            "/kvtier.v1.HostTier/Lookup",
            Unary,
            enc(&|| {
                v1::LookupRequest {
                    session_id: sid.clone(),
                    packed_keys: packed.clone(),
                    ..Default::default()
                }
                .encode_to_vec()
            }),
        ),
        (
            "/kvtier.v1.HostTier/Reserve",
            Unary,
            enc(&|| {
                v1::ReserveRequest {
                    session_id: sid.clone(),
                    keys: k.clone(),
                    parent: k[0].clone(),
                    ..Default::default()
                }
                .encode_to_vec()
            }),
        ),
        (
            "/kvtier.v1.HostTier/Commit",
            Unary,
            enc(&|| {
                v1::CommitRequest {
                    session_id: sid.clone(),
                    keys: k.clone(),
                    ..Default::default()
                }
                .encode_to_vec()
            }),
        ),
        (
            "/kvtier.v1.HostTier/CommitLeased",
            Unary,
            enc(&|| {
                v1::CommitLeasedRequest {
                    session_id: sid.clone(),
                    packed_keys: packed.clone(),
                    parent: k[0].clone(),
                    slots: vec![0, 1, u32::MAX],
                    want: u32::MAX,
                }
                .encode_to_vec()
            }),
        ),
        (
            "/kvtier.v1.HostTier/Abort",
            Unary,
            enc(&|| {
                v1::AbortRequest {
                    session_id: sid.clone(),
                    packed_keys: packed.clone(),
                    ..Default::default()
                }
                .encode_to_vec()
            }),
        ),
        (
            "/kvtier.v1.HostTier/Acquire",
            Unary,
            enc(&|| {
                v1::AcquireRequest {
                    session_id: sid.clone(),
                    keys: k.clone(),
                    ..Default::default()
                }
                .encode_to_vec()
            }),
        ),
        (
            "/kvtier.v1.HostTier/Release",
            Unary,
            enc(&|| {
                v1::ReleaseRequest {
                    session_id: sid.clone(),
                    keys: k.clone(),
                    ..Default::default()
                }
                .encode_to_vec()
            }),
        ),
        (
            "/kvtier.v1.HostTier/Stats",
            Unary,
            enc(&|| v1::StatsRequest {}.encode_to_vec()),
        ),
        (
            "/kvtier.v1.HostTier/Prefetch",
            ServerStream,
            enc(&|| {
                v1::PrefetchRequest {
                    session_id: sid.clone(),
                    request_id: "r1".into(),
                    keys: k.clone(),
                    policy: v1::PrefetchPolicy::Timeout as i32,
                    hints: Some(v1::PrefetchHints {
                        timeout_ms: 50,
                        threshold_tokens: Some(0),
                        recompute_tokens_per_second: 0,
                        whole_load_pages: 0,
                    }),
                    ..Default::default()
                }
                .encode_to_vec()
            }),
        ),
        (
            "/kvtier.v1.HostTier/PrefetchStatus",
            Unary,
            enc(&|| {
                v1::PrefetchStatusRequest {
                    session_id: sid.clone(),
                    request_id: "r1".into(),
                }
                .encode_to_vec()
            }),
        ),
        (
            "/kvtier.v1.HostTier/TakePrefetch",
            Unary,
            enc(&|| {
                v1::TakePrefetchRequest {
                    session_id: sid.clone(),
                    request_id: "r1".into(),
                }
                .encode_to_vec()
            }),
        ),
        (
            "/kvtier.v1.HostTier/ReleasePrefetch",
            Unary,
            enc(&|| {
                v1::ReleasePrefetchRequest {
                    session_id: sid.clone(),
                    request_id: "r1".into(),
                }
                .encode_to_vec()
            }),
        ),
        (
            "/kvtier.v1.HostTier/WatchMetrics",
            ServerStream,
            enc(&|| v1::WatchMetricsRequest { interval_ms: 10 }.encode_to_vec()),
        ),
        (
            "/kvtier.v1.HostTier/WatchEvents",
            ServerStream,
            enc(&|| {
                v1::WatchEventsRequest {
                    stream_id: 7,
                    after_seq: 3,
                }
                .encode_to_vec()
            }),
        ),
        (
            "/kvtier.v1.HostTier/Locate",
            Unary,
            enc(&|| {
                v1::LocateRequest {
                    layout: "00112233445566778899aabbccddeeff".into(),
                    packed_keys: packed.clone(),
                    tokens: vec![1, 2, 3, 4],
                    page_size: 2,
                    include_storage: true,
                    ..Default::default()
                }
                .encode_to_vec()
            }),
        ),
        (
            "/kvtier.v1.ObjectStorage/Get",
            ServerStream,
            enc(&|| {
                v1::GetObjectRequest {
                    name: "fz/00".into(),
                    max_chunk: 4096,
                }
                .encode_to_vec()
            }),
        ),
        (
            "/kvtier.v1.ObjectStorage/Set",
            ClientStream,
            vec![
                v1::SetObjectChunk {
                    name: "fz/01".into(),
                    total_len: 6,
                    data: bytes::Bytes::from_static(b"abc"),
                }
                .encode_to_vec(),
                v1::SetObjectChunk {
                    data: bytes::Bytes::from_static(b"def"),
                    ..Default::default()
                }
                .encode_to_vec(),
            ],
        ),
        (
            "/kvtier.v1.ObjectStorage/Exists",
            Unary,
            enc(&|| {
                v1::ExistsRequest {
                    names: vec!["fz/00".into(), "fz/01".into()],
                }
                .encode_to_vec()
            }),
        ),
        (
            "/kvtier.v1.ObjectStorage/Delete",
            Unary,
            enc(&|| {
                v1::DeleteObjectRequest {
                    name: "fz/02".into(),
                }
                .encode_to_vec()
            }),
        ),
        (
            "/kvtier.v1.Admin/BackendStatus",
            Unary,
            enc(&|| v1::BackendStatusRequest {}.encode_to_vec()),
        ),
        (
            "/kvtier.v1.Admin/RunningConfig",
            Unary,
            enc(&|| v1::RunningConfigRequest {}.encode_to_vec()),
        ),
    ]
}

#[test]
fn every_method_survives_mutated_requests_sent_at_once() {
    // Prefetches end within 2 s whatever their hints ask; the main session outlives the run.
    let mut d = Daemon::start(
        "fuzz",
        &[
            "l2.pool_pages=96",
            "prefetch.negative_ttl=0s",
            "prefetch.timeout_max=2s",
            "sessions.ttl=1h",
        ],
    );
    let rt = rt();
    let spec = layout("fuzz");
    let keys = chain(21, 12);
    let (pages, sid, closing) = rt.block_on(async {
        let mut c = HostClient::connect(&d.target()).await.unwrap();
        let s = c.register("owner", &spec).await.unwrap();
        let pages = store(&mut c, &s, &keys).await;
        let closing = c.register("closed-by-the-fuzzer", &spec).await.unwrap();
        (
            pages,
            s.id.to_bytes().to_vec(),
            closing.id.to_bytes().to_vec(),
        )
    });
    let raw_keys: Vec<Vec<u8>> = keys.iter().map(|k| k.as_bytes().to_vec()).collect();
    let table = methods(&sid, &closing, &raw_keys, &spec);
    mutate::run_batches(&rt, &d.target(), &table, 24, 200);
    assert!(d.child.try_wait().unwrap().is_none(), "kvtierd exited");
    // Still up, and every stored page is still there, byte for byte, for a new client.
    rt.block_on(async {
        let mut c = HostClient::connect(&d.target()).await.unwrap();
        let s = c.register("checker", &spec).await.unwrap();
        let slots = c.acquire(s.id, &keys).await.unwrap();
        assert_eq!(slots.len(), keys.len(), "a stored page went missing");
        let mut buf = vec![0u8; s.layout.page_bytes()];
        for (slot, want) in slots.iter().zip(&pages) {
            s.pool.read(*slot, 0, &mut buf).unwrap();
            assert!(buf == *want, "a stored page changed");
        }
        c.release(s.id, &keys).await.unwrap();
    });
}
