//! `cargo bench --bench agent`: see `kvtier_bench::scenarios::agent`.
#![allow(missing_docs)]

fn main() {
    kvtier_bench::bench_main("agent", kvtier_bench::scenarios::agent::run);
}
