//! Thread placement for comparisons whose two sides run on different servers.
//!
//! On a machine with few cores, where the scheduler puts a server's threads relative to its
//! caller decides how many cross-core transfers and wake-ups a call pays, and a placement
//! sticks for a whole loop. A row and its floor measured side by side, each against its own
//! server, can then land in different placements and differ by more than their code does
//! (the `agent` floor row swung between 0.70 and 1.16 across runs of one binary). [`place`]
//! gives both the same one: the calling thread on one core, the named servers' threads on
//! another, as an engine and its sidecar on different cores are. Dropping the guard puts
//! every thread back as it was.

#![allow(unsafe_code)]

use std::mem::MaybeUninit;

/// Threads pinned by [`place`], with the CPU sets to restore.
pub struct Placed {
    saved: Vec<(libc::pid_t, libc::cpu_set_t)>,
}

impl Drop for Placed {
    fn drop(&mut self) {
        for (tid, set) in &self.saved {
            // A thread that has exited meanwhile is no longer ours to restore.
            let _ = set_affinity(*tid, set);
        }
    }
}

fn affinity(tid: libc::pid_t) -> Option<libc::cpu_set_t> {
    let mut set = MaybeUninit::<libc::cpu_set_t>::zeroed();
    // SAFETY: `set` is a valid, writable cpu_set_t of the size passed.
    let rc = unsafe {
        libc::sched_getaffinity(
            tid,
            std::mem::size_of::<libc::cpu_set_t>(),
            set.as_mut_ptr(),
        )
    };
    // SAFETY: zeroed is a valid cpu_set_t, and the kernel filled it on success.
    (rc == 0).then(|| unsafe { set.assume_init() })
}

fn set_affinity(tid: libc::pid_t, set: &libc::cpu_set_t) -> bool {
    // SAFETY: `set` is a valid cpu_set_t of the size passed; the kernel only reads it.
    unsafe { libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), set) == 0 }
}

fn only(cpu: usize) -> libc::cpu_set_t {
    // SAFETY: an all-zero cpu_set_t is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `cpu` is below CPU_SETSIZE (it came from CPU_ISSET over that range).
    unsafe { libc::CPU_SET(cpu, &mut set) };
    set
}

/// Pins the calling thread to the first CPU it may use, and every thread of this process
/// named one of `servers` (a server runtime's workers and blocking threads share its name;
/// helper threads such as kvtierd's sealer have their own and stay free) to the second,
/// until the guard drops. `None` (and nothing pinned) with fewer than two CPUs, or if the
/// kernel refuses.
pub fn place(servers: &[&str]) -> Option<Placed> {
    // SAFETY: gettid has no preconditions.
    let me = unsafe { libc::gettid() };
    let mine = affinity(me)?;
    let cpus: Vec<usize> = (0..libc::CPU_SETSIZE as usize)
        // SAFETY: `c` is below CPU_SETSIZE and `mine` a valid set.
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &mine) })
        .collect();
    if cpus.len() < 2 {
        return None;
    }
    let mut placed = Placed { saved: Vec::new() };
    let mut pin = |tid: libc::pid_t, cpu: usize| {
        let Some(old) = affinity(tid) else {
            return false;
        };
        if !set_affinity(tid, &only(cpu)) {
            return false;
        }
        placed.saved.push((tid, old));
        true
    };
    if !pin(me, cpus[0]) {
        return None;
    }
    for entry in std::fs::read_dir("/proc/self/task").ok()?.flatten() {
        let Ok(tid) = entry.file_name().to_string_lossy().parse::<libc::pid_t>() else {
            continue;
        };
        let name = std::fs::read_to_string(entry.path().join("comm")).unwrap_or_default();
        if tid != me && servers.contains(&name.trim_end()) && !pin(tid, cpus[1]) {
            return None;
        }
    }
    Some(placed)
}
