//! kvtierd: the common server `main` (kvtier-server) around [`kvtier_daemon::run`].

use kvtier_config::daemon::DaemonConfig;
use kvtier_server::process;

fn main() -> anyhow::Result<()> {
    // Page buffers from the heap, not a fresh mmap each (kvtier_shm::malloc).
    kvtier_shm::malloc::keep_page_buffers_in_heap();
    process::main::<DaemonConfig, _, _, _>(
        "kvtierd",
        "kvtierd — the kvtier node daemon (shared host tier and storage tiers).",
        |cfg, shutdown| {
            kvtier_daemon::run(cfg, shutdown, |r| {
                let metrics = r.metrics.map(|a| format!("http://{a}/metrics"));
                process::print_ready(
                    "kvtierd",
                    &[
                        ("socket", r.socket.display().to_string()),
                        ("tcp", r.tcp.map(|a| a.to_string()).unwrap_or_default()),
                        ("metrics", metrics.unwrap_or_default()),
                    ],
                );
            })
        },
    )
}
