//! An ordered set of slots for eviction and flushing, sized for millions of pages.
//!
//! Pages touched by one index operation share a rank (the operation's tick): a reserve,
//! commit or acquire of a 1,000-page prefix gives all of them the same one. So the set keeps
//! one ordered-map entry per distinct order key, holding a doubly linked list of the slots
//! filed under it, with the links in a flat array indexed by slot (8 bytes a slot). A
//! million pages filed in 64-page groups cost the ordered map ~1 byte a page instead of the
//! ~49 a `BTreeSet<(key, slot)>` costs, and the first slot is found without a scan.
//!
//! Within a key, slots leave in the order they were filed.

use std::collections::BTreeMap;

const NIL: u32 = u32::MAX;

#[derive(Clone, Copy, Debug)]
struct Link {
    prev: u32,
    next: u32,
}

#[derive(Clone, Copy, Debug)]
struct Group {
    head: u32,
    tail: u32,
}

/// Slots ordered by a key `K`, then by when they were filed. The caller remembers each
/// slot's key (it passes it back to [`Order::remove`]); the set never holds a slot twice.
#[derive(Debug)]
pub(super) struct Order<K> {
    groups: BTreeMap<K, Group>,
    /// Per slot; grown on first use, so a set that stays empty costs nothing.
    links: Vec<Link>,
    capacity: u32,
    len: usize,
}

impl<K: Ord + Copy> Order<K> {
    /// An empty set for slots `0..capacity`.
    pub(super) fn new(capacity: u32) -> Self {
        Self {
            groups: BTreeMap::new(),
            links: Vec::new(),
            capacity,
            len: 0,
        }
    }

    /// Slots filed.
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// Files `slot` under `key`, after the slots already there. The slot must not be filed.
    pub(super) fn insert(&mut self, key: K, slot: u32) {
        if self.links.is_empty() {
            self.links = vec![
                Link {
                    prev: NIL,
                    next: NIL
                };
                self.capacity as usize
            ];
        }
        let g = self.groups.entry(key).or_insert(Group {
            head: slot,
            tail: NIL,
        });
        let tail = g.tail;
        g.tail = slot;
        self.links[slot as usize] = Link {
            prev: tail,
            next: NIL,
        };
        if tail != NIL {
            self.links[tail as usize].next = slot;
        }
        self.len += 1;
    }

    /// Takes `slot`, filed under `key`, out of the set.
    pub(super) fn remove(&mut self, key: K, slot: u32) {
        let Link { prev, next } = self.links[slot as usize];
        if prev != NIL {
            self.links[prev as usize].next = next;
        }
        if next != NIL {
            self.links[next as usize].prev = prev;
        }
        match self.groups.get_mut(&key) {
            Some(g) if prev == NIL && next == NIL => {
                debug_assert_eq!(g.head, slot, "slot filed under another key");
                self.groups.remove(&key);
            }
            Some(g) => {
                if prev == NIL {
                    g.head = next;
                }
                if next == NIL {
                    g.tail = prev;
                }
            }
            None => unreachable!("slot {slot} removed under a key it was not filed under"),
        }
        self.len -= 1;
    }

    /// The first slot and its key.
    pub(super) fn first(&self) -> Option<(K, u32)> {
        self.groups.first_key_value().map(|(&k, g)| (k, g.head))
    }

    /// Every slot with its key, in order.
    pub(super) fn iter(&self) -> impl Iterator<Item = (K, u32)> + '_ {
        self.groups.iter().flat_map(move |(&k, g)| {
            std::iter::successors(Some(g.head), move |&s| {
                Some(self.links[s as usize].next).filter(|&n| n != NIL)
            })
            .map(move |s| (k, s))
        })
    }

    /// Whether `slot` is filed under `key`. Walks the key's group; for checks in tests.
    pub(super) fn contains(&self, key: K, slot: u32) -> bool {
        self.groups.get(&key).is_some_and(|g| {
            std::iter::successors(Some(g.head), |&s| {
                Some(self.links[s as usize].next).filter(|&n| n != NIL)
            })
            .any(|s| s == slot)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_leave_by_key_then_filing_order() {
        let mut o: Order<u64> = Order::new(8);
        for (k, s) in [(5, 0), (3, 1), (5, 2), (3, 3), (9, 4)] {
            o.insert(k, s);
        }
        let all: Vec<_> = o.iter().collect();
        assert_eq!(all, [(3, 1), (3, 3), (5, 0), (5, 2), (9, 4)]);
        assert_eq!(o.first(), Some((3, 1)));
        // Head, middle-of-list and tail removals keep the links whole.
        o.remove(3, 1);
        assert_eq!(o.first(), Some((3, 3)));
        o.insert(5, 6);
        o.remove(5, 2);
        assert_eq!(
            o.iter().collect::<Vec<_>>(),
            [(3, 3), (5, 0), (5, 6), (9, 4)]
        );
        o.remove(5, 6);
        o.remove(3, 3);
        assert!(o.contains(5, 0) && !o.contains(5, 6) && !o.contains(3, 3));
        assert_eq!(o.iter().collect::<Vec<_>>(), [(5, 0), (9, 4)]);
        assert_eq!(o.len(), 2);
        o.remove(5, 0);
        o.remove(9, 4);
        assert_eq!((o.len(), o.first()), (0, None));
        // A slot can be filed again, under a new key.
        o.insert(1, 0);
        assert_eq!(o.first(), Some((1, 0)));
    }

    #[test]
    fn an_empty_set_holds_no_per_slot_memory() {
        let o: Order<u64> = Order::new(1 << 20);
        assert!(o.links.capacity() == 0 && o.first().is_none());
    }
}
