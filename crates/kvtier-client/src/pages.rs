//! The L2 page protocol, client side, in one place: a page is written into kvtierd's shared
//! pool by reserve → copy → commit (abort when the copy fails), and read by copying from
//! pinned slots, then releasing the pins. Bytes move by the caller's copy (memcpy or DMA into
//! the mapped pool), never through gRPC; these methods order the calls around it.
//!
//! A writer that holds a [`SlotLease`] writes a few pages in one call instead: copy into
//! leased slots, then `CommitLeased` (each commit tops the lease up).
//!
//! Every daemon call here runs under `call_timeout`: a kvtierd that stops answering is an
//! error ([`PageError::Daemon`]), never a hung caller.

use parking_lot::Mutex;
use std::time::Duration;

use kvtier_core::host_index::Landed;
use kvtier_core::{PageKey, SessionId};

use crate::{ClientError, HostClient, Reserved};

/// Which side of a page move failed.
#[derive(Debug)]
pub enum PageError<E> {
    /// A kvtierd call failed or timed out (reserve, commit, release).
    Daemon(ClientError),
    /// The caller's copy failed; what it reserved was aborted.
    Copy(E),
    /// The caller's copy into slots of its [`SlotLease`] failed: the slots are not used
    /// again unless the caller gives them back ([`SlotLease::give_back`]), which it does when
    /// the failure was not the slots' (a copy its caller stopped, say).
    LeasedCopy(E, Vec<u32>),
}

/// How a [`HostClient::store_pages`] ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StoredPages {
    /// Leading pages L2 now holds (the first page it had no room for ends them).
    pub held: usize,
    /// Of those, how many this call copied (the rest were there already).
    pub copied: usize,
}

/// Slots a session holds leased in kvtierd's pool (no page in them, invisible to everyone),
/// shared by the session's concurrent writers. A write of at most [`SlotLease::MAX_WRITE`]
/// pages that finds that many copies straight into them and lands with one call; every commit
/// asks kvtierd to top the lease up to `want`. It belongs to one session: kvtierd frees the
/// slots when the session ends, so a new session starts with a new lease.
#[derive(Debug)]
pub struct SlotLease {
    slots: Mutex<Vec<u32>>,
    want: u32,
}

impl SlotLease {
    /// The most pages one leased write takes: a decode step's few; larger writes reserve
    /// (their dedup check before the copy is worth its call).
    pub const MAX_WRITE: usize = 4;

    /// An empty lease that asks to hold `want` slots (0: never lease).
    pub fn new(want: u32) -> Self {
        Self {
            slots: Mutex::new(Vec::new()),
            want,
        }
    }

    /// Slots held and not in use by a write.
    pub fn held(&self) -> usize {
        self.slots.lock().len()
    }

    /// `n` slots, or none when fewer are held.
    fn take(&self, n: usize) -> Option<Vec<u32>> {
        let mut s = self.slots.lock();
        let len = s.len();
        (len >= n).then(|| s.split_off(len - n))
    }

    fn give(&self, slots: impl IntoIterator<Item = u32>) {
        self.slots.lock().extend(slots);
    }

    /// Slots of a [`PageError::LeasedCopy`] that may take another write: nothing a later
    /// write reads was left in them (a leased slot is the session's alone until committed).
    pub fn give_back(&self, slots: Vec<u32>) {
        self.give(slots);
    }
}

async fn timed<T>(
    call_timeout: Duration,
    fut: impl Future<Output = Result<T, ClientError>>,
) -> Result<T, ClientError> {
    match tokio::time::timeout(call_timeout, fut).await {
        Ok(r) => r,
        Err(_) => Err(ClientError::Protocol("kvtierd call timed out".into())),
    }
}

impl HostClient {
    /// Writes the pages of `keys` (`parent`: the key before them in their prompt): reserves
    /// slots, lets `copy` fill those it got — `(index into keys, slot)` pairs — and commits
    /// them, so other sessions see a page only once it is whole. Stops at the first page L2
    /// has no room for; a failed copy aborts the reservations.
    pub async fn store_pages<E, F, Fut>(
        &mut self,
        session: SessionId,
        parent: Option<&PageKey>,
        keys: &[PageKey],
        call_timeout: Duration,
        copy: F,
    ) -> Result<StoredPages, PageError<E>>
    where
        F: FnOnce(Vec<(usize, u32)>) -> Fut,
        Fut: Future<Output = Result<(), E>>,
    {
        self.store_pages_with(session, None, parent, keys, call_timeout, copy)
            .await
    }

