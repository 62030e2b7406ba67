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
//!   returns, so the engine may reuse them afterwards; `SaveBatch`: a step's Saves in one
//!   call, checked together and written together.
//!
//! The write policy decides what Save copies ([`WritePolicy::saves_looked_up`]): a lookup is
//! the engine asking for the prompt again, the same signal as a hit in the agent's tree.
//! Lookup answers that selection, and a Save may carry it (`selected`): with TP > 1 only one
//! rank's agent sees the lookups, and every rank must save the same pages. A policy that
//! saves only at eviction is refused at registration: the engine never reports an eviction.
//!
//! [`WritePolicy::saves_looked_up`]: kvtier_core::WritePolicy::saves_looked_up

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use kvtier_client::{PagesLookup, PrefetchOptions, Saved};
use kvtier_core::{Namespace, PageKey, TokenIds};
use kvtier_device::{Device, Fence};
use kvtier_proto::ApiError;
use kvtier_proto::v1;

use crate::call_fence;
use crate::l2::{L2, Writer};
use crate::link::Linked;
use crate::outcome::LoadFailure;
use crate::owner::Caller;
use crate::shared::{Mode, Shared, State, check_page_list};

/// Most pages whose lookups are counted for write_through_selective; when the map reaches
/// it the counts start over (pages hot enough reach the threshold again).
const MAX_COUNTED_PAGES: usize = 1 << 20;

/// An engine-cache request: a prompt's tokens and namespace, and the engine's pages for its
/// pages from `start` on. With `parent` (the key of page `start - 1`), `tokens` begin at page
/// `start`: the call carries and hashes only the pages it is about.
pub(crate) struct Pages<'a> {
    pub(crate) tokens: TokenIds<'a>,
    pub(crate) parent: Option<PageKey>,
    pub(crate) namespace: Namespace,
    pub(crate) start: u32,
    pub(crate) device_pages: &'a [u32],
}

/// What a Load did: how many leading pages landed, and the key of the last page it was
/// asked for (loaded or not; None when it was asked for none), which a Load of the pages
/// after it names as their parent.
pub(crate) struct Loaded {
    pub(crate) pages: u32,
    pub(crate) last_key: Option<PageKey>,
}

/// A checked request: the keys of the pages its tokens cover, from page `first` (0, or
/// `start` under a parent key), and the engine's pages for pages `start..`.
struct Span {
    keys: Vec<PageKey>,
    first: usize,
    start: usize,
    given_parent: Option<PageKey>,
    device: Arc<dyn Device>,
    page_bytes: usize,
}

impl Span {
    /// Keys of pages `page..page + n`.
    fn keys(&self, page: usize, n: usize) -> &[PageKey] {
        &self.keys[page - self.first..page - self.first + n]
    }

    /// Full pages of the prompt the request covers (its last page's index + 1).
    fn total(&self) -> usize {
        self.first + self.keys.len()
    }

    /// The key of page `page - 1`: the parent of a run of pages from `page` on.
    fn parent_of(&self, page: usize) -> Option<PageKey> {
        if page == self.first {
            self.given_parent
        } else {
            page.checked_sub(1).map(|i| self.keys[i - self.first])
        }
    }
}

/// The engine-cache mode's calls.
pub(crate) struct CacheMode {
    s: Arc<Shared>,
    l2: L2,
    /// Names this agent's own prefetches for Load (`load<n>`).
    load_ids: AtomicU64,
}

impl CacheMode {
    pub(crate) fn new(s: Arc<Shared>, l2: L2) -> Self {
        Self {
            s,
            l2,
            load_ids: AtomicU64::new(0),
        }
    }

