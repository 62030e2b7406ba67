//! kvtierd serving SGLang's HiCache RPC storage protocol, end to end on a real kvtierd
//! process: a memfd host pool registered over SCM_RIGHTS as SGLang does, then Exist /
//! BatchPut / BatchGet by offsets into it, with hostile transfers answered in their slots.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::mem::MaybeUninit;
use std::os::fd::{AsFd, OwnedFd};
use std::time::Duration;

use common::*;
use kvtier_proto::sglang::storage_server_client::StorageServerClient;
use kvtier_proto::sglang::{BatchGetRequest, BatchPutRequest, ExistRequest, Iovec, Transfer};

const MAGIC: u64 = 0x8DF6_FBFD;

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Registers a memfd of `len` bytes as SGLang does; returns the connection (keep it open),
/// the pool id and the memfd.
fn register(socket: &std::path::Path, len: u64) -> (std::os::unix::net::UnixStream, u32, OwnedFd) {
    let fd = rustix::fs::memfd_create("sglang-host-pool", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    rustix::fs::ftruncate(&fd, len).unwrap();
    let c = std::os::unix::net::UnixStream::connect(socket).unwrap();
    let name = b"sglang-tp0";
    let mut msg = MAGIC.to_le_bytes().to_vec();
    msg.extend_from_slice(&(name.len() as u32).to_le_bytes());
    msg.extend_from_slice(name);
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut anc = rustix::net::SendAncillaryBuffer::new(&mut space);
    let fds = [fd.as_fd()];
    assert!(anc.push(rustix::net::SendAncillaryMessage::ScmRights(&fds)));
    rustix::net::sendmsg(
        &c,
        &[std::io::IoSlice::new(&msg)],
        &mut anc,
        rustix::net::SendFlags::empty(),
    )
    .unwrap();
    let mut id = [0u8; 4];
    std::io::Read::read_exact(&mut &c, &mut id).unwrap();
    (c, u32::from_le_bytes(id), fd)
}

fn fill(fd: &OwnedFd, offset: u64, bytes: &[u8]) {
    rustix::io::pwrite(fd, bytes, offset).unwrap();
}

fn read(fd: &OwnedFd, offset: u64, len: usize) -> Vec<u8> {
    let mut b = vec![0u8; len];
    rustix::io::pread(fd, &mut b, offset).unwrap();
    b
}

fn t(id: &str, pool: u32, iov: &[(u64, u32)]) -> Transfer {
    Transfer {
        id: id.as_bytes().to_vec(),
        iovec: iov
            .iter()
            .map(|&(offset, length)| Iovec { offset, length })
            .collect(),
        pool_id: pool as i32,
    }
}

#[test]
fn sglang_pages_round_trip_through_kvtierd_and_bad_transfers_fail_alone() {
    let d = Daemon::start("sglang", &["sglang_rpc.enable=true"]);
    let (conn, pool, fd) = register(&d.dir.join("sglang-mempool.sock"), 1 << 20);
    assert_eq!(pool, 1);
    // Two "pages", each a K and a V run at separate offsets, as SGLang lays them out.
    let k0: Vec<u8> = (0..4096u32).map(|i| (i * 7) as u8).collect();
    let v0: Vec<u8> = (0..4096u32).map(|i| (i * 11) as u8).collect();
    let p1: Vec<u8> = (0..8192u32).map(|i| (i * 13) as u8).collect();
    fill(&fd, 0, &k0);
    fill(&fd, 65536, &v0);
    fill(&fd, 8192, &p1);
    rt().block_on(async {
        let ch = kvtier_client::connect(&d.dir.join("sglang-grpc.sock").display().to_string())
            .await
            .unwrap();
        let mut c = StorageServerClient::new(ch);
        let put = c
            .batch_put(BatchPutRequest {
                puts: vec![
                    t("abc_0_k", pool, &[(0, 4096), (65536, 4096)]),
                    t("def_0_k", pool, &[(8192, 8192)]),
                    // Hostile: outside the pool, unknown pool, empty id.
                    t("bad_range", pool, &[((1 << 20) - 10, 4096)]),
                    t("bad_pool", 77, &[(0, 4096)]),
                    t("", pool, &[(0, 4096)]),
                ],
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(put.results, vec![0, 0, 11, 9, 3]);
        let ex = c
            .exist(ExistRequest {
                id: vec![b"abc_0_k".to_vec(), b"nope".to_vec(), b"def_0_k".to_vec()],
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(ex.results, vec![true, false, true]);
        // Wipe the pool, then get both back into new places; a missing id leaves its bytes.
        fill(&fd, 0, &vec![0u8; 1 << 20]);
        fill(&fd, 500_000, &[0xEE; 4096]);
        let get = c
            .batch_get(BatchGetRequest {
                gets: vec![
                    t("abc_0_k", pool, &[(200_000, 4096), (300_000, 4096)]),
                    t("missing", pool, &[(500_000, 4096)]),
                    t("def_0_k", pool, &[(400_000, 8192)]),
                    // The stored object is 8 KiB: asking for 4 KiB is not found, not a prefix.
                    t("def_0_k", pool, &[(600_000, 4096)]),
                ],
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(get.results, vec![0, 5, 0, 5]);
        assert_eq!(read(&fd, 200_000, 4096), k0);
        assert_eq!(read(&fd, 300_000, 4096), v0);
        assert_eq!(read(&fd, 400_000, 8192), p1);
        assert_eq!(
            read(&fd, 500_000, 4096),
            vec![0xEE; 4096],
            "a missing id wrote bytes"
        );
        assert_eq!(read(&fd, 600_000, 4096), vec![0u8; 4096]);
        // A client that shrinks its memfd: transfers past the new end are refused, the daemon
        // keeps running.
        rustix::fs::ftruncate(&fd, 4096).unwrap();
        let get = c
            .batch_get(BatchGetRequest {
                gets: vec![t("def_0_k", pool, &[(400_000, 8192)])],
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(get.results, vec![11]);
        // Once the registration connection closes, the pool id stops resolving.
        drop(conn);
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        loop {
            let put = c
                .batch_put(BatchPutRequest {
                    puts: vec![t("after", pool, &[(0, 1024)])],
                })
                .await
                .unwrap()
                .into_inner();
            if put.results == vec![9] {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the pool outlived its client"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
    // Operations went through the L3 backend's metrics like kvtier's own, and the protocol's.
    let m = d.metrics();
    let tr = |op: &str, outcome: &str| {
        metric(
            &m,
            &format!("kvtier_sglang_transfers_total{{op=\"{op}\",outcome=\"{outcome}\"}}"),
        )
    };
    assert_eq!(tr("put", "ok"), 2.0);
    assert_eq!(tr("put", "out_of_range"), 1.0);
    assert_eq!(tr("put", "invalid"), 1.0);
    assert!(tr("put", "no_pool") >= 2.0);
    assert_eq!(tr("get", "ok"), 2.0);
    assert_eq!(tr("get", "not_found"), 2.0);
    assert_eq!(tr("exist", "ok"), 2.0);
    assert_eq!(metric(&m, "kvtier_sglang_bytes_total{op=\"put\"}"), 16384.0);
    assert_eq!(metric(&m, "kvtier_sglang_pools"), 0.0);
    assert!(
        metric(
            &m,
            "kvtier_l3_backend_ops_total{backend=\"file\",op=\"set\",outcome=\"ok\"}"
        ) >= 2.0
    );
}
