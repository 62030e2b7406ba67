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

/// The commit that ends a [`HostClient::store_pages_deferred`]: the copied pages become
/// visible to other sessions when it runs. Until then they are reserved (a reserve of the
/// same key answers present; nothing reads them), and they expire with the session when it
/// never runs.
#[must_use = "the pages stay invisible until the commit runs"]
pub struct PendingCommit {
    client: HostClient,
    session: SessionId,
    keys: Vec<PageKey>,
    call_timeout: Duration,
}

impl PendingCommit {
    /// How many pages it commits.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Whether it commits nothing (never: a store with nothing copied returns none).
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// Commits the pages.
    pub async fn run(mut self) -> Result<(), ClientError> {
        timed(
            self.call_timeout,
            self.client.commit(self.session, &self.keys),
        )
        .await
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
        let (stored, commit) = self
            .store_pages_deferred(session, parent, keys, call_timeout, copy)
            .await?;
        if let Some(commit) = commit {
            commit.run().await.map_err(PageError::Daemon)?;
        }
        Ok(stored)
    }

    /// [`Self::store_pages`] up to the commit, which it returns for the caller to run when it
    /// chooses (`None` when nothing was copied): the bytes are in their slots once this
    /// returns, so the caller's source may be reused, and the pages become visible when the
    /// commit runs.
    pub async fn store_pages_deferred<E, F, Fut>(
        &mut self,
        session: SessionId,
        parent: Option<&PageKey>,
        keys: &[PageKey],
        call_timeout: Duration,
        copy: F,
    ) -> Result<(StoredPages, Option<PendingCommit>), PageError<E>>
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
            return Ok((StoredPages { held, copied: 0 }, None));
        }
        let reserved: Vec<PageKey> = mine.iter().map(|&(i, _)| keys[i]).collect();
        if let Err(e) = copy(mine).await {
            // Best effort: a reservation not aborted expires with the session's lease.
            let _ = timed(call_timeout, self.abort(session, &reserved)).await;
            return Err(PageError::Copy(e));
        }
        let stored = StoredPages {
            held,
            copied: reserved.len(),
        };
        let commit = PendingCommit {
            client: self.clone(),
            session,
            keys: reserved,
            call_timeout,
        };
        Ok((stored, Some(commit)))
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