    /// Keys of the prompt, checked against the engine-cache pool (owned by `caller`, unless
    /// the call reads no pool memory): `start` within the prompt, the pages (when given) in
    /// the pool, distinct, and not past the prompt's end.
    fn span(&self, caller: Option<&Caller>, req: &Pages<'_>) -> Result<Span, ApiError> {
        let (device, page_size, num_pages) = {
            let st = self.s.lock();
            let e = st.pool(Mode::EngineCache, caller)?;
            (
                e.device.clone(),
                e.pool.layout().page_size(),
                e.pool.num_pages(),
            )
        };
        let pages = req.device_pages;
        check_page_list(num_pages, "device_pages", pages, |_| false)?;
        let start = req.start as usize;
        let first = if req.parent.is_some() {
            if start == 0 {
                return Err(ApiError::invalid(
                    "parent_key",
                    "set with start_page 0: the first page has no parent; send the prompt \
                     from its first token without parent_key",
                ));
            }
            start
        } else {
            0
        };
        let keys = self
            .s
            .keys_after(req.parent.as_ref(), req.tokens, &req.namespace, page_size)?;
        let full = first + keys.len();
        let tokens = first * page_size + req.tokens.len();
        if start > full {
            return Err(ApiError::invalid(
                "start_page",
                format!(
                    "{start} is past the prompt's {full} full pages ({tokens} tokens, page \
                     size {page_size})",
                ),
            ));
        }
        if start + pages.len() > full {
            return Err(ApiError::invalid(
                "device_pages",
                format!(
                    "{} pages from start_page {start} run past the prompt's {full} full \
                     pages ({tokens} tokens, page size {page_size})",
                    pages.len(),
                ),
            ));
        }
        let page_bytes = device.pool().layout().page_bytes();
        Ok(Span {
            keys,
            first,
            start,
            given_parent: req.parent,
            device,
            page_bytes,
        })
    }

    /// How many leading `keys` the write policy saves, by how often each was looked up.
    fn selected(&self, st: &State, keys: &[PageKey]) -> usize {
        let policy = self.s.policy();
        keys.iter()
            .take_while(|k| policy.saves_looked_up(st.lookups.get(*k).copied().unwrap_or(0)))
            .count()
    }

    /// `Lookup`: pages after the engine's own that L2 holds, then L3. Any admitted client
    /// may ask (it reads no pool memory): the engine's scheduler process does.
    /// Under `want_keys`, the answer carries the keys of the pages the request's tokens
    /// cover, for naming later calls by parent key.
    pub(crate) async fn lookup(
        &self,
        req: &Pages<'_>,
        want_keys: bool,
    ) -> Result<PagesLookup, ApiError> {
        let t = Instant::now();
        let span = self.span(None, req)?;
        let (keys, start, total) = (&span.keys, span.start, span.total());
        // Pages before a parent key were counted when they were asked about.
        let save_pages = self.s.policy().counts_hits().then(|| {
            let mut st = self.s.lock();
            if st.lookups.len() + keys.len() > MAX_COUNTED_PAGES {
                st.lookups.clear();
            }
            for k in keys {
                *st.lookups.entry(*k).or_default() += 1;
            }
            (span.first + self.selected(&st, keys)) as u32
        });
        let (l2, l3) = self.l2.tiers(span.keys(start, total - start)).await;
        self.s.metrics.count_match(total, start, l2, l3, t);
        Ok(PagesLookup {
            l2_pages: l2 as u32,
            l3_pages: l3 as u32,
            total_pages: total as u32,
            save_pages,
            keys: if want_keys { span.keys } else { Vec::new() },
        })
    }

