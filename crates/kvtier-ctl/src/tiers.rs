//! `kvtierctl clear`, `flush` and `drain`: operating a running kvtierd's tiers as a whole.
//! Clearing asks for confirmation first (what would go, then a typed answer), unless `--yes`.

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use clap::{Args, ValueEnum};
use kvtier_proto::v1;

use crate::admin;

/// A tier kvtierd holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum TierArg {
    /// The host tier: kvtierd's shared-memory pools (and its memory of SGLang objects).
    L2,
    /// The storage tier: every object of the attached backend.
    L3,
}

impl TierArg {
    fn name(self) -> &'static str {
        match self {
            TierArg::L2 => "l2",
            TierArg::L3 => "l3",
        }
    }
}

/// Flags of `kvtierctl clear`.
#[derive(Debug, Args)]
pub struct ClearArgs {
    /// Which tier: l2 or l3.
    #[arg(value_enum)]
    pub tier: TierArg,
    /// The daemon's control socket, or https://host:port (KVTIER_TOKEN = its admin token,
    /// KVTIER_TLS_CA = the CA of its certificate).
    #[arg(long, default_value = "kvtier-data/kvtierd.sock")]
    pub socket: String,
    /// Do not ask; clear at once.
    #[arg(long)]
    pub yes: bool,
    /// Only say what would be removed (l2).
    #[arg(long, conflicts_with = "yes")]
    pub dry_run: bool,
}

/// Flags of `kvtierctl flush`.
#[derive(Debug, Args)]
pub struct FlushArgs {
    /// The daemon's control socket, or https://host:port (KVTIER_TOKEN = its admin token,
    /// KVTIER_TLS_CA = the CA of its certificate).
    #[arg(long, default_value = "kvtier-data/kvtierd.sock")]
    pub socket: String,
    /// How long to wait for the pages to land in L3, in seconds (1 to 3600).
    #[arg(long, default_value_t = 300, value_parser = clap::value_parser!(u32).range(1..=3600))]
    pub wait_secs: u32,
}

/// Flags of `kvtierctl drain`.
#[derive(Debug, Args)]
pub struct DrainArgs {
    /// The daemon's control socket, or https://host:port (KVTIER_TOKEN = its admin token,
    /// KVTIER_TLS_CA = the CA of its certificate).
    #[arg(long, default_value = "kvtier-data/kvtierd.sock")]
    pub socket: String,
    /// Only report where a drain stands.
    #[arg(long, conflicts_with = "cancel")]
    pub status: bool,
    /// Stop draining: admit sessions, writes and prefetches again.
    #[arg(long)]
    pub cancel: bool,
    /// How long to wait until a stop is safe, in seconds (0: start the drain and return).
    #[arg(long, default_value_t = 600)]
    pub wait_secs: u64,
}

/// `kvtierctl clear`: shows what would be removed, asks `answer` (which gets the question and
/// returns what the operator typed) unless `--yes`, then clears only on the typed answer.
pub fn clear(a: &ClearArgs, answer: &mut dyn FnMut(&str) -> Result<String>) -> Result<String> {
    let tier = match a.tier {
        TierArg::L2 => v1::Tier::Host,
        TierArg::L3 => v1::Tier::Storage,
    };
    let ask = |dry_run: bool| {
        admin(&a.socket, move |mut c| async move {
            c.clear(v1::ClearRequest {
                tier: tier as i32,
                dry_run,
            })
            .await
        })
    };
    if a.dry_run && a.tier == TierArg::L3 {
        bail!("--dry-run counts l2 only; `kvtierctl backend status` shows what l3 holds");
    }
    if a.dry_run || !a.yes {
        let question = match a.tier {
            TierArg::L2 => {
                let r = ask(true)?;
                let mut q = format!(
                    "This removes {} pages from L2 ({} in use stay)",
                    r.removed, r.kept
                );
                if r.unwritten > 0 {
                    write!(
                        q,
                        "; {} of them are not in L3 and will be gone from this node",
                        r.unwritten
                    )?;
                }
                q
            }
            TierArg::L3 => {
                let s = admin(&a.socket, |mut c| async move {
                    c.backend_status(v1::BackendStatusRequest {}).await
                })?;
                let Some(st) = s.stats.filter(|_| s.attached) else {
                    bail!("no l3 backend is attached: nothing to clear");
                };
                format!(
                    "This deletes every object of the {} backend ({} objects, {} bytes) and \
                     makes L2 write its pages again",
                    st.backend, st.objects, st.bytes
                )
            }
        };
        if a.dry_run {
            return Ok(format!("{question}.\n"));
        }
        let typed = format!("clear {}", a.tier.name());
        if answer(&format!("{question}.\nType '{typed}' to go on: "))?.trim() != typed {
            bail!("not cleared: the answer was not '{typed}'");
        }
    }
    let r = ask(false)?;
    Ok(match a.tier {
        TierArg::L2 => format!(
            "cleared l2: {} pages removed ({} were not in L3), {} in use kept\n",
            r.removed, r.unwritten, r.kept
        ),
        TierArg::L3 => format!(
            "cleared l3: {} objects deleted; {} L2 pages will be written again\n",
            r.removed, r.rewrite
        ),
    })
}

