//! The cpu device against a reference: device pages (layer-first) land in host slots
//! page-first, byte for byte, and come back unchanged; bad copy lists change nothing.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::os::fd::OwnedFd;

use kvtier_core::{DType, DevicePool, KvKind, KvPart, Layout, LayoutSpec};
use kvtier_device::cpu::CpuDevice;
use kvtier_device::{Device, Fence, PageCopy};
use kvtier_shm::{Backing, PoolSpec, ShmPool, ShmRegion};

fn spec(kind: KvKind) -> LayoutSpec {
    LayoutSpec {
        model_id: "m".into(),
        model_version: String::new(),
        dtype: DType::Bf16,
        num_layers: 3,
        kind,
        page_size: 16,
        tp_rank: 0,
        tp_size: 1,
    }
}

/// A new descriptor of the engine's region, as the engine hands it to the agent.
fn fd_of(r: &ShmRegion) -> OwnedFd {
    r.fd().try_clone_to_owned().unwrap()
}

/// An engine file that cannot be sealed (a memfd made without `MFD_ALLOW_SEALING`).
fn unsealable(len: usize) -> ShmRegion {
    use rustix::fs::{MemfdFlags, memfd_create};
    let fd = memfd_create("kvtier-unsealable", MemfdFlags::CLOEXEC).unwrap();
    std::fs::File::from(fd.try_clone().unwrap())
        .set_len(len as u64)
        .unwrap();
    ShmRegion::from_fd(fd, "unsealable").unwrap()
}

/// The byte at `i` of run (layer, part) of device page `page`: distinct per run and page.
fn byte(page: usize, layer: usize, part: KvPart, i: usize) -> u8 {
    (page * 131 + layer * 31 + part as usize * 7 + i * 13) as u8
}

fn setup(kind: KvKind, name: &str, pages: u64, threads: usize) -> (CpuDevice, ShmRegion, ShmPool) {
    setup_in(kind, name, pages, threads, true)
}

fn setup_in(
    kind: KvKind,
    name: &str,
    pages: u64,
    threads: usize,
    sealable: bool,
) -> (CpuDevice, ShmRegion, ShmPool) {
    let layout = Layout::new(spec(kind)).unwrap();
    let pool = DevicePool::new(layout.clone(), pages * 16).unwrap();
    let engine = if sealable {
        ShmRegion::memfd(name, pool.total_bytes()).unwrap()
    } else {
        unsealable(pool.total_bytes())
    };
    // Fill every page of the engine's pool as an engine would after prefill.
    for p in 0..pool.num_pages() {
        for (layer, part) in layout.runs() {
            let run = pool.run(p, layer, part).unwrap();
            let bytes: Vec<u8> = (0..run.len).map(|i| byte(p, layer, part, i)).collect();
            engine
                .write(run.buffer * pool.buffer_bytes() + run.offset, &bytes)
                .unwrap();
        }
    }
    let dev = CpuDevice::open(pool, fd_of(&engine), threads).unwrap();
    (dev, engine, host_pool(&layout, name))
}

/// A host pool of 40 slots for `layout`'s pages.
fn host_pool(layout: &Layout, name: &str) -> ShmPool {
    ShmPool::create(&PoolSpec {
        name: format!("kvtier-device-test-host-{}-{name}", std::process::id()),
        backing: Backing::Memfd,
        slots: 40,
        stride: layout.slot_stride(),
        mlock: false,
        huge_pages: false,
        reserve: false,
    })
    .unwrap()
    .0
}

/// Copies of pages `0..n` through `at`: (device page, host slot) of each.
fn copies(n: u32, at: impl Fn(u32) -> (u32, u32)) -> Vec<PageCopy> {
    (0..n)
        .map(|i| {
            let (device_page, host_slot) = at(i);
            PageCopy {
                device_page,
                host_slot,
            }
        })
        .collect()
}

