//! SGLang's HiCache RPC protocol through kvtierd: BatchPut and BatchGet of 128 pages of
//! 1 MiB (SGLang's largest batch), by offsets into a registered memfd, against baselines on
//! the same bytes in the same run.
//!
//! - **memory path** (`sglang_rpc.l3 = "none"`: objects live in kvtierd's memory; a get is
//!   what a second SGLang instance sees for ids another one stored): against a single-thread
//!   memcpy of the same 128 MiB between the heap and the mapped pool; once with a memfd that
//!   kvtierd can seal (plain copies through its mapping), once with one it cannot (copies
//!   guarded against the client shrinking it).
//! - **L3 path** (file backend, `sglang_rpc.memory_bytes = 0`, so every get reads L3):
//!   BatchPut against `std::fs::write` of 128 files of 1 MiB, BatchGet against `std::fs::read`
//!   of them (page cache warm on both sides), with the file backend's 16 calls in flight
//!   versus one thread for the baseline; BatchGet also against its floor, each page read,
//!   checksummed and copied into the pool on one thread.
//! - **L3 path from the disk** (the same with `l3.file.io = "direct"`): BatchGet against raw
//!   `O_DIRECT` reads of the same bytes, 16 in flight on both sides.
//!
//! The client is a tonic client on the gRPC socket (through kvtierd's `:authority` relay, as
//! SGLang's grpcio client is); the pool is registered over `SCM_RIGHTS` as SGLang does.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;

use crate::{InProcessDaemon, compare, record};
use kvtier_proto::sglang::storage_server_client::StorageServerClient;
use kvtier_proto::sglang::{BatchGetRequest, BatchPutRequest, Iovec, Transfer};
use kvtier_shm::ShmRegion;
use tonic::transport::Channel;

const PAGES: usize = 128;
const PAGE: usize = 1 << 20;

/// A memfd pool of `len` bytes registered with the daemon whose data dir is `dir`: the
/// registration connection (keep it), the pool id, and the bench's own mapping of it.
fn register(
    dir: &Path,
    len: usize,
    sealable: bool,
) -> (std::os::unix::net::UnixStream, u32, ShmRegion) {
    let flags = if sealable {
        rustix::fs::MemfdFlags::CLOEXEC | rustix::fs::MemfdFlags::ALLOW_SEALING
    } else {
        rustix::fs::MemfdFlags::CLOEXEC
    };
    let fd: OwnedFd = rustix::fs::memfd_create("bench-sglang-pool", flags).unwrap();
    rustix::fs::ftruncate(&fd, len as u64).unwrap();
    let (c, id) =
        kvtier_daemon::sglang::register_pool(&dir.join("sglang-mempool.sock"), "bench", fd.as_fd())
            .unwrap();
    let region = ShmRegion::from_fd(fd, "bench").unwrap();
    (c, id, region)
}

fn transfers(pool: u32, base: usize) -> Vec<Transfer> {
    (0..PAGES)
        .map(|i| Transfer {
            id: format!("{i:064x}_0_k").into_bytes(),
            iovec: vec![Iovec {
                offset: (base + i * PAGE) as u64,
                length: PAGE as u32,
            }],
            pool_id: pool as i32,
        })
        .collect()
}

struct Side {
    daemon: InProcessDaemon,
    dir: std::path::PathBuf,
    _conn: std::os::unix::net::UnixStream,
    pool: u32,
    region: ShmRegion,
    client: StorageServerClient<Channel>,
}

fn start(rt: &tokio::runtime::Runtime, name: &str, sets: &[&str], sealable: bool) -> Side {
    let mut all = vec!["sglang_rpc.enable=true"];
    all.extend_from_slice(sets);
    let daemon = InProcessDaemon::start_with(name, &all, 0);
    let dir = daemon.ready.socket.parent().unwrap().to_path_buf();
    // Source pages at [0, 128 MiB), destination at [128 MiB, 256 MiB).
    let (conn, pool, region) = register(&dir, 2 * PAGES * PAGE, sealable);
    for i in 0..PAGES {
        region.write(i * PAGE, &page(i)).unwrap();
    }
    let grpc = dir.join("sglang-grpc.sock").display().to_string();
    let client = rt.block_on(async {
        StorageServerClient::new(kvtier_client::connect(&grpc).await.unwrap())
            .max_decoding_message_size(512 << 20)
            .max_encoding_message_size(512 << 20)
    });
    Side {
        daemon,
        dir,
        _conn: conn,
        pool,
        region,
        client,
    }
}

/// Page `i`'s bytes: distinct per page and per offset.
fn page(i: usize) -> Vec<u8> {
    (0..PAGE)
        .map(|j| ((i * 131 + j * 7 + (j >> 11)) & 0xFF) as u8)
        .collect()
}

impl Side {
    fn put(&self, rt: &tokio::runtime::Runtime) {
        let mut c = self.client.clone();
        let r = rt
            .block_on(c.batch_put(BatchPutRequest {
                puts: transfers(self.pool, 0),
            }))
            .unwrap()
            .into_inner();
        assert!(r.results.iter().all(|&x| x == 0), "put: {:?}", r.results);
    }

    fn get(&self, rt: &tokio::runtime::Runtime) {
        let mut c = self.client.clone();
        let r = rt
            .block_on(c.batch_get(BatchGetRequest {
                gets: transfers(self.pool, PAGES * PAGE),
            }))
            .unwrap()
            .into_inner();
        assert!(r.results.iter().all(|&x| x == 0), "get: {:?}", r.results);
    }

