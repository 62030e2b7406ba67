//! A copy's fence: whether it may still touch the engine's pages.
//!
//! An engine hands the agent its pages for one call; once that call's deadline passes, or
//! its client is gone, the engine may give those pages to another request. A copy that ran
//! on after that would read another request's KV into L2 (a save) or write stale KV over
//! another request's pages (a load). So every copy carries the [`Fence`] of the call it
//! serves and enters it for each part it moves ([`Fence::enter`]): once the fence is closed
//! nothing more moves, and the copy ends with
//! [`DeviceError::Fenced`](crate::DeviceError::Fenced). The part in progress when it closes
//! (256 KiB per thread on the cpu device; one 64 MiB part queued on the GPU's stream) still
//! ends, which is why the agent closes a call's fence a little before the client's deadline,
//! and why a client that cancels a call waits for [`Fence::close_and_settle`]: it returns
//! once no part is moving, after which the copy touches nothing more.

use parking_lot::{Condvar, Mutex};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Whether a copy may go on; cheap to clone and check.
#[derive(Clone, Debug)]
pub struct Fence(Option<Arc<Inner>>);

#[derive(Debug)]
struct Inner {
    closed: AtomicBool,
    deadline: Option<Instant>,
    /// Parts moving now (entered, not yet left).
    moving: AtomicUsize,
    /// Where a settling close waits for the last part to leave.
    settling: Mutex<()>,
    settled: Condvar,
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
            moving: AtomicUsize::new(0),
            settling: Mutex::new(()),
            settled: Condvar::new(),
        })))
    }

    /// Closes it: no copy under it moves another part.
    pub fn close(&self) {
        if let Some(i) = &self.0 {
            i.closed.store(true, Ordering::SeqCst);
        }
    }

    /// Whether copies under it may still move.
    pub fn is_open(&self) -> bool {
        match &self.0 {
            None => true,
            Some(i) => {
                // SeqCst: `enter` counts a part and then reads this; a settling close
                // stores it and then reads the count. Of the two, one sees the other.
                !i.closed.load(Ordering::SeqCst) && i.deadline.is_none_or(|d| Instant::now() < d)
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

    /// Enters the fence for one part of a copy: `Fenced` once it is closed, else a guard to
    /// hold while the part moves (a settling close waits for it).
    pub fn enter(&self) -> Result<Moving<'_>, crate::DeviceError> {
        let Some(i) = &self.0 else {
            return Ok(Moving(None));
        };
        // Counted before the check (both SeqCst, see `is_open`): a close that lands between
        // the two waits for the part this check then refuses, and sees it leave at once.
        i.moving.fetch_add(1, Ordering::SeqCst);
        let part = Moving(Some(i));
        self.check()?;
        Ok(part)
    }

    /// Closes it and waits, up to `within`, until no part entered under it is still moving;
    /// whether they all left. After `true`, no copy under this fence touches a byte more.
    /// (Closing several first, then settling each, stops them all at once.)
    pub fn close_and_settle(&self, within: Duration) -> bool {
        let Some(i) = &self.0 else {
            return false;
        };
        i.closed.store(true, Ordering::SeqCst);
        let mut waiting = i.settling.lock();
        i.settled.wait_while_for(
            &mut waiting,
            |_| i.moving.load(Ordering::SeqCst) > 0,
            within,
        );
        i.moving.load(Ordering::SeqCst) == 0
    }

    /// A guard that closes this fence when dropped: the future of the call it belongs to
    /// holds it, so a call whose client went away (its future dropped) fences its copies.
    pub fn close_on_drop(&self) -> CloseOnDrop {
        CloseOnDrop(self.clone())
    }
}

/// One part of a copy moving under a fence (see [`Fence::enter`]).
#[derive(Debug)]
pub struct Moving<'a>(Option<&'a Inner>);

impl Drop for Moving<'_> {
    fn drop(&mut self) {
        if let Some(i) = self.0 {
            // The last part out of a closed fence wakes a settling close. Under the lock: a
            // close that saw this part moving is waiting by then (it holds the lock until
            // it waits), so the wake-up is not lost.
            if i.moving.fetch_sub(1, Ordering::SeqCst) == 1 && i.closed.load(Ordering::SeqCst) {
                let _waiting = i.settling.lock();
                i.settled.notify_all();
            }
        }
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

    #[test]
    fn a_settling_close_waits_for_the_part_moving_and_no_part_enters_after_it() {
        let f = Fence::until(None);
        let part = f.enter().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let closer = {
            let f = f.clone();
            std::thread::spawn(move || {
                let settled = f.close_and_settle(Duration::from_secs(10));
                tx.send(Instant::now()).unwrap();
                settled
            })
        };
        // The close waits while the part moves.
        assert!(rx.recv_timeout(Duration::from_millis(200)).is_err());
        assert!(
            matches!(f.enter(), Err(crate::DeviceError::Fenced)),
            "closed: no new part"
        );
        let left = Instant::now();
        drop(part);
        assert!(closer.join().unwrap(), "settled");
        assert!(
            rx.recv().unwrap() >= left,
            "returned only after the part left"
        );

        // A part that never leaves: the close gives up at its bound and says so.
        let g = Fence::until(None);
        let stuck = g.enter().unwrap();
        assert!(!g.close_and_settle(Duration::from_millis(50)));
        drop(stuck);
        // Nothing moving: settles at once; a fence that never closes cannot settle.
        assert!(Fence::until(None).close_and_settle(Duration::ZERO));
        assert!(!Fence::never().close_and_settle(Duration::ZERO));
        assert!(Fence::never().enter().is_ok());
    }
}
