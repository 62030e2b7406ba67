//! `cargo bench --bench l3_file`: see `kvtier_bench::scenarios::l3_file`.
#![allow(missing_docs)]

fn main() {
    kvtier_bench::bench_main("l3_file", kvtier_bench::scenarios::l3_file::run);
}
