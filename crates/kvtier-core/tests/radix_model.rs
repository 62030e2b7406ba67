//! The radix tree against a reference model, over random operation sequences, for every
//! eviction policy.
//!
//! The model keeps one record per page, keyed by a label that identifies the whole prefix up to
//! that page (as page keys do), with its parent's label, device value, backup flag, lock count
//! and policy metadata. It is deliberately naive: every question is answered by a full scan.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;

use kvtier_core::PolicyKind;
use kvtier_core::policy::{EntryMeta, Rank};
use kvtier_core::radix::{NodeId, RadixTree};
use proptest::prelude::*;

type Label = u64;
const ROOT: Label = 0;

#[derive(Default)]
struct Interner {
    map: HashMap<(Label, u8), Label>,
}

impl Interner {
    /// One label per distinct prefix: equal prefixes get equal labels.
    fn labels(&mut self, tokens: &[u8]) -> Vec<Label> {
        let mut parent = ROOT;
        tokens
            .iter()
            .map(|&t| {
                let next = self.map.len() as Label + 1;
                parent = *self.map.entry((parent, t)).or_insert(next);
                parent
            })
            .collect()
    }
}

#[derive(Clone, Debug)]
struct Page {
    parent: Label,
    value: Option<u32>,
    backed: bool,
    lock: u32,
    meta: EntryMeta,
}

#[derive(Default)]
struct Model {
    pages: HashMap<Label, Page>,
    clock: u64,
}

impl Model {
    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// (device pages, host-only pages) of the longest cached prefix.
    fn prefix(&self, labels: &[Label]) -> (usize, usize) {
        let mut device = 0;
        let mut host = 0;
        for l in labels {
            match self.pages.get(l) {
                Some(p) if p.value.is_some() && host == 0 => device += 1,
                Some(_) => host += 1,
                None => break,
            }
        }
        (device, host)
    }

    fn has_device_child(&self, l: Label) -> bool {
        self.pages
            .values()
            .any(|p| p.parent == l && p.value.is_some())
    }

    fn has_child(&self, l: Label) -> bool {
        self.pages.values().any(|p| p.parent == l)
    }

    fn min_rank(&self, ranks: &dyn Fn(&EntryMeta) -> Rank, device: bool) -> Option<Rank> {
        self.pages
            .iter()
            .filter(|(l, p)| {
                p.lock == 0
                    && if device {
                        p.value.is_some() && !self.has_device_child(**l)
                    } else {
                        p.value.is_none() && !self.has_child(**l)
                    }
            })
            .map(|(_, p)| ranks(&p.meta))
            .min()
    }

    fn count(&self, f: impl Fn(&Page) -> bool) -> usize {
        self.pages.values().filter(|p| f(p)).count()
    }
}

#[derive(Clone, Debug)]
enum Op {
    Insert(Vec<u8>),
    Match(Vec<u8>),
    Lock(Vec<u8>),
    Unlock(usize),
    Evict(usize),
    EvictHost(usize),
    Backup(Vec<u8>),
    /// A backup that stored only the first pages of the matched path.
    PartialBackup(Vec<u8>, usize),
    Priority(Vec<u8>, i8),
    /// The host tier may have lost pages (kvtierd restarted).
    ForgetBackups,
}

fn seq() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(0u8..3, 0..8)
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => seq().prop_map(Op::Insert),
        3 => seq().prop_map(Op::Match),
        2 => seq().prop_map(Op::Lock),
        2 => any::<usize>().prop_map(Op::Unlock),
        3 => (0usize..6).prop_map(Op::Evict),
        1 => (0usize..6).prop_map(Op::EvictHost),
        2 => seq().prop_map(Op::Backup),
        1 => (seq(), any::<usize>()).prop_map(|(s, k)| Op::PartialBackup(s, k)),
        1 => (seq(), any::<i8>()).prop_map(|(s, p)| Op::Priority(s, p)),
        1 => Just(Op::ForgetBackups),
    ]
}

struct Harness {
    tree: RadixTree<Label, u32>,
    model: Model,
    names: Interner,
    handles: Vec<(NodeId, Vec<Label>)>,
    next_value: u32,
    kind: PolicyKind,
}

