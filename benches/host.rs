//! What the machine was like during a run, so that two runs' figures can be told apart: the
//! CPU (model, cores, clock), how much of it the hypervisor took (steal) and how busy it was,
//! and a calibration probe taken at the start and again at the end (a memcpy's bandwidth and
//! a loopback TCP round trip). Ratios against same-run baselines survive a slow host; values
//! do not, and a probe that drifted between start and end says the host changed speed under
//! the run.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

/// Cumulative CPU time of all cores, in the kernel's ticks (`/proc/stat`'s `cpu` line).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CpuTimes {
    /// Ticks spent running anything (user, nice, system, irq, softirq).
    pub busy: u64,
    /// Ticks idle or waiting for I/O.
    pub idle: u64,
    /// Ticks the hypervisor ran something else while this machine wanted the CPU.
    pub steal: u64,
}

impl CpuTimes {
    /// Parses the `cpu` line of `/proc/stat` (fields: user nice system idle iowait irq
    /// softirq steal ...); `None` when there is none or it is malformed.
    pub fn parse(stat: &str) -> Option<Self> {
        let line = stat.lines().find(|l| l.starts_with("cpu "))?;
        let f: Vec<u64> = line
            .split_whitespace()
            .skip(1)
            .map(str::parse)
            .collect::<Result<_, _>>()
            .ok()?;
        let at = |i: usize| f.get(i).copied().unwrap_or(0);
        if f.len() < 4 {
            return None;
        }
        Some(Self {
            busy: at(0) + at(1) + at(2) + at(5) + at(6),
            idle: at(3) + at(4),
            steal: at(7),
        })
    }

    fn now() -> Option<Self> {
        Self::parse(&std::fs::read_to_string("/proc/stat").ok()?)
    }

    /// Shares of the time between `self` and `later`: (busy, steal), each 0..1.
    pub fn shares(self, later: Self) -> (f64, f64) {
        let busy = later.busy.saturating_sub(self.busy) as f64;
        let idle = later.idle.saturating_sub(self.idle) as f64;
        let steal = later.steal.saturating_sub(self.steal) as f64;
        let all = busy + idle + steal;
        if all == 0.0 {
            return (0.0, 0.0);
        }
        (busy / all, steal / all)
    }
}

/// One calibration: a memcpy's bandwidth and a loopback round trip, each a median of repeats.
#[derive(Clone, Copy, Debug)]
pub struct Probe {
    /// GiB/s of copying 64 MiB between two buffers already touched.
    pub memcpy_gib_s: f64,
    /// Microseconds of a 64-byte request and reply over loopback TCP.
    pub tcp_rtt_us: f64,
    cpu: Option<CpuTimes>,
    at: Instant,
}

impl Probe {
    /// Measures now (about a tenth of a second).
    pub fn take() -> Self {
        let cpu = CpuTimes::now();
        let at = Instant::now();
        Self {
            memcpy_gib_s: memcpy_gib_s(),
            tcp_rtt_us: tcp_rtt_us().unwrap_or(f64::NAN),
            cpu,
            at,
        }
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn memcpy_gib_s() -> f64 {
    let n = 64 << 20;
    let src = vec![7u8; n];
    let mut dst = vec![1u8; n];
    let runs = (0..7)
        .map(|_| {
            let t = Instant::now();
            dst.copy_from_slice(std::hint::black_box(&src));
            std::hint::black_box(&dst);
            n as f64 / t.elapsed().as_secs_f64() / f64::from(1u32 << 30)
        })
        .collect();
    median(runs)
}

fn tcp_rtt_us() -> std::io::Result<f64> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let echo = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut s, _) = listener.accept()?;
        s.set_nodelay(true)?;
        let mut buf = [0u8; 64];
        loop {
            if s.read_exact(&mut buf).is_err() {
                return Ok(());
            }
            s.write_all(&buf)?;
        }
    });
    let mut c = TcpStream::connect(addr)?;
    c.set_nodelay(true)?;
    c.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut buf = [0u8; 64];
    let mut rtts = Vec::new();
    for i in 0..300 {
        let t = Instant::now();
        c.write_all(&buf)?;
        c.read_exact(&mut buf)?;
        if i >= 20 {
            rtts.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    drop(c);
    let _ = echo.join();
    Ok(median(rtts))
}

/// The run's host, from a probe at its start and one at its end.
#[derive(Clone, Debug)]
pub struct HostReport {
    /// The CPU's model name, as `/proc/cpuinfo` gives it.
    pub model: String,
    /// CPUs this process may run on.
    pub cores: usize,
    /// The first CPU's clock at the end, MHz, when the kernel reports it.
    pub mhz: Option<f64>,
    /// Share of all CPU time busy (anything, this run included) over the run.
    pub busy: f64,
    /// Share of all CPU time the hypervisor took over the run.
    pub steal: f64,
    /// The calibration at the start and at the end.
    pub start: Probe,
    /// The calibration at the end.
    pub end: Probe,
    /// The run's wall time.
    pub took: Duration,
}

impl HostReport {
    /// The report for a run that started at `start`.
    pub fn finish(start: Probe) -> Self {
        let end = Probe::take();
        let (busy, steal) = match (start.cpu, end.cpu) {
            (Some(a), Some(b)) => a.shares(b),
            _ => (f64::NAN, f64::NAN),
        };
        let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let field = |name: &str| {
            info.lines()
                .find(|l| l.starts_with(name))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        };
        Self {
            model: field("model name").unwrap_or_else(|| "unknown CPU".into()),
            cores: std::thread::available_parallelism().map_or(1, usize::from),
            mhz: field("cpu MHz").and_then(|v| v.parse().ok()),
            busy,
            steal,
            took: end.at.duration_since(start.at),
            start,
            end,
        }
    }

    /// How far the probe moved between start and end: the larger relative change of the
    /// two (0.3 = one of them changed by 30%).
    pub fn drift(&self) -> f64 {
        let rel = |a: f64, b: f64| {
            if a > 0.0 && b > 0.0 {
                (a / b).max(b / a) - 1.0
            } else {
                0.0
            }
        };
        rel(self.start.memcpy_gib_s, self.end.memcpy_gib_s)
            .max(rel(self.start.tcp_rtt_us, self.end.tcp_rtt_us))
    }

    /// What a reader should make of the run's values, in one line.
    pub fn verdict(&self) -> &'static str {
        if self.steal > 0.05 || self.drift() > 0.2 {
            "noisy host: the hypervisor took CPU time or the probe moved during the run; \
             compare ratios (same-run baselines), not values, with other runs"
        } else {
            "steady host: values are comparable with other steady runs on this machine"
        }
    }
}

