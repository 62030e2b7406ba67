//! The copy-method self-check and selection, on CPU with a fake driver that can lie: wrong
//! bytes in either direction, errors, a missing symbol, a method that is slower. The same
//! `select` runs on a GPU at device open (`scripts/gpu-check` exercises the real methods).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use parking_lot::Mutex;
use std::time::Duration;

use kvtier_core::CopyMethod;
use kvtier_core::copy_method::{Check, Method};
use kvtier_device::DeviceError;
use kvtier_device::method::{Direction, Mover, SCRATCH_BYTES, Scratch, select, self_check};
use kvtier_device::plan::Run;

const DEV: u64 = 0x1000_0000;
const HOST: u64 = 0x9000_0000;

/// "Device" and host memory as two vectors at made-up addresses.
#[derive(Debug)]
struct Mem {
    dev: Mutex<Vec<u8>>,
    host: Mutex<Vec<u8>>,
}

impl Mem {
    fn new() -> Self {
        Self {
            dev: Mutex::new(vec![0; SCRATCH_BYTES]),
            host: Mutex::new(vec![0; SCRATCH_BYTES]),
        }
    }
}

impl Scratch for Mem {
    fn bytes(&self) -> usize {
        SCRATCH_BYTES
    }
    fn device_base(&self) -> u64 {
        DEV
    }
    fn host_base(&self) -> u64 {
        HOST
    }
    fn write_device(&self, bytes: &[u8]) -> Result<(), DeviceError> {
        self.dev.lock().copy_from_slice(bytes);
        Ok(())
    }
    fn read_device(&self, out: &mut [u8]) -> Result<(), DeviceError> {
        out.copy_from_slice(&self.dev.lock());
        Ok(())
    }
    fn write_host(&self, bytes: &[u8]) {
        self.host.lock().copy_from_slice(bytes);
    }
    fn read_host(&self, out: &mut [u8]) {
        out.copy_from_slice(&self.host.lock());
    }
}

/// How a fake method misbehaves.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Lie {
    None,
    /// Flips one byte of every load (host → device).
    WrongLoad,
    /// Drops the last byte of every run to host.
    ShortSave,
    /// Every copy fails in the "driver".
    Fails,
    /// Copies right, but sleeps per batch.
    Slow(Duration),
}

#[derive(Debug)]
struct Fake<'a> {
    method: Method,
    lie: Lie,
    mem: &'a Mem,
}

// The movers hold `&Mem`; select needs `'static` boxes, so tests leak one `Mem` each.
impl Mover for Fake<'static> {
    fn method(&self) -> Method {
        self.method
    }

    fn copy(&self, runs: &[Run], dir: Direction) -> Result<(), DeviceError> {
        if self.lie == Lie::Fails {
            return Err(DeviceError::Copy("CUDA_ERROR_INVALID_VALUE".into()));
        }
        if let Lie::Slow(d) = self.lie {
            std::thread::sleep(d);
        }
        let mut dev = self.mem.dev.lock();
        let mut host = self.mem.host.lock();
        for r in runs {
            let (d, h, n) = (
                (r.device - DEV) as usize,
                (r.host - HOST) as usize,
                r.len as usize,
            );
            match dir {
                Direction::FromHost => {
                    dev[d..d + n].copy_from_slice(&host[h..h + n]);
                    if self.lie == Lie::WrongLoad {
                        dev[d + n / 2] ^= 0x40;
                    }
                }
                Direction::ToHost => {
                    let n = if self.lie == Lie::ShortSave { n - 1 } else { n };
                    host[h..h + n].copy_from_slice(&dev[d..d + n]);
                }
            }
        }
        Ok(())
    }
}

fn mem() -> &'static Mem {
    Box::leak(Box::new(Mem::new()))
}

fn fake(mem: &'static Mem, method: Method, lie: Lie) -> Result<Box<dyn Mover>, String> {
    Ok(Box::new(Fake { method, lie, mem }))
}

