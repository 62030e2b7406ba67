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
    if let Err(e) = check_args(&args[1..]) {
        eprintln!("kvtier-bench: {e}\n{USAGE}");
        std::process::exit(2);
    }
    if args.iter().any(|a| a == "--help" || a == "-h") {
        println!("{USAGE}");
        return;
    }
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
    // The host's calibration before the first scenario and after the last.
    let probe = kvtier_bench::host::Probe::take();
    // Human-readable progress goes to stderr when the JSON is wanted on stdout.
    for (name, run, ceph) in ALL {
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

/// Every scenario, in the order they run: (name, run, needs Ceph). `--only` takes a
/// comma-separated list of the names.
const ALL: [Scenario; 16] = [
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
    ("fleet", scenarios::fleet::run, false),
    // Runs kvtierd's side alone unless benches/peers/run set up Mooncake Store.
    ("peers", scenarios::peers::run, false),
    // Measures only where there is an NVIDIA GPU (scripts/gpu-check).
    ("gpu", scenarios::gpu::run, false),
    // benches/vllm_bench.py in the Python environment, against the binaries beside this.
    ("vllm", scenarios::vllm::run, false),
];

/// The flags, for `--help` and for a refused argument.
const USAGE: &str = "usage: kvtier-bench [--only SCENARIO[,SCENARIO...]] [--quick] [--check] \
[--json] [--no-s3] [--diag] [--sizes]
  --only    run these scenarios (default: all)
  --quick   fewer rounds and pages (a smoke run)
  --check   exit with status 1 if a row misses its goal beyond the run's noise
  --json    the rows as JSON on stdout (commentary on stderr)
  --no-s3   skip what needs the local Ceph RGW
  --diag    split l3_file and prefetch rows into their costs
  --sizes   l3_remote and l3_s3 across page sizes";

/// Refuses an argument that is not a flag above, and `--only` without known scenarios:
/// a mistyped flag must not silently run every scenario for minutes.
fn check_args(args: &[String]) -> Result<(), String> {
    const FLAGS: [&str; 9] = [
        "--quick", "--json", "--check", "--no-s3", "--diag", "--sizes", "--only", "--help", "-h",
    ];
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if !FLAGS.contains(&a.as_str()) {
            return Err(format!("unknown argument {a:?}"));
        }
        if a == "--only" {
            let list = it
                .next()
                .ok_or("--only needs a comma-separated list of scenarios")?;
            for name in list.split(',') {
                if !ALL.iter().any(|s| s.0 == name) {
                    return Err(format!(
                        "--only: {name:?} is not a scenario; scenarios: {}",
                        ALL.map(|s| s.0).join(", ")
                    ));
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn flags_and_scenarios_are_checked_by_name() {
        assert!(check_args(&args(&["--only", "agent,host_rpc", "--quick", "--check"])).is_ok());
        assert!(check_args(&args(&[])).is_ok());
        let e = check_args(&args(&["--qiuck"])).unwrap_err();
        assert!(e.contains("\"--qiuck\""), "{e}");
        let e = check_args(&args(&["--only", "agent,hostrpc"])).unwrap_err();
        assert!(e.contains("\"hostrpc\"") && e.contains("host_rpc"), "{e}");
        assert!(
            check_args(&args(&["--only"]))
                .unwrap_err()
                .contains("--only")
        );
    }
}