impl Harness {
    fn new(kind: PolicyKind) -> Self {
        Self {
            tree: RadixTree::new(kind),
            model: Model::default(),
            names: Interner::default(),
            handles: Vec::new(),
            next_value: 1,
            kind,
        }
    }

    /// Runs a match on both, checks the answers agree, and touches the model's pages.
    fn do_match(&mut self, labels: &[Label]) -> kvtier_core::radix::Match<u32> {
        let m = self.tree.match_prefix(labels);
        let now = self.model.tick();
        let (device, host) = self.model.prefix(labels);
        assert_eq!(m.device_pages(), device, "device prefix length");
        assert_eq!(m.host_pages, host, "host prefix length");
        for (i, l) in labels[..device + host].iter().enumerate() {
            let p = self.model.pages.get_mut(l).unwrap();
            if i < device {
                assert_eq!(Some(m.device_values[i]), p.value, "value of page {i}");
            }
            p.meta.last_access = now;
            p.meta.hits += 1;
        }
        m
    }

    fn apply(&mut self, op: &Op) {
        match op {
            Op::Insert(s) => {
                let labels = self.names.labels(s);
                let values: Vec<u32> = (0..labels.len() as u32)
                    .map(|i| self.next_value + i)
                    .collect();
                self.next_value += labels.len() as u32;
                let r = self.tree.insert(&labels, &values).unwrap();
                let now = self.model.tick();
                let (device, host) = self.model.prefix(&labels);
                assert_eq!(r.already_on_device, device, "duplicates reported");
                assert_eq!(r.revived, host, "revived pages reported");
                let mut parent = ROOT;
                for (l, v) in labels.iter().zip(&values) {
                    let p = self.model.pages.entry(*l).or_insert(Page {
                        parent,
                        value: None,
                        backed: false,
                        lock: 0,
                        meta: EntryMeta {
                            created: now,
                            ..EntryMeta::default()
                        },
                    });
                    p.value.get_or_insert(*v);
                    p.meta.last_access = now;
                    parent = *l;
                }
            }
            Op::Match(s) => {
                let labels = self.names.labels(s);
                self.do_match(&labels);
            }
            Op::Lock(s) => {
                let labels = self.names.labels(s);
                let m = self.do_match(&labels);
                self.tree.lock(m.device_node).unwrap();
                let locked = labels[..m.device_pages()].to_vec();
                for l in &locked {
                    self.model.pages.get_mut(l).unwrap().lock += 1;
                }
                self.handles.push((m.device_node, locked));
            }
            Op::Unlock(i) => {
                if self.handles.is_empty() {
                    return;
                }
                let (id, locked) = self.handles.swap_remove(i % self.handles.len());
                self.tree.unlock(id).unwrap();
                for l in &locked {
                    self.model.pages.get_mut(l).unwrap().lock -= 1;
                }
            }
            Op::Evict(n) => {
                let evictable = self.model.count(|p| p.value.is_some() && p.lock == 0);
                let policy = self.kind.build();
                let victims = self.tree.evict(*n);
                let total: usize = victims.iter().map(|v| v.values.len()).sum();
                assert_eq!(total, (*n).min(evictable), "pages evicted");
                for v in victims {
                    let min = self.model.min_rank(&|m| policy.rank(m), true);
                    let last = *v.keys.last().unwrap();
                    let meta = self.model.pages[&last].meta;
                    assert!(!self.model.has_device_child(last), "victim is not a leaf");
                    assert_eq!(Some(policy.rank(&meta)), min, "victim out of policy order");
                    for (l, val) in v.keys.iter().zip(&v.values) {
                        let p = self.model.pages.get_mut(l).unwrap();
                        assert_eq!(p.meta, meta, "pages of one node share metadata");
                        assert_eq!(p.lock, 0, "locked page evicted");
                        assert_eq!(p.value, Some(*val), "evicted value");
                        assert_eq!(p.backed, v.backed_up);
                        p.value = None;
                    }
                    if !v.backed_up {
                        for l in v.keys.iter().rev() {
                            assert!(!self.model.has_child(*l), "removed page had children");
                            self.model.pages.remove(l);
                        }
                    }
                }
            }
            Op::EvictHost(n) => {
                let host_only = self.model.count(|p| p.value.is_none());
                let policy = self.kind.build();
                let victims = self.tree.evict_host(*n);
                let total: usize = victims.iter().map(|v| v.keys.len()).sum();
                assert_eq!(total, (*n).min(host_only), "host pages forgotten");
                for v in victims {
                    let min = self.model.min_rank(&|m| policy.rank(m), false);
                    let last = *v.keys.last().unwrap();
                    assert_eq!(Some(policy.rank(&self.model.pages[&last].meta)), min);
                    for l in v.keys.iter().rev() {
                        assert!(!self.model.has_child(*l));
                        let p = self.model.pages.remove(l).unwrap();
                        assert!(p.value.is_none() && p.backed);
                    }
                }
            }
            Op::Backup(s) => {
                let labels = self.names.labels(s);
                let m = self.do_match(&labels);
                let matched = &labels[..m.device_pages() + m.host_pages];
                let unbacked = matched
                    .iter()
                    .filter(|l| !self.model.pages[*l].backed)
                    .count();
                let path = self.tree.unbacked_path(m.last_node).unwrap();
                let path_pages: usize = path
                    .iter()
                    .map(|id| self.tree.view(*id).unwrap().keys.len())
                    .sum();
                assert_eq!(path_pages, unbacked, "unbacked path length");
                self.tree.mark_backed_up(m.last_node).unwrap();
                for l in matched {
                    self.model.pages.get_mut(l).unwrap().backed = true;
                }
            }
            Op::PartialBackup(s, k) => {
                let labels = self.names.labels(s);
                let m = self.do_match(&labels);
                let matched = m.device_pages() + m.host_pages;
                if matched == 0 {
                    return;
                }
                let last = labels[k % matched];
                assert!(
                    self.tree
                        .mark_backed_up_through(m.last_node, &last)
                        .unwrap()
                );
                for l in &labels[..=k % matched] {
                    self.model.pages.get_mut(l).unwrap().backed = true;
                }
            }
            Op::ForgetBackups => {
                let host_only = self.model.count(|p| p.value.is_none());
                let marked = self.model.count(|p| p.value.is_some() && p.backed);
                assert_eq!(self.tree.forget_backups(), (host_only, marked));
                self.model.pages.retain(|_, p| p.value.is_some());
                for p in self.model.pages.values_mut() {
                    p.backed = false;
                }
            }
            Op::Priority(s, prio) => {
                let labels = self.names.labels(s);
                let m = self.do_match(&labels);
                if m.last_node == self.tree.root() {
                    return;
                }
                self.tree
                    .set_priority(m.last_node, i32::from(*prio))
                    .unwrap();
                for l in self.tree.view(m.last_node).unwrap().keys {
                    self.model.pages.get_mut(l).unwrap().meta.priority = i32::from(*prio);
                }
            }
        }
        self.tree.validate().unwrap();
        let m = &self.model;
        assert_eq!(self.tree.device_pages(), m.count(|p| p.value.is_some()));
        assert_eq!(
            self.tree.protected_pages(),
            m.count(|p| p.value.is_some() && p.lock > 0)
        );
        assert_eq!(self.tree.host_only_pages(), m.count(|p| p.value.is_none()));
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn tree_agrees_with_model(
        kind in prop::sample::select(PolicyKind::ALL.to_vec()),
        ops in prop::collection::vec(op(), 1..80),
    ) {
        let mut h = Harness::new(kind);
        for op in &ops {
            h.apply(op);
        }
        // Releasing every lock makes every device page evictable, and evicting them all
        // empties the device tier.
        while let Some((id, _)) = h.handles.pop() {
            h.tree.unlock(id).unwrap();
        }
        let total = h.tree.device_pages();
        let freed: usize = h.tree.evict(usize::MAX).iter().map(|v| v.values.len()).sum();
        prop_assert_eq!(freed, total);
        prop_assert_eq!(h.tree.device_pages(), 0);
        h.tree.validate().unwrap();
    }
}
