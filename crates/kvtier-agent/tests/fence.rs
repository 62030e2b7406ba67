//! Each engine call's copy fence, end to end with real processes: a Load or Save that the
//! agent reads after its client gave up (a stopped agent, resumed) copies nothing into or out
//! of the engine's pages, stores nothing, and holds no pin or reservation in kvtierd
//! afterwards; each page is counted `late`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use kvtier_proto::v1::PrefetchPolicy;

/// Not a test: the entry point of the kvtierd child processes the tests start.
#[test]
#[ignore = "entry point of test daemons"]
fn daemon_entry() {
    assert!(daemon_child(), "run by the tests, not by hand");
}

fn signal(p: &Proc, sig: &str) {
    let ok = Command::new("kill")
        .args([sig, &p.child.id().to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill {sig} failed");
}

/// kvtierd's pinned and reserved (being written) pages, over all pools.
async fn held(socket: &std::path::Path) -> (u32, u32) {
    let mut c = kvtier_client::HostClient::connect(&socket.display().to_string())
        .await
        .unwrap();
    let st = c.stats().await.unwrap();
    st.pools.iter().fold((0, 0), |(p, w), s| {
        (p + s.pinned_pages, w + s.writing_pages)
    })
}

#[test]
fn calls_read_after_their_deadline_copy_nothing_and_hold_nothing() {
    let d = dir("fence-late");
    let _kvtierd = daemon(&d, &["l2.pool_pages=64", "l3.backend=none"]);
    let sock = d.join("kvtierd.sock");
    let spec = mha(0, 1);
    rt().block_on(async {
        let a = agent(&d, "fl", &[]);
        let mut e = Engine::start_cache(&a, spec.clone(), 32, "fl").await;
        e.wait_connected().await;
        // A prompt in L2, and a second one computed into pages 4..8 but not yet saved.
        let t = tokens(41, 4);
        let u = tokens(42, 4);
        for (k, p) in keys(&spec, &t).iter().zip(0..) {
            e.compute(p, k);
        }
        for (k, p) in keys(&spec, &u).iter().zip(4..) {
            e.compute(p, k);
        }
        let r = e
            .client
            .save_pages(&t, None, 0, (0..4).collect())
            .await
            .unwrap();
        assert_eq!(r.stored, 4);

        // The agent stops; a Load into pages 10..14 and a Save of pages 4..8 go out with a
        // 300 ms deadline and time out; the agent resumes and reads both late.
        signal(&a, "-STOP");
        let mut c = e.client.clone();
        c.set_call_timeout(Some(Duration::from_millis(300)));
        let (mut lc, mut sc) = (c.clone(), c.clone());
        let (t2, u2) = (t.clone(), u.clone());
        let load = tokio::spawn(async move {
            lc.load_pages(
                &t2,
                None,
                0,
                (10..14).collect(),
                PrefetchPolicy::Unspecified,
            )
            .await
        });
        let save = tokio::spawn(async move { sc.save_pages(&u2, None, 0, (4..8).collect()).await });
        assert!(load.await.unwrap().is_err(), "the load did not time out");
        assert!(save.await.unwrap().is_err(), "the save did not time out");
        tokio::time::sleep(Duration::from_millis(700)).await;
        signal(&a, "-CONT");
        let resumed = Instant::now();

        // Within a second: counted late, nothing pinned or reserved in kvtierd.
        let page = loop {
            let page = a.metrics_page();
            let late_loads = metric(
                &page,
                "kvtier_agent_load_failed_pages_total{reason=\"late\"}",
            );
            let late_saves = metric(&page, "kvtier_agent_lost_pages_total{reason=\"late\"}");
            if late_loads == 4.0 && late_saves == 4.0 && held(&sock).await == (0, 0) {
                break page;
            }
            assert!(
                resumed.elapsed() < Duration::from_secs(1),
                "after 1 s: late loads {late_loads}, late saves {late_saves}, kvtierd \
                 (pinned, writing) {:?}",
                held(&sock).await
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        assert_eq!(
            metric(&page, "kvtier_agent_load_back_pages_total"),
            0.0,
            "a late load counted pages loaded"
        );
        // Nothing moved: the load's pages are as the engine left them (zero), and L2 holds
        // none of the late save's pages.
        for p in 10..14 {
            assert!(
                !keys(&spec, &t).iter().any(|k| e.holds(p, k)),
                "late load wrote page {p}"
            );
        }
        assert_eq!(l2_pages(&sock, &spec, &keys(&spec, &u)).await, 0);

        // The agent is well: the same calls in time load and save every page.
        let n = c
            .load_pages(&t, None, 0, (10..14).collect(), PrefetchPolicy::Unspecified)
            .await
            .unwrap();
        assert_eq!(n, 4);
        for (k, p) in keys(&spec, &t).iter().zip(10..) {
            assert!(e.holds(p, k), "page {p} did not load");
        }
        let r = c.save_pages(&u, None, 0, (4..8).collect()).await.unwrap();
        assert_eq!(r.stored, 4, "{r:?}");
        assert_eq!(held(&sock).await, (0, 0));
    });
}
