//! The fleet replay's router: which node serves a request, by one of four policies. The
//! `kvtier` policy reads every node's `WatchEvents` stream into a [`FleetView`] (which node's
//! L2 holds each page, and which pages L3 holds) and sends a request where its modeled time
//! to first token is least: the node's queue plus the prefill its cache does not save.

use std::collections::{HashMap, HashSet};

use anyhow::{Result, bail};
use kvtier_core::PageKey;
use kvtier_core::events::{Event, EventKind, EventTier};

/// How the router chooses a node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Policy {
    /// Each node in turn.
    RoundRobin,
    /// A node drawn at random (seeded).
    Random,
    /// Consistent hashing on the prompt's first page: one prefix, one node, blind to load.
    PrefixHash,
    /// The least modeled time to first token, from kvtier's events (see `Router::kvtier`).
    Kvtier,
}

impl Policy {
    /// Every policy, in the order a comparison prints them.
    pub const ALL: [Policy; 4] = [
        Policy::RoundRobin,
        Policy::Random,
        Policy::PrefixHash,
        Policy::Kvtier,
    ];

    /// The policy's name.
    pub fn name(self) -> &'static str {
        match self {
            Policy::RoundRobin => "round_robin",
            Policy::Random => "random",
            Policy::PrefixHash => "prefix_hash",
            Policy::Kvtier => "kvtier",
        }
    }
}

impl std::str::FromStr for Policy {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<Self> {
        match Policy::ALL.iter().find(|p| p.name() == s) {
            Some(p) => Ok(*p),
            None => bail!(
                "router policy {s:?}: expected one of {}",
                Policy::ALL.map(Policy::name).join(", ")
            ),
        }
    }
}

/// Which nodes' L2 holds each page, and which pages L3 holds, as the nodes' events say; and
/// the pages of requests the router sent and the nodes have not finished, which no event
/// announces yet (the node is computing them: the next request on that prefix should wait
/// for it there rather than compute it again elsewhere). Up to 64 nodes (a bit each).
#[derive(Debug, Default)]
pub struct FleetView {
    l2: HashMap<PageKey, u64>,
    l3: HashSet<PageKey>,
    /// Pages in flight: which nodes, and how many of each node's unfinished requests, hold
    /// each.
    pending: HashMap<PageKey, u64>,
    pending_count: HashMap<(PageKey, usize), u32>,
}

impl FleetView {
    /// Applies node `node`'s `events`.
    pub fn apply(&mut self, node: usize, events: &[Event]) {
        let bit = 1u64 << node;
        for e in events {
            match (e.kind, e.tier) {
                (EventKind::Stored { key, .. }, EventTier::L2Host) => {
                    *self.l2.entry(key).or_insert(0) |= bit;
                }
                (EventKind::Stored { key, .. }, EventTier::L3Storage) => {
                    self.l3.insert(key);
                }
                (EventKind::Removed { key }, EventTier::L2Host) => self.forget(key, bit),
                (EventKind::Removed { key }, EventTier::L3Storage) => {
                    self.l3.remove(&key);
                }
                (EventKind::Cleared { .. }, EventTier::L2Host) | (EventKind::Resync, _) => {
                    self.forget_node(node);
                }
                // One node's clear of the shared L3 says nothing of what others wrote since:
                // their Stored events bring them back.
                (EventKind::Cleared { .. }, EventTier::L3Storage) => self.l3.clear(),
            }
        }
    }

    /// Forgets every page node `node`'s L2 held (its stream ended, or it resyncs); the
    /// requests sent to it stay pending until they finish.
    pub fn forget_node(&mut self, node: usize) {
        let bit = 1u64 << node;
        self.l2.retain(|_, nodes| {
            *nodes &= !bit;
            *nodes != 0
        });
    }

    fn forget(&mut self, key: PageKey, bit: u64) {
        if let Some(nodes) = self.l2.get_mut(&key) {
            *nodes &= !bit;
            if *nodes == 0 {
                self.l2.remove(&key);
            }
        }
    }

