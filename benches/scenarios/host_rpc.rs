//! Round-trip latency of kvtierd's host-tier RPCs over the Unix socket, against an empty gRPC
//! call (grpc.health.v1 Check) on the same socket, measured in the same run.
//!
//! The daemon runs in-process on its own runtime thread (the same `run` the binary calls); the
//! client is a separate runtime, so every call crosses the socket.
//!
//! The 1,000-page pairs also run against their floor, interleaved: the same two calls' bytes
//! each way through a server that does nothing ([`crate::sink`], same settings, socket kind
//! and runtime size), plus the index's own work on the same keys in this thread
//! (`HostIndex`, the pool's size and policy). What a pair takes beyond that floor is
//! kvtierd's own handling (the state lock, events, the sealer's queue, metrics) and the
//! sealer's checksums sharing the cores (their CPU per commit is reported on its own row).
#![allow(clippy::unwrap_used)]

use std::hint::black_box;
use std::time::{Duration, Instant};

use kvtier_client::HostClient;
use kvtier_core::host_index::HostIndex;
use kvtier_core::{DType, KvKind, LayoutSpec, Namespace, PageHasher, PageKey, PolicyKind};
use kvtier_proto::v1;
use prost::Message as _;

/// Pages in the daemon's pool, and in the floor's index.
const POOL: u32 = 65_536;

/// The name of kvtierd's checksum thread (`kvtier_daemon::sealer`).
const SEALER: &str = "kvtierd-sealer";

/// The bytes each way of a call pair on `pages` keys, as the client and kvtierd encode them:
/// (first request, its reply, second request, its reply). Both requests carry the session
/// and the packed keys; the first reply carries a slot per key (numbers near the top of a
/// [`POOL`]-slot pool, 3 varint bytes), with a status per key when `with_status` (Reserve);
/// the second reply is empty (Commit, Release).
fn pair_sizes(pages: usize, with_status: bool) -> [usize; 4] {
    let keyed = v1::AcquireRequest {
        session_id: vec![1; 16],
        keys: Vec::new(),
        packed_keys: vec![1; 32 * pages],
    }
    .encoded_len();
    let slots: Vec<u32> = (0..pages as u32).map(|i| POOL - 1 - i).collect();
    let reply = if with_status {
        v1::ReserveResponse {
            status: vec![1; pages],
            slots,
        }
        .encoded_len()
    } else {
        v1::AcquireResponse { slots }.encoded_len()
    };
    [keyed, reply, keyed, 0]
}