#[test]
fn an_honest_method_passes_and_every_lie_is_caught_with_its_reason() {
    let m = mem();
    let honest = Fake {
        method: Method::PerRun,
        lie: Lie::None,
        mem: m,
    };
    assert!(
        matches!(self_check(&honest, m), Check::Passed { bytes_per_sec } if bytes_per_sec > 0.0)
    );
    for (lie, says) in [
        (Lie::WrongLoad, "FromHost: byte"),
        (Lie::ShortSave, "ToHost: byte"),
        (Lie::Fails, "CUDA_ERROR_INVALID_VALUE"),
    ] {
        let liar = Fake {
            method: Method::Batch,
            lie,
            mem: m,
        };
        match self_check(&liar, m) {
            Check::Disabled { reason } => assert!(reason.contains(says), "{lie:?}: {reason}"),
            c => panic!("{lie:?} passed: {c:?}"),
        }
    }
}

#[test]
fn auto_takes_the_fastest_method_that_passed_and_reports_the_rest() {
    let m = mem();
    let s = select(
        CopyMethod::Auto,
        vec![
            (
                Method::Batch,
                Err("cuMemcpyBatchAsync: the driver is CUDA 12.4, 12.8 needed".into()),
            ),
            (Method::Kernel, fake(m, Method::Kernel, Lie::WrongLoad)),
            (
                Method::PerRun,
                fake(m, Method::PerRun, Lie::Slow(Duration::from_millis(2))),
            ),
        ],
        m,
    )
    .unwrap();
    assert_eq!(s.mover.method(), Method::PerRun);
    assert_eq!(s.choice.method, Method::PerRun);
    let reasons: Vec<String> = s
        .checks
        .iter()
        .map(|(m, c)| match c {
            Check::Disabled { reason } => format!("{}: {reason}", m.name()),
            Check::Passed { .. } => format!("{}: passed", m.name()),
        })
        .collect();
    assert!(reasons[0].contains("12.8 needed"), "{reasons:?}");
    assert!(
        reasons[1].starts_with("kernel: FromHost: byte"),
        "{reasons:?}"
    );
    assert_eq!(reasons[2], "per_run: passed");

    // Both honest: the faster wins under auto, the named one when named.
    let both = || {
        vec![
            (
                Method::Batch,
                fake(m, Method::Batch, Lie::Slow(Duration::from_millis(20))),
            ),
            (Method::PerRun, fake(m, Method::PerRun, Lie::None)),
        ]
    };
    assert_eq!(
        select(CopyMethod::Auto, both(), m).unwrap().choice.method,
        Method::PerRun
    );
    let named = select(CopyMethod::Batch, both(), m).unwrap();
    assert_eq!(named.choice.method, Method::Batch);
    assert_eq!(named.mover.method(), Method::Batch);
}

#[test]
fn a_named_method_that_fails_falls_back_with_its_reason_and_none_passing_is_an_error() {
    let m = mem();
    let s = select(
        CopyMethod::Kernel,
        vec![
            (Method::Kernel, fake(m, Method::Kernel, Lie::ShortSave)),
            (Method::PerRun, fake(m, Method::PerRun, Lie::None)),
        ],
        m,
    )
    .unwrap();
    assert_eq!(s.mover.method(), Method::PerRun);
    let (from, why) = s.choice.fallback_from.unwrap();
    assert_eq!(from, Method::Kernel);
    assert!(why.contains("ToHost: byte"), "{why}");

    let e = select(
        CopyMethod::Auto,
        vec![
            (Method::Batch, Err("symbol missing".into())),
            (Method::PerRun, fake(m, Method::PerRun, Lie::Fails)),
        ],
        m,
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("no copy method passed") && e.contains("batch: symbol missing"),
        "{e}"
    );
    assert!(e.contains("per_run: an empty batch: "), "{e}");
}
