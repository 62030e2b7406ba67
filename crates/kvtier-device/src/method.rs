//! Copy methods and their start-up self-check.
//!
//! A [`Mover`] executes a batch of [`Run`]s in one direction and returns when every byte has
//! landed. The cuda device offers three (`cuMemcpyBatchAsync`, a gather/scatter kernel, one
//! `cuMemcpyAsync` per run); [`select`] copies test pages both ways with each, through a
//! [`Scratch`] pair of buffers it can also read and write by a trusted path, compares every
//! byte, times a batch of 32 KiB runs, and lets [`CopyMethod::choose`] pick. A method that is
//! missing or wrong is disabled with its reason. Nothing here touches a device: tests drive it
//! with movers that lie.

use std::time::Instant;

use kvtier_core::CopyMethod;
use kvtier_core::copy_method::{Check, Choice, Method};

use crate::DeviceError;
use crate::plan::Run;

/// Which way a batch goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// Device → host (backups, saves).
    ToHost,
    /// Host → device (loads).
    FromHost,
}

/// Executes batches of runs.
pub trait Mover: Send + Sync + std::fmt::Debug {
    /// Which method this is.
    fn method(&self) -> Method;

    /// Copies every run of `runs` (none overlapping another on either side) and returns when
    /// all have landed.
    fn copy(&self, runs: &[Run], dir: Direction) -> Result<(), DeviceError>;
}

/// A device buffer and a host buffer of the same length for the self-check, each readable
/// and writable by a path that does not depend on the method under test.
pub trait Scratch {
    /// Bytes of each buffer.
    fn bytes(&self) -> usize;
    /// Address of the device buffer.
    fn device_base(&self) -> u64;
    /// Address of the host buffer (registered the way the host pool is).
    fn host_base(&self) -> u64;
    /// Writes the whole device buffer.
    fn write_device(&self, bytes: &[u8]) -> Result<(), DeviceError>;
    /// Reads the whole device buffer.
    fn read_device(&self, out: &mut [u8]) -> Result<(), DeviceError>;
    /// Writes the whole host buffer.
    fn write_host(&self, bytes: &[u8]);
    /// Reads the whole host buffer.
    fn read_host(&self, out: &mut [u8]);
}

/// Bytes a [`Scratch`] needs for [`self_check`].
pub const SCRATCH_BYTES: usize = 4 << 20;

/// Lengths of the checked runs: tiny, odd, unaligned and large, so every path of every method
/// (vector and byte loops, small and large descriptors) is covered.
const CHECK_LENS: [u64; 10] = [
    16,
    1,
    4100,
    32 << 10,
    7,
    256 << 10,
    48,
    64 << 10,
    3,
    16 << 10,
];
/// The timed batch: 2 MiB in runs of 32 KiB, the shape of a layer-first 2 MiB page.
const TIMED_RUN: u64 = 32 << 10;
const TIMED_BYTES: u64 = 2 << 20;
const TIMED_ROUNDS: usize = 3;

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[3] ^ seed)
        .collect()
}

/// Scattered runs: placed in order on the device side (odd gaps, odd starts) and in reverse
/// on the host side, so no run lands where it started.
fn check_runs(s: &dyn Scratch) -> Vec<Run> {
    let (mut d, mut h) = (3u64, s.bytes() as u64 / 2);
    let mut runs = Vec::with_capacity(CHECK_LENS.len());
    for (i, &len) in CHECK_LENS.iter().enumerate() {
        h -= len + 16 + (i as u64 % 3);
        runs.push(Run {
            device: s.device_base() + d,
            host: s.host_base() + h,
            len,
        });
        d += len + 32 + (i as u64 % 5);
    }
    runs
}

fn first_difference(got: &[u8], want: &[u8]) -> Option<usize> {
    got.iter().zip(want).position(|(a, b)| a != b)
}

/// Copies test runs both ways with `mover` and compares every byte of both buffers against
/// what the runs should have done, then times a batch. Every failure is a `Disabled` reason.
pub fn self_check(mover: &dyn Mover, s: &dyn Scratch) -> Check {
    match check(mover, s) {
        Ok(bytes_per_sec) => Check::Passed { bytes_per_sec },
        Err(reason) => Check::Disabled { reason },
    }
}