fn pct(mut v: Vec<Duration>, p: f64) -> Duration {
    v.sort_unstable();
    v[((v.len() as f64 - 1.0) * p) as usize]
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// Runs the scenario (`quick`: fewer pages and rounds).
pub fn run(quick: bool) {
    let pool = format!("l2.pool_pages={POOL}");
    let daemon = crate::InProcessDaemon::start("rpc", &[&pool, "l3.backend=none"]);
    let socket = daemon.ready.socket.clone();
    let sink = crate::sink::Sink::start("rpc", 1);

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let target = socket.display().to_string();
        let mut c = HostClient::connect(&target).await.unwrap();
        let spec = LayoutSpec {
            model_id: "bench".into(),
            model_version: String::new(),
            dtype: DType::Bf16,
            num_layers: 2,
            kind: KvKind::Mha { kv_heads: 2, head_dim: 64 },
            page_size: 16,
            tp_rank: 0,
            tp_size: 1,
        };
        let s = c.register("bench", &spec).await.unwrap();
        let mut health = tonic_health::pb::health_client::HealthClient::new(
            kvtier_client::connect(&target).await.unwrap(),
        );
        let hasher = PageHasher::new(16, &Namespace::default()).unwrap();
        let mut seq = 0u32;
        let mut fresh = |n: usize| -> Vec<PageKey> {
            seq += 1;
            let tokens: Vec<u32> = (0..n as u32 * 16).map(|i| seq.wrapping_mul(7_919) ^ (i << 8)).collect();
            hasher.keys(&tokens)
        };
        let iters = |pages: usize| if quick { 50 } else if pages == 1 { 3000 } else { 400 };

        let mut base = Vec::new();
        for _ in 0..iters(1) {
            let t = Instant::now();
            health
                .check(tonic_health::pb::HealthCheckRequest { service: String::new() })
                .await
                .unwrap();
            base.push(t.elapsed());
        }
        let base50 = pct(base.clone(), 0.5);
        crate::say!("kvtierd host-tier RPC round trips over a Unix socket (same-run baseline: empty health check)");
        crate::say!("{:<34} {:>10} {:>10} {:>12}", "operation", "p50 µs", "p99 µs", "p50 / empty");
        crate::say!("{:<34} {:>10.1} {:>10.1} {:>12.2}", "empty call (health check)", us(base50), us(pct(base, 0.99)), 1.0);
        for pages in [1usize, 1000] {
            let mut rc = Vec::new();
            for _ in 0..iters(pages) {
                let keys = fresh(pages);
                let t = Instant::now();
                let r = c.reserve(s.id, None, &keys).await.unwrap();
                assert_eq!(r.len(), pages);
                c.commit(s.id, &keys).await.unwrap();
                rc.push(t.elapsed());
            }
            let keys = fresh(pages);
            c.reserve(s.id, None, &keys).await.unwrap();
            c.commit(s.id, &keys).await.unwrap();
            let mut ar = Vec::new();
            for _ in 0..iters(pages) {
                let t = Instant::now();
                let slots = c.acquire(s.id, &keys).await.unwrap();
                assert_eq!(slots.len(), pages);
                c.release(s.id, &keys).await.unwrap();
                ar.push(t.elapsed());
            }
            for (name, v) in [("reserve+commit", rc), ("acquire+release", ar)] {
                let p50 = pct(v.clone(), 0.5);
                let p99 = pct(v.clone(), 0.99);
                crate::record(
                    &format!("{name} {pages} page(s) p50"),
                    us(p50),
                    "µs",
                    "empty RPC p50",
                    us(base50),
                    Some(base50.as_secs_f64() / p50.as_secs_f64()),
                );
                crate::record(
                    &format!("{name} {pages} page(s) p99"),
                    us(p99),
                    "µs",
                    "empty RPC p50",
                    us(base50),
                    None,
                );
                crate::say!(
                    "{:<34} {:>10.1} {:>10.1} {:>12.2}",
                    format!("{name}, {pages} page(s)"),
                    us(p50),
                    us(pct(v, 0.99)),
                    p50.as_secs_f64() / base50.as_secs_f64()
                );
            }
        }
        // The floor of the 1,000-page pairs, interleaved with them: the same bytes through
        // the sink, and the index's work on the same keys here (also timed on its own).
        let pages = 1000;
        let mut sc = crate::sink::SinkClient::connect(&sink).await;
        let mut index = HostIndex::new(POOL, PolicyKind::default());
        // And kvtierd's whole state (sessions, events, the sealer's queue) in this thread,
        // configured as the daemon is: the index's work plus kvtierd's bookkeeping, no server.
        let (cfg, state_dir) = daemon_config(&pool);
        let mut state = kvtier_daemon::state::HostState::new(&cfg).unwrap();
        let layout = kvtier_core::Layout::new(spec.clone()).unwrap();
        let sid = state
            .register("floor".into(), "", &layout, Instant::now())
            .unwrap()
            .session_id;
        let held = fresh(pages);
        c.reserve(s.id, None, &held).await.unwrap();
        c.commit(s.id, &held).await.unwrap();
        black_box(index.reserve(0, None, &held));
        index.commit(0, &held).unwrap();
        state.reserve(sid, None, &held, Instant::now()).unwrap();
        state.commit(sid, &held, 0, Instant::now()).unwrap();
        let (mut rcs, mut ars) = (Vec::new(), Vec::new());
        let [r1, r2, r3, r4] = pair_sizes(pages, true);
        let [a1, a2, a3, a4] = pair_sizes(pages, false);
        let (mut rc, mut rcf, mut rci) = (Vec::new(), Vec::new(), Vec::new());
        let (mut ar, mut arf, mut ari) = (Vec::new(), Vec::new(), Vec::new());
        // kvtierd's sealer checksums committed pages and seals their records on its own tick
        // (`sealer::PERIOD`), after the commits answered: it meets row and floor alike at
        // random, and its CPU per commit is reported on a row of its own.
        let sealer = crate::thread_cpu::cpu_time(SEALER);
        for _ in 0..iters(pages) {
            let keys = fresh(pages);
            let t = Instant::now();
            c.reserve(s.id, None, &keys).await.unwrap();
            c.commit(s.id, &keys).await.unwrap();
            rc.push(t.elapsed());

            let keys = fresh(pages);
            let t = Instant::now();
            sc.call(r1, r2).await;
            let i = Instant::now();
            black_box(index.reserve(1, None, &keys));
            let mut work = i.elapsed();
            sc.call(r3, r4).await;
            let i = Instant::now();
            index.commit(1, &keys).unwrap();
            work += i.elapsed();
            rcf.push(t.elapsed());
            rci.push(work);

            let t = Instant::now();
            c.acquire(s.id, &held).await.unwrap();
            c.release(s.id, &held).await.unwrap();
            ar.push(t.elapsed());

            let t = Instant::now();
            sc.call(a1, a2).await;
            let i = Instant::now();
            black_box(index.acquire(&held));
            let mut work = i.elapsed();
            sc.call(a3, a4).await;
            let i = Instant::now();
            index.release(&held).unwrap();
            work += i.elapsed();
            arf.push(t.elapsed());
            ari.push(work);

            let keys = fresh(pages);
            let t = Instant::now();
            black_box(state.reserve(sid, None, &keys, Instant::now()).unwrap());
            black_box(state.commit(sid, &keys, 0, Instant::now()).unwrap());
            state.publish_changes();
            rcs.push(t.elapsed());
            // What kvtierd's sealer takes off the state, untimed.
            black_box(state.seal_jobs(usize::MAX));
            let t = Instant::now();
            black_box(state.acquire(sid, &held, Instant::now()).unwrap());
            state.release(sid, &held, Instant::now()).unwrap();
            ars.push(t.elapsed());
        }
        // The last commits' seals, to count their CPU too.
        let window = 2 * kvtier_daemon::sealer::PERIOD;
        crate::thread_cpu::wait_idle(SEALER, window, Duration::from_secs(10));
        let sealer = crate::thread_cpu::cpu_time(SEALER).saturating_sub(sealer) / iters(pages) as u32;
        let mib = (layout.page_bytes() * pages) >> 20;
        crate::say!(
            "kvtierd's sealer: {:.0} µs of CPU per commit of {pages} pages ({mib} MiB checksummed), on its own thread after the commit answered",
            us(sealer)
        );
        crate::record(
            &format!("sealer CPU per commit of {pages} pages ({mib} MiB)"),
            us(sealer),
            "µs",
            "reserve+commit p50",
            us(pct(rc.clone(), 0.5)),
            None,
        );
        crate::say!(
            "the 1,000-page pairs against their floor (interleaved, p50 µs): the same bytes through a no-op server + the index's work here"
        );
        for (name, row, floor, work, whole) in [
            ("reserve+commit", rc, rcf, rci, rcs),
            ("acquire+release", ar, arf, ari, ars),
        ] {
            let (row, floor, work) = (pct(row, 0.5), pct(floor, 0.5), pct(work, 0.5));
            let whole = pct(whole, 0.5);
            crate::say!(
                "{name:<17} {:>8.1}  floor {:>8.1} (index {:>6.1}; kvtierd's state in-process {:>6.1})  floor / pair {:.2}",
                us(row),
                us(floor),
                us(work),
                us(whole),
                floor.as_secs_f64() / row.as_secs_f64()
            );
            crate::record(
                &format!("{name} {pages} pages vs their floor"),
                us(row),
                "µs",
                "no-op server + index",
                us(floor),
                Some(floor.as_secs_f64() / row.as_secs_f64()),
            );
        }
        c.close(s.id).await.unwrap();
        // As kvtierd does when it stops: its pools' files go (their memory with the state).
        for p in state.pools() {
            p.shm.unlink();
        }
        let _ = std::fs::remove_dir_all(&state_dir);
    });
    drop(rt);
    sink.stop();
    daemon.stop();
}

/// A daemon config as [`crate::InProcessDaemon`] gives kvtierd, for the state measured
/// in-process (its pool file in the default shm directory, unlinked at the end).
fn daemon_config(pool: &str) -> (kvtier_config::daemon::DaemonConfig, std::path::PathBuf) {
    let dir = std::env::temp_dir().join(format!("kvtier-bench-rpc-state-{}", std::process::id()));
    let cfg = kvtier_config::daemon::DaemonConfig::load(&kvtier_config::Sources {
        sets: vec![
            format!("data_dir={}", dir.display()),
            pool.to_string(),
            "l3.backend=none".into(),
        ],
        ..kvtier_config::Sources::default()
    })
    .unwrap();
    (cfg, dir)
}
