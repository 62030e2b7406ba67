//! Peer comparison: kvtierd against Mooncake Store doing the same job — put and get of 2 MiB
//! pages, same machine, same run. kvtierd is measured on both of its paths: the shared-memory
//! path (reserve → copy into the mapped slot → commit; acquire → copy out → release) and its
//! byte-streaming ObjectStorage service (the remote backend, gRPC over loopback TCP).
//! Mooncake Store runs through `benches/peers/mooncake_put_get.py` (one client with its own
//! segment, TCP transport, its master on loopback) when `KVTIER_PEER_MOONCAKE` holds the
//! command — `benches/peers/run` sets everything up. Without it, kvtierd's figures are
//! reported alone.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use kvtier_client::{HostClient, Reserved};
use kvtier_core::{DType, KvKind, Layout, LayoutSpec, Namespace, PageHasher};
use kvtier_storage::Store;

use crate::median;

/// Mooncake's put and get bytes/s, from the script the environment names.
fn mooncake(pages: usize, page_bytes: usize, rounds: usize) -> Option<(f64, f64)> {
    let cmd = std::env::var("KVTIER_PEER_MOONCAKE").ok()?;
    let mut parts = cmd.split_whitespace();
    let program = parts.next()?;
    let out = std::process::Command::new(program)
        .args(parts)
        .args([
            "--pages",
            &pages.to_string(),
            "--page-bytes",
            &page_bytes.to_string(),
            "--rounds",
            &rounds.to_string(),
        ])
        .output()
        .ok()?;
    if !out.status.success() {
        crate::say!(
            "mooncake run failed: {}",
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .last()
                .unwrap_or_default()
        );
        return None;
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().rev().find(|l| l.starts_with('{'))?;
    let v: serde_json::Value = serde_json::from_str(line).ok()?;
    Some((
        v["put_bytes_per_s"].as_f64()?,
        v["get_bytes_per_s"].as_f64()?,
    ))
}

/// Runs the scenario.
pub fn run(quick: bool) {
    let pages = if quick { 16 } else { 64 };
    let rounds = 5;
    let spec = LayoutSpec {
        model_id: "bench-peers".into(),
        model_version: String::new(),
        dtype: DType::Bf16,
        num_layers: 32,
        kind: KvKind::Mha {
            kv_heads: 8,
            head_dim: 128,
        },
        page_size: 16,
        tp_rank: 0,
        tp_size: 1,
    };
    let page_bytes = Layout::new(spec.clone()).unwrap().page_bytes();
    let d = crate::InProcessDaemon::start_with(
        "peers",
        &[
            // Four times what the rounds store, and no dirty limit: write-back never starts
            // flushing to L3 during the measured puts (it would share these 2 cores with
            // them). This measures L2's put path; writing to L3 is the l3_* scenarios'.
            &format!("l2.pool_pages={}", 4 * pages * rounds + 16),
            "l2.dirty_fraction=1.0",
            "server.tcp=127.0.0.1:0",
            "server.tcp_insecure=true",
            "server.token=bench-token",
            "l3.backend=memory",
            &format!(
                "l3.memory.capacity_bytes={}",
                2 * pages * rounds * page_bytes + (64 << 20)
            ),
            "l3.write_policy=write_back",
        ],
        0,
    );
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let data: Vec<Vec<u8>> = (0..pages)
        .map(|i| (0..page_bytes).map(|j| (i * 13 + j) as u8).collect())
        .collect();
    let total = (pages * page_bytes) as f64;
    let hasher = PageHasher::new(16, &Namespace::default()).unwrap();
    let (mut shm_put, mut shm_get, mut obj_put, mut obj_get) = (vec![], vec![], vec![], vec![]);
    // The put's floor: one thread copying the same bytes into memory already mapped.
    let mut memcpy = Vec::new();
    // Where a put's time goes: the copies into the slots alone.
    let mut put_copy = Vec::new();
    let mut dst = vec![1u8; pages * page_bytes];
    rt.block_on(async {
        let mut c = HostClient::connect(&d.ready.socket.display().to_string())
            .await
            .unwrap();
        let s = c.register("peers", &spec).await.unwrap();
        let remote: Arc<dyn Store> = Arc::new(crate::remote_store(
            &format!("http://{}", d.ready.tcp.unwrap()),
            "bench-token",
        ));
        let mut out = vec![0u8; page_bytes];
        for r in 0..rounds {
            let tokens: Vec<u32> = (0..pages as u32 * 16)
                .map(|i| (r as u32 + 1) * 1_000_003 + i)
                .collect();
            let keys = hasher.keys(&tokens);
            let t = Instant::now();
            for (chunk, d) in dst.chunks_mut(page_bytes).zip(&data) {
                chunk.copy_from_slice(d);
            }
            std::hint::black_box(&dst);
            memcpy.push(total / t.elapsed().as_secs_f64());
            // Shared memory: put = reserve, copy in, commit; get = acquire, copy out, release.
            let t = Instant::now();
            let res = c.reserve(s.id, None, &keys).await.unwrap();
            let tc = Instant::now();
            for (r, d) in res.iter().zip(&data) {
                let Reserved::Slot(slot) = r else {
                    panic!("no slot")
                };
                s.pool.write(*slot, 0, d).unwrap();
            }
            put_copy.push(total / tc.elapsed().as_secs_f64());
            c.commit(s.id, &keys).await.unwrap();
            shm_put.push(total / t.elapsed().as_secs_f64());
            let t = Instant::now();
            let slots = c.acquire(s.id, &keys).await.unwrap();
            for &slot in &slots {
                s.pool.read(slot, 0, &mut out).unwrap();
            }
            c.release(s.id, &keys).await.unwrap();
            shm_get.push(total / t.elapsed().as_secs_f64());
            assert_eq!(slots.len(), pages);
        }
        // ObjectStorage over TCP, after the shared-memory rounds: its heavy socket and
        // allocation traffic would otherwise spill into them.
        for r in 0..rounds {
            let names: Vec<String> = (0..pages).map(|i| format!("ee/{r:02x}{i:04x}")).collect();
            let t = Instant::now();
            for (n, d) in names.iter().zip(&data) {
                remote
                    .set(n, Bytes::new(), Bytes::from(d.clone()))
                    .await
                    .unwrap();
            }
            obj_put.push(total / t.elapsed().as_secs_f64());
            let t = Instant::now();
            for n in &names {
                assert_eq!(remote.get(n).await.unwrap().unwrap().len(), page_bytes);
            }
            obj_get.push(total / t.elapsed().as_secs_f64());
        }
    });
    drop(rt);
    d.stop();
    let peer = mooncake(pages, page_bytes, rounds);
    if peer.is_none() {
        crate::say!("Mooncake Store not measured (run benches/peers/run for the comparison)");
    }
    let gb = |x: f64| x / 1e9;
    let noise = crate::spread(&memcpy);
    let (put, floor) = (median(shm_put.clone()), median(memcpy));
    crate::record(
        &format!("put, kvtierd shared memory vs memcpy, {pages} x 2 MiB"),
        gb(put),
        "GB/s",
        "memcpy, 1 thread",
        gb(floor),
        Some(put / floor),
    );
    crate::set_noise(noise);
    crate::say!(
        "put, kvtierd shared memory            {:>8.3} GB/s   memcpy {:>8.3} GB/s   (its copies alone {:>8.3} GB/s)",
        gb(put),
        gb(floor),
        gb(median(put_copy))
    );
    for (name, kv, pick) in [
        ("put, kvtierd shared memory", median(shm_put), 0),
        ("get, kvtierd shared memory", median(shm_get), 1),
        ("put, kvtierd ObjectStorage (TCP)", median(obj_put), 0),
        ("get, kvtierd ObjectStorage (TCP)", median(obj_get), 1),
    ] {
        let base = peer.map(|(p, g)| if pick == 0 { p } else { g });
        crate::record(
            &format!("{name}, {pages} x 2 MiB"),
            gb(kv),
            "GB/s",
            if pick == 0 {
                "Mooncake Store put"
            } else {
                "Mooncake Store get"
            },
            base.map_or(0.0, gb),
            base.map(|b| kv / b),
        );
        crate::say!(
            "{name:<36} {:>8.3} GB/s   Mooncake {:>8.3} GB/s",
            gb(kv),
            base.map_or(0.0, gb)
        );
    }
}