    /// `Load`: the asked pages into the engine's pages, as many leading ones as L2 holds or
    /// L3 delivers in time (per `policy`), while the call's `fence` is open. Returns how
    /// many loaded.
    pub(crate) async fn load(
        &self,
        caller: &Caller,
        req: &Pages<'_>,
        policy: v1::PrefetchPolicy,
        hints: Option<v1::PrefetchHints>,
        fence: &Fence,
    ) -> Result<Loaded, ApiError> {
        let t = Instant::now();
        let s = &self.s;
        let span = self.span(Some(caller), req)?;
        let n = req.device_pages.len();
        let want = span.keys(span.start, n);
        let none = |last_key| Loaded { pages: 0, last_key };
        let last_key = want.last().copied();
        if n == 0 {
            return Ok(none(last_key));
        }
        if !fence.is_open() {
            // Read late (a stopped or busy agent): pin nothing for a caller gone.
            s.count_load_failed(LoadFailure::Late, n);
            return Ok(none(last_key));
        }
        let Some(linked) = s.link.current() else {
            s.count_load_failed(LoadFailure::DaemonUnreachable, n);
            return Ok(none(last_key));
        };
        let mut c = linked.client.clone();
        let Some(mut slots) = self.l2.call(&linked, c.acquire(linked.session, want)).await else {
            s.count_load_failed(LoadFailure::DaemonUnreachable, n);
            return Ok(none(last_key));
        };
        // kvtierd is a peer: never trust it to answer for more keys than were asked about.
        slots.truncate(n);
        if slots.len() < n {
            let more = self
                .fetch_rest(&linked, &span, slots.len()..n, (policy, hints), fence)
                .await;
            slots.extend(more);
        }
        let pinned = &want[..slots.len()];
        let loaded = match self
            .l2
            .read(
                &linked,
                &span.device,
                pinned,
                &slots,
                req.device_pages,
                fence,
            )
            .await
        {
            Ok(n) => n,
            Err(why) => {
                s.count_load_failed(why, slots.len());
                0
            }
        };
        s.count_load_failed(LoadFailure::Missing, n - slots.len());
        s.count_loaded(loaded, span.page_bytes, t);
        Ok(Loaded {
            pages: loaded as u32,
            last_key,
        })
    }

    /// Pages `rest` (of the Load's, `got..n`) that L2 lacked, from L3 through a prefetch of
    /// the agent's own, per `policy`: the slots of those that landed (pinned), in order.
    async fn fetch_rest(
        &self,
        linked: &Arc<Linked>,
        span: &Span,
        rest: std::ops::Range<usize>,
        (policy, hints): (v1::PrefetchPolicy, Option<v1::PrefetchHints>),
        fence: &Fence,
    ) -> Vec<u32> {
        let from = span.start + rest.start;
        let keys = span.keys(from, rest.len());
        let id = format!("load{}", self.load_ids.fetch_add(1, Ordering::Relaxed));
        // The engine has planned on these pages already (its blocks are allocated): a short
        // L3 hit is fetched unless the caller says otherwise; kvtierd's load-versus-recompute
        // check still applies.
        let mut hints = hints.unwrap_or_default();
        hints.threshold_tokens.get_or_insert(0);
        let opts = PrefetchOptions {
            parent: span.parent_of(from),
            policy,
            hints,
        };
        let mut c = linked.client.clone();
        // The progress stream is not needed: TakePrefetch waits per the policy.
        let Some(_progress) = self
            .l2
            .call(linked, c.prefetch(linked.session, &id, keys, opts))
            .await
        else {
            return Vec::new();
        };
        // TakePrefetch waits per the policy (up to prefetch.timeout_max under
        // wait_complete), longer than the engine may wait for this call: once the call's
        // fence closes, the prefetch is given up, so its landed pages are unpinned now and
        // the take comes back (what it pinned already is released after the fenced copy).
        let take = self.l2.call(linked, c.take_prefetch(linked.session, &id));
        tokio::pin!(take);
        let taken = tokio::select! {
            r = &mut take => r,
            () = call_fence::closed(fence) => {
                let mut c = linked.client.clone();
                self.l2
                    .call(linked, c.release_prefetch(linked.session, &id))
                    .await;
                take.await
            }
        };
        match taken {
            Some((_, mut slots)) => {
                slots.truncate(keys.len());
                slots
            }
            None => {
                let mut c = linked.client.clone();
                self.l2
                    .call(linked, c.release_prefetch(linked.session, &id))
                    .await;
                Vec::new()
            }
        }
    }

    /// `Save`: the engine's computed pages into L2, per the write policy (or `selected`, the
    /// policy's selection as a Lookup answered it), before returning. What does not reach L2
    /// is counted lost, by reason (the engine will evict those pages without telling anyone).
    pub(crate) async fn save(
        &self,
        caller: &Caller,
        req: &Pages<'_>,
        selected: Option<u32>,
        fence: &Fence,
    ) -> Result<Saved, ApiError> {
        let plan = self.plan_save(caller, req, selected)?;
        Ok(self.write_save(&plan, fence).await)
    }

