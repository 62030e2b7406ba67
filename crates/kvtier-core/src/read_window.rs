//! How many reads to keep in flight against a storage tier.
//!
//! A backend is either throughput-bound (a local disk or the page cache: more reads in flight
//! only queue, and each takes longer) or latency-bound (S3, a remote node, a slow or throttled
//! store: each read waits the same time however many run, so the rate grows with the number in
//! flight). A fixed concurrency is wrong for one of the two. [`ReadWindow`] finds the number
//! the way delay-based congestion control does (TCP Vegas): it keeps the least latency seen as
//! the backend's base and, once per round (as many completions as the window), compares the
//! round's mean latency with it. Reads that take about the base latency mean the backend has
//! room, so the window doubles; reads that take several times the base mean the extra reads
//! only queue, so it shrinks. It never leaves `[min, max]`, so a backend is never read with
//! less concurrency than configured.
//!
//! At `min` the base forgets slowly (it creeps up a little each round), so a backend that
//! became slower for good, and now waits the same long time however many reads run, is not
//! held to its old best forever; above `min` it does not, or a window holding steady would
//! ratchet itself up into queueing.

use std::time::Duration;

/// A round whose mean latency is at most this times the base grows the window.
const GROW_BELOW: f64 = 1.5;
/// A round whose mean latency is over this times the base shrinks the window.
const SHRINK_ABOVE: f64 = 3.0;
/// How much the base latency creeps up per round at `min`, so it follows a backend that slowed
/// down.
const BASE_DRIFT: f64 = 1.05;

/// The number of reads to keep in flight against one tier, learnt from their latencies.
#[derive(Debug, Clone)]
pub struct ReadWindow {
    min: usize,
    max: usize,
    current: usize,
    base: Option<f64>,
    round_count: usize,
    round_sum: f64,
}

impl ReadWindow {
    /// A window that starts at `min` and stays within `[min, max]` (`max` below `min` counts as
    /// `min`; 0 counts as 1).
    pub fn new(min: usize, max: usize) -> Self {
        let min = min.max(1);
        Self {
            min,
            max: max.max(min),
            current: min,
            base: None,
            round_count: 0,
            round_sum: 0.0,
        }
    }

    /// Reads to keep in flight now.
    pub fn limit(&self) -> usize {
        self.current
    }

    /// The least latency seen (slowly forgotten), if any read finished.
    pub fn base_latency(&self) -> Option<Duration> {
        self.base.map(Duration::from_secs_f64)
    }

    /// Folds in one finished read that took `latency`. Returns the new limit.
    pub fn observe(&mut self, latency: Duration) -> usize {
        let l = latency.as_secs_f64().max(1e-7);
        self.base = Some(self.base.map_or(l, |b| b.min(l)));
        self.round_count += 1;
        self.round_sum += l;
        if self.round_count >= self.current {
            let mean = self.round_sum / self.round_count as f64;
            let base = self.base.unwrap_or(mean);
            if mean <= base * GROW_BELOW {
                self.current = (self.current * 2).min(self.max);
            } else if mean > base * SHRINK_ABOVE {
                self.current = (self.current * 3 / 4).max(self.min);
            }
            if self.current == self.min {
                self.base = Some(base * BASE_DRIFT);
            }
            self.round_count = 0;
            self.round_sum = 0.0;
        }
        self.current
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `reads` completions against a backend whose latency for `n` reads in flight is
    /// `latency(n)` seconds.
    fn drive(w: &mut ReadWindow, reads: usize, latency: impl Fn(usize) -> f64) {
        for _ in 0..reads {
            let n = w.limit();
            w.observe(Duration::from_secs_f64(latency(n)));
        }
    }

    #[test]
    fn a_latency_bound_backend_opens_the_window_to_its_max() {
        // 200 ms per read, however many run: S3 or a slow remote.
        let mut w = ReadWindow::new(16, 256);
        drive(&mut w, 2_000, |_| 0.2);
        assert_eq!(w.limit(), 256);
    }

    #[test]
    fn a_throughput_bound_backend_keeps_the_window_small() {
        // Two cores, 0.5 ms of work per read: n in flight take n/2 × 0.5 ms each.
        let mut w = ReadWindow::new(4, 256);
        drive(&mut w, 5_000, |n| 0.0005 * (n as f64 / 2.0).max(1.0));
        assert!(
            w.limit() <= 8,
            "window grew to {} on a saturated backend",
            w.limit()
        );
    }

    #[test]
    fn it_shrinks_when_a_backend_saturates_and_never_below_min() {
        let mut w = ReadWindow::new(8, 128);
        drive(&mut w, 2_000, |_| 0.05);
        assert_eq!(w.limit(), 128);
        // The backend now serves 8 at a time: more in flight only queue.
        drive(&mut w, 20_000, |n| 0.05 * (n as f64 / 8.0).max(1.0));
        assert!(w.limit() < 128, "window stayed at {}", w.limit());
        assert!(w.limit() >= 8);
    }

    #[test]
    fn a_backend_that_turns_latency_bound_for_good_opens_the_window_again() {
        // A local store first (0.5 ms, saturated past 4 in flight), then 200 ms per read
        // whatever the concurrency (say, throttled S3).
        let mut w = ReadWindow::new(4, 256);
        drive(&mut w, 2_000, |n| 0.0005 * (n as f64 / 4.0).max(1.0));
        assert!(w.limit() <= 8);
        drive(&mut w, 3_000, |_| 0.2);
        assert_eq!(w.limit(), 256);
    }

    #[test]
    fn bounds_are_sane() {
        let w = ReadWindow::new(0, 0);
        assert_eq!(w.limit(), 1);
        let w = ReadWindow::new(32, 4);
        assert_eq!(w.limit(), 32);
        let mut w = ReadWindow::new(32, 4);
        drive(&mut w, 1_000, |_| 0.1);
        assert_eq!(w.limit(), 32);
    }
}