fn check_slot(dev: &CpuDevice, host: &ShmPool, slot: u32, page: usize) {
    let layout = dev.pool().layout();
    let mut buf = vec![0u8; layout.page_bytes()];
    host.read(slot, 0, &mut buf).unwrap();
    for (layer, part) in layout.runs() {
        let off = layout.host_run_offset(layer, part);
        for i in 0..layout.run_bytes() {
            assert_eq!(
                buf[off + i],
                byte(page, layer, part, i),
                "slot {slot} (page {page}) run ({layer}, {part:?}) byte {i}"
            );
        }
    }
}

fn round_trip(kind: KvKind, name: &str, threads: usize) {
    let (dev, engine, host) = setup(kind, name, 32, threads);
    let snapshot = {
        let mut b = vec![0u8; engine.len()];
        engine.read(0, &mut b).unwrap();
        b
    };
    // Pages out of order into scattered slots.
    let copies = copies(20, |i| ((i * 7) % 32, 39 - i));
    dev.copy_to_host(&host, &copies, &Fence::never()).unwrap();
    for c in &copies {
        check_slot(&dev, &host, c.host_slot, c.device_page as usize);
    }
    // Wipe the engine's pool, load the pages back: identical to before for those pages.
    engine.write(0, &vec![0u8; engine.len()]).unwrap();
    dev.copy_from_host(&host, &copies, &Fence::never()).unwrap();
    let mut after = vec![0u8; engine.len()];
    engine.read(0, &mut after).unwrap();
    let pool = dev.pool();
    for p in 0..pool.num_pages() {
        let loaded = copies.iter().any(|c| c.device_page as usize == p);
        for (layer, part) in pool.layout().runs() {
            let run = pool.run(p, layer, part).unwrap();
            let at = run.buffer * pool.buffer_bytes() + run.offset;
            let got = &after[at..at + run.len];
            if loaded {
                assert_eq!(
                    got,
                    &snapshot[at..at + run.len],
                    "page {p} came back different"
                );
            } else {
                assert!(
                    got.iter().all(|&b| b == 0),
                    "page {p} was written but not asked for"
                );
            }
        }
    }
}

#[test]
fn mha_pages_round_trip_single_and_multi_threaded() {
    let mha = KvKind::Mha {
        kv_heads: 2,
        head_dim: 64,
    };
    round_trip(mha, "mha1", 1);
    round_trip(mha, "mha4", 4);
}

#[test]
fn mla_pages_round_trip() {
    round_trip(
        KvKind::Mla {
            kv_lora_rank: 512,
            rope_dim: 64,
        },
        "mla",
        3,
    );
}

#[test]
fn bad_copies_change_nothing() {
    let (dev, engine, host) = setup(
        KvKind::Mha {
            kv_heads: 1,
            head_dim: 64,
        },
        "bad",
        8,
        2,
    );
    let before = {
        let mut b = vec![0u8; host.len()];
        for s in 0..host.slots() {
            host.read(
                s,
                0,
                &mut b[s as usize * host.stride()..(s as usize + 1) * host.stride()],
            )
            .unwrap();
        }
        b
    };
    let good = PageCopy {
        device_page: 1,
        host_slot: 1,
    };
    let e = dev
        .copy_to_host(
            &host,
            &[
                good,
                PageCopy {
                    device_page: 8,
                    host_slot: 2,
                },
            ],
            &Fence::never(),
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("copies[1].device_page"), "{e}");
    let e = dev
        .copy_from_host(
            &host,
            &[PageCopy {
                device_page: 0,
                host_slot: 40,
            }],
            &Fence::never(),
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("copies[0].host_slot"), "{e}");
    let mut after = vec![0u8; host.len()];
    for s in 0..host.slots() {
        host.read(
            s,
            0,
            &mut after[s as usize * host.stride()..(s as usize + 1) * host.stride()],
        )
        .unwrap();
    }
    assert!(after == before, "a refused copy list moved bytes");
    // A pool file shorter than the pool is refused at open, naming the sizes.
    let layout = dev.pool().layout().clone();
    let bigger = DevicePool::new(layout, 16 * 16).unwrap();
    let e = CpuDevice::open(bigger, fd_of(&engine), 1)
        .unwrap_err()
        .to_string();
    assert!(e.contains("expected at least"), "{e}");
}

