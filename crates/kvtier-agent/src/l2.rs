//! The agent's one port to L2: every kvtierd call a mode makes goes through here, and so do
//! both page moves, over `kvtier_client`'s page protocol.
//!
//! - [`L2::read`]: pages pinned in L2 → the engine's device pages, then unpinned; a page
//!   counts as loaded only when its pin was still held at the end.
//! - [`L2::write`]: the engine's device pages → L2 (reserve, copy, commit). While L2 has no
//!   room it tries again as long as each `cache.evict_wait` brings progress (writes to L3
//!   landing make room), and it waits for a restarting kvtierd (a Save `cache.evict_wait`, a
//!   tree-mode backup, whose page is still on the device, `cache.daemon_wait`): slow storage
//!   and a slow restart are backpressure, not a reason to give a page up. What still fails
//!   comes back with its [`Loss`] reason.
//!
//! A daemon call that fails because the link is gone marks it broken, so the link task
//! reconnects; any other failure is the daemon's answer to this call only.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier_client::{ClientError, PageError, StoredPages};
use kvtier_core::PageKey;
use kvtier_device::method::Direction;
use kvtier_device::{Device, DeviceError, Fence, PageCopy};
use kvtier_shm::ShmPool;

use crate::link::{Linked, is_link_error};
use crate::outcome::{LoadFailure, Loss};
use crate::shared::Shared;

/// Who waits on a write: the engine (a Save it blocks on, whose wait for the link is counted
/// as a backpressure wait, and whose pages are the engine's only while the call's fence is
/// open) or a background backup (the agent's own pages while the engine's registration that
/// gave them lasts: under that registration's fence, closed when the engine registers again
/// and takes every page back; its waits count where an engine call waits on it, at Insert or
/// Evict).
#[derive(Clone, Copy, Debug)]
pub(crate) enum Writer<'a> {
    Engine(&'a Fence),
    Background(&'a Fence),
}

impl Writer<'_> {
    /// The fence the write's copies run under.
    fn fence(&self) -> &Fence {
        match self {
            Writer::Engine(f) | Writer::Background(f) => f,
        }
    }
}

/// How a [`L2::write`] ended.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Stored {
    /// Leading pages L2 holds (through the current session).
    pub(crate) done: usize,
    /// Pages this write copied.
    pub(crate) copied: usize,
    /// Pages this write found in L2 already.
    pub(crate) present: usize,
    /// Why the pages after `done` are not in L2, when some are not.
    pub(crate) failure: Option<Loss>,
}

/// Runs a device copy: on a blocking thread (a DMA wait or a large memcpy must not stall the
/// runtime), or here when the device says it is a short memcpy. `fence` is checked before
/// each part moves and once more after the last: a copy it closed on ends
/// [`DeviceError::Fenced`], and what it moved is neither committed nor counted loaded.
async fn copy(
    device: Arc<dyn Device>,
    pool: Arc<ShmPool>,
    copies: Vec<PageCopy>,
    dir: Direction,
    fence: Fence,
) -> Result<(), DeviceError> {
    fence.check()?;
    let inline = device.copies_inline(copies_bytes(&device, copies.len()));
    let run = move || {
        match dir {
            Direction::ToHost => device.copy_to_host(&pool, &copies, &fence),
            Direction::FromHost => device.copy_from_host(&pool, &copies, &fence),
        }?;
        fence.check()
    };
    if inline {
        return run();
    }
    tokio::task::spawn_blocking(run)
        .await
        .unwrap_or_else(|e| Err(DeviceError::Copy(format!("copy task failed: {e}"))))
}

fn copies_bytes(device: &Arc<dyn Device>, pages: usize) -> usize {
    pages.saturating_mul(device.pool().layout().page_bytes())
}

/// The L2 port: kvtierd calls with the link's deadline, and the page moves.
#[derive(Clone)]
pub(crate) struct L2 {
    s: Arc<Shared>,
}

impl L2 {
    pub(crate) fn new(s: Arc<Shared>) -> Self {
        Self { s }
    }

    /// Runs a daemon call with the link's deadline; `None` when it failed (a failure that
    /// means the link is gone marks it broken: kvtierd unreachable, or the session lost, as
    /// its `NOT_FOUND` trailer says; a prefetch that is gone is not).
    pub(crate) async fn call<T>(
        &self,
        linked: &Arc<Linked>,
        fut: impl Future<Output = Result<T, ClientError>>,
    ) -> Option<T> {
        let r = match tokio::time::timeout(self.s.link.timeout(), fut).await {
            Ok(r) => r,
            Err(_) => Err(ClientError::Protocol("kvtierd call timed out".into())),
        };
        match r {
            Ok(v) => Some(v),
            Err(e) => {
                self.failed(linked, &e);
                None
            }
        }
    }

