//! Radix tree match and insert at 1k to 1M cached pages.
//!
//! The tree holds sequences of 256 pages, in groups of 16 that share a 32-page system prompt
//! (the shape of chat traffic). `match` looks up a whole cached sequence; `insert+evict` adds a
//! new 256-page sequence branching off a cached one and evicts 256 pages, so the tree stays at
//! its size (the steady state of a full cache).
#![allow(missing_docs, clippy::unwrap_used)]

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use std::collections::HashMap;

use kvtier_bench::{MEASURE, compare, tokens};
use kvtier_core::radix::RadixTree;
use kvtier_core::{Namespace, PageHasher, PageKey, PolicyKind};

const SEQ: usize = 256;
const SHARED: usize = 32;
const GROUP: usize = 16;
const PAGE: usize = 16;

fn sequences(pages: usize, seed: u64) -> Vec<Vec<PageKey>> {
    let h = PageHasher::new(PAGE, &Namespace::default()).unwrap();
    let n = pages.div_ceil(SEQ);
    (0..n)
        .map(|i| {
            let mut t = tokens(SHARED * PAGE, (i / GROUP) as u64 + seed * 1_000_000);
            t.extend(tokens(
                (SEQ - SHARED) * PAGE,
                i as u64 + 1 + seed * 1_000_000 + 500_000,
            ));
            h.keys(&t)
        })
        .collect()
}

fn build(seqs: &[Vec<PageKey>]) -> RadixTree<PageKey, u32> {
    let mut t = RadixTree::new(PolicyKind::Lru);
    let mut v = 0u32;
    for s in seqs {
        let vals: Vec<u32> = (v..v + s.len() as u32).collect();
        v += s.len() as u32;
        t.insert(s, &vals).unwrap();
    }
    t
}

/// Same-run baseline: looking the same 256 keys up one by one in a flat hash map (what a cache
/// without prefix structure would pay per request).
fn ratios() {
    println!("radix match of {SEQ} pages vs {SEQ} HashMap lookups, ratio = tree / baseline speed");
    for pages in [1_000usize, 100_000, 1_000_000] {
        let seqs = sequences(pages, 1);
        let mut tree = build(&seqs);
        let flat: HashMap<PageKey, u32> = seqs.iter().flatten().map(|k| (*k, 1)).collect();
        let (mut i, mut j) = (0usize, 0usize);
        let c = compare(
            &format!("match {SEQ} pages, {pages} cached"),
            SEQ as u64,
            2000,
            || {
                j = (j + 7919) % seqs.len();
                seqs[j].iter().filter(|k| flat.contains_key(*k)).count()
            },
            || {
                i = (i + 7919) % seqs.len();
                tree.match_prefix(&seqs[i]).device_pages()
            },
        );
        println!("{}", c.line("Mpages/s", 1e6));
    }
}

fn bench(c: &mut Criterion) {
    ratios();
    let mut g = c.benchmark_group("radix");
    g.measurement_time(MEASURE).sample_size(20);
    g.throughput(Throughput::Elements(SEQ as u64));
    for pages in [1_000usize, 10_000, 100_000, 1_000_000] {
        let seqs = sequences(pages, 1);
        let mut tree = build(&seqs);
        let mut i = 0usize;
        g.bench_function(format!("match_{SEQ}_pages/{pages}"), |b| {
            b.iter(|| {
                i = (i + 7919) % seqs.len();
                tree.match_prefix(&seqs[i]).device_pages()
            })
        });
        let fresh = sequences(pages.min(50_000), 2);
        let mut j = 0usize;
        let vals: Vec<u32> = (0..SEQ as u32).collect();
        g.bench_function(format!("insert_evict_{SEQ}_pages/{pages}"), |b| {
            b.iter_batched(
                || {
                    j = (j + 1) % fresh.len();
                    // Branch off a cached sequence: its first half, then fresh pages.
                    let base = &seqs[j % seqs.len()];
                    let mut s = base[..SEQ / 2].to_vec();
                    s.extend_from_slice(&fresh[j][SEQ / 2..]);
                    s
                },
                |s| {
                    let r = tree.insert(&s, &vals).unwrap();
                    tree.evict(SEQ - r.already_on_device);
                },
                BatchSize::SmallInput,
            )
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