    /// [`Self::store_pages`] for a writer holding `lease`: a small write that finds enough
    /// leased slots is one copy and one call (pages already in L2 are copied for nothing and
    /// their slots stay leased); any other reserves, and its commit tops the lease up.
    pub async fn store_pages_with<E, F, Fut>(
        &mut self,
        session: SessionId,
        lease: Option<&SlotLease>,
        parent: Option<&PageKey>,
        keys: &[PageKey],
        call_timeout: Duration,
        copy: F,
    ) -> Result<StoredPages, PageError<E>>
    where
        F: FnOnce(Vec<(usize, u32)>) -> Fut,
        Fut: Future<Output = Result<(), E>>,
    {
        if let Some(lease) = lease
            && !keys.is_empty()
            && keys.len() <= SlotLease::MAX_WRITE
            && let Some(slots) = lease.take(keys.len())
        {
            return self
                .store_leased(session, lease, slots, parent, keys, call_timeout, copy)
                .await;
        }
        let r = timed(call_timeout, self.reserve(session, parent, keys))
            .await
            .map_err(PageError::Daemon)?;
        // kvtierd is a peer: never trust it to answer for more keys than were asked about.
        let held = r
            .iter()
            .take(keys.len())
            .take_while(|r| **r != Reserved::NoSpace)
            .count();
        let mine: Vec<(usize, u32)> = r[..held]
            .iter()
            .enumerate()
            .filter_map(|(i, r)| match r {
                Reserved::Slot(s) => Some((i, *s)),
                _ => None,
            })
            .collect();
        if mine.is_empty() {
            return Ok(StoredPages { held, copied: 0 });
        }
        let reserved: Vec<PageKey> = mine.iter().map(|&(i, _)| keys[i]).collect();
        if let Err(e) = copy(mine).await {
            // Best effort: a reservation not aborted expires with the session's lease.
            let _ = timed(call_timeout, self.abort(session, &reserved)).await;
            return Err(PageError::Copy(e));
        }
        let want = lease.map_or(0, |l| l.want);
        let granted = timed(call_timeout, self.commit_leasing(session, &reserved, want))
            .await
            .map_err(PageError::Daemon)?;
        if let Some(lease) = lease {
            lease.give(granted);
        }
        Ok(StoredPages {
            held,
            copied: reserved.len(),
        })
    }

    /// Copies `keys`' pages into the leased `slots`, then lands them in one call.
    #[allow(clippy::too_many_arguments)]
    async fn store_leased<E, F, Fut>(
        &mut self,
        session: SessionId,
        lease: &SlotLease,
        slots: Vec<u32>,
        parent: Option<&PageKey>,
        keys: &[PageKey],
        call_timeout: Duration,
        copy: F,
    ) -> Result<StoredPages, PageError<E>>
    where
        F: FnOnce(Vec<(usize, u32)>) -> Fut,
        Fut: Future<Output = Result<(), E>>,
    {
        if let Err(e) = copy(slots.iter().copied().enumerate().collect()).await {
            // Not used again unless the caller says the failure was not theirs (a slot the
            // copy cannot reach would fail every write it went to): kvtierd frees them with
            // the session.
            return Err(PageError::LeasedCopy(e, slots));
        }
        // A failed call leaves the slots' fate unknown (landed or not): they are not used
        // again, and kvtierd frees them with the session.
        let (landed, granted) = timed(
            call_timeout,
            self.commit_leased(session, parent, keys, &slots, lease.want),
        )
        .await
        .map_err(PageError::Daemon)?;
        lease.give(granted);
        lease.give(
            slots
                .iter()
                .zip(&landed)
                .filter(|(_, l)| **l != Landed::Stored)
                .map(|(s, _)| *s),
        );
        Ok(StoredPages {
            held: landed.iter().take_while(|l| **l != Landed::NoRoom).count(),
            copied: landed.iter().filter(|l| **l == Landed::Stored).count(),
        })
    }

    /// Reads pinned pages: `copy` reads from `slots` (pinned for `pinned`, by `acquire` or
    /// `take_prefetch`), then the pins are released. What the copy read counts only if the
    /// release succeeded (until then the daemon could not have reused a slot): an `Ok` is
    /// bytes the caller may keep.
    pub async fn load_pages<E, F, Fut>(
        &mut self,
        session: SessionId,
        pinned: &[PageKey],
        slots: &[u32],
        call_timeout: Duration,
        copy: F,
    ) -> Result<(), PageError<E>>
    where
        F: FnOnce(Vec<u32>) -> Fut,
        Fut: Future<Output = Result<(), E>>,
    {
        let copied = if slots.is_empty() {
            Ok(())
        } else {
            copy(slots.to_vec()).await
        };
        let released = if pinned.is_empty() {
            Ok(())
        } else {
            timed(call_timeout, self.release(session, pinned)).await
        };
        copied.map_err(PageError::Copy)?;
        released.map_err(PageError::Daemon)
    }
}
