//! What one client can make kvtierd hold (issue 39, item 7): pools of layouts nobody uses
//! any more are given back, at once when a new layout needs their place, a client's layout
//! cannot make a pool of any size, and an unfinished object upload holds nothing for long.
#![allow(missing_docs)]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::*;
use kvtier_client::HostClient;

#[test]
fn throwaway_layouts_give_their_place_and_their_memory_back() {
    let d = Daemon::start(
        "pool-reclaim",
        &[
            "l2.max_pools=2",
            "l2.pool_pages=8",
            "l3.backend=none",
            "l2.idle_pool_ttl=0s",
        ],
    );
    rt().block_on(async {
        let mut c = HostClient::connect(&d.target()).await.unwrap();
        // Two models come and go.
        let a = c.register("a", &layout("model-a")).await.unwrap();
        store(&mut c, &a, &chain(1, 2)).await;
        let a_file = a.pool_path.clone();
        c.close(a.id).await.unwrap();
        let b = c.register("b", &layout("model-b")).await.unwrap();
        c.close(b.id).await.unwrap();
        // A third takes the place of the least recently used (a), whose file goes.
        let third = c.register("c", &layout("model-c")).await.unwrap();
        assert!(!a_file.exists(), "the reclaimed pool's file stayed");
        let m = d.metrics();
        assert_eq!(metric(&m, "kvtier_l2_pools_reclaimed_total"), 1.0);
        assert_eq!(
            metric(&m, "kvtier_l2_lost_pages_total{reason=\"no_l3\"}"),
            2.0,
            "a's pages were dropped uncounted"
        );
        // b goes for the next; with both pools in use, a fifth layout is refused.
        let fourth = c.register("d", &layout("model-d")).await.unwrap();
        let e = c.register("e", &layout("model-e")).await.unwrap_err();
        assert_eq!(e.code(), Some(tonic::Code::ResourceExhausted), "{e}");
        assert!(e.to_string().contains("l2.max_pools"), "{e}");
        // The pools in use kept their pages.
        store(&mut c, &third, &chain(3, 2)).await;
        assert_eq!(c.lookup(third.id, &chain(3, 2)).await.unwrap(), 2);
        drop(fourth);
    });
}

#[test]
fn an_unused_pool_goes_after_its_idle_time() {
    let d = Daemon::start(
        "pool-idle",
        &[
            "l2.pool_pages=8",
            "l3.backend=none",
            "sessions.ttl=1s",
            "l2.idle_pool_ttl=1s",
        ],
    );
    let file = rt().block_on(async {
        let mut c = HostClient::connect(&d.target()).await.unwrap();
        let s = c.register("gone", &layout("idle")).await.unwrap();
        c.close(s.id).await.unwrap();
        s.pool_path.clone()
    });
    assert!(file.exists());
    eventually("the idle pool to go", Duration::from_secs(10), || {
        !file.exists()
    });
    assert_eq!(metric(&d.metrics(), "kvtier_l2_pools"), 0.0);
}

#[test]
fn a_layout_cannot_make_a_pool_of_any_size() {
    // 16 KiB pages (common::layout) against a 8 KiB bound.
    let d = Daemon::start("page-bound", &["l2.pool_pages=4", "l2.max_page_bytes=8KiB"]);
    rt().block_on(async {
        let mut c = HostClient::connect(&d.target()).await.unwrap();
        let e = c.register("huge", &layout("huge")).await.unwrap_err();
        assert_eq!(e.code(), Some(tonic::Code::InvalidArgument), "{e}");
        assert!(e.to_string().contains("l2.max_page_bytes"), "{e}");
    });
    assert_eq!(metric(&d.metrics(), "kvtier_l2_pools"), 0.0);
}

#[test]
fn an_upload_of_empty_chunks_is_refused_at_the_first() {
    use kvtier_proto::v1;
    let d = Daemon::start("upload-empty", &["l3.backend=memory"]);
    rt().block_on(async {
        let ch = kvtier_client::connect(&d.target()).await.unwrap();
        let mut c = v1::object_storage_client::ObjectStorageClient::new(ch);
        let first = v1::SetObjectChunk {
            name: "ab/cd".into(),
            total_len: 1 << 20,
            data: Default::default(),
        };
        let empties = (0..100_000).map(|_| v1::SetObjectChunk::default());
        let chunks = tokio_stream::iter(std::iter::once(first).chain(empties));
        let e = c.set(chunks).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e}");
        assert!(e.message().contains("empty chunk"), "{e}");
        // Nothing was stored.
        let found = c
            .exists(v1::ExistsRequest {
                names: vec!["ab/cd".into()],
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(found.leading, 0);
    });
}
