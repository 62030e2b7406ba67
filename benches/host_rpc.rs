//! `cargo bench --bench host_rpc`: see `kvtier_bench::scenarios::host_rpc`.
#![allow(missing_docs)]

fn main() {
    kvtier_bench::bench_main("host_rpc", kvtier_bench::scenarios::host_rpc::run);
}
