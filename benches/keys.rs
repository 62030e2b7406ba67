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
use kvtier_bench::scenarios::keys::{TOKENS, per_page, stream};
use kvtier_bench::{MEASURE, tokens};
use kvtier_core::{Namespace, PageHasher};

fn bench(c: &mut Criterion) {
    kvtier_bench::begin("keys");
    // Quick when run as a test (`cargo test --bench keys`: no `--bench` argument).
    kvtier_bench::scenarios::keys::run(!std::env::args().any(|a| a == "--bench"));
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
