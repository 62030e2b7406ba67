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
//!   moments instead of when the agent's kvtierd session ends;
//! - when its client cancels it: a Load, Save or SaveBatch that names itself in
//!   [`CALL_ID_HEADER`] (LoadBack may not: its pages join the tree as it commits) is in
//!   [`Calls`] while it runs, and the Cancel RPC closes its fence and answers once no part of
//!   its copies is still moving, so the client may reuse the pages the moment it returns
//!   (vLLM's worker, giving up on a preempted request's save, need not wait for the call).
//!   A Cancel may overtake the call it names (two streams of one connection); the id is
//!   remembered as cancelled for [`CANCELLED_FOR`], and a call arriving under it starts
//!   with its fence closed.

use parking_lot::Mutex;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use kvtier_device::Fence;
use kvtier_proto::ApiError;

use crate::owner::{Caller, OwnerToken};

pub(crate) use kvtier_client::{CALL_ID_HEADER, DEADLINE_HEADER};

/// The longest call id (printable ASCII).
const MAX_CALL_ID: usize = 64;
/// The most calls one Cancel names.
pub(crate) const MAX_CANCEL: usize = 256;
/// How long a Cancel waits for the parts moving under the fences it closed: one part is at
/// most 256 KiB per cpu copy thread or 64 MiB queued on a GPU stream, milliseconds.
pub(crate) const SETTLE: Duration = Duration::from_secs(2);

/// How long a cancelled id stays cancelled for a call that arrives after its Cancel; longer
/// than any call's deadline the clients here set (a later call is past its deadline, so
/// fenced anyway, unless it sent none).
pub(crate) const CANCELLED_FOR: Duration = Duration::from_secs(60);
/// The most cancelled ids remembered (oldest forgotten first): 64 bytes each at most.
const MAX_CANCELLED: usize = 1 << 16;

type Key = (OwnerToken, String);

/// The calls in flight that named themselves, by their client's owner token and id (only
/// the client that presented the token can cancel them), and the ids cancelled lately.
#[derive(Debug, Default)]
pub(crate) struct Calls(Mutex<CallsInner>);

#[derive(Debug, Default)]
pub(crate) struct CallsInner {
    running: HashMap<Key, Fence>,
    cancelled: HashMap<Key, Instant>,
    /// `cancelled`'s keys, oldest first.
    order: VecDeque<(Instant, Key)>,
}

impl CallsInner {
    /// Forgets cancelled ids older than [`CANCELLED_FOR`], and the oldest past the cap.
    fn expire(&mut self, now: Instant) {
        while let Some((at, _)) = self.order.front() {
            if now.duration_since(*at) < CANCELLED_FOR && self.order.len() <= MAX_CANCELLED {
                break;
            }
            if let Some((at, k)) = self.order.pop_front()
                && self.cancelled.get(&k) == Some(&at)
            {
                self.cancelled.remove(&k);
            }
        }
    }
}

/// A call's entry in [`Calls`], removed when dropped (the call's task ended).
#[derive(Debug)]
pub(crate) struct Registered {
    calls: Arc<Calls>,
    key: Option<(OwnerToken, String)>,
}

impl Drop for Registered {
    fn drop(&mut self) {
        if let Some(k) = self.key.take() {
            self.calls.lock().running.remove(&k);
        }
    }
}

impl Calls {
    fn lock(&self) -> parking_lot::MutexGuard<'_, CallsInner> {
        self.0.lock()
    }

    /// Enters the call of `req` under `fence` when it names itself: a bad id, or one that
    /// a call of the same client still runs under, is refused naming the header; one
    /// cancelled already closes `fence` at once. A call without an owner token is not
    /// entered (nothing could cancel it).
    pub(crate) fn register<T>(
        self: &Arc<Self>,
        req: &tonic::Request<T>,
        caller: &Caller,
        fence: &Fence,
    ) -> Result<Registered, ApiError> {
        let none = Registered {
            calls: self.clone(),
            key: None,
        };
        let Some(v) = req.metadata().get(CALL_ID_HEADER) else {
            return Ok(none);
        };
        let id = call_id(v.to_str().ok(), CALL_ID_HEADER)?;
        let Some(token) = caller.token else {
            return Ok(none);
        };
        let key = (token, id.to_string());
        let mut calls = self.lock();
        calls.expire(Instant::now());
        if calls.cancelled.contains_key(&key) {
            fence.close();
        }
        if calls.running.contains_key(&key) {
            return Err(ApiError::AlreadyExists(format!(
                "{CALL_ID_HEADER} {id:?}: a call of this client with that id is still running; \
                 give each call an id of its own"
            )));
        }
        calls.running.insert(key.clone(), fence.clone());
        Ok(Registered {
            calls: self.clone(),
            key: Some(key),
        })
    }

    /// Cancels `caller`'s calls named `ids`: every id is remembered as cancelled (a call
    /// that arrives under it later starts fenced), and the fences of those running now are
    /// returned for the caller to close and settle.
    pub(crate) fn cancel(&self, caller: &Caller, ids: &[String]) -> Result<Vec<Fence>, ApiError> {
        if ids.len() > MAX_CANCEL {
            return Err(ApiError::invalid(
                "call_ids",
                format!("{} ids; at most {MAX_CANCEL} in one Cancel", ids.len()),
            ));
        }
        let Some(token) = caller.token else {
            return Err(ApiError::invalid(
                crate::owner::OWNER_HEADER,
                "missing: a call is cancelled by the client that made it, which presents its \
                 owner token",
            ));
        };
        for (i, id) in ids.iter().enumerate() {
            call_id(Some(id), &format!("call_ids[{i}]"))?;
        }
        let now = Instant::now();
        let mut calls = self.lock();
        let mut found = Vec::new();
        let mut named = std::collections::HashSet::new();
        for id in ids {
            if !named.insert(id) {
                continue;
            }
            let key = (token, id.clone());
            if let Some(f) = calls.running.get(&key) {
                found.push(f.clone());
            }
            calls.cancelled.insert(key.clone(), now);
            calls.order.push_back((now, key));
        }
        calls.expire(now);
        Ok(found)
    }
}

