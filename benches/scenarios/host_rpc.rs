//! Round-trip latency of kvtierd's host-tier RPCs over the Unix socket, against an empty gRPC
//! call (grpc.health.v1 Check) on the same socket, measured in the same run.
//!
//! The daemon runs in-process on its own runtime thread (the same `run` the binary calls); the
//! client is a separate runtime, so every call crosses the socket.
#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use kvtier_client::HostClient;
use kvtier_core::{DType, KvKind, LayoutSpec, Namespace, PageHasher, PageKey};

fn pct(mut v: Vec<Duration>, p: f64) -> Duration {
    v.sort_unstable();
    v[((v.len() as f64 - 1.0) * p) as usize]
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// Runs the scenario (`quick`: fewer pages and rounds).
pub fn run(quick: bool) {
    let daemon = crate::InProcessDaemon::start("rpc", &["l2.pool_pages=65536", "l3.backend=none"]);
    let socket = daemon.ready.socket.clone();

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
        c.close(s.id).await.unwrap();
    });
    drop(rt);
    daemon.stop();
}
