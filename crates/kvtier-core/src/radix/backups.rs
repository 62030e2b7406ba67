//! Which pages the host tier below holds: the backed-up marks a tree node carries, set as
//! backups land (a page is only useful there with its whole prefix), read to plan the next
//! backup, and forgotten when the host tier may have lost pages.

use std::hash::Hash;

use super::{NodeId, ROOT, RadixTree};
use crate::Error;

impl<K: Clone + Eq + Hash, V: Copy> RadixTree<K, V> {
    /// Records that the host tier holds the pages of `id` and of all its ancestors (a page is
    /// only useful in the host tier when its whole prefix is there too).
    pub fn mark_backed_up(&mut self, id: NodeId) -> Result<(), Error> {
        let mut idx = self.resolve(id)?;
        while idx != ROOT && !self.node(idx).backed_up {
            let n = self.node_mut(idx);
            n.backed_up = true;
            idx = n.parent;
        }
        Ok(())
    }

    /// Records that the host tier holds the pages from the root down to and including the
    /// page labelled `last`, which must lie on the path from the root to `id`: the node holding
    /// it is split after it when it is not that node's last page. How a backup that stored
    /// only part of its path keeps its progress, robust to the nodes of the path having been
    /// split meanwhile (a label appears once on a root path, so it names the place exactly).
    /// Returns whether `last` was found.
    pub fn mark_backed_up_through(&mut self, id: NodeId, last: &K) -> Result<bool, Error> {
        let mut idx = self.resolve(id)?;
        while idx != ROOT {
            if let Some(i) = self.node(idx).keys.iter().position(|k| k == last) {
                let len = self.node(idx).keys.len();
                let holder = if i + 1 < len {
                    self.split(idx, i + 1)
                } else {
                    idx
                };
                let holder = self.id(holder);
                self.mark_backed_up(holder)?;
                return Ok(true);
            }
            idx = self.node(idx).parent;
        }
        Ok(false)
    }

    /// The nodes from the highest ancestor of `id` that is not backed up down to `id`: what a
    /// backup of `id` must copy, in order.
    pub fn unbacked_path(&self, id: NodeId) -> Result<Vec<NodeId>, Error> {
        let mut idx = self.resolve(id)?;
        let mut out = Vec::new();
        while idx != ROOT && !self.node(idx).backed_up {
            out.push(self.id(idx));
            idx = self.node(idx).parent;
        }
        out.reverse();
        Ok(out)
    }

    /// The label of the page just before node `id`'s first page (the last page of its
    /// parent), or `None` when `id` starts at the root.
    pub fn parent_key(&self, id: NodeId) -> Result<Option<K>, Error> {
        let idx = self.resolve(id)?;
        let parent = self.node(idx).parent;
        if parent == ROOT || idx == ROOT {
            return Ok(None);
        }
        Ok(self.node(parent).keys.last().cloned())
    }

    /// Forgets what the host tier was believed to hold: drops every host-only node and
    /// clears every backed-up mark, so each page is backed up (or found there already) again
    /// before its eviction. For when the host tier may have lost pages, such as a restarted
    /// kvtierd. Returns the host-only pages dropped and the device pages whose mark was
    /// cleared.
    pub fn forget_backups(&mut self) -> (usize, usize) {
        let dropped = self
            .evict_host(usize::MAX)
            .iter()
            .map(|e| e.keys.len())
            .sum();
        let mut cleared = 0;
        for (i, slot) in self.slots.iter_mut().enumerate() {
            if i as u32 != ROOT
                && let Some(n) = &mut slot.node
                && n.backed_up
            {
                n.backed_up = false;
                cleared += n.keys.len();
            }
        }
        (dropped, cleared)
    }
}