impl std::fmt::Display for HostReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mhz = self
            .mhz
            .map_or_else(|| "clock unknown".into(), |m| format!("{m:.0} MHz"));
        writeln!(f, "host: {}, {} CPUs, {mhz}", self.model, self.cores)?;
        writeln!(
            f,
            "host over the run ({:.0} s): {:.0}% busy, {:.1}% stolen by the hypervisor",
            self.took.as_secs_f64(),
            self.busy * 100.0,
            self.steal * 100.0
        )?;
        writeln!(
            f,
            "host probe, start -> end: memcpy {:.1} -> {:.1} GiB/s, loopback TCP round trip \
             {:.1} -> {:.1} µs (drift {:.0}%)",
            self.start.memcpy_gib_s,
            self.end.memcpy_gib_s,
            self.start.tcp_rtt_us,
            self.end.tcp_rtt_us,
            self.drift() * 100.0
        )?;
        writeln!(f, "{}", self.verdict())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const STAT: &str = "cpu  100 5 50 800 20 3 2 40 0 0\ncpu0 50 2 25 400 10 1 1 20 0 0\n";

    #[test]
    fn proc_stat_is_read_into_busy_idle_and_steal() {
        let t = CpuTimes::parse(STAT).unwrap();
        assert_eq!(
            t,
            CpuTimes {
                busy: 100 + 5 + 50 + 3 + 2,
                idle: 800 + 20,
                steal: 40
            }
        );
        // A kernel without steal accounting (4 fields) reads as none stolen.
        let old = CpuTimes::parse("cpu 1 2 3 4\n").unwrap();
        assert_eq!((old.busy, old.idle, old.steal), (6, 4, 0));
        assert_eq!(CpuTimes::parse("intr 1 2 3\n"), None);
        assert_eq!(CpuTimes::parse("cpu 1 x 3 4\n"), None);
    }

    #[test]
    fn shares_are_of_the_time_between_two_readings() {
        let a = CpuTimes {
            busy: 100,
            idle: 100,
            steal: 0,
        };
        let b = CpuTimes {
            busy: 160,
            idle: 120,
            steal: 20,
        };
        let (busy, steal) = a.shares(b);
        assert!(
            (busy - 0.6).abs() < 1e-9 && (steal - 0.2).abs() < 1e-9,
            "{busy} {steal}"
        );
        assert_eq!(a.shares(a), (0.0, 0.0));
    }

    fn report(start: (f64, f64), end: (f64, f64), steal: f64) -> HostReport {
        let p = |(m, r): (f64, f64)| Probe {
            memcpy_gib_s: m,
            tcp_rtt_us: r,
            cpu: None,
            at: Instant::now(),
        };
        HostReport {
            model: "test".into(),
            cores: 2,
            mhz: None,
            busy: 0.5,
            steal,
            start: p(start),
            end: p(end),
            took: Duration::from_secs(1),
        }
    }

    #[test]
    fn a_probe_that_moved_or_stolen_time_marks_the_run_noisy() {
        let steady = report((10.0, 30.0), (10.5, 31.0), 0.0);
        assert!(steady.drift() < 0.1 && steady.verdict().starts_with("steady"));
        // The round trip doubled: 100% drift, whichever way.
        let slower = report((10.0, 30.0), (10.0, 60.0), 0.0);
        assert!((slower.drift() - 1.0).abs() < 1e-9);
        assert!(slower.verdict().starts_with("noisy"));
        assert!((report((10.0, 60.0), (10.0, 30.0), 0.0).drift() - 1.0).abs() < 1e-9);
        assert!(
            report((10.0, 30.0), (10.0, 30.0), 0.08)
                .verdict()
                .starts_with("noisy")
        );
        let text = slower.to_string();
        assert!(
            text.contains("30.0 -> 60.0 µs") && text.contains("drift 100%"),
            "{text}"
        );
    }

    #[test]
    fn a_probe_measures_this_machine() {
        let p = Probe::take();
        assert!(p.memcpy_gib_s > 0.1, "{p:?}");
        assert!(p.tcp_rtt_us > 0.0 && p.tcp_rtt_us < 100_000.0, "{p:?}");
    }
}
