//! `cargo bench --bench sglang`: see `kvtier_bench::scenarios::sglang`.
#![allow(missing_docs)]

fn main() {
    kvtier_bench::bench_main("sglang", kvtier_bench::scenarios::sglang::run);
}
