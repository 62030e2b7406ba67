//! `cargo bench --bench prefetch`: see `kvtier_bench::scenarios::prefetch`.
#![allow(missing_docs)]

fn main() {
    kvtier_bench::bench_main("prefetch", kvtier_bench::scenarios::prefetch::run);
}