    /// For each of `nodes` nodes, the leading pages of `prompt` its L2 holds (or a request
    /// sent to it is computing); and how many pages past each node's run L3 holds. One walk over the prompt, narrowing the set of
    /// nodes still matching.
    pub fn prefix(&self, prompt: &[PageKey], nodes: usize) -> Vec<(usize, usize)> {
        let mut l2 = vec![0usize; nodes];
        let mut alive = if nodes >= 64 {
            u64::MAX
        } else {
            (1u64 << nodes) - 1
        };
        for (i, k) in prompt.iter().enumerate() {
            let held =
                self.l2.get(k).copied().unwrap_or(0) | self.pending.get(k).copied().unwrap_or(0);
            let dropped = alive & !held;
            for (n, run) in l2.iter_mut().enumerate() {
                if dropped & (1 << n) != 0 {
                    *run = i;
                }
            }
            alive &= held;
            if alive == 0 {
                break;
            }
        }
        for (n, run) in l2.iter_mut().enumerate() {
            if alive & (1 << n) != 0 {
                *run = prompt.len();
            }
        }
        l2.into_iter()
            .map(|run| {
                let l3 = prompt[run..]
                    .iter()
                    .take_while(|k| self.l3.contains(*k))
                    .count();
                (run, l3)
            })
            .collect()
    }

    /// Pages held in some node's L2.
    pub fn l2_pages(&self) -> usize {
        self.l2.len()
    }

    /// Node `node` was sent a request whose pages are `keys`.
    pub fn sent(&mut self, node: usize, keys: &[PageKey]) {
        for k in keys {
            *self.pending_count.entry((*k, node)).or_insert(0) += 1;
            *self.pending.entry(*k).or_insert(0) |= 1 << node;
        }
    }

    /// Node `node` finished a request [`FleetView::sent`] it: its pages are for the events
    /// to announce from now on.
    pub fn finished(&mut self, node: usize, keys: &[PageKey]) {
        for k in keys {
            let std::collections::hash_map::Entry::Occupied(mut c) =
                self.pending_count.entry((*k, node))
            else {
                continue;
            };
            *c.get_mut() -= 1;
            if *c.get() == 0 {
                c.remove();
                if let Some(nodes) = self.pending.get_mut(k) {
                    *nodes &= !(1 << node);
                    if *nodes == 0 {
                        self.pending.remove(k);
                    }
                }
            }
        }
    }
}

/// What the router needs of a request: its prompt's page keys and length.
pub struct Ask<'a> {
    /// The prompt's full pages' keys.
    pub keys: &'a [PageKey],
    /// Prompt tokens.
    pub tokens: u64,
    /// Tokens per page.
    pub page_size: u64,
}

/// The router: a policy and what it keeps to decide.
pub struct Router {
    policy: Policy,
    nodes: usize,
    next: usize,
    rng: u64,
    /// Tokens each node has been sent and not finished (its queue), as the router models it.
    pub queued: Vec<u64>,
    /// Which nodes are in the fleet: the router sends only to those (at least one).
    pub present: Vec<bool>,
    /// Which nodes answer (their kvtierd's health check): of those present, the router
    /// sends to those that answer while any does.
    pub answering: Vec<bool>,
    /// Prefill tokens a second one worker computes: a miss's cost.
    prefill_tokens_per_second: f64,
    /// Workers a node has: its queue drains this many times faster than one worker.
    workers_per_node: f64,
    /// Tokens a second L3 delivers to a node, in prefill-token terms (a hit from L3 costs a
    /// load, not nothing).
    l3_tokens_per_second: f64,
}

impl Router {
    /// A router over `nodes` nodes (at most 64).
    pub fn new(
        policy: Policy,
        nodes: usize,
        workers_per_node: usize,
        prefill_tokens_per_second: f64,
        seed: u64,
    ) -> Self {
        Self {
            policy,
            nodes,
            next: 0,
            rng: seed | 1,
            queued: vec![0; nodes],
            present: vec![true; nodes],
            answering: vec![true; nodes],
            prefill_tokens_per_second: prefill_tokens_per_second.max(1.0),
            workers_per_node: workers_per_node.max(1) as f64,
            l3_tokens_per_second: prefill_tokens_per_second.max(1.0) * 20.0,
        }
    }

    /// The policy.
    pub fn policy(&self) -> Policy {
        self.policy
    }

    /// The node for `ask` among those [`Router::present`] (`view`: the fleet as its events
    /// say; only `kvtier` reads it), and the tokens the router expects that node to compute
    /// for it.
    pub fn route(&mut self, ask: &Ask<'_>, view: &FleetView) -> (usize, u64) {
        let answering: Vec<usize> = (0..self.nodes)
            .filter(|n| self.present[*n] && self.answering[*n])
            .collect();
        let present: Vec<usize> = (0..self.nodes).filter(|n| self.present[*n]).collect();
        // With none answering, those present; with none present (a caller's error) every
        // node, rather than no answer.
        let present = if !answering.is_empty() {
            answering
        } else if !present.is_empty() {
            present
        } else {
            (0..self.nodes).collect()
        };
        let node = match self.policy {
            Policy::RoundRobin => {
                self.next = (self.next + 1) % self.nodes;
                while !present.contains(&self.next) {
                    self.next = (self.next + 1) % self.nodes;
                }
                self.next
            }
            Policy::Random => {
                // xorshift64*
                self.rng ^= self.rng >> 12;
                self.rng ^= self.rng << 25;
                self.rng ^= self.rng >> 27;
                present
                    [(self.rng.wrapping_mul(0x2545_F491_4F6C_DD1D) % present.len() as u64) as usize]
            }
            Policy::PrefixHash => match ask.keys.first() {
                Some(k) => rendezvous(k, &present),
                None => present[0],
            },
            Policy::Kvtier => return self.kvtier(ask, view, &present),
        };
        (node, ask.tokens)
    }