#[test]
fn cuda_without_a_driver_is_a_clear_error() {
    if kvtier_device::cuda::driver_present() {
        return; // A GPU machine: the gated GPU tests cover this device.
    }
    let layout = Layout::new(spec(KvKind::Mha {
        kv_heads: 1,
        head_dim: 64,
    }))
    .unwrap();
    let pool = DevicePool::new(layout, 64).unwrap();
    let handles = vec![[0u8; 64]; pool.num_buffers()];
    let map = kvtier_device::plan::DeviceMap::layer_first(&pool);
    let e = kvtier_device::cuda::CudaDevice::open(map, 0, &handles, kvtier_core::CopyMethod::Auto)
        .unwrap_err()
        .to_string();
    assert!(e.contains("libcuda"), "{e}");
}

#[test]
fn a_closed_fence_moves_nothing_either_way() {
    let name = "fenced";
    let (dev, engine, host) = setup(
        KvKind::Mha {
            kv_heads: 2,
            head_dim: 64,
        },
        name,
        16,
        4,
    );
    let snapshot = |len: usize, read: &dyn Fn(&mut [u8])| {
        let mut b = vec![0u8; len];
        read(&mut b);
        b
    };
    let engine_bytes = || snapshot(engine.len(), &|b| engine.read(0, b).unwrap());
    let host_bytes = || {
        let page = dev.pool().layout().page_bytes();
        snapshot(page * host.slots() as usize, &|b| {
            for (s, chunk) in b.chunks_mut(page).enumerate() {
                host.read(s as u32, 0, chunk).unwrap();
            }
        })
    };
    let (engine_before, host_before) = (engine_bytes(), host_bytes());
    // Sixteen pages over four threads: each part checks the fence before it moves a byte.
    let copies = copies(16, |i| (i, 20 + i));
    let closed = Fence::until(None);
    closed.close();
    let late = Fence::until(Some(std::time::Instant::now()));
    for fence in [&closed, &late] {
        assert!(matches!(
            dev.copy_to_host(&host, &copies, fence),
            Err(kvtier_device::DeviceError::Fenced)
        ));
        assert!(matches!(
            dev.copy_from_host(&host, &copies, fence),
            Err(kvtier_device::DeviceError::Fenced)
        ));
    }
    assert!(
        host_bytes() == host_before,
        "a fenced save wrote the host pool"
    );
    assert!(
        engine_bytes() == engine_before,
        "a fenced load wrote the engine's pages"
    );
    // Open, the same copies move.
    dev.copy_to_host(&host, &copies, &Fence::until(None))
        .unwrap();
    for c in &copies {
        check_slot(&dev, &host, c.host_slot, c.device_page as usize);
    }
}

