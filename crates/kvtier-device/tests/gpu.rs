//! The cuda device on a real GPU (feature `gpu-tests`): pages round-trip between device
//! buffers and the host pool, bit-identical, and bad copy lists are refused.
#![cfg(feature = "gpu-tests")]
#![allow(clippy::unwrap_used, clippy::expect_used, unsafe_code)]

use std::path::PathBuf;

use cudarc::driver::sys;
use kvtier_core::{DType, DevicePool, KvKind, Layout, LayoutSpec};
use kvtier_device::cuda::CudaDevice;
use kvtier_device::{Device, PageCopy};
use kvtier_shm::{Backing, PoolSpec, ShmPool};

#[test]
fn pages_round_trip_through_gpu_buffers() {
    let layout = Layout::new(LayoutSpec {
        model_id: "gpu".into(),
        model_version: String::new(),
        dtype: DType::Bf16,
        num_layers: 4,
        kind: KvKind::Mha {
            kv_heads: 8,
            head_dim: 128,
        },
        page_size: 16,
        tp_rank: 0,
        tp_size: 1,
    })
    .unwrap();
    let pool = DevicePool::new(layout.clone(), 64 * 16).unwrap();
    // Initialise the driver and allocate the "engine's" buffers in this process.
    let probe = CudaDevice::from_device_ptrs(pool.clone(), 0, &vec![0; pool.num_buffers()]);
    drop(probe);
    let mut ptrs = Vec::new();
    for _ in 0..pool.num_buffers() {
        let mut p = 0;
        // SAFETY: test-only allocation on the current (primary) context.
        let r = unsafe { sys::cuMemAlloc_v2(&mut p, pool.buffer_bytes()) };
        assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
        ptrs.push(p);
    }
    let dev = CudaDevice::from_device_ptrs(pool.clone(), 0, &ptrs).unwrap();
    let host = ShmPool::create(&PoolSpec {
        name: format!("kvtier-gpu-test-{}", std::process::id()),
        dir: PathBuf::from("/dev/shm"),
        backing: Backing::Memfd,
        slots: 128,
        stride: layout.slot_stride(),
        mlock: false,
        huge_pages: false,
        reserve: false,
        access: kvtier_shm::FileAccess::OWNER,
        grant: None,
    })
    .unwrap();
    let page = |s: u32| -> Vec<u8> {
        (0..layout.page_bytes())
            .map(|i| (i as u32 * 17 + s * 101) as u8)
            .collect()
    };
    for s in 0..64 {
        host.write(s, 0, &page(s)).unwrap();
    }
    let load: Vec<PageCopy> = (0..64)
        .map(|i| PageCopy {
            device_page: 63 - i,
            host_slot: i,
        })
        .collect();
    dev.copy_from_host(&host, &load).unwrap();
    let store: Vec<PageCopy> = (0..64)
        .map(|i| PageCopy {
            device_page: 63 - i,
            host_slot: 64 + i,
        })
        .collect();
    dev.copy_to_host(&host, &store).unwrap();
    let mut back = vec![0u8; layout.page_bytes()];
    for i in 0..64 {
        host.read(64 + i, 0, &mut back).unwrap();
        assert!(back == page(i), "slot {i} did not round-trip");
    }
    assert!(
        dev.copy_to_host(
            &host,
            &[PageCopy {
                device_page: 64,
                host_slot: 0
            }]
        )
        .is_err()
    );
    drop(dev);
    for p in ptrs {
        // SAFETY: frees the test allocations above.
        unsafe { sys::cuMemFree_v2(p) };
    }
}
