//! kvtier-agent: the common server `main` (kvtier-server) around [`kvtier_agent::run`].

use kvtier_config::agent::AgentConfig;
use kvtier_server::process;

fn main() -> anyhow::Result<()> {
    // Page buffers from the heap, not a fresh mmap each (kvtier_shm::malloc).
    kvtier_shm::malloc::keep_page_buffers_in_heap();
    process::main::<AgentConfig, _, _, _>(
        "kvtier-agent",
        "kvtier-agent — the per-worker L1 agent of kvtier (the engine's prefix cache).",
        |cfg, shutdown| {
            kvtier_agent::run(cfg, shutdown, |r| {
                let metrics = r.metrics.map(|a| format!("http://{a}/metrics"));
                process::print_ready(
                    "kvtier-agent",
                    &[
                        ("socket", r.socket.display().to_string()),
                        ("metrics", metrics.unwrap_or_default()),
                    ],
                );
            })
        },
    )
}
