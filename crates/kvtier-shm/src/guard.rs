//! Copies through a mapping of a file that another process may shrink at any moment.
//!
//! Touching a `MAP_SHARED` mapping past the end of its file raises SIGBUS, whose default
//! action kills the process. A memfd a client shared cannot always be sealed against
//! shrinking, and checking its size first leaves a window. So a guarded copy announces the
//! range it is about to touch (per thread); kvtier's SIGBUS handler, on a fault inside that
//! range, maps anonymous memory over the rest of it (so the copy finishes, on bytes that mean
//! nothing) and records the hit; the caller then reports the copy as failed and treats the
//! mapping as damaged. A fault anywhere else goes to whatever handled SIGBUS before (by
//! default: the process dies, as it should for a real bug). This is how display servers copy
//! out of client shared-memory buffers.
//!
//! The handler only reads a thread-local (const-initialised, so no lazy set-up), calls
//! `mmap` and, for foreign faults, `sigaction` or the previous handler: all
//! async-signal-safe.

use std::cell::Cell;
use std::mem::MaybeUninit;
use std::sync::Once;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering, compiler_fence};

thread_local! {
    /// The range `[start, end)` this thread is copying through, while it does.
    static ACTIVE: Cell<(usize, usize)> = const { Cell::new((0, 0)) };
    /// Whether a fault in that range was absorbed.
    static HIT: Cell<bool> = const { Cell::new(false) };
}

static INSTALL: Once = Once::new();
static INSTALLED: AtomicBool = AtomicBool::new(false);
static PAGE: AtomicUsize = AtomicUsize::new(4096);

struct Previous(std::cell::UnsafeCell<MaybeUninit<libc::sigaction>>);
// SAFETY: written once inside `INSTALL.call_once` before the handler is installed, read only
// afterwards (by the handler).
unsafe impl Sync for Previous {}
static PREVIOUS: Previous = Previous(std::cell::UnsafeCell::new(MaybeUninit::zeroed()));

extern "C" fn on_sigbus(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo for a SA_SIGINFO handler.
    let addr = unsafe { (*info).si_addr() } as usize;
    let (start, end) = ACTIVE.with(Cell::get);
    if addr >= start && addr < end {
        let page = PAGE.load(Ordering::Relaxed);
        let from = addr & !(page - 1);
        let to = end.div_ceil(page) * page;
        // SAFETY: `[from, to)` lies within the mapping the guarded copy announced (rounded to
        // whole pages of it); replacing it with private anonymous memory is what makes the
        // faulting instruction succeed when the handler returns.
        let p = unsafe {
            libc::mmap(
                from as *mut libc::c_void,
                to - from,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_FIXED | libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p != libc::MAP_FAILED {
            HIT.with(|h| h.set(true));
            return;
        }
    }
    // Not ours: as if this handler had never been installed.
    // SAFETY: PREVIOUS was filled before this handler could run; the calls below are what
    // the previous disposition asks for.
    unsafe {
        let prev = &*(*PREVIOUS.0.get()).as_ptr();
        let action = prev.sa_sigaction;
        if action == libc::SIG_DFL || action == libc::SIG_IGN {
            // Restore it and return: the instruction faults again and the default applies.
            libc::sigaction(libc::SIGBUS, prev, std::ptr::null_mut());
        } else if prev.sa_flags & libc::SA_SIGINFO != 0 {
            let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                std::mem::transmute(action);
            f(sig, info, ctx);
        } else {
            let f: extern "C" fn(libc::c_int) = std::mem::transmute(action);
            f(sig);
        }
    }
}

/// Installs the handler once per process; false if that failed (then copies are not guarded
/// and callers must not rely on it).
fn install() -> bool {
    INSTALL.call_once(|| {
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        if page > 0 {
            PAGE.store(page as usize, Ordering::Relaxed);
        }
        // SAFETY: a zeroed sigaction is a valid starting point; the handler has the
        // SA_SIGINFO signature; PREVIOUS is written before the new handler is active.
        unsafe {
            let mut act: libc::sigaction = std::mem::zeroed();
            act.sa_sigaction = on_sigbus as *const () as usize;
            act.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
            libc::sigemptyset(&mut act.sa_mask);
            let prev = (*PREVIOUS.0.get()).as_mut_ptr();
            if libc::sigaction(libc::SIGBUS, &act, prev) == 0 {
                INSTALLED.store(true, Ordering::Release);
            }
        }
    });
    INSTALLED.load(Ordering::Acquire)
}

/// Runs `copy`, which touches only `[start, start + len)`, with SIGBUS in that range
/// absorbed. Returns `None` when the guard could not be installed (the copy did not run),
/// otherwise whether the copy completed without a fault (`Some(false)`: its bytes are
/// meaningless and the range is no longer mapped to the file).
pub fn guarded(start: usize, len: usize, copy: impl FnOnce()) -> Option<bool> {
    if !install() {
        return None;
    }
    let end = start.saturating_add(len);
    let outer = ACTIVE.with(|a| a.replace((start, end)));
    HIT.with(|h| h.set(false));
    // The handler runs between the copy's instructions: keep the compiler from moving the
    // announcement after, or the check before, the copy.
    compiler_fence(Ordering::SeqCst);
    copy();
    compiler_fence(Ordering::SeqCst);
    let hit = HIT.with(|h| h.replace(false));
    ACTIVE.with(|a| a.set(outer));
    Some(!hit)
}

/// Whether a guarded copy found a mapping's file shrunk: from then on part of the mapping is
/// anonymous memory, not the file, so every later copy through it fails too.
#[derive(Debug, Default)]
pub(crate) struct Damage(AtomicBool);

impl Damage {
    /// Whether a copy found the file shrunk.
    pub(crate) fn is_set(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }

    /// `Truncated` (naming `path`) once a copy found the file shrunk.
    pub(crate) fn check(&self, path: &std::path::Path) -> Result<(), crate::ShmError> {
        if self.is_set() {
            return Err(crate::ShmError::Truncated(path.display().to_string()));
        }
        Ok(())
    }

    /// The result of a guarded copy ([`guarded`]'s `copied`): a fault marks the mapping
    /// damaged; no guard at all runs `fallback` (a copy through the file, never the mapping).
    pub(crate) fn after(
        &self,
        copied: Option<bool>,
        path: &std::path::Path,
        fallback: impl FnOnce() -> Result<(), crate::ShmError>,
    ) -> Result<(), crate::ShmError> {
        match copied {
            Some(true) => Ok(()),
            Some(false) => {
                self.0.store(true, Ordering::Release);
                Err(crate::ShmError::Truncated(path.display().to_string()))
            }
            None => fallback(),
        }
    }
}
