//! The tree's invariants (see the module docs of `radix`), checked in full against a walk:
//! the unit tests and the model-based property test call it after every step.

use std::hash::Hash;

use super::{ROOT, RadixTree};

impl<K: Clone + Eq + Hash, V: Copy> RadixTree<K, V> {
    /// Checks every invariant and count against a full walk. For tests and debugging: `O(n)`.
    pub fn validate(&self) -> Result<(), String> {
        let (mut device, mut protected, mut host_only, mut nodes) = (0, 0, 0, 1);
        let mut stack = vec![ROOT];
        while let Some(idx) = stack.pop() {
            let n = self.node(idx);
            let mut device_children = 0;
            for (k, &c) in &n.children {
                let child = self.node(c);
                nodes += 1;
                if child.parent != idx {
                    return Err(format!("node {c} has parent {} not {idx}", child.parent));
                }
                if child.keys.first() != Some(k) || child.keys.is_empty() {
                    return Err(format!("node {c} is filed under the wrong first key"));
                }
                if child.lock > n.lock && idx != ROOT {
                    return Err(format!("node {c} is locked more than its parent"));
                }
                if child.values.is_some() {
                    device_children += 1;
                    if n.values.is_none() {
                        return Err(format!("device node {c} under host-only node {idx}"));
                    }
                }
                if child.backed_up && !n.backed_up {
                    return Err(format!("backed-up node {c} under unbacked node {idx}"));
                }
                stack.push(c);
            }
            if device_children != n.device_children {
                return Err(format!("node {idx}: device_children count is wrong"));
            }
            if idx == ROOT {
                continue;
            }
            match &n.values {
                Some(v) => {
                    if v.len() != n.keys.len() {
                        return Err(format!("node {idx}: values and keys differ in length"));
                    }
                    device += v.len();
                    if n.lock > 0 {
                        protected += v.len();
                    }
                }
                None => {
                    if !n.backed_up {
                        return Err(format!("node {idx} is neither on device nor backed up"));
                    }
                    host_only += n.keys.len();
                }
            }
            let rank = self.policy.rank(&n.meta);
            let want_d = n.lock == 0 && n.values.is_some() && n.device_children == 0;
            let want_h = n.lock == 0 && n.values.is_none() && n.children.is_empty();
            if want_d != self.device_set.contains(&(rank, idx)) || want_d != n.device_rank.is_some()
            {
                return Err(format!("node {idx}: device candidate set is stale"));
            }
            if want_h != self.host_set.contains(&(rank, idx)) || want_h != n.host_rank.is_some() {
                return Err(format!("node {idx}: host candidate set is stale"));
            }
        }
        let counts = (device, protected, host_only, nodes);
        let kept = (
            self.device_pages,
            self.protected_pages,
            self.host_only_pages,
            self.nodes,
        );
        if counts != kept {
            return Err(format!(
                "counts (device, protected, host-only, nodes) walked {counts:?} but kept {kept:?}"
            ));
        }
        let candidates = self.device_set.len() + self.host_set.len();
        let filed = self
            .slots
            .iter()
            .filter_map(|s| s.node.as_ref())
            .map(|n| usize::from(n.device_rank.is_some()) + usize::from(n.host_rank.is_some()))
            .sum::<usize>();
        if candidates != filed {
            return Err("candidate sets hold entries of removed nodes".into());
        }
        Ok(())
    }
}