    /// A call on `linked` failed: a failure that means the link is gone marks it broken, and
    /// so does a call that timed out (kvtierd may still carry it out: a pin or reservation
    /// nobody waits for any more, which only closing the session gives back; the link
    /// closes it once a new session is up).
    fn failed(&self, linked: &Arc<Linked>, e: &ClientError) {
        if is_link_error(e) || matches!(e, ClientError::Protocol(_)) {
            self.s.link.broken(linked, e);
        } else {
            tracing::debug!("kvtierd call failed: {e}");
        }
    }

    /// How many leading `keys` L2 holds, and how many after those L3 holds; none when there
    /// is no session.
    pub(crate) async fn tiers(&self, keys: &[PageKey]) -> (usize, usize) {
        if keys.is_empty() {
            return (0, 0);
        }
        let Some(linked) = self.s.link.current() else {
            return (0, 0);
        };
        let mut c = linked.client.clone();
        self.call(&linked, c.lookup_tiers(linked.session, keys, true))
            .await
            .unwrap_or((0, 0))
    }

    /// Copies the pages pinned in `slots` (for `pinned`, in order) into `pages` — as many as
    /// both have, while `fence` is open — then releases every pin. Returns how many pages
    /// loaded.
    pub(crate) async fn read(
        &self,
        linked: &Arc<Linked>,
        device: &Arc<dyn Device>,
        pinned: &[PageKey],
        slots: &[u32],
        pages: &[u32],
        fence: &Fence,
    ) -> Result<usize, LoadFailure> {
        let n = slots.len().min(pages.len());
        let mut c = linked.client.clone();
        let (pool, device) = (linked.pool.clone(), device.clone());
        let pages = pages[..n].to_vec();
        let r = c
            .load_pages(
                linked.session,
                pinned,
                &slots[..n],
                self.s.link.timeout(),
                |slots| {
                    let copies = pages
                        .iter()
                        .zip(&slots)
                        .map(|(&p, &s)| PageCopy {
                            device_page: p,
                            host_slot: s,
                        })
                        .collect();
                    copy(device, pool, copies, Direction::FromHost, fence.clone())
                },
            )
            .await;
        match r {
            Ok(()) => Ok(n),
            Err(
                PageError::Copy(DeviceError::Fenced)
                | PageError::LeasedCopy(DeviceError::Fenced, _),
            ) => Err(LoadFailure::Late),
            Err(PageError::Copy(e) | PageError::LeasedCopy(e, _)) => {
                tracing::warn!("copy from L2 failed, the engine computes instead: {e}");
                Err(LoadFailure::CopyFailed)
            }
            Err(PageError::Daemon(e)) => {
                self.failed(linked, &e);
                Err(LoadFailure::DaemonUnreachable)
            }
        }
    }

    /// One reserve → copy → commit of `pages` (the device pages of `keys`), or for a few
    /// pages, copy into leased slots → commit.
    async fn store(
        &self,
        linked: &Arc<Linked>,
        device: &Arc<dyn Device>,
        keys: &[PageKey],
        pages: &[u32],
        parent: Option<PageKey>,
        fence: &Fence,
    ) -> Result<StoredPages, Loss> {
        let mut c = linked.client.clone();
        let (pool, device) = (linked.pool.clone(), device.clone());
        let pages = pages.to_vec();
        let r = c
            .store_pages_with(
                linked.session,
                Some(&linked.lease),
                parent.as_ref(),
                keys,
                self.s.link.timeout(),
                |mine| {
                    let copies = mine
                        .iter()
                        .map(|&(i, s)| PageCopy {
                            device_page: pages[i],
                            host_slot: s,
                        })
                        .collect();
                    copy(device, pool, copies, Direction::ToHost, fence.clone())
                },
            )
            .await;
        r.map_err(|e| match e {
            PageError::Copy(DeviceError::Fenced) => Loss::Late,
            // A fenced copy stopped for its call's sake, not the slots': they take the next
            // write (kept, they would stay leased and unused for the session's life).
            PageError::LeasedCopy(DeviceError::Fenced, slots) => {
                linked.lease.give_back(slots);
                Loss::Late
            }
            PageError::Copy(e) | PageError::LeasedCopy(e, _) => {
                tracing::warn!("copy to L2 failed: {e}");
                Loss::CopyFailed
            }
            PageError::Daemon(e) => {
                if is_link_error(&e) || matches!(e, ClientError::Protocol(_)) {
                    self.s.link.broken(linked, &e);
                    Loss::DaemonUnreachable
                } else {
                    tracing::debug!("kvtierd refused a write: {e}");
                    Loss::Refused
                }
            }
        })
    }

