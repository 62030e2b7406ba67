//! One simulated inference worker: a cpu KV pool (layer-first, in shared memory), a page
//! allocator, and the scheduler's side of the cache protocol with its agent. Every page it
//! receives from any tier is checked against the deterministic KV.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use kvtier_client::AgentClient;
use kvtier_core::{DevicePool, Layout, LayoutSpec, Namespace, PageHasher, PageKey};
use kvtier_proto::v1;

use crate::kv::{KvPool, SimDevice};
use crate::workload::Request;

/// Most load rounds (prefetch, then load back) for one request.
const MAX_LOAD_ROUNDS: usize = 16;

/// A page that did not hold what recomputing it gives.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Corrupt {
    /// Request index.
    pub request: usize,
    /// The page key, hex.
    pub key: String,
    /// Where it came from: device, host or storage.
    pub tier: &'static str,
}

/// What one request did.
#[derive(Clone, Debug, Default)]
pub struct Outcome {
    /// The request's index in the workload.
    pub request: usize,
    /// Prompt tokens.
    pub input_tokens: u64,
    /// Tokens served by the worker's device, L2 (host) and L3 (storage).
    pub device: u64,
    /// See `device`.
    pub host: u64,
    /// See `device`.
    pub storage: u64,
    /// Tokens computed.
    pub computed: u64,
    /// Pages computed (prompt and generated tokens, full pages).
    pub computed_pages: u64,
    /// Pages checked against the deterministic KV.
    pub verified: u64,
    /// Pages that failed the check.
    pub corrupt: Vec<Corrupt>,
    /// Final state of the prefetch, if one ran (`completed`, `timed_out`, `revoked:...`).
    pub prefetch: Option<String>,
    /// Pages the match found in L2 and in L3 after the device prefix.
    pub matched: (u64, u64),
    /// Bytes loaded back from L2.
    pub load_back_bytes: u64,
    /// Time spent in LoadBack calls.
    pub load_back_time: Duration,
    /// Time the request waited for storage: from asking for a prefetch to having its pages
    /// on the device (every round).
    pub storage_wait: Duration,
    /// The longest deadline the daemon gave this request's prefetches.
    pub storage_deadline: Duration,
}

/// The simulated worker.
pub struct Worker {
    /// Index.
    pub id: usize,
    socket: PathBuf,
    spec: LayoutSpec,
    layout: Layout,
    kv: KvPool,
    pages: u64,
    client: Option<AgentClient>,
    free: Vec<u32>,
    hasher: PageHasher,
    prefetch: Option<v1::PrefetchPolicy>,
    scratch: (Vec<u8>, Vec<u8>),
    /// Wall seconds one computed token takes (0: compute is instant).
    seconds_per_token: f64,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker").field("id", &self.id).finish()
    }
}

impl Worker {
    /// A worker with a pool of `pages` pages on `device` (in /dev/shm, or on GPU 0), talking
    /// to the agent at `socket`.
    pub fn new(
        id: usize,
        socket: PathBuf,
        spec: LayoutSpec,
        pages: u64,
        prefetch: Option<v1::PrefetchPolicy>,
        run_id: &str,
        device: SimDevice,
    ) -> Result<Self> {
        let layout = Layout::new(spec.clone()).context("layout")?;
        let page_size = layout.page_size();
        let pool = DevicePool::new(layout.clone(), pages * page_size as u64).context("pool")?;
        let kv = KvPool::new(pool, device, &format!("kvtier-sim-{run_id}-worker-{id}"))?;
        Ok(Self {
            id,
            socket,
            spec,
            layout,
            kv,
            pages,
            client: None,
            free: Vec::new(),
            hasher: PageHasher::new(page_size, &Namespace::default())?,
            prefetch,
            scratch: (Vec::new(), Vec::new()),
            seconds_per_token: 0.0,
        })
    }

    /// Makes prefill take wall time: `time_scale / tokens_per_second` per computed token,
    /// so the worker is busy while it computes, as an engine is (0: instant).
    pub fn set_compute_time(&mut self, tokens_per_second: f64, time_scale: f64) {
        self.seconds_per_token = if tokens_per_second > 0.0 && time_scale > 0.0 {
            time_scale / tokens_per_second
        } else {
            0.0
        };
    }

    /// Page bytes of the layout.
    pub fn page_bytes(&self) -> usize {
        self.layout.page_bytes()
    }

    /// (Re)connects to the agent and registers the pool: the agent starts with an empty tree,
    /// so every page is free again.
    pub async fn connect(&mut self) -> Result<()> {
        let mut c = AgentClient::connect(&self.socket.display().to_string())
            .await
            .with_context(|| format!("connecting to the agent at {}", self.socket.display()))?;
        c.register_pool(
            &self.spec,
            self.pages * self.layout.page_size() as u64,
            self.kv.memory()?,
        )
        .await
        .context("registering the KV pool")?;
        self.client = Some(c);
        self.free = (0..self.pages as u32).rev().collect();
        Ok(())
    }

