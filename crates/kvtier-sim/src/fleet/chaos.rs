//! What goes wrong in a fleet replay, and when: [`FleetChaos`].

use anyhow::{Result, bail};

/// One thing that goes wrong in a fleet, before request `at` (its index in the replay) is
/// routed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FleetChaos {
    /// Node `node`'s kvtierd is SIGKILLed and started again at once: the new one takes over
    /// the pool the dead one left (`l2.take_over_after_crash`, on by default) or starts
    /// empty, L3 keeps what reached it, its agents register again, and requests routed there
    /// meanwhile miss. The router's stream ends and starts over with a snapshot.
    KillNode {
        /// See [`FleetChaos`].
        at: usize,
        /// The node.
        node: usize,
    },
    /// Node `node`'s kvtierd stops answering for `ms` milliseconds (SIGSTOP, then SIGCONT),
    /// as in a long pause or a stalled disk: its stream goes quiet rather than ending, and
    /// the router's health check routes around it.
    HangNode {
        /// See [`FleetChaos`].
        at: usize,
        /// The node.
        node: usize,
        /// How long.
        ms: u64,
    },
    /// Node `node` leaves: the router sends it nothing more, and once it has served what it
    /// was sent its kvtierd stops (SIGTERM: its pool goes with it).
    RemoveNode {
        /// See [`FleetChaos`].
        at: usize,
        /// The node.
        node: usize,
    },
    /// Node `node`, removed before, comes back with a new kvtierd (an empty L2); the router
    /// sends it requests once its workers reach it.
    AddNode {
        /// See [`FleetChaos`].
        at: usize,
        /// The node.
        node: usize,
    },
}

impl FleetChaos {
    /// The request it comes before.
    pub fn at(&self) -> usize {
        match *self {
            FleetChaos::KillNode { at, .. }
            | FleetChaos::HangNode { at, .. }
            | FleetChaos::RemoveNode { at, .. }
            | FleetChaos::AddNode { at, .. } => at,
        }
    }

    /// The node it strikes.
    pub fn node(&self) -> usize {
        match *self {
            FleetChaos::KillNode { node, .. }
            | FleetChaos::HangNode { node, .. }
            | FleetChaos::RemoveNode { node, .. }
            | FleetChaos::AddNode { node, .. } => node,
        }
    }

    /// [`FleetChaos::KillNode`].
    pub fn kill(at: usize, node: usize) -> Self {
        FleetChaos::KillNode { at, node }
    }

    /// [`FleetChaos::RemoveNode`].
    pub fn remove(at: usize, node: usize) -> Self {
        FleetChaos::RemoveNode { at, node }
    }

    /// [`FleetChaos::AddNode`].
    pub fn add(at: usize, node: usize) -> Self {
        FleetChaos::AddNode { at, node }
    }

    /// Parses `AT:NODE:MS` (`--hang-node-at 40:1:3000`) into a [`FleetChaos::HangNode`].
    pub fn parse_hang(s: &str) -> Result<FleetChaos> {
        let mut parts = s.split(':').map(|p| p.trim().parse::<u64>().ok());
        match (parts.next(), parts.next(), parts.next(), parts.next()) {
            (Some(Some(at)), Some(Some(node)), Some(Some(ms)), None) if ms > 0 => {
                Ok(FleetChaos::HangNode {
                    at: usize::try_from(at)?,
                    node: usize::try_from(node)?,
                    ms,
                })
            }
            _ => bail!(
                "{s:?}: expected REQUEST:NODE:MILLISECONDS, whole numbers (a hang of at least \
                 1 ms), e.g. 40:1:3000"
            ),
        }
    }

    /// Parses `AT:NODE` (a command line's `--kill-node-at 40:1`) into `make(at, node)`.
    pub fn parse(s: &str, make: fn(usize, usize) -> FleetChaos) -> Result<FleetChaos> {
        let parsed = s
            .split_once(':')
            .and_then(|(a, n)| Some((a.trim().parse().ok()?, n.trim().parse().ok()?)));
        match parsed {
            Some((at, node)) => Ok(make(at, node)),
            None => bail!("{s:?}: expected REQUEST:NODE, two whole numbers, e.g. 40:1"),
        }
    }

