//! The C allocator's large-buffer setting, for processes that move pages through heap buffers.
//!
//! glibc serves an allocation above its mmap threshold with a fresh `mmap` and unmaps it on
//! free, so every such buffer costs a page fault per 4 KiB and the kernel's zeroing. The
//! threshold starts at 128 KiB and rises only when an mmapped block is freed, so whether a
//! 2 MiB page buffer comes from the heap depends on what the process happened to free
//! before. Measured on `kvtier-bench --only l3_remote` (2 MiB gets over gRPC): runs landed
//! either at 3.4–5 GiB/s or at 1.9–2.4 GiB/s, by that accident alone.
//!
//! [`keep_page_buffers_in_heap`] fixes the threshold at 32 MiB (the ceiling glibc's own
//! adjustment would reach) and the trim threshold at 64 MiB (twice that, as glibc's
//! adjustment sets it), so page-sized buffers are reused from the heap in every run.

/// The mmap threshold set: buffers up to this size come from the heap.
pub const MMAP_THRESHOLD: usize = 32 << 20;

/// Free memory kept at the top of a heap before it is returned to the kernel.
pub const TRIM_THRESHOLD: usize = 64 << 20;

/// Sets glibc's mmap and trim thresholds (see the module docs). Call once at start-up, before
/// threads allocate. Returns false where the C library refused (or is not glibc's; then it
/// does nothing).
pub fn keep_page_buffers_in_heap() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let to_int = |v: usize| libc::c_int::try_from(v).unwrap_or(libc::c_int::MAX);
        // SAFETY: mallopt only changes allocator parameters; it takes no pointers, and both
        // parameters are documented for use at any time.
        let mmap = unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, to_int(MMAP_THRESHOLD)) };
        // SAFETY: as above.
        let trim = unsafe { libc::mallopt(libc::M_TRIM_THRESHOLD, to_int(TRIM_THRESHOLD)) };
        mmap == 1 && trim == 1
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn glibc_accepts_the_thresholds() {
        assert!(keep_page_buffers_in_heap());
        // A page-sized buffer still works afterwards, of course.
        let v = vec![7u8; 2 << 20];
        assert_eq!(
            v.iter().map(|&b| usize::from(b)).sum::<usize>(),
            7 * (2 << 20)
        );
    }
}
