//! The cuda device on a real GPU (feature `gpu-tests`; `scripts/gpu-check` runs it): pages
//! round-trip between device buffers and the host pool bit-identical for MHA and MLA layouts
//! and page sizes of 16–256 tokens, a backup and a load run at once without mixing, and bad
//! copy lists and bad IPC handles are refused with an error.
#![cfg(feature = "gpu-tests")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use kvtier_core::{CopyMethod, DType, DevicePool, KvKind, Layout, LayoutSpec};
use kvtier_device::cuda::{CudaDevice, DeviceBuffer, IPC_HANDLE_BYTES};
use kvtier_device::plan::{DeviceMap, Piece};
use kvtier_device::{Device, DeviceError, Fence, PageCopy};
use kvtier_shm::{Backing, PoolSpec, ShmPool};

const PAGES: u32 = 64;

fn layout(kind: KvKind, page_size: u32, num_layers: u32) -> Layout {
    Layout::new(LayoutSpec {
        model_id: "gpu".into(),
        model_version: String::new(),
        dtype: DType::Bf16,
        num_layers,
        kind,
        page_size,
        tp_rank: 0,
        tp_size: 1,
    })
    .unwrap()
}

fn host_pool(layout: &Layout, slots: u32, tag: &str) -> ShmPool {
    ShmPool::create(&PoolSpec {
        name: format!("kvtier-gpu-test-{tag}-{}", std::process::id()),
        backing: Backing::Memfd,
        slots,
        stride: layout.slot_stride(),
        mlock: false,
        huge_pages: false,
        reserve: false,
    })
    .unwrap()
    .0
}

/// The methods every test runs with. A named method that fails its self-check falls back;
/// that is only acceptable for `batch` on a driver older than 12.8.
const METHODS: [CopyMethod; 3] = [CopyMethod::Batch, CopyMethod::Kernel, CopyMethod::PerRun];

fn pool_of(layout: &Layout) -> DevicePool {
    DevicePool::new(layout.clone(), u64::from(PAGES) * layout.page_size() as u64).unwrap()
}

/// Opens `map` over `ptrs` with `method`; `None` when the method is not usable here for an
/// acceptable reason (printed), a panic when it failed its self-check.
fn open_with(map: DeviceMap, ptrs: &[u64], method: CopyMethod) -> Option<CudaDevice> {
    let dev = CudaDevice::from_device_ptrs(map, 0, ptrs, method).unwrap();
    for (m, c) in dev.checks() {
        eprintln!("{}: {c:?}", m.name());
    }
    if let Some((m, why)) = &dev.choice().fallback_from {
        assert!(
            why.contains("needs 12.8"),
            "{} failed its self-check: {why}",
            m.name()
        );
        eprintln!("{} skipped: {why}", m.name());
        return None;
    }
    // `auto` reports the method it picked; a named method must be the one in use.
    if method != CopyMethod::Auto {
        assert_eq!(dev.choice().method.name(), method.name());
    }
    Some(dev)
}

/// A device over freshly allocated buffers; the buffers must outlive it.
fn device(layout: &Layout, method: CopyMethod) -> Option<(CudaDevice, Vec<DeviceBuffer>)> {
    let pool = pool_of(layout);
    let buffers: Vec<DeviceBuffer> = (0..pool.num_buffers())
        .map(|_| DeviceBuffer::new(0, pool.buffer_bytes()).unwrap())
        .collect();
    let ptrs: Vec<u64> = buffers.iter().map(DeviceBuffer::ptr).collect();
    let dev = open_with(DeviceMap::layer_first(&pool), &ptrs, method)?;
    Some((dev, buffers))
}

/// A page's bytes: different in every slot and at every offset, never all zero.
fn page(layout: &Layout, seed: u32) -> Vec<u8> {
    (0..layout.page_bytes())
        .map(|i| {
            (i as u32)
                .wrapping_mul(17)
                .wrapping_add(seed.wrapping_mul(101)) as u8
                ^ 0x5a
        })
        .collect()
}

