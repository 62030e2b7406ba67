//! `cargo bench --bench l3_s3`: see `kvtier_bench::scenarios::l3_s3`.
#![allow(missing_docs)]

fn main() {
    kvtier_bench::bench_main("l3_s3", kvtier_bench::scenarios::l3_s3::run);
}
