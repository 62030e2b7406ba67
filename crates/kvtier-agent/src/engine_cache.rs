//! Engine-cache mode: the agent beside an engine that keeps its own prefix cache over its
//! pool (vLLM's block pool frees and reuses blocks without telling anyone, so a tree of the
//! engine's pages kept here would go stale). The agent keeps no tree; pages are named by
//! their position in a prompt, and the engine says which of its pages hold them:
//!
//! - `Lookup`: how many pages after the engine's own hits L2 holds, then L3;
//! - `Load`: pin those pages in L2 (prefetching from L3 first what L2 lacks, per the
//!   prefetch policy), copy them into the engine's pages, unpin; a page not loaded is a miss
//!   the engine computes, counted by reason;
//! - `Save`: copy the engine's computed pages into L2 (reserve, copy, commit) before the call
//!   returns, so the engine may reuse them afterwards.
//!
//! The write policy decides what Save copies: `write_through` every page,
//! `write_through_selective` the pages looked up at least `threshold` times (a lookup is the
//! engine asking for the prompt again: the same signal as a hit in the agent's tree).
//! Lookup answers that selection, and a Save may carry it (`selected`): with TP > 1 only one
//! rank's agent sees the lookups, and every rank must save the same pages.
//! `write_back` is refused at registration: the engine never reports an eviction.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use kvtier_client::PrefetchOptions;
use kvtier_core::PageKey;
use kvtier_device::{Device, DeviceError, PageCopy};
use kvtier_proto::ApiError;
use kvtier_proto::v1;

use crate::agent::{AgentService, State, check_page_list, lock, request_tokens};
use crate::backup::Loss;
use crate::link::Linked;
use crate::owner::Caller;

/// Most pages whose lookups are counted for write_through_selective; when the map reaches
/// it the counts start over (pages hot enough reach the threshold again).
const MAX_COUNTED_PAGES: usize = 1 << 20;

/// Why a page a Load was asked for did not load: the `reason` of
/// `kvtier_agent_load_failed_pages_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoadFailure {
    /// Neither in L2 nor fetched from L3 in time (evicted since the lookup, a prefetch that
    /// stopped at its deadline, an L3 copy that failed its checksum).
    Missing,
    /// No session with kvtierd, or it stopped answering.
    DaemonUnreachable,
    /// The host → device copy failed.
    CopyFailed,
}

impl LoadFailure {
    /// Every reason, in label order.
    pub const ALL: [LoadFailure; 3] = [
        LoadFailure::Missing,
        LoadFailure::DaemonUnreachable,
        LoadFailure::CopyFailed,
    ];

    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            LoadFailure::Missing => "missing",
            LoadFailure::DaemonUnreachable => "daemon_unreachable",
            LoadFailure::CopyFailed => "copy_failed",
        }
    }
}

/// A checked engine-cache request: its keys, and the engine's pages for
/// `keys[start..start + pages.len()]`.
struct Span {
    keys: Vec<PageKey>,
    start: usize,
    device: Arc<dyn Device>,
    page_bytes: usize,
}

impl Span {
    fn parent(&self) -> Option<PageKey> {
        self.start.checked_sub(1).map(|i| self.keys[i])
    }
}