    /// `SaveBatch`: several Saves in one call. Every request is checked before any page
    /// moves (a malformed one refuses the call, naming `requests[i]`); then their writes run
    /// together, except that a request continuing an earlier one's prompt (its parent is
    /// that request's last page) runs after it, so each page's parent is in L2 first.
    pub(crate) async fn save_batch(
        &self,
        caller: &Caller,
        reqs: &[(Pages<'_>, Option<u32>)],
        fence: &Fence,
    ) -> Result<Vec<Saved>, ApiError> {
        let plans = reqs
            .iter()
            .enumerate()
            .map(|(i, (req, selected))| {
                self.plan_save(caller, req, *selected)
                    .map_err(|e| e.within(&format!("requests[{i}]")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let chains = chains(&plans);
        let plans = &plans;
        let written = futures::future::join_all(chains.iter().map(|chain| async move {
            let mut out = Vec::with_capacity(chain.len());
            for &i in chain {
                out.push((i, self.write_save(&plans[i], fence).await));
            }
            out
        }))
        .await;
        let mut out = vec![Saved::default(); plans.len()];
        for (i, saved) in written.into_iter().flatten() {
            out[i] = saved;
        }
        Ok(out)
    }

    /// Checks a Save and takes the write policy's selection for it.
    fn plan_save<'a>(
        &self,
        caller: &Caller,
        req: &Pages<'a>,
        selected: Option<u32>,
    ) -> Result<SavePlan<'a>, ApiError> {
        let span = self.span(Some(caller), req)?;
        let n = req.device_pages.len();
        let selected = match selected {
            // The policy's selection as the lookup answered it (possibly another rank's
            // agent): every rank saves the same pages.
            Some(upto) => (upto as usize).saturating_sub(span.start).min(n),
            None => self.selected(&self.s.lock(), span.keys(span.start, n)),
        };
        Ok(SavePlan {
            span,
            device_pages: req.device_pages,
            selected,
        })
    }

    /// Writes a checked Save's selected pages into L2 while `fence` is open; counts what it
    /// skipped and lost.
    async fn write_save(&self, plan: &SavePlan<'_>, fence: &Fence) -> Saved {
        let (span, selected) = (&plan.span, plan.selected);
        let n = plan.device_pages.len();
        self.s.count_backup("skipped", n - selected);
        let mut out = Saved {
            skipped: (n - selected) as u32,
            ..Saved::default()
        };
        if selected == 0 {
            return out;
        }
        let stored = self
            .l2
            .write(
                Writer::Engine(fence),
                &span.device,
                span.keys(span.start, selected),
                &plan.device_pages[..selected],
                span.parent_of(span.start),
                |_, _| {},
            )
            .await;
        out.stored = stored.copied as u32;
        out.present = stored.present as u32;
        out.failed = (selected - stored.done) as u32;
        if let Some(why) = stored.failure {
            self.s.count_lost(why, u64::from(out.failed));
        }
        out
    }
}

/// A checked Save: its keys, the engine's pages, and how many leading ones the write policy
/// saves.
struct SavePlan<'a> {
    span: Span,
    device_pages: &'a [u32],
    selected: usize,
}

impl SavePlan<'_> {
    /// The key of the last page this Save writes, when it writes any.
    fn last_key(&self) -> Option<PageKey> {
        (self.selected > 0)
            .then(|| self.span.keys(self.span.start, self.selected)[self.selected - 1])
    }
}

/// Groups a batch's Saves into chains that run one after another: a Save whose parent is an
/// earlier Save's last page joins that Save's chain, after it. Chains run together.
fn chains(plans: &[SavePlan<'_>]) -> Vec<Vec<usize>> {
    let mut chains: Vec<Vec<usize>> = Vec::new();
    let mut ends: std::collections::HashMap<PageKey, usize> = std::collections::HashMap::new();
    for (i, p) in plans.iter().enumerate() {
        let joined = p
            .span
            .parent_of(p.span.start)
            .and_then(|parent| ends.get(&parent).copied());
        let c = match joined {
            Some(c) => {
                chains[c].push(i);
                c
            }
            None => {
                chains.push(vec![i]);
                chains.len() - 1
            }
        };
        if let Some(last) = p.last_key() {
            ends.insert(last, c);
        }
    }
    chains
}
