//! `kvtier-bench`: every scenario in one run, each figure with the baseline measured in the
//! same run and their ratio, as a table (and `--json`). `--quick` runs small versions
//! (under a minute here); `--no-s3` skips the scenarios that need a local Ceph;
//! `--only a,b` runs the named scenarios. Each row shows its goal (benches/goals.rs) and
//! `MISS` where it falls short by more than the run's noise; `--check` then exits with
//! status 1, listing those rows. After the table it says what the host was like during the
//! run (`host.rs`: CPU, stolen time, a calibration at start and end), so that two runs'
//! values can be told apart.
#![allow(missing_docs)]

use kvtier_bench::scenarios;

#[global_allocator]
static GLOBAL: kvtier_bench::CountingAlloc = kvtier_bench::CountingAlloc;

type Scenario = (&'static str, fn(bool), bool);

fn main() {
    // As kvtierd and kvtier-agent do (the in-process daemons run on this allocator).
    kvtier_shm::malloc::keep_page_buffers_in_heap();
    // Child servers of the end-to-end scenario are this binary re-executed.
    if kvtier_sim::cluster::serve_child_from_env() {
        return;
    }
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let json = args.iter().any(|a| a == "--json");
    let check = args.iter().any(|a| a == "--check");
    kvtier_bench::commentary_to_stderr(json);
    let no_s3 = args.iter().any(|a| a == "--no-s3");
    let only: Vec<String> = args
        .iter()
        .position(|a| a == "--only")
        .and_then(|i| args.get(i + 1))
        .map(|s| s.split(',').map(str::to_string).collect())
        .unwrap_or_default();
    // (name, run, needs Ceph)
    let all: [Scenario; 15] = [
        ("keys", scenarios::keys::run, false),
        ("agent", scenarios::agent::run, false),
        ("host_rpc", scenarios::host_rpc::run, false),
        ("events", scenarios::events::run, false),
        ("index", scenarios::index::run, false),
        ("l3_file", scenarios::l3_file::run, false),
        ("l3_rocksdb", scenarios::l3_rocksdb::run, false),
        ("l3_remote", scenarios::l3_remote::run, false),
        ("l3_s3", scenarios::l3_s3::run, true),
        ("prefetch", scenarios::prefetch::run, false),
        ("sglang", scenarios::sglang::run, false),
        ("sim", scenarios::sim::run, false),
        // Runs kvtierd's side alone unless benches/peers/run set up Mooncake Store.
        ("peers", scenarios::peers::run, false),
        // Measures only where there is an NVIDIA GPU (scripts/gpu-check).
        ("gpu", scenarios::gpu::run, false),
        // benches/vllm_bench.py in the Python environment, against the binaries beside this.
        ("vllm", scenarios::vllm::run, false),
    ];
    // The host's calibration before the first scenario and after the last.
    let probe = kvtier_bench::host::Probe::take();
    // Human-readable progress goes to stderr when the JSON is wanted on stdout.
    for (name, run, ceph) in all {
        if !only.is_empty() && !only.iter().any(|o| o == name) {
            continue;
        }
        if ceph && no_s3 {
            continue;
        }
        eprintln!("== {name}");
        kvtier_bench::begin(name);
        run(quick);
    }
    kvtier_bench::stop_shared_ceph();
    let host = kvtier_bench::host::HostReport::finish(probe);
    let rows = kvtier_bench::recorded();
    if json {
        match serde_json::to_string(&rows) {
            Ok(s) => println!("{s}"),
            Err(e) => eprintln!("encoding the rows: {e}"),
        }
    } else {
        print!("\n{}", kvtier_bench::table(&rows));
    }
    // Why this run's values may differ from another's (with --json, beside the rows).
    if json {
        eprint!("{host}");
    } else {
        print!("{host}");
    }
    if check {
        let misses = kvtier_bench::goals::misses(&rows);
        if !misses.is_empty() {
            eprintln!("{} rows miss their goal:", misses.len());
            for m in &misses {
                eprintln!("  {m}");
            }
            std::process::exit(1);
        }
        eprintln!("every row with a goal meets it");
    }
}
