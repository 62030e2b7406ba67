//! `kvtierctl events`: a running kvtierd's `WatchEvents` stream, one line per event
//! (docs/routing.md): what its L2 gains and loses, live.

use std::fmt::Write as _;

use anyhow::{Context, Result, bail};
use clap::Args;
use kvtier_core::events::{Event, EventKind, EventTier};

/// Flags of `kvtierctl events`.
#[derive(Debug, Args)]
pub struct EventsArgs {
    /// The daemon's control socket (or http://host:port for its TCP listener).
    #[arg(long, default_value = "kvtier-data/kvtierd.sock")]
    pub socket: String,
    /// Resume after this event: `STREAM:SEQ` as a previous run printed them (default: start
    /// from a snapshot of what L2 holds).
    #[arg(long, value_parser = parse_resume)]
    pub after: Option<(u64, u64)>,
    /// Stop after this many events (0: until Ctrl-C or the daemon goes away).
    #[arg(long, default_value_t = 0)]
    pub count: u64,
}

fn parse_resume(s: &str) -> Result<(u64, u64), String> {
    let bad = || format!("--after: {s:?} is not STREAM:SEQ (two decimal numbers)");
    let (a, b) = s.split_once(':').ok_or_else(bad)?;
    Ok((a.parse().map_err(|_| bad())?, b.parse().map_err(|_| bad())?))
}

/// One event as a line: seq, kind, layout, key and parent (first 16 hex digits each).
pub fn render_event(e: &Event) -> String {
    let short = |k: &kvtier_core::PageKey| k.to_hex()[..16].to_string();
    let layout = e.layout.map(|l| l.to_hex()[..16].to_string());
    let layout = layout.as_deref().unwrap_or("*");
    let tier = match e.tier {
        EventTier::L2Host => "l2",
        EventTier::L3Storage => "l3",
    };
    let mut line = String::new();
    let _ = match e.kind {
        EventKind::Stored { key, parent } => write!(
            line,
            "{:>10} stored   {tier} {layout} {} after {}",
            e.seq,
            short(&key),
            parent.as_ref().map_or("-".into(), short)
        ),
        EventKind::Removed { key } => {
            write!(
                line,
                "{:>10} removed  {tier} {layout} {}",
                e.seq,
                short(&key)
            )
        }
        EventKind::Cleared { tenant: None } => {
            write!(line, "{:>10} cleared  {tier} {layout}", e.seq)
        }
        EventKind::Cleared { tenant: Some(t) } => write!(
            line,
            "{:>10} cleared  {tier} {layout} tenant {}",
            e.seq,
            t.to_hex()
        ),
        EventKind::Resync => write!(
            line,
            "{:>10} resync      (a snapshot of what the node holds follows)",
            e.seq
        ),
    };
    line
}

/// `kvtierctl events`: writes each event to `out`, with a header naming the node and the
/// stream when it starts or changes. Returns on Ctrl-C or after `count` events; fails when
/// the daemon cannot be reached or goes away.
pub fn events(a: &EventsArgs, out: &mut dyn std::io::Write) -> Result<()> {
    crate::with_host(&a.socket, |mut c| async move {
        let (stream_id, after) = a.after.unwrap_or((0, 0));
        let mut stream = c
            .watch_events(stream_id, after)
            .await
            .with_context(|| format!("asking kvtierd at {} for events", a.socket))?;
        let ctrl_c = tokio::signal::ctrl_c();
        tokio::pin!(ctrl_c);
        let (mut shown, mut current) = (0u64, None);
        loop {
            let next = tokio::select! {
                _ = &mut ctrl_c => return Ok(()),
                b = stream.next() => b,
            };
            let batch = match next {
                Ok(Some(b)) => b,
                Ok(None) => bail!("kvtierd at {} went away (it closed the stream)", a.socket),
                Err(e) => bail!("kvtierd at {} went away: {e}", a.socket),
            };
            if current != Some(batch.stream_id) {
                current = Some(batch.stream_id);
                writeln!(
                    out,
                    "node {} stream {} (resume with --after {}:SEQ)",
                    batch.node, batch.stream_id, batch.stream_id
                )?;
            }
            for e in &batch.events {
                writeln!(out, "{}", render_event(e))?;
                shown += 1;
                if a.count > 0 && shown >= a.count {
                    out.flush()?;
                    return Ok(());
                }
            }
            out.flush()?;
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvtier_core::{LayoutFingerprint, PageKey};

    #[test]
    fn each_kind_renders_on_one_line_and_a_bad_resume_is_named() {
        let ev = |kind, layout| Event {
            seq: 7,
            unix_nanos: 0,
            kind,
            layout,
            tier: EventTier::L2Host,
        };
        let fp = Some(LayoutFingerprint([0xab; 16]));
        let stored = render_event(&ev(
            EventKind::Stored {
                key: PageKey([1; 32]),
                parent: None,
            },
            fp,
        ));
        assert_eq!(
            stored,
            "         7 stored   l2 abababababababab 0101010101010101 after -"
        );
        let removed = render_event(&ev(
            EventKind::Removed {
                key: PageKey([2; 32]),
            },
            fp,
        ));
        assert!(removed.contains("removed  l2 abababababababab 0202020202020202"));
        let all = EventKind::Cleared { tenant: None };
        assert!(render_event(&ev(all, None)).ends_with("cleared  l2 *"));
        let one = EventKind::Cleared {
            tenant: Some(kvtier_core::TenantTag(0xac)),
        };
        assert!(render_event(&ev(one, fp)).ends_with("tenant 00000000000000ac"));
        let l3 = Event {
            tier: EventTier::L3Storage,
            ..ev(all, None)
        };
        assert!(render_event(&l3).ends_with("cleared  l3 *"));
        assert!(render_event(&ev(EventKind::Resync, None)).contains("resync"));
        assert_eq!(parse_resume("12:34"), Ok((12, 34)));
        assert!(parse_resume("12").unwrap_err().contains("--after"));
        assert!(parse_resume("a:1").unwrap_err().contains("STREAM:SEQ"));
    }
}
