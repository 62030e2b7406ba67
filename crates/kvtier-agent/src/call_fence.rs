//! Each engine call's copy fence, from the deadline its client sent.
//!
//! A Load, Save, SaveBatch or LoadBack copies between L2 and pages the engine lends for the
//! call. When the call's deadline passes the engine takes them back (vLLM reports the
//! blocks failed and may hand them to another request), so the copies of the call must stop
//! before then: [`of`] builds the call's [`Fence`], which closes
//!
//! - a margin ([`margin`]) before the earlier of the two deadlines the client sent: gRPC's
//!   `grpc-timeout` (relative to when the agent read the request) and
//!   [`DEADLINE_HEADER`] (wall-clock, so a request that sat in the socket of a stopped or
//!   busy agent is seen to be late);
//! - when the call's future is dropped (its client reset the stream): the service holds the
//!   fence's [`close_on_drop`](Fence::close_on_drop) guard, and runs the call on a task of
//!   its own, so a call whose client left still releases its pins and reservations (its
//!   fenced copy fails, and the page protocol's failure path unpins and aborts) within
//!   moments instead of when the agent's kvtierd session ends.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use kvtier_device::Fence;

pub(crate) use kvtier_client::DEADLINE_HEADER;

/// How long before the client's deadline the fence closes: a tenth of the call's time, at
/// most 100 ms. The copy part in flight when it closes (≤ 256 KiB per thread) ends well
/// within it.
fn margin(timeout: Duration) -> Duration {
    (timeout / 10).min(Duration::from_millis(100))
}

/// The fence of the call `req`: closes before the client's deadline (none sent: only when
/// the call is dropped).
pub(crate) fn of<T>(req: &tonic::Request<T>) -> Fence {
    let now = Instant::now();
    let relative = req
        .metadata()
        .get("grpc-timeout")
        .and_then(|v| v.to_str().ok())
        .and_then(grpc_timeout);
    let absolute = req
        .metadata()
        .get(DEADLINE_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .map(|ns| {
            let at = UNIX_EPOCH + Duration::from_nanos(ns);
            at.duration_since(SystemTime::now())
                .unwrap_or(Duration::ZERO)
        });
    let left = match (relative, absolute) {
        (Some(r), Some(a)) => Some(r.min(a)),
        (r, a) => r.or(a),
    };
    // The margin is a share of the whole call's time where it is known.
    let whole = relative.unwrap_or(left.unwrap_or_default());
    Fence::until(left.map(|l| now + l.saturating_sub(margin(whole))))
}

/// Returns once `fence` is closed (checked every 10 ms): for racing a wait that the fence
/// should cut short.
pub(crate) async fn closed(fence: &Fence) {
    while fence.is_open() {
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

/// gRPC's `grpc-timeout` value: up to 8 digits and a unit (H, M, S, m, u, n).
fn grpc_timeout(v: &str) -> Option<Duration> {
    let (digits, unit) = v.split_at(v.len().checked_sub(1)?);
    if digits.is_empty() || digits.len() > 8 {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n * 3600),
        "M" => Duration::from_secs(n * 60),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(headers: &[(&'static str, String)]) -> tonic::Request<()> {
        let mut r = tonic::Request::new(());
        for (k, v) in headers {
            r.metadata_mut().insert(*k, v.parse().unwrap());
        }
        r
    }

    fn unix_ns(from_now: i64) -> String {
        let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
        (now.as_nanos() as i64 + from_now).to_string()
    }

    #[test]
    fn grpc_timeouts_parse_and_bad_ones_are_none() {
        assert_eq!(grpc_timeout("2S"), Some(Duration::from_secs(2)));
        assert_eq!(grpc_timeout("1999m"), Some(Duration::from_millis(1999)));
        assert_eq!(grpc_timeout("5u"), Some(Duration::from_micros(5)));
        assert_eq!(grpc_timeout("1H"), Some(Duration::from_secs(3600)));
        for bad in ["", "S", "123456789S", "12x", "-1S", "1.5S"] {
            assert_eq!(grpc_timeout(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn the_fence_closes_at_the_earlier_deadline_less_the_margin() {
        // No deadline sent: open until dropped.
        assert!(of(&request(&[])).is_open());
        // A relative deadline, fresh: open.
        assert!(of(&request(&[("grpc-timeout", "2S".into())])).is_open());
        // A request that waited in a stopped agent's socket: its relative timeout looks
        // fresh, its wall-clock deadline has passed.
        let late = request(&[
            ("grpc-timeout", "2S".into()),
            (DEADLINE_HEADER, unix_ns(-1_000_000)),
        ]);
        assert!(!of(&late).is_open());
        // Within the margin of the deadline: closed already.
        let close = request(&[("grpc-timeout", "50m".into())]);
        let f = of(&close);
        std::thread::sleep(Duration::from_millis(46));
        assert!(!f.is_open(), "open within 5 ms of a 50 ms deadline");
        // A malformed header is ignored, never a deadline of zero.
        assert!(of(&request(&[(DEADLINE_HEADER, "soon".into())])).is_open());
    }
}