fn round_trip(layout: &Layout) {
    for method in METHODS {
        if let Some((dev, _buffers)) = device(layout, method) {
            round_trip_on(&dev, layout);
        }
    }
}

fn round_trip_on(dev: &CudaDevice, layout: &Layout) {
    let host = host_pool(layout, 2 * PAGES, "rt");
    for s in 0..PAGES {
        host.write(s, 0, &page(layout, s)).unwrap();
    }
    // Scattered both ways: slot i goes to page 63 - i and comes back to slot 64 + i.
    let load: Vec<PageCopy> = (0..PAGES)
        .map(|i| PageCopy {
            device_page: PAGES - 1 - i,
            host_slot: i,
        })
        .collect();
    dev.copy_from_host(&host, &load, &Fence::never()).unwrap();
    let store: Vec<PageCopy> = (0..PAGES)
        .map(|i| PageCopy {
            device_page: PAGES - 1 - i,
            host_slot: PAGES + i,
        })
        .collect();
    dev.copy_to_host(&host, &store, &Fence::never()).unwrap();
    let mut back = vec![0u8; layout.page_bytes()];
    for i in 0..PAGES {
        host.read(PAGES + i, 0, &mut back).unwrap();
        assert!(
            back == page(layout, i),
            "{layout:?}: slot {i} did not round-trip"
        );
    }
}

#[test]
fn mha_pages_of_16_to_256_tokens_round_trip_bit_identical() {
    for page_size in [16, 64, 256] {
        round_trip(&layout(
            KvKind::Mha {
                kv_heads: 8,
                head_dim: 128,
            },
            page_size,
            4,
        ));
    }
}

#[test]
fn mla_pages_round_trip_bit_identical() {
    for page_size in [16, 64] {
        round_trip(&layout(
            KvKind::Mla {
                kv_lora_rank: 512,
                rope_dim: 64,
            },
            page_size,
            8,
        ));
    }
}

#[test]
fn a_backup_and_a_load_at_once_do_not_mix() {
    let layout = layout(
        KvKind::Mha {
            kv_heads: 8,
            head_dim: 128,
        },
        16,
        8,
    );
    for method in METHODS {
        if let Some((dev, _buffers)) = device(&layout, method) {
            both_at_once(Arc::new(dev), &layout);
        }
    }
}

fn both_at_once(dev: Arc<CudaDevice>, layout: &Layout) {
    let layout = layout.clone();
    let host = Arc::new(host_pool(&layout, 2 * PAGES, "both"));
    // Pages 0..32 hold slots 0..32; then back them up to slots 64.. while slots 32..64 load
    // into pages 32..64, at the same time on the two streams.
    for s in 0..PAGES {
        host.write(s, 0, &page(&layout, s)).unwrap();
    }
    let half = PAGES / 2;
    let first: Vec<PageCopy> = (0..half)
        .map(|i| PageCopy {
            device_page: i,
            host_slot: i,
        })
        .collect();
    dev.copy_from_host(&host, &first, &Fence::never()).unwrap();
    let backup = {
        let (dev, host) = (dev.clone(), host.clone());
        std::thread::spawn(move || {
            for _ in 0..20 {
                let c: Vec<PageCopy> = (0..half)
                    .map(|i| PageCopy {
                        device_page: i,
                        host_slot: PAGES + i,
                    })
                    .collect();
                dev.copy_to_host(&host, &c, &Fence::never()).unwrap();
            }
        })
    };
    for _ in 0..20 {
        let c: Vec<PageCopy> = (half..PAGES)
            .map(|i| PageCopy {
                device_page: i,
                host_slot: i,
            })
            .collect();
        dev.copy_from_host(&host, &c, &Fence::never()).unwrap();
    }
    backup.join().unwrap();
    let mut back = vec![0u8; layout.page_bytes()];
    for i in 0..half {
        host.read(PAGES + i, 0, &mut back).unwrap();
        assert!(back == page(&layout, i), "backed-up slot {i} differs");
    }
    let c: Vec<PageCopy> = (half..PAGES)
        .map(|i| PageCopy {
            device_page: i,
            host_slot: PAGES + i,
        })
        .collect();
    dev.copy_to_host(&host, &c, &Fence::never()).unwrap();
    for i in half..PAGES {
        host.read(PAGES + i, 0, &mut back).unwrap();
        assert!(back == page(&layout, i), "loaded page {i} differs");
    }
}

