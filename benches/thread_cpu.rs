//! The CPU time of this process's threads by name: what work a call leaves to a server's
//! helper thread after it answers (kvtierd's sealer checksums every committed page) costs,
//! and when that thread has gone quiet before the bench times something else.

use std::collections::HashMap;
use std::time::{Duration, Instant};

/// The name [`by_name`] gives this process's main thread, whatever the binary is called.
pub const MAIN: &str = "main";

/// CPU time (ns) this process's live threads have run so far, summed by thread name (the
/// main thread as [`MAIN`]), from the kernel's per-thread scheduler accounting
/// (`/proc/self/task/*/schedstat`). A running thread's figure is brought up to date at each
/// scheduler tick and switch, so compare readings over windows of several milliseconds.
pub fn by_name() -> HashMap<String, u64> {
    let mut by = HashMap::new();
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return by;
    };
    let main = std::process::id().to_string();
    for t in tasks.flatten() {
        let p = t.path();
        let (Ok(comm), Ok(stat)) = (
            std::fs::read_to_string(p.join("comm")),
            std::fs::read_to_string(p.join("schedstat")),
        ) else {
            continue; // gone meanwhile
        };
        let ns: u64 = stat
            .split_whitespace()
            .next()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let name = if t.file_name().to_str() == Some(main.as_str()) {
            MAIN
        } else {
            comm.trim_end()
        };
        *by.entry(name.to_string()).or_insert(0) += ns;
    }
    by
}

/// CPU time spent so far by the live threads named `name` ([`by_name`]).
pub fn cpu_time(name: &str) -> Duration {
    Duration::from_nanos(by_name().get(name).copied().unwrap_or(0))
}

/// Waits until the threads named `name` spend no CPU over a whole `window`, for at most
/// `limit`. Returns whether they did.
pub fn wait_idle(name: &str, window: Duration, limit: Duration) -> bool {
    let start = Instant::now();
    let mut before = cpu_time(name);
    while start.elapsed() < limit {
        std::thread::sleep(window);
        let now = cpu_time(name);
        if now == before {
            return true;
        }
        before = now;
    }
    false
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU8, Ordering};

    use super::*;

    #[test]
    fn a_busy_thread_is_counted_and_idle_once_it_blocks() {
        // 0: spin, 1: block (alive and idle), 2: exit.
        let phase = Arc::new(AtomicU8::new(0));
        let p = phase.clone();
        let t = std::thread::Builder::new()
            .name("thread-cpu-test".into())
            .spawn(move || {
                let mut x = 0u64;
                while p.load(Ordering::Relaxed) == 0 {
                    x = std::hint::black_box(x.wrapping_add(1));
                }
                while p.load(Ordering::Relaxed) == 1 {
                    std::thread::park_timeout(Duration::from_secs(1));
                }
            })
            .unwrap();
        let window = Duration::from_millis(20);
        std::thread::sleep(window);
        assert!(cpu_time("thread-cpu-test") >= Duration::from_millis(5));
        assert!(
            !wait_idle("thread-cpu-test", window, 3 * window),
            "busy, yet idle"
        );
        phase.store(1, Ordering::Relaxed);
        assert!(wait_idle("thread-cpu-test", window, Duration::from_secs(2)));
        phase.store(2, Ordering::Relaxed);
        t.thread().unpark();
        t.join().unwrap();
        assert_eq!(cpu_time("no-such-thread"), Duration::ZERO);
        assert!(by_name()[MAIN] > 0, "the main thread is named {MAIN}");
    }
}
