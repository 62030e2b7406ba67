//! What L2 knows of L3, a component of [`HostState`](super::HostState): the write policy
//! while a tier is attached, whether the tier is failing, its generation (advanced when L3
//! is cleared, so writes and loads from before do not mark pages held), and what kvtierd
//! learned of L3 since the last publication of events. It calls nothing: `HostState` asks
//! it and applies its answers to the pools.

use kvtier_core::host_index::L3Mode;
use kvtier_core::{LayoutFingerprint, WritePolicy};

use crate::events::EventKind;

/// One L3 event of this kvtierd's: of a layout (`None`: every layout), its kind.
pub(crate) type L3Event = (Option<LayoutFingerprint>, EventKind);

/// What L2 knows of L3.
#[derive(Debug, Default)]
pub(crate) struct L3View {
    /// The L2 → L3 write policy while a tier is attached; the daemon's one copy of it.
    write: Option<WritePolicy>,
    /// Whether the attached tier is failing (its breaker open): eviction may then give up
    /// pages L3 does not hold.
    down: bool,
    /// L3's generation.
    epoch: u64,
    /// What this kvtierd learned of L3 since the last publication.
    learned: Vec<L3Event>,
}

impl L3View {
    /// The write policy, while a tier is attached.
    pub(crate) fn write(&self) -> Option<WritePolicy> {
        self.write
    }

    /// A tier attached, swapped (up, until it says otherwise) or detached (`None`).
    pub(crate) fn attach(&mut self, write: Option<WritePolicy>) {
        self.write = write;
        self.down = false;
    }

    /// Whether the tier is failing; true when that changed.
    pub(crate) fn set_down(&mut self, down: bool) -> bool {
        std::mem::replace(&mut self.down, down) != down
    }

    /// Whether it is failing.
    pub(crate) fn is_down(&self) -> bool {
        self.down
    }

    /// Whether pages can be written now: a tier is attached and not failing.
    pub(crate) fn writable(&self) -> bool {
        self.write.is_some() && !self.down
    }

    /// How the pools may evict: only what L3 holds while it is up, freely without a tier,
    /// and giving up unwritten pages (counted) while it is down.
    pub(crate) fn mode(&self) -> L3Mode {
        match (self.write, self.down) {
            (None, _) => L3Mode::Absent,
            // Every policy copies a page to L3 before its slot is reused.
            (Some(p), false) if p.copied_below_before_reuse() => L3Mode::Up,
            (Some(_), _) => L3Mode::Down,
        }
    }

    /// The current generation.
    pub(crate) fn epoch(&self) -> u64 {
        self.epoch
    }

    /// L3 was cleared: a new generation, and a CLEARED of every layout to publish.
    pub(crate) fn cleared(&mut self) {
        self.epoch += 1;
        self.learn(None, EventKind::Cleared { tenant: None });
    }

    /// Something learned of L3, to publish.
    pub(crate) fn learn(&mut self, layout: Option<LayoutFingerprint>, kind: EventKind) {
        self.learned.push((layout, kind));
    }

    /// What was learned since the last call.
    pub(crate) fn take_learned(&mut self) -> Vec<L3Event> {
        std::mem::take(&mut self.learned)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mode_follows_the_tier_and_a_clear_starts_a_generation() {
        let mut v = L3View::default();
        assert_eq!(v.mode(), L3Mode::Absent);
        assert!(!v.writable());
        v.attach(Some(WritePolicy::WriteBack));
        assert_eq!((v.mode(), v.writable()), (L3Mode::Up, true));
        assert!(v.set_down(true) && !v.set_down(true));
        assert_eq!((v.mode(), v.writable()), (L3Mode::Down, false));
        // A tier attached again is up until it says otherwise.
        v.attach(Some(WritePolicy::WriteThrough));
        assert!(!v.is_down());
        v.cleared();
        assert_eq!(v.epoch(), 1);
        let learned = v.take_learned();
        assert_eq!(learned, vec![(None, EventKind::Cleared { tenant: None })]);
        assert!(v.take_learned().is_empty());
    }
}