    /// Every page that came back equals what was put.
    fn verify(&self) {
        let mut got = vec![0u8; PAGE];
        for i in 0..PAGES {
            self.region.read((PAGES + i) * PAGE, &mut got).unwrap();
            assert!(got == page(i), "page {i} came back different");
        }
    }
}

/// Runs the scenario (`quick`: fewer rounds).
pub fn run(quick: bool) {
    let rounds = if quick { 3 } else { 7 };
    let total = (PAGES * PAGE) as u64;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let heap: Vec<Vec<u8>> = (0..PAGES).map(page).collect();
    let gib = f64::from(1 << 30);

    // Memory path, for a pool kvtierd could seal (copies through its mapping) and for one it
    // could not (guarded copies).
    let mut scratch: Vec<Vec<u8>> = vec![vec![0u8; PAGE]; PAGES];
    let mut memory_get_s = 0.0;
    for (sealable, how) in [(true, "sealed pool"), (false, "unsealed pool")] {
        let m = start(
            &rt,
            "sglang-memory",
            &["sglang_rpc.l3=none", "sglang_rpc.memory_bytes=512MiB"],
            sealable,
        );
        let put = compare(
            &format!("BatchPut 128x1MiB, memory, {how} vs memcpy"),
            total,
            rounds,
            || {
                for (i, s) in scratch.iter_mut().enumerate() {
                    m.region.read(i * PAGE, s).unwrap();
                }
            },
            || m.put(&rt),
        );
        crate::say!("{}", put.line("GiB/s", gib));
        let get = compare(
            &format!("BatchGet 128x1MiB, memory, {how} vs memcpy"),
            total,
            rounds,
            || {
                for (i, p) in heap.iter().enumerate() {
                    m.region.write((PAGES + i) * PAGE, p).unwrap();
                }
            },
            || m.get(&rt),
        );
        m.verify();
        crate::say!("{}", get.line("GiB/s", gib));
        if sealable {
            memory_get_s = get.subject_s;
        }
        m.daemon.stop();
    }

    // L3 path: file backend, no memory copy.
    let f = start(&rt, "sglang-file", &["sglang_rpc.memory_bytes=0B"], true);
    let raw = f.dir.join("raw-baseline");
    std::fs::create_dir_all(&raw).unwrap();
    let put = compare(
        "BatchPut 128x1MiB, file L3 vs fs::write",
        total,
        rounds,
        || {
            for (i, p) in heap.iter().enumerate() {
                std::fs::write(raw.join(format!("{i}")), p).unwrap();
            }
        },
        || f.put(&rt),
    );
    crate::say!("{}", put.line("GiB/s", gib));
    let get = compare(
        "BatchGet 128x1MiB, file L3 vs fs::read",
        total,
        rounds,
        || {
            (0..PAGES)
                .map(|i| std::fs::read(raw.join(format!("{i}"))).unwrap().len())
                .sum::<usize>()
        },
        || f.get(&rt),
    );
    f.verify();
    crate::say!("{}", get.line("GiB/s", gib));
    // The floor of a verified read into the engine's pool, on one thread: each page read,
    // checksummed, and copied in (an engine's buffer never sees unverified bytes, and
    // kvtier-shm lends no references into shared memory, so the pool is not the read's
    // destination).
    let floor = compare(
        "BatchGet 128x1MiB, file L3 vs its floor (read + CRC32C + copy into the pool)",
        total,
        rounds,
        || {
            for i in 0..PAGES {
                let b = std::fs::read(raw.join(format!("{i}"))).unwrap();
                std::hint::black_box(kvtier_core::checksum::crc32c(&b));
                f.region.write((PAGES + i) * PAGE, &b).unwrap();
            }
        },
        || f.get(&rt),
    );
    f.verify();
    crate::say!("{}", floor.line("GiB/s", gib));
    // Does sharing pay: a second instance's get from kvtierd's memory vs from the file L3.
    let pays = get.subject_s / memory_get_s;
    record(
        "BatchGet from memory, speed-up over file L3",
        pays,
        "x",
        "BatchGet from file L3",
        1.0,
        None,
    );
    crate::say!("BatchGet served from memory is {pays:.2}x the file L3 path");
    f.daemon.stop();

    // The L3 path from the disk (issue 65): kvtierd reads its files with O_DIRECT, against
    // raw O_DIRECT reads of the same bytes, 16 in flight on both sides.
    let d = start(
        &rt,
        "sglang-file-direct",
        &["sglang_rpc.memory_bytes=0B", "l3.file.io=direct"],
        true,
    );
    d.put(&rt);
    let raw = d.dir.join("raw-baseline");
    std::fs::create_dir_all(&raw).unwrap();
    for (i, p) in heap.iter().enumerate() {
        std::fs::write(raw.join(format!("{i}")), p).unwrap();
    }
    let raw_cold = || {
        std::thread::scope(|s| {
            let raw = &raw;
            (0..16)
                .map(|t| {
                    s.spawn(move || {
                        (t..PAGES)
                            .step_by(16)
                            .map(|i| {
                                crate::scenarios::l3_file_cold::raw_read_reused(
                                    &raw.join(format!("{i}")),
                                    PAGE,
                                )
                            })
                            .sum::<usize>()
                    })
                })
                .collect::<Vec<_>>()
                .into_iter()
                .map(|h| h.join().unwrap())
                .sum::<usize>()
        })
    };
    let cold = compare(
        "BatchGet 128x1MiB, cold file L3 (io = direct) vs raw O_DIRECT reads",
        total,
        rounds,
        raw_cold,
        || d.get(&rt),
    );
    d.verify();
    crate::say!("{}", cold.line("GiB/s", gib));
    d.daemon.stop();
}