/// The engine's own blocks in place (the CPU stand-in for DMA): one file per layer, each
/// block's K then V back to back (block-major, as vLLM lays a layer out), with a gap after
/// each block. Saved pages land page-first, loaded pages land where the map places them and
/// nowhere else.
#[test]
fn a_mapped_pool_reads_and_writes_the_engines_blocks_in_place() {
    use kvtier_device::plan::{DeviceMap, Piece};
    let layout = Layout::new(spec(KvKind::Mha {
        kv_heads: 2,
        head_dim: 64,
    }))
    .unwrap();
    let blocks = 24usize;
    let pool = DevicePool::new(layout.clone(), blocks as u64 * 16).unwrap();
    let run = layout.run_bytes();
    let stride = 2 * run + 64;
    // Larger than the map uses: the agent maps the whole file.
    let regions: Vec<ShmRegion> = (0..3)
        .map(|l| ShmRegion::memfd(&format!("mapped-{l}"), blocks * stride + 4096).unwrap())
        .collect();
    let at = |p: usize, part: KvPart| p * stride + part as usize * run;
    for p in 0..blocks {
        for (layer, part) in layout.runs() {
            let bytes: Vec<u8> = (0..run).map(|i| byte(p, layer, part, i)).collect();
            regions[layer].write(at(p, part), &bytes).unwrap();
        }
    }
    let mut runs: Vec<(usize, KvPart)> = layout.runs().collect();
    runs.sort_by_key(|&(l, part)| layout.host_run_offset(l, part));
    let pieces = runs
        .iter()
        .map(|&(layer, part)| Piece {
            region: layer,
            offset: at(0, part) as u64,
            page_stride: stride as u64,
            len: run as u64,
        })
        .collect();
    let map = DeviceMap::new(pool, vec![(blocks * stride) as u64; 3], pieces).unwrap();
    let fds = || regions.iter().map(fd_of).collect::<Vec<_>>();
    // Files shorter than the map, or the wrong number of them, are refused by name.
    let e = CpuDevice::open_mapped(
        map.clone(),
        fds()[..2].iter().map(|f| f.try_clone().unwrap()).collect(),
        2,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("allocations"), "{e}");
    let short = ShmRegion::memfd("mapped-short", blocks * stride - 1).unwrap();
    let mut with_short = fds();
    with_short[2] = fd_of(&short);
    let e = CpuDevice::open_mapped(map.clone(), with_short, 2)
        .unwrap_err()
        .to_string();
    assert!(e.contains("allocations[2]"), "{e}");

    let dev = CpuDevice::open_mapped(map, fds(), 2).unwrap();
    let host = host_pool(&layout, "mapped");
    let copies = copies(12, |i| ((i * 5) % 24, 30 - i));
    dev.copy_to_host(&host, &copies, &Fence::never()).unwrap();
    for c in &copies {
        check_slot(&dev, &host, c.host_slot, c.device_page as usize);
    }
    // Wiped, loaded back: those blocks as they were, every other byte (gaps, other blocks,
    // the file's tail) untouched.
    let snapshots: Vec<Vec<u8>> = regions
        .iter()
        .map(|r| {
            let mut b = vec![0u8; r.len()];
            r.read(0, &mut b).unwrap();
            b
        })
        .collect();
    for r in &regions {
        r.write(0, &vec![0u8; r.len()]).unwrap();
    }
    dev.copy_from_host(&host, &copies, &Fence::never()).unwrap();
    for (layer, r) in regions.iter().enumerate() {
        let mut got = vec![0u8; r.len()];
        r.read(0, &mut got).unwrap();
        for (i, (&g, &s)) in got.iter().zip(&snapshots[layer]).enumerate() {
            let (p, within) = (i / stride, i % stride);
            let loaded = p < blocks
                && within < 2 * run
                && copies.iter().any(|c| c.device_page as usize == p);
            assert_eq!(g, if loaded { s } else { 0 }, "layer {layer} byte {i}");
        }
    }
}

/// Review finding (issue 61): an engine that shrank its own file under the agent killed it
/// with SIGBUS (the copy touched the mapping past the file's end). A file the engine made
/// sealable is sealed against shrinking when the agent maps it; one it did not (or a tmpfs
/// file) fails the copy on shrinking, and every later one: the mapping is no longer the
/// file.
#[test]
fn an_engine_file_shrunk_under_the_agent_fails_the_copy_not_the_agent() {
    let kind = KvKind::Mha {
        kv_heads: 2,
        head_dim: 64,
    };
    let (dev, engine, host) = setup(kind, "sealed", 16, 2);
    let copies = copies(16, |i| (i, i));
    let shrink = |r: &ShmRegion| std::fs::File::from(fd_of(r)).set_len(0);
    assert!(shrink(&engine).is_err(), "a sealed engine file shrank");
    dev.copy_to_host(&host, &copies, &Fence::never()).unwrap();

    let (dev, engine, host) = setup_in(kind, "shrunk", 16, 2, false);
    dev.copy_to_host(&host, &copies, &Fence::never()).unwrap();
    shrink(&engine).unwrap();
    for _ in 0..2 {
        let e = dev
            .copy_to_host(&host, &copies, &Fence::never())
            .unwrap_err()
            .to_string();
        assert!(e.contains("shrank"), "{e}");
        let e = dev
            .copy_from_host(&host, &copies, &Fence::never())
            .unwrap_err()
            .to_string();
        assert!(e.contains("shrank"), "{e}");
    }
}
