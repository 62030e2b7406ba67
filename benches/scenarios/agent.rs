//! kvtier-agent on the cpu device, against baselines measured in the same run:
//! - backup (device → L2: reserve, copy, commit) and load-back (L2 → device: pin, copy,
//!   release, insert) of 1,000 pages vs a single-thread memcpy of the same bytes;
//! - Match of a 1,000-page cached prefix (hashing included) vs an empty RPC (a health check)
//!   on the same socket.
//!
//! kvtierd and the agent run in this process (their own runtimes, real sockets and shared
//! memory); this process is the engine.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use crate::{InProcessAgent, InProcessDaemon, compare};
use kvtier_client::{AgentClient, PoolMemory};
use kvtier_core::{DType, DevicePool, KvKind, Layout, LayoutSpec, Namespace, PageHasher};
use kvtier_shm::ShmRegion;

/// 8 layers, 8 KV heads of 128, bf16, 16-token pages: 512 KiB pages (1,000 pages = 500 MiB).
fn spec(layers: u32) -> LayoutSpec {
    LayoutSpec {
        model_id: "bench-agent".into(),
        model_version: String::new(),
        dtype: DType::Bf16,
        num_layers: layers,
        kind: KvKind::Mha {
            kv_heads: 8,
            head_dim: 128,
        },
        page_size: 16,
        tp_rank: 0,
        tp_size: 1,
    }
}

/// Runs the scenario (`quick`: fewer pages and rounds).
/// Runs the scenario: 1,000 pages (200 when `quick`) of 128 KiB, 512 KiB and 2 MiB (only
/// 512 KiB when `quick`), and the match latency at 512 KiB.
pub fn run(quick: bool) {
    device_plan(quick);
    let sizes: &[u32] = if quick { &[8] } else { &[2, 8, 32] };
    for &layers in sizes {
        one(quick, layers, layers == 8);
    }
}

/// The cpu device alone, on one thread, executing its copy plan (one memcpy per (layer, K|V)
/// run of every page) against one memcpy of the same bytes: what the plan costs (P1).
fn device_plan(quick: bool) {
    use kvtier_device::cpu::CpuDevice;
    use kvtier_device::{Device, Fence, PageCopy};
    let layout = Layout::new(LayoutSpec {
        page_size: 16,
        ..spec(32)
    })
    .unwrap();
    let pages: u32 = if quick { 32 } else { 128 };
    let rounds = if quick { 5 } else { 15 };
    let pool = DevicePool::new(layout.clone(), u64::from(pages) * 16).unwrap();
    let engine = ShmRegion::memfd("kvtier-bench-plan", pool.total_bytes()).unwrap();
    let dev = CpuDevice::open(pool, engine.fd().try_clone_to_owned().unwrap(), 1).unwrap();
    let host = super::gpu::host_pool(layout.slot_stride(), pages, "plan");
    let copies: Vec<PageCopy> = (0..pages)
        .map(|i| PageCopy {
            device_page: i,
            host_slot: pages - 1 - i,
        })
        .collect();
    let bytes = pages as usize * layout.page_bytes();
    let src = vec![5u8; bytes];
    let mut dst = vec![0u8; bytes];
    let name = format!(
        "cpu device plan, {} KiB pages of {} KiB runs",
        layout.page_bytes() >> 10,
        layout.run_bytes() >> 10
    );
    for (what, to_host) in [("backup", true), ("load", false)] {
        let c = compare(
            &format!("{name}, {what}"),
            bytes as u64,
            rounds,
            || {
                dst.copy_from_slice(&src);
                dst[7]
            },
            || {
                if to_host {
                    dev.copy_to_host(&host, &copies, &Fence::never()).unwrap();
                } else {
                    dev.copy_from_host(&host, &copies, &Fence::never()).unwrap();
                }
            },
        );
        crate::say!("{}", c.line("GiB/s", f64::from(1 << 30)));
    }
}