/// Refuses a call that names itself but cannot be cancelled (LoadBack); else an entry that
/// registers nothing.
pub(crate) fn not_cancellable<T>(
    req: &tonic::Request<T>,
    calls: &Arc<Calls>,
) -> Result<Registered, ApiError> {
    if req.metadata().contains_key(CALL_ID_HEADER) {
        return Err(ApiError::invalid(
            CALL_ID_HEADER,
            "LoadBack cannot be cancelled (the pages it fills join the agent's tree as it \
             commits); send it without a call id",
        ));
    }
    Ok(Registered {
        calls: calls.clone(),
        key: None,
    })
}

/// A call id as sent in `field`: 1 to [`MAX_CALL_ID`] printable ASCII characters (no
/// spaces).
fn call_id<'a>(v: Option<&'a str>, field: &str) -> Result<&'a str, ApiError> {
    match v {
        Some(id)
            if !id.is_empty()
                && id.len() <= MAX_CALL_ID
                && id.bytes().all(|b| b.is_ascii_graphic()) =>
        {
            Ok(id)
        }
        _ => Err(ApiError::invalid(
            field,
            format!("a call id is 1 to {MAX_CALL_ID} printable ASCII characters, no spaces"),
        )),
    }
}

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

    fn caller() -> Caller {
        Caller {
            token: Some(OwnerToken::random().unwrap()),
            peer: None,
        }
    }

    #[test]
    fn calls_are_found_by_their_clients_token_and_id_only_and_ids_are_checked() {
        let calls = Arc::new(Calls::default());
        let (a, b) = (caller(), caller());
        let named = request(&[(CALL_ID_HEADER, "c1".into())]);
        let f = Fence::until(None);
        let entry = calls.register(&named, &a, &f).unwrap();
        // Another client's token finds nothing; a name given twice counts once.
        assert!(calls.cancel(&b, &["c1".into()]).unwrap().is_empty());
        assert!(f.is_open());
        let found = calls.cancel(&a, &["c1".into(), "c1".into()]).unwrap();
        assert_eq!(found.len(), 1);
        // A second call under a running id is refused, naming the header.
        let e = calls
            .register(&named, &a, &Fence::until(None))
            .unwrap_err()
            .to_string();
        assert!(e.contains(CALL_ID_HEADER), "{e}");
        drop(entry);
        // Cancelled before it arrives: it starts fenced.
        let late = Fence::until(None);
        let _e = calls.register(&named, &a, &late).unwrap();
        assert!(!late.is_open(), "a call under a cancelled id started open");
        // Bad ids, by field.
        let e = calls
            .cancel(&a, &["ok".into(), "not ok".into()])
            .unwrap_err()
            .to_string();
        assert!(e.contains("call_ids[1]"), "{e}");
        let long = request(&[(CALL_ID_HEADER, "x".repeat(65))]);
        assert!(calls.register(&long, &a, &Fence::until(None)).is_err());
        let many: Vec<String> = (0..=MAX_CANCEL).map(|i| i.to_string()).collect();
        assert!(calls.cancel(&a, &many).is_err());
        // LoadBack refuses an id (its pages join the tree as it commits).
        assert!(not_cancellable(&named, &calls).is_err());
        assert!(not_cancellable(&request(&[]), &calls).is_ok());
    }

    #[test]
    fn cancelled_ids_are_forgotten_past_the_cap_oldest_first() {
        let calls = Calls::default();
        let a = caller();
        for chunk in 0..(MAX_CANCELLED / MAX_CANCEL + 2) {
            let ids: Vec<String> = (0..MAX_CANCEL).map(|i| format!("{chunk}-{i}")).collect();
            calls.cancel(&a, &ids).unwrap();
        }
        let inner = calls.lock();
        assert!(
            inner.cancelled.len() <= MAX_CANCELLED,
            "{}",
            inner.cancelled.len()
        );
        assert!(
            !inner
                .cancelled
                .contains_key(&(a.token.unwrap(), "0-0".into()))
        );
        let last = format!("{}-0", MAX_CANCELLED / MAX_CANCEL + 1);
        assert!(inner.cancelled.contains_key(&(a.token.unwrap(), last)));
    }
}