    /// Writes `pages` (the device pages of `keys`, whose prompt has `parent` before them)
    /// into L2, trying again while L2 makes progress or kvtierd may come back, and while the
    /// engine's fence is open (a page not copied when it closes is lost, [`Loss::Late`]);
    /// `on_stored`
    /// hears each step, with the session it went through and how many leading pages L2 then
    /// holds. A new session starts over from the first page (what the old one held may be
    /// gone with it). Counts the pages stored, present and failed, and the bytes.
    pub(crate) async fn write(
        &self,
        writer: Writer<'_>,
        device: &Arc<dyn Device>,
        keys: &[PageKey],
        pages: &[u32],
        parent: Option<PageKey>,
        mut on_stored: impl FnMut(&Linked, usize),
    ) -> Stored {
        let fence = writer.fence();
        let s = &self.s;
        let t = Instant::now();
        let wait = s.settings.evict_wait;
        // How long a kvtierd that went away may take to come back: a background backup's
        // page stays on the device meanwhile, so it waits for a restart, however slow the
        // host (`cache.daemon_wait`); a Save the engine blocks on waits `cache.evict_wait`.
        let link_wait = match writer {
            Writer::Engine(_) => wait,
            Writer::Background(_) => s.settings.daemon_wait,
        };
        let mut deadline = Instant::now() + wait;
        let mut pause = Duration::from_millis(1);
        let mut out = Stored::default();
        let mut generation = None;
        let failure = loop {
            if !fence.is_open() {
                break Some(Loss::Late);
            }
            let linked = match s.link.current() {
                Some(l) => Some(l),
                None => {
                    // The session is coming up (the engine's first saves) or back: wait for
                    // it, bounded.
                    let t = Instant::now();
                    let l = s.link.current_or_wait(link_wait).await;
                    match writer {
                        Writer::Engine(_) => s.count_wait("link", t.elapsed()),
                        Writer::Background(_) => s.count_daemon_wait(t.elapsed()),
                    }
                    if l.is_some() {
                        // A daemon back from a restart gets the whole wait for room (its
                        // successor's L2 may be full at first), not what the link wait
                        // left of it.
                        deadline = Instant::now() + wait;
                        pause = Duration::from_millis(1);
                    }
                    l
                }
            };
            let Some(linked) = linked else {
                break Some(Loss::DaemonUnreachable);
            };
            if generation.replace(linked.generation) != Some(linked.generation) {
                out.done = 0;
            }
            let from = out.done;
            let parent = if from == 0 {
                parent
            } else {
                Some(keys[from - 1])
            };
            let why = match self
                .store(
                    &linked,
                    device,
                    &keys[from..],
                    &pages[from..],
                    parent,
                    fence,
                )
                .await
            {
                Ok(r) => {
                    out.copied += r.copied;
                    out.present += r.held - r.copied;
                    s.count_backup("stored", r.copied);
                    s.count_backup("present", r.held - r.copied);
                    out.done += r.held;
                    if r.held > 0 {
                        on_stored(&linked, out.done);
                    }
                    if out.done == keys.len() {
                        break None;
                    }
                    if r.held > 0 {
                        deadline = Instant::now() + wait;
                        pause = Duration::from_millis(1);
                    }
                    Loss::L2Full
                }
                Err(why) => why,
            };
            let now = Instant::now();
            if !why.retry(now < deadline, s.link.may_come_back(link_wait)) {
                break Some(why);
            }
            tokio::time::sleep(pause.min(deadline.saturating_duration_since(now))).await;
            pause = (pause * 2).min(Duration::from_millis(50));
        };
        out.failure = failure;
        s.count_backup("failed", keys.len() - out.done);
        let policy = s.policy().name();
        let page_bytes = device.pool().layout().page_bytes();
        s.metrics
            .backup_bytes
            .with_label_values(&[policy])
            .inc_by((out.copied * page_bytes) as u64);
        s.metrics
            .backup_seconds
            .with_label_values(&[policy])
            .observe(t.elapsed().as_secs_f64());
        out
    }
}