#[test]
fn bad_copy_lists_and_bad_ipc_handles_are_refused() {
    let layout = layout(
        KvKind::Mha {
            kv_heads: 8,
            head_dim: 128,
        },
        16,
        2,
    );
    let (dev, _buffers) = device(&layout, CopyMethod::Auto).unwrap();
    let host = host_pool(&layout, 4, "bad");
    host.write(0, 0, &page(&layout, 7)).unwrap();
    let out_of_pool = [PageCopy {
        device_page: PAGES,
        host_slot: 0,
    }];
    assert!(matches!(
        dev.copy_to_host(&host, &out_of_pool, &Fence::never()),
        Err(DeviceError::Invalid { .. })
    ));
    let out_of_host = [PageCopy {
        device_page: 0,
        host_slot: 4,
    }];
    assert!(matches!(
        dev.copy_from_host(&host, &out_of_host, &Fence::never()),
        Err(DeviceError::Invalid { .. })
    ));
    // A list with one bad entry moves nothing: slot 1 stays as it was.
    let before = {
        let mut b = vec![0u8; layout.page_bytes()];
        host.read(1, 0, &mut b).unwrap();
        b
    };
    let mixed = [
        PageCopy {
            device_page: 0,
            host_slot: 1,
        },
        PageCopy {
            device_page: PAGES + 5,
            host_slot: 2,
        },
    ];
    assert!(dev.copy_to_host(&host, &mixed, &Fence::never()).is_err());
    let mut after = vec![0u8; layout.page_bytes()];
    host.read(1, 0, &mut after).unwrap();
    assert!(after == before, "a refused list moved bytes");
    // Garbage IPC handles: an error naming the handle, not a crash.
    let pool = DevicePool::new(layout.clone(), u64::from(PAGES) * 16).unwrap();
    let junk = vec![[0xabu8; IPC_HANDLE_BYTES]; pool.num_buffers()];
    let map = DeviceMap::layer_first(&pool);
    match CudaDevice::open(map.clone(), 0, &junk, CopyMethod::Auto) {
        Err(DeviceError::Copy(m)) => assert!(m.contains("ipc_handles[0]"), "{m}"),
        other => panic!("junk IPC handles gave {other:?}"),
    }
    let few = vec![[0u8; IPC_HANDLE_BYTES]; 1];
    assert!(matches!(
        CudaDevice::open(map, 0, &few, CopyMethod::Auto),
        Err(DeviceError::Invalid { .. })
    ));
}

/// vLLM's layouts over one allocation each: K and V of every layer in one tensor `[2, blocks,
/// ...]` at an offset per layer, and all layers of a block together `[blocks, layers, 2, ...]`.
fn vllm_maps(layout: &Layout) -> Vec<(&'static str, DeviceMap, u64)> {
    let pool = pool_of(layout);
    let (run, n, layers) = (
        layout.run_bytes() as u64,
        u64::from(PAGES),
        layout.num_layers() as u64,
    );
    let per_layer = 2 * n * run + 4096; // a gap between layers, as an allocator leaves
    let k_then_v: Vec<Piece> = (0..2)
        .flat_map(|part| {
            (0..layers).map(move |l| Piece {
                region: 0,
                offset: 512 + l * per_layer + part * n * run,
                page_stride: run,
                len: run,
            })
        })
        .collect();
    let runs = layout.runs_per_page() as u64;
    let block_first: Vec<Piece> = (0..runs)
        .map(|i| Piece {
            region: 0,
            offset: i * run,
            page_stride: runs * run,
            len: run,
        })
        .collect();
    let a = 512 + layers * per_layer;
    let b = n * runs * run;
    vec![
        (
            "k_then_v",
            DeviceMap::new(pool.clone(), vec![a], k_then_v).unwrap(),
            a,
        ),
        (
            "block_first",
            DeviceMap::new(pool, vec![b], block_first).unwrap(),
            b,
        ),
    ]
}

