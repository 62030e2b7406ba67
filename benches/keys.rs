//! Page-key hashing against raw SHA-256 over the same bytes.
//!
//! Two baselines, measured in the same run:
//! - `stream`: one SHA-256 over all the token bytes — the machine's hashing speed. The chain
//!   cannot reach it: each page also hashes its 32-byte parent and pays its own final block.
//! - `per-page`: the same per-page preimages hashed by sha2 directly (parent ‖ tokens, the
//!   tokens already as bytes) — the cost of the specification itself; the gap to it is the
//!   overhead of kvtier's code.
#![allow(missing_docs, clippy::unwrap_used)]

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvtier_bench::{MEASURE, compare, tokens};
use kvtier_core::{Namespace, PageHasher};
use sha2::{Digest, Sha256};

const TOKENS: usize = 1 << 20;

fn stream(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

fn per_page(bytes: &[u8], page_bytes: usize) -> [u8; 32] {
    let mut prev: Option<[u8; 32]> = None;
    for page in bytes.chunks_exact(page_bytes) {
        let mut h = Sha256::new();
        if let Some(p) = &prev {
            h.update(p);
        }
        h.update(page);
        prev = Some(h.finalize().into());
    }
    prev.unwrap_or_default()
}

fn ratios() {
    let toks = tokens(TOKENS, 7);
    let bytes: Vec<u8> = toks.iter().flat_map(|t| t.to_le_bytes()).collect();
    println!(
        "page keys over {TOKENS} tokens ({} MiB), ratio = kvtier / baseline speed",
        bytes.len() >> 20
    );
    for page in [16usize, 64, 256] {
        let h = PageHasher::new(page, &Namespace::default()).unwrap();
        let c = compare(
            &format!("keys P={page} vs sha2 stream"),
            bytes.len() as u64,
            15,
            || stream(&bytes),
            || h.keys(&toks),
        );
        println!("{}", c.line("GiB/s", (1u64 << 30) as f64));
        let c = compare(
            &format!("keys P={page} vs sha2 per-page"),
            bytes.len() as u64,
            15,
            || per_page(&bytes, page * 4),
            || h.keys(&toks),
        );
        println!("{}", c.line("GiB/s", (1u64 << 30) as f64));
    }
}

fn bench(c: &mut Criterion) {
    ratios();
    let toks = tokens(TOKENS, 7);
    let bytes: Vec<u8> = toks.iter().flat_map(|t| t.to_le_bytes()).collect();
    let mut g = c.benchmark_group("keys");
    g.throughput(Throughput::Bytes(bytes.len() as u64));
    g.measurement_time(MEASURE).sample_size(10);
    g.bench_function("sha2_stream", |b| b.iter(|| stream(&bytes)));
    for page in [16usize, 64, 256] {
        let h = PageHasher::new(page, &Namespace::default()).unwrap();
        g.bench_function(format!("sha2_per_page/{page}"), |b| {
            b.iter(|| per_page(&bytes, page * 4))
        });
        g.bench_function(format!("page_keys/{page}"), |b| b.iter(|| h.keys(&toks)));
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
