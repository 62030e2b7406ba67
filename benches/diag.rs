//! The benches' diagnostic mode (`--diag`): where a row's time goes.
//!
//! A [`Ladder`] measures the same work several ways, each rung adding one cost to the one
//! before (the copy alone, then its checksum, then a fresh buffer, then the hop to another
//! thread, then kvtier's own call), interleaved round by round like [`crate::compare`], and
//! prints each rung's time per item and what it added. The rung that adds most is where to
//! look first; `perf record -g` on the same scenario then says why.

use std::time::Instant;

/// Whether the run asked for diagnostics (`--diag` among the arguments).
pub fn wanted() -> bool {
    std::env::args().any(|a| a == "--diag")
}

/// One rung: its name, the work, and whether it adds to the rung before (or stands aside).
struct Rung<'a> {
    name: String,
    run: Box<dyn FnMut() + 'a>,
    step: bool,
}

/// Rungs of one piece of work, each measured as a whole over `items` items.
pub struct Ladder<'a> {
    what: String,
    items: usize,
    rungs: Vec<Rung<'a>>,
}

impl<'a> Ladder<'a> {
    /// A ladder for `what`, each rung doing `items` items (pages, calls) per run.
    pub fn new(what: &str, items: usize) -> Self {
        Self {
            what: what.to_string(),
            items: items.max(1),
            rungs: Vec::new(),
        }
    }

    /// Adds a rung: `run` does the whole work once, with one cost more than the rung before.
    pub fn rung(mut self, name: &str, run: impl FnMut() + 'a) -> Self {
        self.rungs.push(Rung {
            name: name.to_string(),
            run: Box::new(run),
            step: true,
        });
        self
    }

    /// Adds a measurement beside the ladder (one cost alone, another way to the same end):
    /// printed with its time, not as a step from the rung before.
    pub fn aside(mut self, name: &str, run: impl FnMut() + 'a) -> Self {
        self.rungs.push(Rung {
            name: name.to_string(),
            run: Box::new(run),
            step: false,
        });
        self
    }

    /// Runs every rung `rounds` times, interleaved, and prints each one's median time per
    /// item and what it added to the rung before. Returns the medians (seconds per item).
    pub fn run(mut self, rounds: usize) -> Vec<f64> {
        let mut times: Vec<Vec<f64>> = vec![Vec::new(); self.rungs.len()];
        for _ in 0..rounds.max(1) {
            for (i, r) in self.rungs.iter_mut().enumerate() {
                let t = Instant::now();
                (r.run)();
                times[i].push(t.elapsed().as_secs_f64() / self.items as f64);
            }
        }
        let medians: Vec<f64> = times.into_iter().map(crate::median).collect();
        crate::say!(
            "diag   {} ({} per run, medians of {rounds}):",
            self.what,
            self.items
        );
        let mut before: Option<f64> = None;
        for (r, &m) in self.rungs.iter().zip(&medians) {
            let added = match (r.step, before) {
                (true, Some(b)) => format!("{:>+9.1} µs", (m - b) * 1e6),
                (true, None) => String::new(),
                (false, _) => "    (aside)".to_string(),
            };
            crate::say!("diag     {:<58} {:>9.1} µs {added}", r.name, m * 1e6);
            if r.step {
                before = Some(m);
            }
        }
        medians
    }
}
