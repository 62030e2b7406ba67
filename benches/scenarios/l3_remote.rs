//! The remote backend (a second kvtierd's ObjectStorage over gRPC on loopback TCP) against raw
//! loopback TCP moving the same bytes with the same request/response pattern, in one run.
//!
//! Baseline: a thread that, per object, reads 2 MiB and answers one byte (set), or reads one
//! byte and answers 2 MiB (get) — the least any protocol could do per page.
#![allow(clippy::unwrap_used)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;

use crate::compare;
use bytes::Bytes;
use kvtier_storage::Store;

const PAGE: usize = 2 << 20;

fn raw_server() -> std::net::SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::spawn(move || {
        for conn in l.incoming() {
            let Ok(mut s) = conn else { return };
            s.set_nodelay(true).unwrap();
            std::thread::spawn(move || {
                let mut buf = vec![0u8; PAGE];
                let mut op = [0u8; 1];
                while s.read_exact(&mut op).is_ok() {
                    if op[0] == b's' {
                        if s.read_exact(&mut buf).is_err() || s.write_all(b"k").is_err() {
                            return;
                        }
                    } else if s.write_all(&buf).is_err() {
                        return;
                    }
                }
            });
        }
    });
    addr
}

/// Runs the scenario (`quick`: fewer pages and rounds).
pub fn run(quick: bool) {
    let pages = if quick { 8 } else { 32 };
    let daemon = crate::InProcessDaemon::start(
        "remote",
        &[
            "server.tcp=127.0.0.1:0",
            "server.tcp_insecure=true",
            "server.token=bench-token",
            "l3.backend=memory",
            "l3.memory.capacity_bytes=1GiB",
        ],
    );
    let ready = daemon.ready.clone();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let remote: Arc<dyn Store> = {
        let _in_runtime = rt.enter();
        Arc::new(crate::remote_store(
            &format!("http://{}", ready.tcp.unwrap()),
            "bench-token",
        ))
    };
    let data: Vec<Bytes> = (0..pages)
        .map(|i| Bytes::from((0..PAGE).map(|j| (i * 7 + j) as u8).collect::<Vec<u8>>()))
        .collect();
    let names: Vec<String> = (0..pages).map(|i| format!("ab/{i:04x}")).collect();
    let mut raw = TcpStream::connect(raw_server()).unwrap();
    raw.set_nodelay(true).unwrap();
    let mut back = vec![0u8; PAGE];
    let total = (pages * PAGE) as u64;
    let rounds = if quick { 3 } else { 7 };
    crate::say!(
        "remote L3 over loopback TCP, {pages} objects of 2 MiB, ratio = kvtier / raw TCP speed"
    );
    let set = compare(
        "set 2 MiB vs raw TCP write+ack",
        total,
        rounds,
        || {
            for d in &data {
                raw.write_all(b"s").unwrap();
                raw.write_all(d).unwrap();
                raw.read_exact(&mut back[..1]).unwrap();
            }
        },
        || {
            rt.block_on(async {
                for (n, d) in names.iter().zip(&data) {
                    remote.set(n, Bytes::new(), d.clone()).await.unwrap();
                }
            })
        },
    );
    crate::say!("{}", set.line("GiB/s", f64::from(1 << 30)));
    let get = compare(
        "get 2 MiB vs raw TCP request+read",
        total,
        rounds,
        || {
            for _ in 0..pages {
                raw.write_all(b"g").unwrap();
                raw.read_exact(&mut back).unwrap();
            }
        },
        || {
            rt.block_on(async {
                for n in &names {
                    assert_eq!(remote.get(n).await.unwrap().unwrap().len(), PAGE);
                }
            })
        },
    );
    crate::say!("{}", get.line("GiB/s", f64::from(1 << 30)));
    // `--sizes`: latency of one get by object size (a fixed ~40 ms here once meant Nagle).
    if std::env::args().any(|a| a == "--sizes") {
        for size in [1024usize, 65536, 1 << 20, 2 << 20] {
            rt.block_on(async {
                remote
                    .set("cd/01", Bytes::new(), Bytes::from(vec![1u8; size]))
                    .await
                    .unwrap();
                let t = std::time::Instant::now();
                for _ in 0..20 {
                    remote.get("cd/01").await.unwrap();
                }
                crate::say!("get {size} B: {:?} each", t.elapsed() / 20);
            });
        }
    }
    drop(rt);
    daemon.stop();
}