fn one(quick: bool, layers: u32, with_match: bool) {
    let pages: u32 = if quick { 200 } else { 1000 };
    let rounds = if quick { 2 } else { 3 };
    let layout = Layout::new(spec(layers)).unwrap();
    let page_bytes = layout.page_bytes();
    let pid = std::process::id();
    let dir = std::env::temp_dir().join(format!("kvtier-bench-agent-{pid}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let daemon_sock = dir.join("kvtierd.sock");
    let d = InProcessDaemon::start_with(
        "agent",
        &[
            &format!("server.socket={}", daemon_sock.display()),
            &format!("l2.pool_pages={}", pages + 16),
            "l3.backend=none",
        ],
        0,
    );
    let a = InProcessAgent::start(&[
        format!("data_dir={}", dir.display()),
        format!("daemon.address={}", daemon_sock.display()),
        "cache.write_policy=write_back".into(),
    ]);
    // The engine's pool: room for the request twice (computed, then loaded back).
    let pool = DevicePool::new(layout.clone(), u64::from(2 * pages) * 16).unwrap();
    let region =
        ShmRegion::memfd(&format!("kvtier-bench-agent-{pid}"), pool.total_bytes()).unwrap();
    // Touch every page once so neither side pays first-touch faults in the timings.
    region.write(0, &vec![7u8; pool.total_bytes()]).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut c = rt.block_on(async {
        let mut c = AgentClient::connect(&a.ready.socket.display().to_string())
            .await
            .unwrap();
        c.register_pool(
            &spec(layers),
            u64::from(2 * pages) * 16,
            PoolMemory::Cpu {
                fd: std::sync::Arc::new(region.fd().try_clone_to_owned().unwrap()),
            },
        )
        .await
        .unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        while !c.stats().await.unwrap().daemon_connected {
            assert!(Instant::now() < deadline, "agent never reached kvtierd");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        c
    });
    let total = u64::from(pages) * page_bytes as u64;
    // Baseline: one thread copying the same bytes between two buffers.
    let src = vec![3u8; page_bytes * pages as usize];
    let mut dst = vec![0u8; page_bytes * pages as usize];
    dst.copy_from_slice(&src);
    let mut memcpy = || {
        dst.copy_from_slice(&src);
        dst[0]
    };
    // And with as many threads as the device's copy pool (this machine's cores).
    let threads = std::thread::available_parallelism().map_or(2, usize::from);
    let mut src2 = vec![3u8; page_bytes * pages as usize];
    let mut dst2 = vec![0u8; page_bytes * pages as usize];
    let mut memcpy_mt = || {
        let per = dst2.len().div_ceil(threads);
        std::thread::scope(|sc| {
            for (d, s) in dst2.chunks_mut(per).zip(src2.chunks(per)) {
                sc.spawn(move || d.copy_from_slice(s));
            }
        });
        src2[0] = src2[0].wrapping_add(1);
        dst2[0]
    };
    std::hint::black_box(memcpy_mt());
    crate::say!(
        "kvtier-agent (cpu device), {pages} pages of {} KiB; ratio = kvtier / baseline speed",
        page_bytes >> 10
    );

    // Each round a new request: insert (compute) on the first half, back it up by evicting
    // it (write_back), then load it back into the second half.
    let mut backup_s = Vec::new();
    let mut load_s = Vec::new();
    let mut base_s = Vec::new();
    let mut base_mt = Vec::new();
    for seed in 1..=rounds as u32 {
        let tokens: Vec<u32> = (0..pages * 16).map(|i| seed * 1_000_003 + i).collect();
        let first: Vec<u32> = (0..pages).collect();
        let second: Vec<u32> = (pages..2 * pages).collect();
        rt.block_on(async {
            c.insert(tokens.clone(), None, first.clone()).await.unwrap();
        });
        let t = Instant::now();
        std::hint::black_box(memcpy());
        base_s.push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        std::hint::black_box(memcpy_mt());
        base_mt.push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        let ev = rt.block_on(async { c.evict(pages).await.unwrap() });
        backup_s.push(t.elapsed().as_secs_f64());
        assert_eq!((ev.pages.len(), ev.backed_up), (pages as usize, pages));
        let t = Instant::now();
        let lb = rt.block_on(async {
            let m = c.match_prefix(&tokens, None).await.unwrap();
            let lb = c.load_back(m.handle, second.clone()).await.unwrap();
            c.release(m.handle).await.unwrap();
            lb
        });
        load_s.push(t.elapsed().as_secs_f64());
        assert_eq!(lb.loaded, pages);
        // Make room for the next round.
        rt.block_on(async {
            c.evict(2 * pages).await.unwrap();
        });
    }
    let med = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (b, bk, lb) = (med(base_s), med(backup_s), med(load_s));
    let bmt = med(base_mt);
    let gibs = |s: f64| total as f64 / s / f64::from(1 << 30);
    let kib = page_bytes >> 10;
    crate::record(
        &format!("backup {pages} pages of {kib} KiB"),
        gibs(bk),
        "GiB/s",
        "memcpy, 1 thread",
        gibs(b),
        Some(b / bk),
    );
    crate::record(
        &format!("load-back {pages} pages of {kib} KiB"),
        gibs(lb),
        "GiB/s",
        "memcpy, 1 thread",
        gibs(b),
        Some(b / lb),
    );
    for (what, s) in [("backup", bk), ("load-back", lb)] {
        crate::record(
            &format!("{what} {pages} pages of {kib} KiB"),
            gibs(s),
            "GiB/s",
            &format!("memcpy, {threads} threads"),
            gibs(bmt),
            Some(bmt / s),
        );
    }
    crate::say!(
        "{:<44} {:>8.3} GiB/s  memcpy 1 thread {:>8.3} GiB/s  ratio {:.3}",
        "backup (evict, write_back)",
        gibs(bk),
        gibs(b),
        b / bk
    );
    crate::say!(
        "{:<44} {:>8.3} GiB/s  memcpy 1 thread {:>8.3} GiB/s  ratio {:.3}",
        "load-back (match + load_back + release)",
        gibs(lb),
        gibs(b),
        b / lb
    );

    if !with_match {
        drop(c);
        a.stop();
        d.stop();
        let _ = std::fs::remove_dir_all(&dir);
        return;
    }
    // Match latency of a cached prefix: put one request on the device and match it.
    let tokens: Vec<u32> = (0..pages * 16).map(|i| 777 * 1_000_003 + i).collect();
    rt.block_on(async {
        c.insert(tokens.clone(), None, (0..pages).collect())
            .await
            .unwrap();
    });
    let ch = rt.block_on(kvtier_client::connect(
        &a.ready.socket.display().to_string(),
    ));
    let mut health = tonic_health::pb::health_client::HealthClient::new(ch.unwrap());
    let n = if quick { 50 } else { 200 };
    let mut empty = || {
        rt.block_on(async {
            health
                .check(tonic_health::pb::HealthCheckRequest {
                    service: String::new(),
                })
                .await
                .unwrap()
        })
    };
    let m = compare(
        &format!("match of a {pages}-page cached prefix"),
        1,
        n,
        &mut empty,
        || {
            rt.block_on(async {
                let m = c.match_prefix(&tokens, None).await.unwrap();
                assert_eq!(m.device_pages.len(), pages as usize);
                c.release(m.handle).await.unwrap();
            })
        },
    );
    crate::record(
        &format!("match+release of a {pages}-page prefix p50"),
        m.subject_s * 1e6,
        "µs",
        "empty RPC",
        m.baseline_s * 1e6,
        Some(m.ratio()),
    );
    crate::say!(
        "{:<44} {:>8.1} µs  empty RPC {:>8.1} µs  ratio {:.3} (match + release)",
        m.name,
        m.subject_s * 1e6,
        m.baseline_s * 1e6,
        m.ratio()
    );
    // What no match+release can go below, interleaved with it: the two calls' bytes each way
    // through a server that does nothing else (`crate::sink`: kvtier's HTTP/2 settings, a
    // Unix socket, a runtime of the agent's two workers) but compute the prompt's page keys
    // (the SHA-256 chain shared with SGLang) before it answers, as any server handed a prompt
    // must; and the radix tree's match, lock and unlock of those keys, here in the bench's
    // thread. The keys alone, in this thread, are timed beside it.
    let sizes = match_sizes(&tokens, pages as usize);
    let sink = crate::sink::Sink::start("agent", 2);
    // Its client on a runtime of its own, dropped before the sink stops (a graceful stop
    // waits for the connection, which only that runtime can close).
    let srt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut sc = srt.block_on(crate::sink::SinkClient::connect(&sink));
    let hasher = PageHasher::new(16, &Namespace::default()).unwrap();
    let mut tree = kvtier_core::RadixTree::<kvtier_core::PageKey, u32>::new(
        kvtier_core::PolicyKind::default(),
    );
    let keys = hasher.keys(&tokens);
    tree.insert(&keys, &(0..pages).collect::<Vec<u32>>())
        .unwrap();
    // Both servers' threads on one core and this (the engine's) thread on another, so the row
    // and its floor are measured in the same placement (`crate::placement`).
    let placed = crate::placement::place(&["kvtier-agent", "sink"]);
    let (mut row, mut floor, mut parts) = (Vec::new(), Vec::new(), [0.0f64; 3]);
    for _ in 0..n {
        let t = Instant::now();
        rt.block_on(async {
            let m = c.match_prefix(&tokens, None).await.unwrap();
            c.release(m.handle).await.unwrap();
        });
        row.push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        srt.block_on(sc.call_keying(sizes[0], sizes[1], 16));
        let keyed = t.elapsed();
        let m = tree.match_prefix(&keys);
        tree.lock(m.device_node).unwrap();
        std::hint::black_box(m.device_values);
        tree.unlock(m.device_node).unwrap();
        let worked = t.elapsed();
        srt.block_on(sc.call(sizes[2], sizes[3]));
        let whole = t.elapsed();
        floor.push(whole.as_secs_f64());
        parts[0] += (keyed + whole - worked).as_secs_f64();
        parts[2] += (worked - keyed).as_secs_f64();
    }
    let placement = if placed.is_some() {
        "servers on one core, engine on another"
    } else {
        "threads not placed"
    };
    drop(placed);
    for _ in 0..n {
        let t = Instant::now();
        std::hint::black_box(hasher.keys(&tokens));
        parts[1] += t.elapsed().as_secs_f64();
    }
    drop(sc);
    drop(srt);
    sink.stop();
    let (row, floor) = (crate::median(row), crate::median(floor));
    let mean = |x: f64| x / n as f64 * 1e6;
    crate::say!(
        "{:<44} {:>8.1} µs  floor {:>8.1} µs (calls with keys {:.1}, of which keys {:.1}; tree {:.1}; means; {placement})  ratio {:.3}",
        format!("match+release of {pages} pages vs its floor"),
        row * 1e6,
        floor * 1e6,
        mean(parts[0]),
        mean(parts[1]),
        mean(parts[2]),
        floor / row
    );
    crate::record(
        &format!("match+release of {pages} pages vs its floor"),
        row * 1e6,
        "µs",
        "same bytes, server keys + tree",
        floor * 1e6,
        Some(floor / row),
    );
    drop(c);
    a.stop();
    d.stop();
    let _ = std::fs::remove_dir_all(&dir);
}

/// The bytes each way of a match (its request and reply) and of a release, as kvtier's
/// client sends them (`packed_tokens`) and a full hit of `pages` pages answers.
fn match_sizes(tokens: &[u32], pages: usize) -> [usize; 4] {
    use kvtier_proto::v1;
    use prost::Message;
    let request = v1::MatchRequest {
        tokens: Vec::new(),
        namespace: None,
        // Only the length counts: 4 bytes a token.
        packed_tokens: vec![0u8; tokens.len() * 4].into(),
    }
    .encoded_len();
    let reply = v1::MatchResponse {
        handle: u64::MAX,
        device_pages: (0..pages as u32).collect(),
        l2_pages: 0,
        l3_pages: 0,
        total_pages: pages as u32,
    }
    .encoded_len();
    let release = v1::AgentReleaseRequest { handle: u64::MAX }.encoded_len();
    [request, reply, release, 0]
}