impl AgentService {
    /// Keys of the prompt, checked against the engine-cache pool (owned by `caller`, unless
    /// the call reads no pool memory): `start_page` within the prompt, `pages` (when given)
    /// in the pool, distinct, and not past the prompt's end.
    fn span(
        &self,
        caller: Option<&Caller>,
        packed: &[u8],
        ns: Option<v1::Namespace>,
        start: u32,
        pages: &[u32],
    ) -> Result<Span, ApiError> {
        let (device, page_size, num_pages) = {
            let st = lock(&self.shared.state);
            let e = st.cache_engine(caller)?;
            (
                e.device.clone(),
                e.pool.layout().page_size(),
                e.pool.num_pages(),
            )
        };
        check_page_list(num_pages, "device_pages", pages, |_| false)?;
        let tokens = request_tokens(&[], packed)?;
        let keys = self.keys(&tokens, ns, page_size)?;
        let start = start as usize;
        if start > keys.len() {
            return Err(ApiError::invalid(
                "start_page",
                format!(
                    "{start} is past the prompt's {} full pages ({} tokens, page size \
                     {page_size})",
                    keys.len(),
                    tokens.len()
                ),
            ));
        }
        if start + pages.len() > keys.len() {
            return Err(ApiError::invalid(
                "device_pages",
                format!(
                    "{} pages from start_page {start} run past the prompt's {} full pages \
                     ({} tokens, page size {page_size})",
                    pages.len(),
                    keys.len(),
                    tokens.len()
                ),
            ));
        }
        let page_bytes = device.pool().layout().page_bytes();
        Ok(Span {
            keys,
            start,
            device,
            page_bytes,
        })
    }

    /// How many leading `keys` the write policy saves, by how often each was looked up.
    fn selected(&self, st: &State, keys: &[PageKey]) -> usize {
        let policy = self.shared.policy;
        keys.iter()
            .take_while(|k| policy.saves_looked_up(st.lookups.get(*k).copied().unwrap_or(0)))
            .count()
    }

    /// `Lookup`: pages after the engine's own that L2 holds, then L3. Any admitted client
    /// may ask (it reads no pool memory): the engine's scheduler process does.
    pub(crate) async fn lookup_pages(
        &self,
        req: v1::PagesLookupRequest,
    ) -> Result<v1::PagesLookupResponse, ApiError> {
        let t = Instant::now();
        let span = self.span(None, &req.packed_tokens, req.namespace, req.start_page, &[])?;
        let (keys, start) = (&span.keys, span.start);
        let save_pages = self.shared.policy.counts_hits().then(|| {
            let mut st = lock(&self.shared.state);
            if st.lookups.len() + keys.len() > MAX_COUNTED_PAGES {
                st.lookups.clear();
            }
            for k in keys {
                *st.lookups.entry(*k).or_default() += 1;
            }
            self.selected(&st, keys) as u32
        });
        let (mut l2, mut l3) = (0, 0);
        if start < keys.len()
            && let Some(linked) = self.shared.link.current()
        {
            let mut c = linked.client.clone();
            if let Some((a, b)) = self
                .call(
                    &linked,
                    c.lookup_tiers(linked.session, &keys[start..], true),
                )
                .await
            {
                (l2, l3) = (a, b);
            }
        }
        self.shared
            .metrics
            .count_match(keys.len(), start, l2, l3, t);
        Ok(v1::PagesLookupResponse {
            l2_pages: l2 as u32,
            l3_pages: l3 as u32,
            total_pages: keys.len() as u32,
            save_pages,
        })
    }

    fn count_load_failed(&self, why: LoadFailure, pages: usize) {
        if pages > 0 {
            self.shared
                .metrics
                .load_failed_pages
                .with_label_values(&[why.label()])
                .inc_by(pages as u64);
        }
    }

