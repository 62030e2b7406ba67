//! `cargo bench --bench l3_remote`: see `kvtier_bench::scenarios::l3_remote`.
#![allow(missing_docs)]

fn main() {
    kvtier_bench::bench_main("l3_remote", kvtier_bench::scenarios::l3_remote::run);
}
