//! The L2 host index against a reference model, over random operation sequences by two
//! writers, under every eviction policy, in a pool small enough to evict and run out of space.
//! Each chain's keys carry their own tenant tag (their first byte): chain 0's tenant may have a
//! page quota, chain 1's is counted without one.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;

use kvtier_core::host_index::{HostIndex, L3Mark, L3Mode, Landed, PageState, Reserve};
use kvtier_core::{PageKey, PolicyKind, TenantTag};
use proptest::prelude::*;

const CAPACITY: u32 = 6;

/// Page `i` of chain `c`: chains share nothing, pages of a chain are a prefix sequence. The
/// first 8 bytes (the tenant tag) depend on the chain only.
fn key(c: u8, i: u8) -> PageKey {
    let mut k = [0u8; 32];
    k[0] = c;
    k[8] = i;
    PageKey(k)
}

fn chain(c: u8, len: u8) -> Vec<PageKey> {
    (0..len).map(|i| key(c, i)).collect()
}

#[derive(Clone, Debug)]
struct Entry {
    state: PageState,
    owner: u64,
    pins: u32,
    /// Instance id of this entry; a re-created key gets a new one.
    instance: u64,
    /// Instance of the parent entry when this one was created, if the parent was indexed.
    parent_instance: Option<u64>,
    l3: L3Mark,
    /// Written by a client, not yet in L3.
    dirty: bool,
}

#[derive(Default)]
struct Model {
    entries: HashMap<PageKey, Entry>,
    next_instance: u64,
    /// Slots leased, by owner.
    leases: HashMap<u64, Vec<u32>>,
}

impl Model {
    fn ready_prefix(&self, keys: &[PageKey]) -> usize {
        keys.iter()
            .take_while(|k| {
                self.entries
                    .get(k)
                    .is_some_and(|e| e.state == PageState::Ready)
            })
            .count()
    }

    fn leased(&self) -> u32 {
        self.leases.values().map(|l| l.len() as u32).sum()
    }

    /// Whether a page other than those in `gone` was created under `instance`.
    fn has_children(&self, instance: u64, gone: &[u64]) -> bool {
        self.entries
            .values()
            .any(|e| e.parent_instance == Some(instance) && !gone.contains(&e.instance))
    }
}