fn check(mover: &dyn Mover, s: &dyn Scratch) -> Result<f64, String> {
    let len = s.bytes();
    if len < SCRATCH_BYTES {
        return Err(format!("scratch of {len} bytes, {SCRATCH_BYTES} needed"));
    }
    let runs = check_runs(s);
    let (db, hb) = (s.device_base(), s.host_base());
    let fail = |what: &str, e: DeviceError| format!("{what}: {e}");
    mover
        .copy(&[], Direction::ToHost)
        .map_err(|e| fail("an empty batch", e))?;
    for dir in [Direction::FromHost, Direction::ToHost] {
        let (dev, host) = (pattern(len, 0x11), pattern(len, 0xa7));
        s.write_device(&dev)
            .map_err(|e| fail("writing the device scratch", e))?;
        s.write_host(&host);
        mover
            .copy(&runs, dir)
            .map_err(|e| fail(&format!("{dir:?}"), e))?;
        // What the destination should hold: its own pattern with the runs' source bytes.
        let (src, mut want) = match dir {
            Direction::FromHost => (host, dev),
            Direction::ToHost => (dev, host),
        };
        for r in &runs {
            let (from, to) = match dir {
                Direction::FromHost => (r.host - hb, r.device - db),
                Direction::ToHost => (r.device - db, r.host - hb),
            };
            want[to as usize..(to + r.len) as usize]
                .copy_from_slice(&src[from as usize..(from + r.len) as usize]);
        }
        let mut got = vec![0; len];
        match dir {
            Direction::FromHost => s
                .read_device(&mut got)
                .map_err(|e| fail("reading the device scratch", e))?,
            Direction::ToHost => s.read_host(&mut got),
        }
        if let Some(i) = first_difference(&got, &want) {
            return Err(format!(
                "{dir:?}: byte {i} is {:#04x}, expected {:#04x}",
                got[i], want[i]
            ));
        }
    }
    // The timed batch: 2 MiB of 32 KiB runs each way, device runs in order, host runs spread.
    let n = TIMED_BYTES / TIMED_RUN;
    let timed: Vec<Run> = (0..n)
        .map(|i| Run {
            device: db + i * TIMED_RUN,
            host: hb + TIMED_BYTES + ((i * 7) % n) * TIMED_RUN,
            len: TIMED_RUN,
        })
        .collect();
    let start = Instant::now();
    for _ in 0..TIMED_ROUNDS {
        for dir in [Direction::ToHost, Direction::FromHost] {
            mover
                .copy(&timed, dir)
                .map_err(|e| fail("the timed batch", e))?;
        }
    }
    let secs = start.elapsed().as_secs_f64().max(1e-9);
    Ok((2 * TIMED_ROUNDS) as f64 * TIMED_BYTES as f64 / secs)
}

/// A method offered to [`select`]: its mover, or why it could not even be set up.
pub type Offered = (Method, Result<Box<dyn Mover>, String>);

/// The outcome of [`select`]: the mover copies use, what every method's check found, and the
/// decision (with the reason when the configured method was not usable).
#[derive(Debug)]
pub struct Selected {
    /// The mover to use.
    pub mover: Box<dyn Mover>,
    /// Each offered method and its check, in [`Method::ALL`] order.
    pub checks: Vec<(Method, Check)>,
    /// What [`CopyMethod::choose`] decided.
    pub choice: Choice,
}

/// Self-checks every offered method (a method that could not even be set up is offered as
/// `Err(reason)`) and picks one for `want`. Errors only when none passed.
pub fn select(
    want: CopyMethod,
    offered: Vec<Offered>,
    scratch: &dyn Scratch,
) -> Result<Selected, DeviceError> {
    let mut checks = Vec::with_capacity(offered.len());
    let mut movers = Vec::with_capacity(offered.len());
    for (method, m) in offered {
        let c = match m {
            Ok(m) => {
                let c = self_check(m.as_ref(), scratch);
                movers.push(m);
                c
            }
            Err(reason) => Check::Disabled { reason },
        };
        checks.push((method, c));
    }
    let Some(choice) = want.choose(&checks) else {
        let why: Vec<String> = checks
            .iter()
            .map(|(m, c)| match c {
                Check::Disabled { reason } => format!("{}: {reason}", m.name()),
                Check::Passed { .. } => format!("{}: passed", m.name()),
            })
            .collect();
        return Err(DeviceError::Unavailable(format!(
            "no copy method passed its self-check ({})",
            why.join("; ")
        )));
    };
    let pos = movers
        .iter()
        .position(|m| m.method() == choice.method)
        .ok_or_else(|| DeviceError::Unavailable("the chosen copy method vanished".into()))?;
    Ok(Selected {
        mover: movers.swap_remove(pos),
        checks,
        choice,
    })
}