    /// Checks `chaos` (sorted here by request; at one request, in the order given: a
    /// command line's kills, removals, adds, then hangs) against a fleet of `nodes` replaying
    /// `requests`: every node exists, every event comes before a request of the replay, a
    /// node is removed only while in and added only while out, and one node always stays in.
    pub fn validate(chaos: &mut [FleetChaos], nodes: usize, requests: usize) -> Result<()> {
        chaos.sort_by_key(FleetChaos::at);
        let mut present = vec![true; nodes];
        for c in chaos.iter() {
            let n = c.node();
            if c.at() >= requests {
                bail!(
                    "{c:?}: the replay has requests 0 to {}, so it would never happen",
                    requests.saturating_sub(1)
                );
            }
            if n >= nodes {
                bail!("{c:?}: the fleet has nodes 0 to {}", nodes - 1);
            }
            match c {
                FleetChaos::KillNode { .. } | FleetChaos::HangNode { .. } if !present[n] => {
                    bail!("{c:?}: node {n} is out of the fleet then")
                }
                FleetChaos::RemoveNode { .. } => {
                    if !present[n] {
                        bail!("{c:?}: node {n} is already out");
                    }
                    present[n] = false;
                    if !present.contains(&true) {
                        bail!("{c:?}: that would leave no node to route to");
                    }
                }
                FleetChaos::AddNode { .. } => {
                    if present[n] {
                        bail!("{c:?}: node {n} is in the fleet then (remove it first)");
                    }
                    present[n] = true;
                }
                FleetChaos::KillNode { .. } | FleetChaos::HangNode { .. } => {}
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn chaos_parses_and_is_checked_against_the_fleet() {
        assert_eq!(
            FleetChaos::parse("40:1", FleetChaos::kill).unwrap(),
            FleetChaos::KillNode { at: 40, node: 1 }
        );
        assert_eq!(
            FleetChaos::parse_hang("40:1:3000").unwrap(),
            FleetChaos::HangNode {
                at: 40,
                node: 1,
                ms: 3000
            }
        );
        for bad in ["40:1", "40:1:0", "40:1:x", "40:1:2:3"] {
            let e = FleetChaos::parse_hang(bad).unwrap_err();
            assert!(
                e.to_string().contains("REQUEST:NODE:MILLISECONDS"),
                "{bad}: {e}"
            );
        }
        for bad in ["40", "x:1", "40:", "-1:0"] {
            let e = FleetChaos::parse(bad, FleetChaos::kill).unwrap_err();
            assert!(e.to_string().contains("REQUEST:NODE"), "{bad}: {e}");
        }
        let check = |mut c: Vec<FleetChaos>, nodes| FleetChaos::validate(&mut c, nodes, 100);
        // Sorted by request before it is checked: the add comes after the remove.
        check(vec![FleetChaos::add(30, 1), FleetChaos::remove(10, 1)], 2).unwrap();
        for (c, nodes, says) in [
            (vec![FleetChaos::kill(1, 2)], 2, "nodes 0 to 1"),
            (vec![FleetChaos::kill(100, 0)], 2, "would never happen"),
            (vec![FleetChaos::add(1, 0)], 2, "is in the fleet"),
            (
                vec![FleetChaos::remove(1, 0), FleetChaos::remove(2, 0)],
                2,
                "already out",
            ),
            (
                vec![FleetChaos::remove(1, 0), FleetChaos::remove(2, 1)],
                2,
                "no node to route to",
            ),
            (
                vec![FleetChaos::remove(1, 0), FleetChaos::kill(2, 0)],
                2,
                "out of the fleet",
            ),
        ] {
            let e = check(c, nodes).unwrap_err().to_string();
            assert!(e.contains(says), "{e}");
        }
    }
}