/// `kvtierctl flush`: writes every page L3 lacks and waits for it. Fails when the pages did
/// not all land in time, saying why.
pub fn flush(a: &FlushArgs) -> Result<String> {
    let wait_ms = a.wait_secs * 1000;
    let r = admin(&a.socket, |mut c| async move {
        c.flush(v1::FlushRequest { wait_ms }).await
    })?;
    if !r.done {
        bail!(
            "flush incomplete: {} of {} pages are not in L3: {}",
            r.left,
            r.pages,
            r.reason
        );
    }
    Ok(format!("flushed: {} pages are in L3\n", r.pages))
}

/// `kvtierctl drain`: starts (or cancels, or reports) a drain, and waits until a stop is
/// safe, writing progress to `progress` as it changes. Fails if it is not safe in time.
pub fn drain(a: &DrainArgs, progress: &mut dyn std::io::Write) -> Result<String> {
    let call = |action: v1::DrainAction| {
        admin(&a.socket, move |mut c| async move {
            c.drain(v1::DrainRequest {
                action: action as i32,
            })
            .await
        })
    };
    if a.cancel {
        call(v1::DrainAction::Cancel)?;
        return Ok(
            "drain cancelled: kvtierd admits sessions, writes and prefetches again\n".into(),
        );
    }
    let first = if a.status {
        call(v1::DrainAction::Status)?
    } else {
        call(v1::DrainAction::Start)?
    };
    if a.status || a.wait_secs == 0 {
        return Ok(describe(&first));
    }
    let deadline = Instant::now() + Duration::from_secs(a.wait_secs);
    let mut r = first;
    let mut last = String::new();
    while !r.safe_to_stop {
        let line = describe(&r);
        if line != last {
            progress.write_all(line.as_bytes())?;
            last = line;
        }
        if Instant::now() >= deadline {
            bail!("not safe to stop after {} s: {}", a.wait_secs, r.reason);
        }
        std::thread::sleep(Duration::from_millis(200));
        r = call(v1::DrainAction::Status)?;
    }
    Ok(describe(&r))
}

/// One line on where a drain stands.
fn describe(r: &v1::DrainResponse) -> String {
    let head = match (r.draining, r.safe_to_stop) {
        (false, _) => "not draining",
        (true, true) => "drained: safe to stop",
        (true, false) => "draining",
    };
    let mut s = format!(
        "{head}  unwritten {}  queued to L3 {}  being written {}  sessions {}",
        r.unwritten_pages, r.queued_writes, r.writing_pages, r.sessions
    );
    if !r.reason.is_empty() {
        let _ = write!(s, "  ({})", r.reason);
    }
    s.push('\n');
    s
}

/// Asks on the terminal: prints `question` to stderr and returns the line typed on stdin.
/// Refuses when stdin is not a terminal (a script must say `--yes`).
pub fn ask_terminal(question: &str) -> Result<String> {
    use std::io::{BufRead as _, IsTerminal as _, Write as _};
    let stdin = std::io::stdin();
    if !stdin.is_terminal() {
        bail!("refusing to clear without confirmation: stdin is not a terminal; pass --yes");
    }
    let mut err = std::io::stderr();
    err.write_all(question.as_bytes())?;
    err.flush()?;
    let mut line = String::new();
    stdin.lock().read_line(&mut line)?;
    Ok(line)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_drain_line_says_what_waiting_is_for() {
        let r = v1::DrainResponse {
            draining: true,
            unwritten_pages: 4,
            reason: "4 pages are still to be written to L3".into(),
            ..v1::DrainResponse::default()
        };
        let line = describe(&r);
        assert!(line.starts_with("draining  unwritten 4"), "{line}");
        assert!(line.contains("(4 pages are still"), "{line}");
        let done = v1::DrainResponse {
            draining: true,
            safe_to_stop: true,
            ..v1::DrainResponse::default()
        };
        assert!(describe(&done).starts_with("drained: safe to stop"));
    }
}