    /// The `kvtier` policy: for each node, the modeled time to first token of the request
    /// there, `queued / (workers × prefill rate) + computed / prefill rate + from_l3 / L3
    /// rate`, where `computed` is the prompt less the pages that node's L2 holds (or a
    /// request sent there is computing) and the pages after them L3 holds, and `from_l3`
    /// those L3 pages; plus what the choice costs everyone else: the prefill it spends
    /// beyond the least any node would (`(computed − least) / prefill rate`: work another
    /// node's cache would have saved, which later requests queue behind). The least among
    /// `present` wins (ties: the lower node).
    ///
    /// Without that last term a loaded fleet recomputes cached prefixes on idle nodes to
    /// shave one request's wait: on the trace slice with isolated pools it served 0.40 of the
    /// ideal reuse, with it 0.46, at the same time to first token.
    fn kvtier(&self, ask: &Ask<'_>, view: &FleetView, present: &[usize]) -> (usize, u64) {
        let runs = view.prefix(ask.keys, self.nodes);
        let computed_at = |n: usize| {
            let (l2, l3) = runs[n];
            let saved = ((l2 + l3) as u64 * ask.page_size).min(ask.tokens);
            (
                ask.tokens - saved,
                (l3 as u64 * ask.page_size).min(saved) as f64,
            )
        };
        let least = present.iter().map(|n| computed_at(*n).0).min().unwrap_or(0);
        let mut best = (f64::INFINITY, present[0], ask.tokens);
        for &n in present {
            let (computed, from_l3) = computed_at(n);
            let t = self.queued[n] as f64
                / (self.workers_per_node * self.prefill_tokens_per_second)
                + computed as f64 / self.prefill_tokens_per_second
                + from_l3 / self.l3_tokens_per_second
                + (computed - least) as f64 / self.prefill_tokens_per_second;
            if t < best.0 {
                best = (t, n, computed);
            }
        }
        (best.1, best.2)
    }
}

