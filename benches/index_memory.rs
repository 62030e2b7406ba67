//! `cargo bench --bench index_memory`: see `kvtier_bench::scenarios::index`; this binary
//! installs the counting allocator the byte figures need.
#![allow(missing_docs)]

#[global_allocator]
static GLOBAL: kvtier_bench::CountingAlloc = kvtier_bench::CountingAlloc;

fn main() {
    kvtier_bench::bench_main("index", kvtier_bench::scenarios::index::run);
}
