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
    }
}