    /// `Load`: the asked pages into the engine's pages, as many leading ones as L2 holds or
    /// L3 delivers in time.
    pub(crate) async fn load_pages(
        &self,
        caller: &Caller,
        req: v1::LoadPagesRequest,
    ) -> Result<v1::LoadPagesResponse, ApiError> {
        let t = Instant::now();
        let policy = v1::PrefetchPolicy::try_from(req.policy).map_err(|_| {
            ApiError::invalid(
                "policy",
                format!("{} is not a PrefetchPolicy value", req.policy),
            )
        })?;
        let span = self.span(
            Some(caller),
            &req.packed_tokens,
            req.namespace,
            req.start_page,
            &req.device_pages,
        )?;
        let n = req.device_pages.len();
        let want = &span.keys[span.start..span.start + n];
        let none = v1::LoadPagesResponse { loaded: 0 };
        if n == 0 {
            return Ok(none);
        }
        let Some(linked) = self.shared.link.current() else {
            self.count_load_failed(LoadFailure::DaemonUnreachable, n);
            return Ok(none);
        };
        let mut c = linked.client.clone();
        let Some(mut slots) = self.call(&linked, c.acquire(linked.session, want)).await else {
            self.count_load_failed(LoadFailure::DaemonUnreachable, n);
            return Ok(none);
        };
        // kvtierd is a peer: never trust it to answer for more keys than were asked about.
        slots.truncate(n);
        if slots.len() < n {
            let more = self
                .fetch_rest(&linked, &span, slots.len(), n, policy, req.hints)
                .await;
            slots.extend(more);
        }
        let pinned = &want[..slots.len()];
        let copies: Vec<PageCopy> = req
            .device_pages
            .iter()
            .zip(&slots)
            .map(|(&p, &s)| PageCopy {
                device_page: p,
                host_slot: s,
            })
            .collect();
        let copied = if copies.is_empty() {
            Ok(())
        } else {
            let (pool, device) = (linked.pool.clone(), span.device.clone());
            match tokio::task::spawn_blocking(move || device.copy_from_host(&pool, &copies)).await {
                Ok(r) => r,
                Err(e) => Err(DeviceError::Copy(format!("copy task failed: {e}"))),
            }
        };
        // A read counts only if its pins were still held when it ended.
        let released = pinned.is_empty()
            || self
                .call(&linked, c.release(linked.session, pinned))
                .await
                .is_some();
        let loaded = match (&copied, released) {
            (Err(e), _) => {
                tracing::warn!("load copy failed, the engine computes instead: {e}");
                self.count_load_failed(LoadFailure::CopyFailed, slots.len());
                0
            }
            (Ok(()), false) => {
                self.count_load_failed(LoadFailure::DaemonUnreachable, slots.len());
                0
            }
            (Ok(()), true) => slots.len(),
        };
        self.count_load_failed(LoadFailure::Missing, n - slots.len());
        let m = &self.shared.metrics;
        m.load_back_pages.inc_by(loaded as u64);
        m.load_back_bytes.inc_by((loaded * span.page_bytes) as u64);
        m.load_back_seconds.observe(t.elapsed().as_secs_f64());
        Ok(v1::LoadPagesResponse {
            loaded: loaded as u32,
        })
    }

    /// Pages `got..n` of a Load that L2 lacked, from L3 through a prefetch of the agent's
    /// own, per `policy`: the slots of those that landed (pinned), in order.
    async fn fetch_rest(
        &self,
        linked: &Arc<Linked>,
        span: &Span,
        got: usize,
        n: usize,
        policy: v1::PrefetchPolicy,
        hints: Option<v1::PrefetchHints>,
    ) -> Vec<u32> {
        let from = span.start + got;
        let keys = &span.keys[from..span.start + n];
        let id = format!(
            "load{}",
            self.shared.load_ids.fetch_add(1, Ordering::Relaxed)
        );
        // The engine has planned on these pages already (its blocks are allocated): a short
        // L3 hit is fetched unless the caller says otherwise; kvtierd's load-versus-recompute
        // check still applies.
        let mut hints = hints.unwrap_or_default();
        hints.threshold_tokens.get_or_insert(0);
        let opts = PrefetchOptions {
            parent: from.checked_sub(1).map(|i| span.keys[i]),
            policy,
            hints,
        };
        let mut c = linked.client.clone();
        // The progress stream is not needed: TakePrefetch waits per the policy.
        let Some(_progress) = self
            .call_prefetch(linked, c.prefetch(linked.session, &id, keys, opts))
            .await
        else {
            return Vec::new();
        };
        match self
            .call_prefetch(linked, c.take_prefetch(linked.session, &id))
            .await
        {
            Some((_, mut slots)) => {
                slots.truncate(keys.len());
                slots
            }
            None => {
                self.call_prefetch(linked, c.release_prefetch(linked.session, &id))
                    .await;
                Vec::new()
            }
        }
    }

