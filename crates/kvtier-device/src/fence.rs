//! A copy's fence: whether it may still touch the engine's pages.
//!
//! An engine hands the agent its pages for one call; once that call's deadline passes, or
//! its client is gone, the engine may give those pages to another request. A copy that ran
//! on after that would read another request's KV into L2 (a save) or write stale KV over
//! another request's pages (a load). So every copy carries the [`Fence`] of the call it
//! serves and checks it before each part it moves: once the fence is closed nothing more
//! moves, and the copy ends with [`DeviceError::Fenced`](crate::DeviceError::Fenced). The
//! part in progress when it closes (a few pages on the cpu device; the transfers already
//! queued on the GPU's stream) still ends, which is why the agent closes a call's fence a
//! little before the client's deadline.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

/// Whether a copy may go on; cheap to clone and check.
#[derive(Clone, Debug)]
pub struct Fence(Option<Arc<Inner>>);

#[derive(Debug)]
struct Inner {
    closed: AtomicBool,
    deadline: Option<Instant>,
}

impl Fence {
    /// A fence that never closes: copies the agent owns (tree mode's pages, its own
    /// backups), and tests.
    pub const fn never() -> Self {
        Self(None)
    }

    /// A fence that closes at `deadline` (when given) or when [`Self::close`] is called.
    pub fn until(deadline: Option<Instant>) -> Self {
        Self(Some(Arc::new(Inner {
            closed: AtomicBool::new(false),
            deadline,
        })))
    }

    /// Closes it: no copy under it moves another part.
    pub fn close(&self) {
        if let Some(i) = &self.0 {
            i.closed.store(true, Ordering::Release);
        }
    }

    /// Whether copies under it may still move.
    pub fn is_open(&self) -> bool {
        match &self.0 {
            None => true,
            Some(i) => {
                !i.closed.load(Ordering::Acquire) && i.deadline.is_none_or(|d| Instant::now() < d)
            }
        }
    }

    /// `Ok` while open, else the error a fenced copy ends with.
    pub fn check(&self) -> Result<(), crate::DeviceError> {
        if self.is_open() {
            Ok(())
        } else {
            Err(crate::DeviceError::Fenced)
        }
    }

    /// A guard that closes this fence when dropped: the future of the call it belongs to
    /// holds it, so a call whose client went away (its future dropped) fences its copies.
    pub fn close_on_drop(&self) -> CloseOnDrop {
        CloseOnDrop(self.clone())
    }
}

/// Closes its fence when dropped (see [`Fence::close_on_drop`]).
#[derive(Debug)]
pub struct CloseOnDrop(Fence);

impl Drop for CloseOnDrop {
    fn drop(&mut self) {
        self.0.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_fence_closes_when_told_at_its_deadline_or_when_its_guard_drops() {
        let never = Fence::never();
        never.close();
        assert!(never.is_open(), "a fence that never closes stays open");

        let f = Fence::until(None);
        assert!(f.check().is_ok());
        f.clone().close();
        assert!(!f.is_open(), "a clone closes the same fence");
        assert!(matches!(f.check(), Err(crate::DeviceError::Fenced)));

        let past = Fence::until(Some(Instant::now()));
        assert!(!past.is_open(), "a deadline now has passed");
        let later = Fence::until(Some(Instant::now() + Duration::from_secs(60)));
        assert!(later.is_open());

        let g = Fence::until(None);
        {
            let _guard = g.close_on_drop();
            assert!(g.is_open());
        }
        assert!(!g.is_open(), "the dropped guard closed it");
    }
}
