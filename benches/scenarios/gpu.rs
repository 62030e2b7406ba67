//! The cuda device against pinned `cuMemcpyAsync` of the same bytes, in the same run, on the
//! same registered host memory: backups (device → host) and loads (host → device) of whole
//! pages of a layer-first pool, which kvtier moves as one copy per (layer, K|V) run, against
//! one copy of all the bytes, with every copy method (`batch`, `kernel`, `per_run`). Also both
//! directions at once, the time to open (self-checks) and attach (register the host pool),
//! and the latency of the first copy after that. Needs an NVIDIA GPU: elsewhere it
//! says so and records nothing. `scripts/gpu-check` runs it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Instant;

use crate::{compare, record, say};
use kvtier_core::{CopyMethod, DType, DevicePool, KvKind, Layout, LayoutSpec};
use kvtier_device::cuda::{CudaDevice, DeviceBuffer, driver_present};
use kvtier_device::plan::DeviceMap;
use kvtier_device::{Device, Fence, PageCopy};
use kvtier_shm::{Backing, PoolSpec, ShmPool};

/// One shape: its name in the rows, tokens per page and layers (MHA, 8 KV heads of 128 bf16).
struct Shape {
    name: &'static str,
    page_size: u32,
    layers: u32,
}

const SHAPES: &[Shape] = &[
    Shape {
        name: "256 KiB pages, 16 KiB runs",
        page_size: 8,
        layers: 8,
    },
    Shape {
        name: "2 MiB pages, 32 KiB runs",
        page_size: 16,
        layers: 32,
    },
    Shape {
        name: "2 MiB pages, 256 KiB runs",
        page_size: 128,
        layers: 4,
    },
    Shape {
        name: "8 MiB pages, 128 KiB runs",
        page_size: 64,
        layers: 32,
    },
];

fn layout(page_size: u32, layers: u32) -> Layout {
    Layout::new(LayoutSpec {
        model_id: "bench".into(),
        model_version: String::new(),
        dtype: DType::Bf16,
        num_layers: layers,
        kind: KvKind::Mha {
            kv_heads: 8,
            head_dim: 128,
        },
        page_size,
        tp_rank: 0,
        tp_size: 1,
    })
    .unwrap()
}

/// A memfd-backed host pool of `slots` slots of `stride` bytes.
pub(crate) fn host_pool(stride: usize, slots: u32, tag: &str) -> ShmPool {
    ShmPool::create(&PoolSpec {
        name: format!("kvtier-bench-gpu-{tag}-{}", std::process::id()),
        backing: Backing::Memfd,
        slots,
        stride,
        mlock: false,
        huge_pages: false,
        reserve: false,
    })
    .unwrap()
    .0
}

/// Runs the scenario (`quick`: fewer rounds and a smaller pool for the first-copy figure).
pub fn run(quick: bool) {
    if !driver_present() {
        say!("gpu: no CUDA driver on this machine, nothing measured");
        return;
    }
    let rounds = if quick { 5 } else { 20 };
    let pages: u32 = 64;
    say!("cuda device, {pages} pages per copy, ratio = kvtier / one pinned cuMemcpyAsync");
    for shape in SHAPES {
        let layout = layout(shape.page_size, shape.layers);
        let pool = DevicePool::new(
            layout.clone(),
            u64::from(2 * pages) * u64::from(shape.page_size),
        )
        .unwrap();
        let buffers: Vec<DeviceBuffer> = (0..pool.num_buffers())
            .map(|_| DeviceBuffer::new(0, pool.buffer_bytes()).unwrap())
            .collect();
        let ptrs: Vec<u64> = buffers.iter().map(DeviceBuffer::ptr).collect();
        let map = DeviceMap::layer_first(&pool);
        for method in METHODS {
            let dev = CudaDevice::from_device_ptrs(map.clone(), 0, &ptrs, method).unwrap();
            if let Some((m, why)) = &dev.choice().fallback_from {
                say!("gpu: {} not measured ({why})", m.name());
                continue;
            }
            if method == CopyMethod::Auto {
                say!("gpu: auto picked {}", dev.choice().method.name());
            }
            measure(shape, &layout, &dev, pages, rounds, method.name());
        }
    }
    first_copy(quick);
}

/// Every method the device offers, each measured on its own device, then what `auto` picks
/// (the rows the goals hold).
const METHODS: [CopyMethod; 4] = [
    CopyMethod::Batch,
    CopyMethod::Kernel,
    CopyMethod::PerRun,
    CopyMethod::Auto,
];

