//! The cuda device on a real GPU (feature `gpu-tests`; `scripts/gpu-check` runs it): pages
//! round-trip between device buffers and the host pool bit-identical for MHA and MLA layouts
//! and page sizes of 16–256 tokens, a backup and a load run at once without mixing, and bad
//! copy lists and bad IPC handles are refused with an error.
#![cfg(feature = "gpu-tests")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::sync::Arc;

use kvtier_core::{DType, DevicePool, KvKind, Layout, LayoutSpec};
use kvtier_device::cuda::{CudaDevice, DeviceBuffer, IPC_HANDLE_BYTES};
use kvtier_device::{Device, DeviceError, PageCopy};
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
        dir: PathBuf::from("/dev/shm"),
        backing: Backing::Memfd,
        slots,
        stride: layout.slot_stride(),
        mlock: false,
        huge_pages: false,
        reserve: false,
        access: kvtier_shm::FileAccess::OWNER,
        grant: None,
    })
    .unwrap()
}

/// A device over freshly allocated buffers; the buffers must outlive it.
fn device(layout: &Layout) -> (CudaDevice, Vec<DeviceBuffer>) {
    let pool =
        DevicePool::new(layout.clone(), u64::from(PAGES) * layout.page_size() as u64).unwrap();
    let buffers: Vec<DeviceBuffer> = (0..pool.num_buffers())
        .map(|_| DeviceBuffer::new(0, pool.buffer_bytes()).unwrap())
        .collect();
    let ptrs: Vec<u64> = buffers.iter().map(DeviceBuffer::ptr).collect();
    let dev = CudaDevice::from_device_ptrs(pool, 0, &ptrs).unwrap();
    (dev, buffers)
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
    let (dev, _buffers) = device(layout);
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
    dev.copy_from_host(&host, &load).unwrap();
    let store: Vec<PageCopy> = (0..PAGES)
        .map(|i| PageCopy {
            device_page: PAGES - 1 - i,
            host_slot: PAGES + i,
        })
        .collect();
    dev.copy_to_host(&host, &store).unwrap();
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
    let (dev, _buffers) = device(&layout);
    let dev = Arc::new(dev);
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
    dev.copy_from_host(&host, &first).unwrap();
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
                dev.copy_to_host(&host, &c).unwrap();
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
        dev.copy_from_host(&host, &c).unwrap();
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
    dev.copy_to_host(&host, &c).unwrap();
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
    let (dev, _buffers) = device(&layout);
    let host = host_pool(&layout, 4, "bad");
    host.write(0, 0, &page(&layout, 7)).unwrap();
    let out_of_pool = [PageCopy {
        device_page: PAGES,
        host_slot: 0,
    }];
    assert!(matches!(
        dev.copy_to_host(&host, &out_of_pool),
        Err(DeviceError::Invalid { .. })
    ));
    let out_of_host = [PageCopy {
        device_page: 0,
        host_slot: 4,
    }];
    assert!(matches!(
        dev.copy_from_host(&host, &out_of_host),
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
    assert!(dev.copy_to_host(&host, &mixed).is_err());
    let mut after = vec![0u8; layout.page_bytes()];
    host.read(1, 0, &mut after).unwrap();
    assert!(after == before, "a refused list moved bytes");
    // Garbage IPC handles: an error naming the handle, not a crash.
    let pool = DevicePool::new(layout.clone(), u64::from(PAGES) * 16).unwrap();
    let junk = vec![[0xabu8; IPC_HANDLE_BYTES]; pool.num_buffers()];
    match CudaDevice::open(pool.clone(), 0, &junk) {
        Err(DeviceError::Copy(m)) => assert!(m.contains("ipc_handles[0]"), "{m}"),
        other => panic!("junk IPC handles gave {other:?}"),
    }
    let few = vec![[0u8; IPC_HANDLE_BYTES]; 1];
    assert!(matches!(
        CudaDevice::open(pool, 0, &few),
        Err(DeviceError::Invalid { .. })
    ));
}
