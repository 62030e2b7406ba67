//! The L2 page protocol, client side, in one place: a page is written into kvtierd's shared
//! pool by reserve → copy → commit (abort when the copy fails), and read by copying from
//! pinned slots, then releasing the pins. Bytes move by the caller's copy (memcpy or DMA into
//! the mapped pool), never through gRPC; these methods order the calls around it.
//!
//! Every daemon call here runs under `call_timeout`: a kvtierd that stops answering is an
//! error ([`PageError::Daemon`]), never a hung caller.

use std::time::Duration;

use kvtier_core::{PageKey, SessionId};

use crate::{ClientError, HostClient, Reserved};

/// Which side of a page move failed.
#[derive(Debug)]
pub enum PageError<E> {
    /// A kvtierd call failed or timed out (reserve, commit, release).
    Daemon(ClientError),
    /// The caller's copy failed; what it reserved was aborted.
    Copy(E),
}

/// How a [`HostClient::store_pages`] ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StoredPages {
    /// Leading pages L2 now holds (the first page it had no room for ends them).
    pub held: usize,
    /// Of those, how many this call copied (the rest were there already).
    pub copied: usize,
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
        timed(call_timeout, self.commit(session, &reserved))
            .await
            .map_err(PageError::Daemon)?;
        Ok(StoredPages {
            held,
            copied: reserved.len(),
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
