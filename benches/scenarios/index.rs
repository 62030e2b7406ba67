//! Memory per page of the L2 index and the agent's radix tree, and eviction latency, at 10k,
//! 1M and 10M pages (reports: no baseline). The calling binary counts live heap bytes with a
//! counting global allocator.
#![allow(clippy::unwrap_used)]

use std::time::Instant;

use kvtier_core::host_index::HostIndex;
use kvtier_core::radix::RadixTree;
use kvtier_core::{Namespace, PageHasher, PageKey, PolicyKind};

fn chains(pages: usize) -> Vec<Vec<PageKey>> {
    let h = PageHasher::new(16, &Namespace::default()).unwrap();
    (0..pages.div_ceil(64))
        .map(|c| {
            let tokens: Vec<u32> = (0..64 * 16).map(|i| (c * 64 * 16 + i) as u32).collect();
            h.keys(&tokens)
        })
        .collect()
}

/// Runs the scenario: 10k, 1M and 10M pages (`quick`: 10k and 100k). Bytes per page need
/// the counting allocator the calling binary installs ([`crate::CountingAlloc`]); without
/// it only the eviction latencies are meaningful.
pub fn run(quick: bool) {
    let sizes: &[usize] = if quick {
        &[10_000, 100_000]
    } else {
        &[10_000, 1_000_000, 10_000_000]
    };
    let live = crate::live_bytes;
    crate::say!(
        "{:<28} {:>10} {:>14} {:>16}",
        "structure",
        "pages",
        "bytes/page",
        "evict p50 (ns)"
    );
    // The L2 index's eviction p50 at the smallest and the largest size.
    let mut evict_p50: Vec<(usize, u128)> = Vec::new();
    for &pages in sizes {
        let keys = chains(pages);
        let n = keys.iter().map(Vec::len).sum::<usize>();

        let before = live();
        let mut ix = HostIndex::new(n as u32, PolicyKind::Lru);
        for (i, c) in keys.iter().enumerate() {
            ix.reserve(i as u64, None, c);
            ix.commit(i as u64, c).unwrap();
        }
        let bytes = live() - before;
        let mut lat: Vec<u128> = (0..1000)
            .map(|_| {
                let t = Instant::now();
                ix.evict(1);
                t.elapsed().as_nanos()
            })
            .collect();
        lat.sort_unstable();
        crate::say!(
            "{:<28} {:>10} {:>14.1} {:>16}",
            "L2 HostIndex",
            n,
            bytes as f64 / n as f64,
            lat[500]
        );
        crate::record(
            &format!("L2 HostIndex, {n} pages: bytes/page"),
            bytes as f64 / n as f64,
            "B",
            "-",
            0.0,
            None,
        );
        evict_p50.push((n, lat[500]));
        crate::record(
            &format!("L2 HostIndex, {n} pages: evict p50"),
            lat[500] as f64,
            "ns",
            "-",
            0.0,
            None,
        );
        drop(ix);

        let before = live();
        let mut tree: RadixTree<PageKey, u32> = RadixTree::new(PolicyKind::Lru);
        let vals: Vec<u32> = (0..64).collect();
        for c in &keys {
            tree.insert(c, &vals[..c.len()]).unwrap();
        }
        let bytes = live() - before;
        let mut lat: Vec<u128> = (0..1000)
            .map(|_| {
                let t = Instant::now();
                tree.evict(1);
                t.elapsed().as_nanos()
            })
            .collect();
        lat.sort_unstable();
        crate::say!(
            "{:<28} {:>10} {:>14.1} {:>16}",
            "agent RadixTree (64-page seqs)",
            n,
            bytes as f64 / n as f64,
            lat[500]
        );
        crate::record(
            &format!("agent RadixTree, {n} pages: bytes/page"),
            bytes as f64 / n as f64,
            "B",
            "-",
            0.0,
            None,
        );
        crate::record(
            &format!("agent RadixTree, {n} pages: evict p50"),
            lat[500] as f64,
            "ns",
            "-",
            0.0,
            None,
        );
    }
    if let (Some(&(small, a)), Some(&(large, b))) = (evict_p50.first(), evict_p50.last()) {
        crate::record(
            &format!("L2 HostIndex evict p50, {large} vs {small} pages"),
            b as f64,
            "ns",
            &format!("{small} pages"),
            a as f64,
            Some(a as f64 / b.max(1) as f64),
        );
        // The floor: removing a key from any hash index reads one cell at a random place in
        // a table of this size, one dependent memory load that no cache holds at 10M pages.
        let table = (large * 4 / 3 + 1).next_power_of_two() * 8;
        let load = dependent_load_ns(table);
        crate::record(
            &format!("one dependent load in a {} MiB table", table >> 20),
            load,
            "ns",
            "-",
            0.0,
            None,
        );
        let floor = a as f64 + load;
        crate::record(
            &format!("L2 HostIndex evict p50 at {large} pages vs its floor"),
            b as f64,
            "ns",
            &format!("{small}-page evict + 1 load"),
            floor,
            Some(floor / b.max(1) as f64),
        );
    }
}

/// Nanoseconds per load in a chain of dependent loads through a random cycle over `bytes`
/// of memory (Sattolo's shuffle, so every load waits for the one before).
fn dependent_load_ns(bytes: usize) -> f64 {
    let n = (bytes / 8).max(2);
    let mut next: Vec<u64> = (0..n as u64).collect();
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    for i in (1..n).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        next.swap(i, (x % i as u64) as usize);
    }
    let (mut p, k) = (0usize, 1_000_000);
    let t = Instant::now();
    for _ in 0..k {
        p = next[p] as usize;
    }
    std::hint::black_box(p);
    t.elapsed().as_nanos() as f64 / k as f64
}