/// Rendezvous (highest random weight) hashing of `key` over `nodes`: adding or removing a
/// node moves only the prefixes that node wins or held.
fn rendezvous(key: &PageKey, nodes: &[usize]) -> usize {
    nodes
        .iter()
        .copied()
        .max_by_key(|n| {
            let mut h = 0xcbf2_9ce4_8422_2325u64 ^ (*n as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            for b in &key.0[..8] {
                h = (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
            }
            h
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use kvtier_core::events::Event;

    fn stored(key: u8, tier: EventTier) -> Event {
        Event {
            seq: 1,
            unix_nanos: 0,
            kind: EventKind::Stored {
                key: PageKey([key; 32]),
                parent: None,
            },
            layout: None,
            tier,
        }
    }

    fn keys(ids: &[u8]) -> Vec<PageKey> {
        ids.iter().map(|i| PageKey([*i; 32])).collect()
    }

    /// The one-walk prefix equals each node's own count, on seeded random fleets.
    #[test]
    fn the_prefix_walk_equals_counting_each_node_alone() {
        let mut rng = 7u64;
        let mut draw = |m: u64| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng % m
        };
        for _ in 0..200 {
            let nodes = 1 + draw(8) as usize;
            let mut view = FleetView::default();
            let mut held: Vec<HashSet<u8>> = vec![HashSet::new(); nodes];
            let mut l3 = HashSet::new();
            for _ in 0..draw(60) {
                let (n, k) = (draw(nodes as u64) as usize, draw(12) as u8);
                if draw(4) == 0 {
                    view.apply(
                        n,
                        &[Event {
                            kind: EventKind::Removed {
                                key: PageKey([k; 32]),
                            },
                            ..stored(k, EventTier::L2Host)
                        }],
                    );
                    held[n].remove(&k);
                } else if draw(5) == 0 {
                    view.apply(n, &[stored(k, EventTier::L3Storage)]);
                    l3.insert(k);
                } else {
                    view.apply(n, &[stored(k, EventTier::L2Host)]);
                    held[n].insert(k);
                }
            }
            let prompt: Vec<u8> = (0..draw(10)).map(|_| draw(12) as u8).collect();
            let got = view.prefix(&keys(&prompt), nodes);
            for (n, h) in held.iter().enumerate() {
                let run = prompt.iter().take_while(|k| h.contains(k)).count();
                let after = prompt[run..].iter().take_while(|k| l3.contains(k)).count();
                assert_eq!(got[n], (run, after), "node {n}, prompt {prompt:?}");
            }
        }
    }

    /// `kvtier` sends a request to the node holding its prefix, unless that node's queue
    /// costs more than the prefix saves; a resync forgets the node's pages.
    #[test]
    fn kvtier_weighs_the_saved_prefill_against_the_queue() {
        let mut view = FleetView::default();
        view.apply(1, &[1, 2, 3].map(|k| stored(k, EventTier::L2Host)));
        let prompt = keys(&[1, 2, 3, 4]);
        let ask = Ask {
            keys: &prompt,
            tokens: 4 * 64,
            page_size: 64,
        };
        let mut r = Router::new(Policy::Kvtier, 3, 1, 1000.0, 1);
        assert_eq!(r.route(&ask, &view), (1, 64));
        r.queued[1] = 1000;
        assert_eq!(
            r.route(&ask, &view).0,
            0,
            "the queue outweighs 192 tokens saved"
        );
        r.queued[1] = 100;
        assert_eq!(r.route(&ask, &view).0, 1);
        // 0.3 s of queue against 0.192 s of prefill node 0 would spend: node 0's request
        // alone would start sooner, but the fleet would compute 192 tokens it holds.
        r.queued[1] = 300;
        assert_eq!(r.route(&ask, &view).0, 1, "the recomputation counts too");
        view.apply(
            1,
            &[Event {
                kind: EventKind::Resync,
                ..stored(0, EventTier::L2Host)
            }],
        );
        assert_eq!(r.route(&ask, &view).0, 0);
        // A request on this prefix sent to node 2 and not finished: the next one follows it.
        view.sent(2, &prompt[..3]);
        assert_eq!(r.route(&ask, &view).0, 2);
        view.sent(2, &prompt[..3]);
        view.finished(2, &prompt[..3]);
        assert_eq!(r.route(&ask, &view).0, 2, "one of the two is still running");
        view.finished(2, &prompt[..3]);
        assert_eq!(r.route(&ask, &view).0, 0);
        assert!("least_loaded".parse::<Policy>().is_err());
        assert_eq!("prefix_hash".parse::<Policy>().unwrap(), Policy::PrefixHash);
    }

    /// Nodes out of the fleet, or not answering, get nothing under any policy; the rest
    /// still do, and prefix hashing keeps every prefix that did not live on those nodes
    /// where it was.
    #[test]
    fn absent_nodes_get_nothing() {
        let view = FleetView::default();
        let prompts: Vec<Vec<PageKey>> = (0..200u32)
            .map(|i| {
                let mut k = [0u8; 32];
                k[..4].copy_from_slice(&i.wrapping_mul(2_654_435_761).to_le_bytes());
                vec![PageKey(k)]
            })
            .collect();
        for policy in Policy::ALL {
            let mut r = Router::new(policy, 4, 1, 1000.0, 3);
            let before: Vec<usize> = prompts
                .iter()
                .map(|p| {
                    let ask = Ask {
                        keys: p,
                        tokens: 64,
                        page_size: 64,
                    };
                    r.route(&ask, &view).0
                })
                .collect();
            r.present[2] = false;
            r.answering[0] = false;
            let mut used = HashSet::new();
            for (p, was) in prompts.iter().zip(&before) {
                let ask = Ask {
                    keys: p,
                    tokens: 64,
                    page_size: 64,
                };
                let n = r.route(&ask, &view).0;
                assert!(n != 2 && n != 0, "{policy:?} sent to {n}");
                used.insert(n);
                if policy == Policy::PrefixHash && *was != 2 && *was != 0 {
                    assert_eq!(n, *was, "a prefix moved off a node still present");
                }
            }
            if policy != Policy::Kvtier {
                // (kvtier with empty queues and no pages: the lowest node wins each tie.)
                assert_eq!(used.len(), 2, "{policy:?} spread over {used:?}");
            }
            // None answering: those present still get requests, never one out.
            r.answering = vec![false; 4];
            for p in &prompts {
                let ask = Ask {
                    keys: p,
                    tokens: 64,
                    page_size: 64,
                };
                assert_ne!(r.route(&ask, &view).0, 2, "{policy:?}");
            }
        }
    }
}