fn measure(shape: &Shape, layout: &Layout, dev: &CudaDevice, pages: u32, rounds: usize, m: &str) {
    let page_bytes = layout.page_bytes();
    let total = pages as usize * page_bytes;
    // Page-sized slots, so the baseline's one copy covers the same host bytes.
    let host = host_pool(layout.slot_stride(), 2 * pages, "pages");
    let mut base = DeviceBuffer::new(0, 2 * total).unwrap();
    let mut base2 = DeviceBuffer::new(0, 2 * total).unwrap();
    for s in 0..2 * pages {
        let bytes: Vec<u8> = (0..page_bytes)
            .map(|i| (i as u32 ^ s.wrapping_mul(2_654_435_761)) as u8)
            .collect();
        host.write(s, 0, &bytes).unwrap();
    }
    let down: Vec<PageCopy> = (0..pages)
        .map(|i| PageCopy {
            device_page: i,
            host_slot: pages + i,
        })
        .collect();
    let up: Vec<PageCopy> = (0..pages)
        .map(|i| PageCopy {
            device_page: i,
            host_slot: i,
        })
        .collect();
    // Correct before fast: what is loaded comes back bit-identical.
    dev.copy_from_host(&host, &up, &Fence::never()).unwrap();
    dev.copy_to_host(&host, &down, &Fence::never()).unwrap();
    let (mut a, mut b) = (vec![0u8; page_bytes], vec![0u8; page_bytes]);
    for i in 0..pages {
        host.read(i, 0, &mut a).unwrap();
        host.read(pages + i, 0, &mut b).unwrap();
        assert!(a == b, "{}: page {i} did not round-trip", shape.name);
    }
    let d2h = compare(
        &format!("backup D→H, {}, {m}", shape.name),
        total as u64,
        rounds,
        || base.copy_with_pool(&host, total, true).unwrap(),
        || dev.copy_to_host(&host, &down, &Fence::never()).unwrap(),
    );
    say!("{}", d2h.line("GB/s", 1e9));
    let h2d = compare(
        &format!("load H→D, {}, {m}", shape.name),
        total as u64,
        rounds,
        || base.copy_with_pool(&host, total, false).unwrap(),
        || dev.copy_from_host(&host, &up, &Fence::never()).unwrap(),
    );
    say!("{}", h2d.line("GB/s", 1e9));
    if shape.page_size == 16 {
        // Both directions at once: a backup of pages 0.. and a load of pages 64.. on the
        // device's two streams, against two single copies on two streams.
        let load_back: Vec<PageCopy> = (0..pages)
            .map(|i| PageCopy {
                device_page: pages + i,
                host_slot: i,
            })
            .collect();
        let both = compare(
            &format!("backup+load at once, {}, {m}", shape.name),
            2 * total as u64,
            rounds,
            || {
                std::thread::scope(|s| {
                    s.spawn(|| base.copy_with_pool(&host, total, true).unwrap());
                    s.spawn(|| base2.copy_with_pool(&host, total, false).unwrap());
                })
            },
            || {
                std::thread::scope(|s| {
                    s.spawn(|| dev.copy_to_host(&host, &down, &Fence::never()).unwrap());
                    s.spawn(|| {
                        dev.copy_from_host(&host, &load_back, &Fence::never())
                            .unwrap()
                    });
                })
            },
        );
        say!("{}", both.line("GB/s", 1e9));
    }
}

/// The first backup after the device opens, over a large host pool, against a later one.
fn first_copy(quick: bool) {
    let layout = layout(16, 32);
    let slots: u32 = if quick { 1024 } else { 4096 };
    let host = host_pool(layout.slot_stride(), slots, "first");
    let pool = DevicePool::new(layout.clone(), 64 * 16).unwrap();
    let buffers: Vec<DeviceBuffer> = (0..pool.num_buffers())
        .map(|_| DeviceBuffer::new(0, pool.buffer_bytes()).unwrap())
        .collect();
    let ptrs: Vec<u64> = buffers.iter().map(DeviceBuffer::ptr).collect();
    let t = Instant::now();
    let dev =
        CudaDevice::from_device_ptrs(DeviceMap::layer_first(&pool), 0, &ptrs, CopyMethod::Auto)
            .unwrap();
    let open_ms = t.elapsed().as_secs_f64() * 1e3;
    let attached = dev.attach_host(&host).unwrap();
    let gib = host.len() as f64 / f64::from(1 << 30);
    say!(
        "open with self-checks: {open_ms:.1} ms; attach (register {gib:.0} GiB): {:.1} ms",
        attached.took.as_secs_f64() * 1e3
    );
    let one = [PageCopy {
        device_page: 0,
        host_slot: slots - 1,
    }];
    let t = Instant::now();
    dev.copy_to_host(&host, &one, &Fence::never()).unwrap();
    let first = t.elapsed().as_secs_f64() * 1e3;
    let mut later = Vec::new();
    for _ in 0..9 {
        let t = Instant::now();
        dev.copy_to_host(&host, &one, &Fence::never()).unwrap();
        later.push(t.elapsed().as_secs_f64() * 1e3);
    }
    later.sort_by(f64::total_cmp);
    let figure = format!("first 2 MiB backup after attach, {gib:.0} GiB host pool");
    record(&figure, first, "ms", "a later backup, p50", later[4], None);
    say!("{figure}: {first:.2} ms (later: {:.3} ms)", later[4]);
}