    /// `Save`: the engine's computed pages into L2, per the write policy, before returning.
    /// While L2 has no room it tries again as long as each `cache.evict_wait` brings
    /// progress, and waits that long for a restarting kvtierd; what still fails is counted
    /// lost, by reason (the engine will evict those pages without telling anyone).
    pub(crate) async fn save_pages(
        &self,
        caller: &Caller,
        req: v1::SavePagesRequest,
    ) -> Result<v1::SavePagesResponse, ApiError> {
        let t = Instant::now();
        let span = self.span(
            Some(caller),
            &req.packed_tokens,
            req.namespace,
            req.start_page,
            &req.device_pages,
        )?;
        let s = &self.shared;
        let n = req.device_pages.len();
        let selected = match req.selected {
            // The policy's selection as the lookup answered it (possibly another rank's
            // agent): every rank saves the same pages.
            Some(upto) => (upto as usize).saturating_sub(span.start).min(n),
            None => self.selected(&lock(&s.state), &span.keys[span.start..span.start + n]),
        };
        self.count_backup("skipped", n - selected);
        let mut out = v1::SavePagesResponse {
            skipped: (n - selected) as u32,
            ..Default::default()
        };
        if selected == 0 {
            return Ok(out);
        }
        let wait = s.evict_wait;
        let mut deadline = Instant::now() + wait;
        let mut pause = Duration::from_millis(1);
        let mut done = 0;
        let failure = loop {
            let linked = match s.link.current() {
                Some(l) => Some(l),
                None => {
                    // The session is coming up (the engine's first saves) or back: wait for
                    // it, bounded, and count the wait.
                    let t = Instant::now();
                    let l = s.link.current_or_wait(wait).await;
                    self.count_wait("link", t.elapsed());
                    l
                }
            };
            let Some(linked) = linked else {
                break Some(Loss::DaemonUnreachable);
            };
            let from = span.start + done;
            let keys = &span.keys[from..span.start + selected];
            let parent = if done == 0 {
                span.parent()
            } else {
                Some(span.keys[from - 1])
            };
            let pages = &req.device_pages[done..selected];
            let why = match self.store(&linked, &span.device, keys, pages, parent).await {
                Ok((upto, copied)) => {
                    out.stored += copied as u32;
                    out.present += (upto - copied) as u32;
                    self.count_backup("stored", copied);
                    self.count_backup("present", upto - copied);
                    s.metrics
                        .backup_bytes
                        .with_label_values(&[s.policy.name()])
                        .inc_by((copied * span.page_bytes) as u64);
                    done += upto;
                    if done == selected {
                        break None;
                    }
                    if upto > 0 {
                        deadline = Instant::now() + wait;
                        pause = Duration::from_millis(1);
                    }
                    Loss::L2Full
                }
                Err(why) => why,
            };
            let now = Instant::now();
            let again = match why {
                Loss::L2Full => now < deadline,
                Loss::DaemonUnreachable => s.link.may_come_back(wait),
                Loss::CopyFailed | Loss::Refused => false,
            };
            if !again {
                break Some(why);
            }
            tokio::time::sleep(pause.min(deadline.saturating_duration_since(now))).await;
            pause = (pause * 2).min(Duration::from_millis(50));
        };
        let failed = selected - done;
        out.failed = failed as u32;
        if let Some(why) = failure {
            self.count_backup("failed", failed);
            self.count_lost(why, failed as u64);
        }
        s.metrics
            .backup_seconds
            .with_label_values(&[s.policy.name()])
            .observe(t.elapsed().as_secs_f64());
        Ok(out)
    }
}