#[derive(Clone, Debug)]
enum Op {
    Reserve {
        owner: u64,
        chain: u8,
        len: u8,
        clean: bool,
    },
    Commit {
        owner: u64,
        chain: u8,
    },
    Abort {
        owner: u64,
        chain: u8,
    },
    Acquire {
        chain: u8,
        len: u8,
    },
    Release {
        chain: u8,
        len: u8,
    },
    Evict(usize),
    EndOwner(u64),
    QueueL3 {
        chain: u8,
        len: u8,
    },
    FinishL3 {
        chain: u8,
        landed: bool,
    },
    Flush(usize),
    /// A page taken over from a dead daemon's pool (page `i` of chain `c`, under page i-1).
    Adopt {
        chain: u8,
        i: u8,
    },
    /// With L3 attached: it goes down (breaker open) or comes back.
    L3Down(bool),
    /// A writer leases up to `n` more slots.
    Lease {
        owner: u64,
        n: usize,
    },
    /// A writer lands pages `from..from + len` of a chain in slots it leased.
    Land {
        owner: u64,
        chain: u8,
        from: u8,
        len: u8,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let owner = 1u64..3;
    let chain = 0u8..4;
    let len = 1u8..5;
    prop_oneof![
        4 => (owner.clone(), chain.clone(), len.clone(), prop::bool::weighted(0.25)).prop_map(|(owner, chain, len, clean)| Op::Reserve { owner, chain, len, clean }),
        3 => (owner.clone(), chain.clone()).prop_map(|(owner, chain)| Op::Commit { owner, chain }),
        1 => (owner.clone(), chain.clone()).prop_map(|(owner, chain)| Op::Abort { owner, chain }),
        3 => (chain.clone(), len.clone()).prop_map(|(chain, len)| Op::Acquire { chain, len }),
        3 => (chain, len).prop_map(|(chain, len)| Op::Release { chain, len }),
        1 => (0usize..4).prop_map(Op::Evict),
        1 => owner.prop_map(Op::EndOwner),
        2 => (0u8..4, 1u8..5).prop_map(|(chain, len)| Op::QueueL3 { chain, len }),
        2 => (0u8..4, any::<bool>()).prop_map(|(chain, landed)| Op::FinishL3 { chain, landed }),
        1 => (0usize..4).prop_map(Op::Flush),
        1 => any::<bool>().prop_map(Op::L3Down),
        1 => (0u8..4, 0u8..4).prop_map(|(chain, i)| Op::Adopt { chain, i }),
        2 => (1u64..3, 1usize..3).prop_map(|(owner, n)| Op::Lease { owner, n }),
        2 => (1u64..3, 0u8..4, 0u8..3, 1u8..3).prop_map(|(owner, chain, from, len)| Op::Land { owner, chain, from, len }),
    ]
}

/// Checks what eviction took against the mode; returns how many L3 did not hold.
fn check_evicted(m: &mut Model, evicted: &[PageKey], mode: L3Mode) -> u64 {
    check_evicted_in(m, evicted, evicted, mode)
}

/// [`check_evicted`] for `keys`, part of a call's `evicted` (in the order the index evicted
/// them): a child evicted before its parent left it a leaf, though the model may still hold
/// the child (it is checked later when the call reserved a page afresh in between).
fn check_evicted_in(m: &mut Model, keys: &[PageKey], evicted: &[PageKey], mode: L3Mode) -> u64 {
    let mut unwritten = 0;
    for k in keys {
        let at = evicted
            .iter()
            .position(|e| e == k)
            .expect("key was evicted");
        // Of those, the ones the model still holds (checked in the other part).
        let gone_before: Vec<u64> = evicted[..at]
            .iter()
            .filter(|g| !keys.contains(g))
            .filter_map(|g| m.entries.get(g))
            .map(|e| e.instance)
            .collect();
        let e = m.entries.remove(k).expect("evicted key was indexed");
        assert_eq!(e.state, PageState::Ready, "evicted a page being written");
        assert_eq!(e.pins, 0, "evicted a pinned page");
        assert_ne!(
            e.l3,
            L3Mark::Queued,
            "evicted a page while writing it to L3"
        );
        let leaf = !m.has_children(e.instance, &gone_before);
        match (mode, e.l3) {
            // Without L3 only leaves leave, so prefixes stay reachable.
            (L3Mode::Absent, _) => assert!(leaf, "evicted a page with a resident child"),
            // With L3, a page L3 holds may leave from anywhere in its chain.
            (L3Mode::Up | L3Mode::Down, L3Mark::Persisted) => {}
            (L3Mode::Up, _) => panic!("evicted a page L3 does not hold while L3 is up"),
            (L3Mode::Down, _) => assert!(leaf, "evicted an unwritten page with a resident child"),
        }
        if e.l3 != L3Mark::Persisted {
            unwritten += 1;
        }
    }
    unwritten
}

fn queue(m: &mut Model, queued: &[(PageKey, u32)]) {
    for (k, _) in queued {
        let e = m.entries.get_mut(k).unwrap();
        assert_eq!(
            (e.state, e.l3),
            (PageState::Ready, L3Mark::None),
            "queued a page twice or unready"
        );
        e.l3 = L3Mark::Queued;
    }
}

/// The tenant of chain `c`'s pages.
fn tenant(c: u8) -> TenantTag {
    TenantTag::of(&key(c, 0))
}

fn run(kind: PolicyKind, l3: bool, dirty_limit: u32, quota: Option<u32>, ops: &[Op]) {
    let mut ix = HostIndex::new(CAPACITY, kind);
    ix.set_tenant_quota(tenant(0), quota);
    ix.set_tenant_quota(tenant(1), None);
    let mut mode = if l3 { L3Mode::Up } else { L3Mode::Absent };
    ix.set_l3_mode(mode);
    ix.set_dirty_limit(dirty_limit);
    let mut m = Model::default();
    let mut unwritten = 0;
    for op in ops {
        match op {
            Op::Reserve {
                owner,
                chain: c,
                len,
                clean,
            } => {
                let keys = chain(*c, *len);
                let dirty_before = ix.stats().dirty;
                let quota_before = ix.tenant_usage(tenant(0)).unwrap();
                let (out, evicted) = if *clean {
                    ix.reserve_clean(*owner, None, &keys)
                } else {
                    ix.reserve(*owner, None, &keys)
                };
                if !*clean
                    && mode == L3Mode::Up
                    && out.iter().any(|r| matches!(r, Reserve::Reserved(_)))
                {
                    assert!(
                        ix.stats().dirty <= dirty_limit.max(dirty_before),
                        "a writer went past the dirty limit"
                    );
                }
                // Outcomes are decided key by key, evictions happen on the way: a page may be
                // evicted to make room for an earlier key and then reserved afresh, or (with
                // L3) reported present and then make room for a later key.
                let (before, after): (Vec<PageKey>, Vec<PageKey>) = evicted.iter().partition(|k| {
                    keys.iter()
                        .zip(&out)
                        .any(|(key, r)| key == *k && matches!(r, Reserve::Reserved(_)))
                });
                unwritten += check_evicted_in(&mut m, &before, &evicted, mode);
                let mut seen_no_space = false;
                let mut parent: Option<u64> = None;
                for (k, r) in keys.iter().zip(&out) {
                    match r {
                        Reserve::Present => {
                            assert!(!seen_no_space);
                            assert!(m.entries.contains_key(k), "Present for an absent key");
                        }
                        Reserve::Reserved(_) => {
                            assert!(!seen_no_space, "a slot after NoSpace");
                            assert!(!m.entries.contains_key(k), "reserved a present key");
                            m.next_instance += 1;
                            m.entries.insert(
                                *k,
                                Entry {
                                    state: PageState::Writing,
                                    owner: *owner,
                                    pins: 0,
                                    instance: m.next_instance,
                                    parent_instance: parent,
                                    l3: L3Mark::None,
                                    dirty: !*clean,
                                },
                            );
                        }
                        Reserve::NoSpace => seen_no_space = true,
                    }
                    parent = m.entries.get(k).map(|e| e.instance);
                }
                unwritten += check_evicted_in(&mut m, &after, &evicted, mode);
                // A tenant at its quota makes room among its own pages only, and never
                // reserves past it.
                let q = ix.tenant_usage(tenant(0)).unwrap();
                let own = evicted.iter().filter(|k| k.0[0] == 0).count() as u64;
                let by_quota = q.quota_evictions - quota_before.quota_evictions;
                assert!(
                    by_quota <= own,
                    "a quota eviction took another tenant's page"
                );
                if *c != 0 {
                    assert_eq!(by_quota, 0, "another tenant's write evicted by quota");
                } else if let Some(limit) = quota {
                    assert!(
                        q.pages <= limit.max(quota_before.pages),
                        "reserved past the quota: {} pages, quota {limit}",
                        q.pages
                    );
                }
            }
            Op::Commit { owner, chain: c } | Op::Abort { owner, chain: c } => {
                let mine: Vec<PageKey> = chain(*c, 4)
                    .into_iter()
                    .filter(|k| {
                        m.entries
                            .get(k)
                            .is_some_and(|e| e.state == PageState::Writing && e.owner == *owner)
                    })
                    .collect();
                // Someone else's or a ready page is refused, and nothing changes.
                if let Some(other) = chain(*c, 4).into_iter().find(|k| {
                    m.entries
                        .get(k)
                        .is_some_and(|e| e.state == PageState::Ready || e.owner != *owner)
                }) {
                    let mut bad = mine.clone();
                    bad.push(other);
                    assert!(ix.commit(*owner, &bad).is_err());
                    assert!(ix.abort(*owner, &bad).is_err());
                }
                if matches!(op, Op::Commit { .. }) {
                    ix.commit(*owner, &mine).unwrap();
                    for k in &mine {
                        m.entries.get_mut(k).unwrap().state = PageState::Ready;
                    }
                } else {
                    ix.abort(*owner, &mine).unwrap();
                    for k in &mine {
                        m.entries.remove(k);
                    }
                }
            }
            Op::Acquire { chain: c, len } => {
                let keys = chain(*c, *len);
                let want = m.ready_prefix(&keys);
                assert_eq!(ix.lookup(&keys), want);
                let slots = ix.acquire(&keys);
                assert_eq!(slots.len(), want);
                for (k, s) in keys.iter().zip(&slots) {
                    assert_eq!(ix.get(k), Some((*s, PageState::Ready)));
                    m.entries.get_mut(k).unwrap().pins += 1;
                }
            }
            Op::Release { chain: c, len } => {
                let keys = chain(*c, *len);
                let ok = keys
                    .iter()
                    .all(|k| m.entries.get(k).is_some_and(|e| e.pins > 0));
                // The index cannot tell a client's pin from an L3 write's; the daemon's sessions
                // only ever release their own. Skip releases that would take the writer's pin.
                let steals = !ok
                    && keys.iter().all(|k| {
                        m.entries
                            .get(k)
                            .is_some_and(|e| e.pins > 0 || e.l3 == L3Mark::Queued)
                    });
                if steals {
                    continue;
                }
                assert_eq!(ix.release(&keys).is_ok(), ok, "release of {keys:?}");
                if ok {
                    for k in &keys {
                        m.entries.get_mut(k).unwrap().pins -= 1;
                    }
                }
            }
            Op::Evict(n) => {
                let evicted = ix.evict(*n);
                assert!(evicted.len() <= *n);
                unwritten += check_evicted(&mut m, &evicted, mode);
            }
            Op::QueueL3 { chain: c, len } => {
                let keys = chain(*c, *len);
                let want: Vec<PageKey> = keys
                    .iter()
                    .filter(|k| {
                        m.entries
                            .get(k)
                            .is_some_and(|e| e.state == PageState::Ready && e.l3 == L3Mark::None)
                    })
                    .copied()
                    .collect();
                let got = ix.queue_for_l3(&keys);
                assert_eq!(got.iter().map(|(k, _)| *k).collect::<Vec<_>>(), want);
                queue(&mut m, &got);
            }
            Op::FinishL3 { chain: c, landed } => {
                for k in chain(*c, 4) {
                    ix.finish_l3(&k, *landed);
                    if let Some(e) = m.entries.get_mut(&k).filter(|e| e.l3 == L3Mark::Queued) {
                        e.l3 = if *landed {
                            L3Mark::Persisted
                        } else {
                            L3Mark::None
                        };
                        e.dirty &= !*landed;
                    }
                }
            }
            Op::Flush(n) => {
                let got = ix.flush_candidates(*n);
                let eligible = m
                    .entries
                    .values()
                    .filter(|e| e.state == PageState::Ready && e.pins == 0 && e.l3 == L3Mark::None)
                    .count();
                // Without L3 there is nothing to flush to.
                let eligible = if mode == L3Mode::Absent { 0 } else { eligible };
                assert_eq!(
                    got.len(),
                    eligible.min(*n),
                    "flush handed out the wrong count"
                );
                for (k, _) in &got {
                    assert_eq!(m.entries[k].pins, 0, "flushed a pinned page");
                }
                queue(&mut m, &got);
            }
            Op::Adopt { chain: c, i } => {
                let k = key(*c, *i);
                let parent = i.checked_sub(1).map(|p| key(*c, p));
                let got = ix.adopt(k, parent);
                let fits =
                    !m.entries.contains_key(&k) && (m.entries.len() as u32) + m.leased() < CAPACITY;
                assert_eq!(got.is_some(), fits, "adopt of {k:?}");
                if let Some(slot) = got {
                    assert_eq!(ix.get(&k), Some((slot, PageState::Ready)));
                    // A parent counts only while indexed (checked for every page below).
                    assert_eq!(ix.parent(&k), parent.filter(|p| m.entries.contains_key(p)));
                    m.next_instance += 1;
                    let parent_instance =
                        parent.and_then(|p| m.entries.get(&p)).map(|e| e.instance);
                    m.entries.insert(
                        k,
                        Entry {
                            state: PageState::Ready,
                            owner: 0,
                            pins: 0,
                            instance: m.next_instance,
                            parent_instance,
                            l3: L3Mark::None,
                            dirty: true,
                        },
                    );
                }
            }
            Op::L3Down(down) => {
                if mode != L3Mode::Absent {
                    mode = if *down { L3Mode::Down } else { L3Mode::Up };
                    ix.set_l3_mode(mode);
                }
            }
            Op::Lease { owner, n } => {
                let before = ix.stats();
                let (slots, evicted) = ix.lease(*owner, *n);
                assert!(slots.len() <= *n);
                unwritten += check_evicted(&mut m, &evicted, mode);
                let held: Vec<u32> = m
                    .entries
                    .keys()
                    .filter_map(|k| ix.get(k))
                    .map(|g| g.0)
                    .collect();
                for s in &slots {
                    assert!(!held.contains(s), "leased slot {s} holds a page");
                    assert!(
                        !m.leases.values().flatten().any(|l| l == s),
                        "slot {s} leased twice"
                    );
                }
                if mode == L3Mode::Up {
                    let s = ix.stats();
                    assert!(
                        s.dirty + s.leased <= dirty_limit.max(before.dirty + before.leased),
                        "a lease went past the dirty limit"
                    );
                }
                m.leases.entry(*owner).or_default().extend(slots);
            }
            Op::Land {
                owner,
                chain: c,
                from,
                len,
            } => {
                let keys: Vec<PageKey> = (*from..from + len).map(|i| key(*c, i)).collect();
                let parent = from.checked_sub(1).map(|p| key(*c, p));
                let mine = m.leases.entry(*owner).or_default();
                if mine.len() < keys.len() {
                    // Slots it does not hold are refused, and nothing changes.
                    let other = (0..CAPACITY).find(|s| !mine.contains(s));
                    let mut bad = mine.clone();
                    bad.extend(other);
                    bad.truncate(keys.len());
                    if bad.len() == keys.len() {
                        assert!(ix.commit_leased(*owner, parent, &keys, &bad).is_err());
                    }
                    continue;
                }
                let slots = mine.split_off(mine.len() - keys.len());
                let (landed, evicted) = ix.commit_leased(*owner, parent, &keys, &slots).unwrap();
                // As for a reservation: a page evicted (for a tenant's quota) may land afresh
                // later in the call, and one reported present may leave after.
                let (before, after): (Vec<PageKey>, Vec<PageKey>) = evicted.iter().partition(|k| {
                    keys.iter()
                        .zip(&landed)
                        .any(|(key, l)| key == *k && *l == Landed::Stored)
                });
                unwritten += check_evicted_in(&mut m, &before, &evicted, mode);
                let mut parent_instance =
                    parent.and_then(|p| m.entries.get(&p)).map(|e| e.instance);
                let mut no_room = false;
                for ((k, s), l) in keys.iter().zip(&slots).zip(&landed) {
                    match l {
                        Landed::Present => {
                            assert!(!no_room);
                            assert!(m.entries.contains_key(k), "Present for an absent key");
                            m.leases.get_mut(owner).unwrap().push(*s);
                        }
                        Landed::Stored => {
                            assert!(!no_room, "landed after NoRoom");
                            assert!(!m.entries.contains_key(k), "landed a present key");
                            assert_eq!(ix.get(k), Some((*s, PageState::Ready)));
                            m.next_instance += 1;
                            m.entries.insert(
                                *k,
                                Entry {
                                    state: PageState::Ready,
                                    owner: *owner,
                                    pins: 0,
                                    instance: m.next_instance,
                                    parent_instance,
                                    l3: L3Mark::None,
                                    dirty: true,
                                },
                            );
                        }
                        Landed::NoRoom => {
                            assert!(*c == 0 && quota.is_some(), "no room without a quota");
                            no_room = true;
                            m.leases.get_mut(owner).unwrap().push(*s);
                        }
                    }
                    parent_instance = m.entries.get(k).map(|e| e.instance);
                }
                unwritten += check_evicted_in(&mut m, &after, &evicted, mode);
            }
            Op::EndOwner(owner) => {
                let freed = ix.end_leases(*owner);
                assert_eq!(freed, m.leases.remove(owner).map_or(0, |l| l.len()));
                let n = ix.abort_owner(*owner);
                let before = m.entries.len();
                m.entries
                    .retain(|_, e| !(e.state == PageState::Writing && e.owner == *owner));
                assert_eq!(n, before - m.entries.len());
            }
        }
        ix.validate().unwrap();
        for (k, e) in &m.entries {
            // The parent link names the incarnation the page was created under, while it lasts.
            let parent = e
                .parent_instance
                .and_then(|i| m.entries.iter().find(|(_, p)| p.instance == i))
                .map(|(pk, _)| *pk);
            assert_eq!(ix.parent(k), parent, "parent of {k:?}");
            assert_eq!(
                ix.l3_info(k).map(|(_, l3)| l3),
                Some(e.l3),
                "L3 mark of {k:?}"
            );
        }
        let s = ix.stats();
        let count = |f: &dyn Fn(&Entry) -> bool| m.entries.values().filter(|e| f(e)).count() as u32;
        assert_eq!(s.ready, count(&|e| e.state == PageState::Ready));
        assert_eq!(s.writing, count(&|e| e.state == PageState::Writing));
        // An L3 write holds one pin of its own while the page is queued.
        let total = |e: &Entry| u64::from(e.pins) + u64::from(e.l3 == L3Mark::Queued);
        assert_eq!(s.pinned, count(&|e| total(e) > 0));
        assert_eq!(s.pins, m.entries.values().map(total).sum::<u64>());
        assert_eq!(s.leased, m.leased());
        assert_eq!(
            ix.free_slots(),
            CAPACITY - m.entries.len() as u32 - m.leased()
        );
        assert_eq!(
            s.unwritten_evictions, unwritten,
            "pages evicted without L3 holding them"
        );
        assert_eq!(s.dirty, count(&|e| e.dirty), "dirty pages");
        let of = |c: u8| m.entries.keys().filter(|k| k.0[0] == c).count() as u32;
        assert_eq!(ix.tenant_usage(tenant(0)).unwrap().pages, of(0));
        assert_eq!(ix.tenant_usage(tenant(1)).unwrap().pages, of(1));
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn index_agrees_with_model(
        kind in prop::sample::select(PolicyKind::ALL.to_vec()),
        l3 in any::<bool>(),
        dirty_limit in 1..=CAPACITY,
        quota in prop::option::of(1u32..4),
        ops in prop::collection::vec(op(), 1..60),
    ) {
        run(kind, l3, dirty_limit, quota, &ops);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// Chain 0's tenant always held to a small quota, so sequences reach it often.
    #[test]
    fn a_quota_takes_only_its_tenants_pages(
        kind in prop::sample::select(PolicyKind::ALL.to_vec()),
        l3 in any::<bool>(),
        quota in 1u32..3,
        ops in prop::collection::vec(op(), 1..80),
    ) {
        run(kind, l3, CAPACITY, Some(quota), &ops);
    }
}
