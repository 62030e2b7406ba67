//! Memory per page of the L2 index and the agent's radix tree, and eviction latency, at 10k,
//! 100k and 1M pages. A counting allocator measures live heap bytes exactly.
#![allow(missing_docs, unsafe_code, clippy::unwrap_used)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use kvtier_core::host_index::HostIndex;
use kvtier_core::radix::RadixTree;
use kvtier_core::{Namespace, PageHasher, PageKey, PolicyKind};

struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to the system allocator unchanged and only counts bytes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        LIVE.fetch_add(l.size(), Ordering::Relaxed);
        // SAFETY: same layout contract as our caller's.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size(), Ordering::Relaxed);
        // SAFETY: `p` came from `alloc` above with this layout.
        unsafe { System.dealloc(p, l) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn chains(pages: usize) -> Vec<Vec<PageKey>> {
    let h = PageHasher::new(16, &Namespace::default()).unwrap();
    (0..pages.div_ceil(64))
        .map(|c| {
            let tokens: Vec<u32> = (0..64 * 16).map(|i| (c * 64 * 16 + i) as u32).collect();
            h.keys(&tokens)
        })
        .collect()
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    println!(
        "{:<28} {:>10} {:>14} {:>16}",
        "structure", "pages", "bytes/page", "evict p50 (ns)"
    );
    for pages in [10_000usize, 100_000, 1_000_000] {
        let keys = chains(pages);
        let n = keys.iter().map(Vec::len).sum::<usize>();

        let before = LIVE.load(Ordering::Relaxed);
        let mut ix = HostIndex::new(n as u32, PolicyKind::Lru);
        for (i, c) in keys.iter().enumerate() {
            ix.reserve(i as u64, None, c);
            ix.commit(i as u64, c).unwrap();
        }
        let bytes = LIVE.load(Ordering::Relaxed) - before;
        let mut lat: Vec<u128> = (0..1000)
            .map(|_| {
                let t = Instant::now();
                ix.evict(1);
                t.elapsed().as_nanos()
            })
            .collect();
        lat.sort_unstable();
        println!(
            "{:<28} {:>10} {:>14.1} {:>16}",
            "L2 HostIndex",
            n,
            bytes as f64 / n as f64,
            lat[500]
        );
        drop(ix);

        let before = LIVE.load(Ordering::Relaxed);
        let mut tree: RadixTree<PageKey, u32> = RadixTree::new(PolicyKind::Lru);
        let vals: Vec<u32> = (0..64).collect();
        for c in &keys {
            tree.insert(c, &vals[..c.len()]).unwrap();
        }
        let bytes = LIVE.load(Ordering::Relaxed) - before;
        let mut lat: Vec<u128> = (0..1000)
            .map(|_| {
                let t = Instant::now();
                tree.evict(1);
                t.elapsed().as_nanos()
            })
            .collect();
        lat.sort_unstable();
        println!(
            "{:<28} {:>10} {:>14.1} {:>16}",
            "agent RadixTree (64-page seqs)",
            n,
            bytes as f64 / n as f64,
            lat[500]
        );
    }
}