    /// Waits until the agent reports a kvtierd session (or `wait` passes).
    pub async fn wait_daemon(&mut self, wait: Duration) -> Result<bool> {
        let deadline = Instant::now() + wait;
        loop {
            let c = self.client.as_mut().context("not connected")?;
            let st = c.stats().await?;
            if st.daemon_connected {
                return Ok(true);
            }
            if Instant::now() > deadline {
                return Ok(false);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits until the agent has no backup queued or running and kvtierd has no L3 write
    /// queued (or `wait` passes): the deterministic mode's "everything has settled".
    pub async fn settle(&mut self, daemon: &mut Option<kvtier_client::HostClient>, wait: Duration) {
        let deadline = Instant::now() + wait;
        while Instant::now() < deadline {
            let agent_busy = match self.stats().await {
                Ok(st) => st.backups_in_flight > 0,
                Err(_) => false,
            };
            let daemon_busy = match daemon.as_mut() {
                Some(d) => match d.stats().await {
                    Ok(st) => st.l3.is_some_and(|l| l.queued_pages > 0),
                    Err(_) => false,
                },
                None => false,
            };
            if !agent_busy && !daemon_busy {
                return;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// Gives every device page back, as an engine shutting down would: the agent evicts them
    /// all, each backed up to L2 first (or counted as lost).
    pub async fn drain(&mut self) -> Result<()> {
        let c = self.client.as_mut().context("not connected")?;
        let ev = c.evict(self.pages as u32).await?;
        self.free.extend(ev.pages);
        Ok(())
    }

    /// The page keys of a request's prompt (full pages).
    pub fn prompt_keys(&self, req: &Request) -> Vec<PageKey> {
        self.hasher.keys(&req.input)
    }

    /// The page keys a request computes or reads: its prompt and generated tokens, full
    /// pages.
    pub fn all_keys(&self, req: &Request) -> Vec<PageKey> {
        let mut all = req.input.clone();
        all.extend_from_slice(&req.output);
        self.hasher.keys(&all)
    }

    /// The agent's counters.
    pub async fn stats(&mut self) -> Result<v1::AgentStatsResponse> {
        let c = self.client.as_mut().context("not connected")?;
        Ok(c.stats().await?)
    }

    /// Takes `n` free pages, asking the agent to evict when short. Pages whose backup is
    /// still running are locked, so eviction may free fewer than asked: wait for them a
    /// little, as an engine's scheduler would, before giving up.
    async fn alloc(&mut self, n: usize) -> Result<Vec<u32>> {
        if n as u64 > self.pages {
            bail!(
                "worker {}: {n} pages needed at once; the device pool has {} (raise \
                 --device-pages)",
                self.id,
                self.pages
            );
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.free.len() < n {
            let short = (n - self.free.len()) as u32;
            let c = self.client.as_mut().context("not connected")?;
            // Evict a little more than needed, so the next request does not evict at once.
            let ev = c.evict(short.max(self.pages as u32 / 16)).await?;
            let got = ev.pages.len();
            self.free.extend(ev.pages);
            if self.free.len() >= n {
                break;
            }
            if Instant::now() > deadline {
                bail!(
                    "worker {}: {n} pages needed, {} free: the device pool ({} pages) is too \
                     small for this request",
                    self.id,
                    self.free.len(),
                    self.pages
                );
            }
            if got == 0 {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }
        let at = self.free.len() - n;
        Ok(self.free.split_off(at))
    }

    fn check(&mut self, page: u32, key: &PageKey) -> bool {
        let (a, b) = &mut self.scratch;
        self.kv.check(page, key, a, b)
    }

    /// Serves one request the way an engine's scheduler would: match, verify the device hit,
    /// prefetch L3 pages, load back from L2 into free pages (verified), compute the rest,
    /// insert, release.
    pub async fn serve(&mut self, req: &Request) -> Result<Outcome> {
        let page_size = self.layout.page_size() as u64;
        let page_bytes = self.layout.page_bytes() as u64;
        let keys = self.hasher.keys(&req.input);
        let mut out = Outcome {
            request: req.index,
            input_tokens: req.input.len() as u64,
            ..Outcome::default()
        };
        let client = self.client.as_mut().context("not connected")?;
        let m = client.match_prefix(&req.input, None).await?;
        let handle = m.handle;
        let mut pages: Vec<u32> = m.device_pages.clone();
        pages.truncate(keys.len());
        for (&p, key) in pages.iter().zip(&keys) {
            out.verified += 1;
            if !self.check(p, key) {
                out.corrupt.push(Corrupt {
                    request: req.index,
                    key: key.to_hex(),
                    tier: "device",
                });
            }
        }
        let d = pages.len();
        out.device = d as u64 * page_size;
        let (l2, l3) = (m.l2_pages as usize, m.l3_pages as usize);
        out.matched = (l2 as u64, l3 as u64);
        // What L2 and L3 hold after the device prefix comes in rounds: a prefix longer than
        // the room L2 has for one prefetch (or than the free pages) takes several.
        let promised = (d + l2 + l3).min(keys.len());
        let mut loaded_total = 0;
        // An engine waits for storage once per request: after a prefetch that ran out of
        // time it serves what landed and computes the rest.
        let mut out_of_time = false;
        let mut waiting: Option<Instant> = None;
        for _round in 0..MAX_LOAD_ROUNDS {
            let now = pages.len();
            if now >= promised {
                break;
            }
            let mut want = (d + l2).saturating_sub(now);
            if now + want < promised
                && !out_of_time
                && let Some(policy) = self.prefetch
            {
                let client = self.client.as_mut().context("not connected")?;
                waiting.get_or_insert_with(Instant::now);
                let mut stream = client.prefetch(handle, policy, None).await?;
                let mut last = None;
                while let Some(p) = stream.message().await? {
                    out.storage_deadline = out
                        .storage_deadline
                        .max(Duration::from_millis(p.deadline_ms));
                    let planned = p.l2_pages + p.hit_pages;
                    last = Some(p);
                    // Best effort: the engine does not wait. It schedules the request at
                    // once (a worker here never has anything else to run first), and the
                    // load back takes what has landed by then.
                    if policy == v1::PrefetchPolicy::BestEffort {
                        want = planned as usize;
                        out_of_time = true;
                        break;
                    }
                }
                if let Some(p) = last {
                    out.prefetch.get_or_insert_with(|| {
                        if out_of_time && p.state == v1::PrefetchState::Running as i32 {
                            "taken_early".to_string()
                        } else {
                            kvtier_client::outcome(&p)
                        }
                    });
                    if policy != v1::PrefetchPolicy::BestEffort {
                        out_of_time = p.state == v1::PrefetchState::TimedOut as i32;
                        want = (p.l2_pages + p.landed_pages) as usize;
                    }
                }
            }
            let want = want.min(self.pages as usize / 2);
            if want == 0 {
                if let Some(w) = waiting.take() {
                    out.storage_wait += w.elapsed();
                }
                break;
            }
            let free = self.alloc(want).await?;
            for &p in &free {
                self.kv.scribble(p, &mut self.scratch.0);
            }
            let t = Instant::now();
            let client = self.client.as_mut().context("not connected")?;
            let lb = client.load_back(handle, free.clone()).await?;
            out.load_back_time += t.elapsed();
            if let Some(w) = waiting.take() {
                out.storage_wait += w.elapsed();
            }
            self.free.extend(lb.unused_pages.iter().copied());
            // The handle's device prefix now: the matched pages and the loaded ones (never
            // more than the request has keys, whatever the agent says).
            let mut dev_now = lb.device_pages.clone();
            dev_now.truncate(keys.len());
            if dev_now.len() <= now || lb.loaded == 0 {
                break;
            }
            for i in now..dev_now.len() {
                let tier = if i < d + l2 { "host" } else { "storage" };
                out.verified += 1;
                if !self.check(dev_now[i], &keys[i]) {
                    out.corrupt.push(Corrupt {
                        request: req.index,
                        key: keys[i].to_hex(),
                        tier,
                    });
                }
            }
            loaded_total += dev_now.len() - now;
            pages = dev_now;
        }
        let host = loaded_total.min(l2);
        out.host = host as u64 * page_size;
        out.storage = (loaded_total - host) as u64 * page_size;
        out.load_back_bytes = loaded_total as u64 * page_bytes;
        // Compute the rest of the prompt and the generated tokens (full pages only: a partial
        // last page is never cached).
        let mut all = req.input.clone();
        all.extend_from_slice(&req.output);
        let all_keys = self.hasher.keys(&all);
        let cached = pages.len();
        out.computed = out.input_tokens - (cached as u64 * page_size).min(out.input_tokens);
        let fresh = self.alloc(all_keys.len().saturating_sub(cached)).await?;
        let computing = Instant::now();
        for (k, &p) in all_keys[cached..].iter().zip(&fresh) {
            let (a, _) = &mut self.scratch;
            self.kv.compute(p, k, a);
        }
        out.computed_pages = fresh.len() as u64;
        pages.extend_from_slice(&fresh);
        // Prefill takes the time the cost model gives it (less what filling the pages took).
        let busy = Duration::from_secs_f64(out.computed as f64 * self.seconds_per_token);
        let left = busy.saturating_sub(computing.elapsed());
        if !left.is_zero() {
            tokio::time::sleep(left).await;
        }
        let client = self.client.as_mut().context("not connected")?;
        let ins = client.insert(all, None, pages).await?;
        self.free.extend(ins.duplicate_pages);
        client.release(handle).await?;
        Ok(out)
    }
}
