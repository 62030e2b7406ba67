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

/// "Computes" the pages of prompt `toks` into device pages `first..`.
fn compute(e: &Engine, spec: &kvtier_core::LayoutSpec, toks: &[u32], first: u32) {
    for (k, p) in keys(spec, toks).iter().zip(first..) {
        e.compute(p, k);
    }
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
        compute(&e, &spec, &t, 0);
        compute(&e, &spec, &u, 4);
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

/// Polls until kvtierd holds no pin and no reservation; panics after `within`.
async fn nothing_held_within(sock: &std::path::Path, since: Instant, within: Duration) {
    loop {
        let h = held(sock).await;
        if h == (0, 0) {
            return;
        }
        assert!(
            since.elapsed() < within,
            "kvtierd still holds (pinned, writing) {h:?} after {:?}",
            since.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[test]
fn a_load_waiting_on_l3_when_its_client_gives_up_unpins_at_once() {
    let d = dir("fence-l3");
    // L3 answers every read 8 s late; L2 holds 32 pages.
    let _kvtierd = daemon(
        &d,
        &[
            "l2.pool_pages=32",
            "l3.backend=memory",
            "l3.fault_get_delay=8s",
        ],
    );
    let sock = d.join("kvtierd.sock");
    let spec = mha(0, 1);
    rt().block_on(async {
        let a = agent(&d, "fl3", &[]);
        let mut e = Engine::start_cache(&a, spec.clone(), 64, "fl3").await;
        e.wait_connected().await;
        // P's 8 pages go to L2 and L3; ten other prompts push them out of L2; P's first 4
        // pages come back to L2. A Load of P then pins 4 pages in L2 and waits on L3.
        let p = tokens(71, 8);
        compute(&e, &spec, &p, 0);
        e.client
            .save_pages(&p, None, 0, (0..8).collect())
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(1000)).await;
        for i in 0..10 {
            let t = tokens(200 + i, 8);
            compute(&e, &spec, &t, 8);
            e.client
                .save_pages(&t, None, 0, (8..16).collect())
                .await
                .unwrap();
        }
        e.client
            .save_pages(&p[..4 * 16], None, 0, (0..4).collect())
            .await
            .unwrap();
        let mut c = e.client.clone();
        c.set_call_timeout(Some(Duration::from_millis(300)));
        let t0 = Instant::now();
        let r = c
            .load_pages(
                &p,
                None,
                0,
                (40..48).collect(),
                PrefetchPolicy::WaitComplete,
            )
            .await;
        assert!(matches!(r, Ok(0) | Err(_)), "{r:?}");
        // Before: the pins stayed until L3 answered or daemon.timeout (1.8-4.8 s).
        nothing_held_within(&sock, t0, Duration::from_secs(1)).await;
        for pg in 40..48 {
            assert!(
                !keys(&spec, &p).iter().any(|k| e.holds(pg, k)),
                "page {pg} loaded after its call gave up"
            );
        }
    });
}

#[test]
fn sessions_given_up_while_kvtierd_stalled_are_closed_once_it_answers() {
    let d = dir("fence-stall");
    let kvtierd = daemon(&d, &["l2.pool_pages=256", "l3.backend=none"]);
    let sock = d.join("kvtierd.sock");
    let spec = mha(0, 1);
    rt().block_on(async {
        let a = agent(&d, "fst", &["daemon.timeout=500ms"]);
        let mut e = Engine::start_cache(&a, spec.clone(), 64, "fst").await;
        e.wait_connected().await;
        let p = tokens(81, 4);
        compute(&e, &spec, &p, 0);
        e.client
            .save_pages(&p, None, 0, (0..4).collect())
            .await
            .unwrap();
        // kvtierd stalls; loads pile up in its socket and time out; the agent gives its
        // session up. Resumed, kvtierd serves the queued calls: pins for the old session.
        signal(&kvtierd, "-STOP");
        let mut calls = Vec::new();
        for i in 0..16u32 {
            let mut c = e.client.clone();
            c.set_call_timeout(Some(Duration::from_millis(200)));
            let p = p.clone();
            calls.push(tokio::spawn(async move {
                let pages = (16 + 4 * (i % 8)..20 + 4 * (i % 8)).collect();
                c.load_pages(&p, None, 0, pages, PrefetchPolicy::Unspecified)
                    .await
            }));
        }
        for call in calls {
            let _ = call.await.unwrap();
        }
        tokio::time::sleep(Duration::from_millis(1200)).await;
        signal(&kvtierd, "-CONT");
        let resumed = Instant::now();
        // Before: the old session held its pins until its lease ran out (about 13 s).
        e.wait_connected().await;
        nothing_held_within(&sock, resumed, Duration::from_secs(3)).await;
        let mut h = kvtier_client::HostClient::connect(&sock.display().to_string())
            .await
            .unwrap();
        let sessions = h.stats().await.unwrap().sessions;
        assert_eq!(sessions.len(), 1, "{sessions:?}");
    });
}

#[test]
fn a_cancelled_call_moves_no_byte_after_cancel_answers() {
    let d = dir("fence-cancel");
    let pages = 4096u32;
    let kvtierd = daemon(
        &d,
        &[&format!("l2.pool_pages={}", pages + 64), "l3.backend=none"],
    );
    let spec = mha(0, 1);
    rt().block_on(async {
        let a = agent(&d, "fc", &[]);
        let mut e = Engine::start_cache(&a, spec.clone(), 2 * u64::from(pages), "fc").await;
        e.wait_connected().await;
        // A long prompt in L2 (64 MiB); a Load of it into the other half of the pool, named
        // "load-1", is cancelled while it copies.
        let t = tokens(91, pages as usize);
        compute(&e, &spec, &t, 0);
        let r = e
            .client
            .save_pages(&t, None, 0, (0..pages).collect())
            .await
            .unwrap();
        assert_eq!(r.stored, pages);
        let ks = keys(&spec, &t);
        let mut c = e.client.clone();
        // A few tries: on a busy machine the load may end before the Cancel reaches it.
        let mut cancelled_once = false;
        for attempt in 0..5 {
            let id = format!("load-{attempt}");
            let mut lc = e.client.clone();
            lc.set_call_id(Some(&id)).unwrap();
            let t2 = t.clone();
            let load = tokio::spawn(async move {
                lc.load_pages(
                    &t2,
                    None,
                    0,
                    (pages..2 * pages).collect(),
                    PrefetchPolicy::Unspecified,
                )
                .await
            });
            // Cancel as soon as the agent runs it (an id no call runs under yet is
            // remembered, and that call, arriving later, copies nothing).
            let cancelled = loop {
                let n = c.cancel(&[&id]).await.unwrap();
                if n == 1 || load.is_finished() {
                    break n;
                }
                tokio::task::yield_now().await;
            };
            // From here the pages are the engine's: it reuses them (zeroes), and nothing
            // the cancelled load still had to copy lands on them.
            for p in pages..2 * pages {
                e.wipe(p);
            }
            let loaded = load.await.unwrap();
            tokio::time::sleep(Duration::from_millis(200)).await;
            let written = (pages..2 * pages)
                .filter(|&p| e.holds(p, &ks[(p - pages) as usize]))
                .count();
            assert_eq!(written, 0, "{written} pages written after Cancel answered");
            if cancelled == 1 {
                assert!(
                    loaded.as_ref().map_or(true, |&n| n < pages),
                    "a cancelled load reported every page loaded: {loaded:?}"
                );
                cancelled_once = true;
                break;
            }
        }
        assert!(
            cancelled_once,
            "every load ended before its Cancel reached it"
        );
        let late = metric(
            &a.metrics_page(),
            "kvtier_agent_load_failed_pages_total{reason=\"late\"}",
        );
        assert!(late > 0.0, "no page counted late");

        // A Cancel that overtakes its call (sent first): the call, arriving later under the
        // cancelled id, copies nothing.
        assert_eq!(c.cancel(&["early"]).await.unwrap(), 0);
        let mut ec = e.client.clone();
        ec.set_call_id(Some("early")).unwrap();
        let r = ec
            .load_pages(
                &t,
                None,
                0,
                (pages..pages + 8).collect(),
                PrefetchPolicy::Unspecified,
            )
            .await;
        assert!(r.as_ref().map_or(true, |&n| n == 0), "{r:?}");
        assert!(
            (pages..pages + 8).all(|p| !e.holds(p, &ks[(p - pages) as usize])),
            "a call under a cancelled id copied"
        );

        // Bad ids are refused, naming the field.
        let e400 = c.cancel(&[""]).await.unwrap_err().to_string();
        assert!(e400.contains("call_ids[0]"), "{e400}");
        let many: Vec<String> = (0..300).map(|i| i.to_string()).collect();
        let refs: Vec<&str> = many.iter().map(String::as_str).collect();
        let e400 = c.cancel(&refs).await.unwrap_err().to_string();
        assert!(e400.contains("at most 256"), "{e400}");
        // Two calls in flight under one id: the second is refused, naming the header. The
        // first waits on a stopped kvtierd meanwhile.
        signal(&kvtierd, "-STOP");
        let mut x = e.client.clone();
        x.set_call_id(Some("dup")).unwrap();
        x.set_call_timeout(Some(Duration::from_secs(3)));
        let (mut x1, mut x2) = (x.clone(), x.clone());
        let (ta, tb) = (t.clone(), t.clone());
        let one = tokio::spawn(async move {
            x1.load_pages(
                &ta,
                None,
                0,
                (pages..pages + 8).collect(),
                PrefetchPolicy::Unspecified,
            )
            .await
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        let two = x2
            .load_pages(&tb, None, 0, vec![pages + 8], PrefetchPolicy::Unspecified)
            .await
            .unwrap_err()
            .to_string();
        signal(&kvtierd, "-CONT");
        assert!(two.contains("kvtier-call-id"), "{two}");
        let _ = one.await.unwrap();
    });
}