/// 8 KV heads of 128 bf16, 16-token pages, 4 layers.
fn mha_16x4() -> Layout {
    layout(
        KvKind::Mha {
            kv_heads: 8,
            head_dim: 128,
        },
        16,
        4,
    )
}

#[test]
fn vllm_layouts_over_one_allocation_round_trip_with_every_method() {
    let layout = mha_16x4();
    for (name, map, bytes) in vllm_maps(&layout) {
        let mem = DeviceBuffer::new(0, bytes as usize).unwrap();
        for method in METHODS {
            eprintln!("{name} with {}", method.name());
            if let Some(dev) = open_with(map.clone(), &[mem.ptr()], method) {
                round_trip_on(&dev, &layout);
            }
        }
    }
}

const CHILD: &str = "KVTIER_GPU_TEST_IPC_CHILD";

/// The exporting engine, run as a child process by the next test: allocates, prints the
/// allocation's IPC handle in hex, and keeps it alive until its stdin closes.
#[test]
fn ipc_exporter_child() {
    let Ok(bytes) = std::env::var(CHILD) else {
        return;
    };
    let mem = DeviceBuffer::new(0, bytes.parse().unwrap()).unwrap();
    let hex: String = mem
        .ipc_handle()
        .unwrap()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    // On a line of its own: libtest has already printed "test ipc_exporter_child ... "
    // without a newline, and prints "ok" after.
    println!("\nHANDLE {hex}");
    use std::io::Read;
    let _ = std::io::stdin().read_to_end(&mut Vec::new());
}

#[test]
fn an_allocation_imported_by_ipc_handle_with_offsets_round_trips() {
    use std::io::BufRead;
    use std::process::{Command, Stdio};
    let layout = mha_16x4();
    for (name, map, bytes) in vllm_maps(&layout) {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "ipc_exporter_child",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD, bytes.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut out = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
        // Wherever on its line it lands: libtest's "test ipc_exporter_child ... " may
        // precede it.
        let hex = out
            .by_ref()
            .map(Result::unwrap)
            .find_map(|l| l.split_once("HANDLE ").map(|(_, h)| h.trim().to_owned()))
            .expect("the child printed no handle");
        let mut handle = [0u8; IPC_HANDLE_BYTES];
        for (i, b) in handle.iter_mut().enumerate() {
            *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap();
        }
        let dev = CudaDevice::open(map.clone(), 0, &[handle], CopyMethod::Auto).unwrap();
        eprintln!(
            "{name}: imported, copies with {}",
            dev.choice().method.name()
        );
        round_trip_on(&dev, &layout);
        // A map that claims more than the allocation holds is refused by handle.
        let pool = map.pool().clone();
        let pieces = map.pieces().to_vec();
        let too_big = DeviceMap::new(pool, vec![bytes + (64 << 20)], pieces).unwrap();
        drop(dev);
        match CudaDevice::open(too_big, 0, &[handle], CopyMethod::Auto) {
            Err(DeviceError::Invalid { field, .. }) => assert_eq!(field, "ipc_handles[0]"),
            other => panic!("an oversized map gave {other:?}"),
        }
        drop(child.stdin.take());
        // Read the child's output to its end, so its last lines find a reader.
        out.for_each(drop);
        assert!(
            child.wait().unwrap().success(),
            "the exporting child failed"
        );
    }
}
