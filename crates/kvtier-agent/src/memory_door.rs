//! The memory door: where an engine hands the agent its KV pool's CPU memory, as file
//! descriptors (`SCM_RIGHTS`) on a Unix socket of its own (`server.memory_socket`), never as
//! a path the agent would open: the agent maps only what a process that may talk to it
//! holds and chose to give, so no client can make it open another's file.
//!
//! A connection deposits once and gets a ticket ([`kvtier_shm::memory_door`] is the wire);
//! `RegisterPool` names the deposit by it (`CpuPool.memory`), and [`Deposits::take`] hands
//! the descriptors over, once, to a caller of the same uid. Who may connect: the engine
//! socket's allow-lists and connection caps ([`GatedListener`]); a deposit not complete
//! within the handshake timeout is dropped. Deposits are bounded: at most
//! [`MAX_PENDING`] wait at once, one per uid (its newest), holding at most
//! [`MAX_PENDING_FDS`] descriptors together, each for [`DEPOSIT_TTL`]; deposits still being
//! read hold at most [`MAX_INFLIGHT_FDS`] more. Answers are counted in
//! `kvtier_agent_memory_door_answers_total{outcome}`.

use kvtier_server::tasks::Tasks;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier_server::metrics::MetricRegistry;
use kvtier_server::peers::GatedListener;
use kvtier_shm::memory_door::{self, Answer, Request, TICKET_LEN};
use tokio::io::Interest;
use tokio::net::UnixStream;

/// Deposits waiting for their `RegisterPool` at once.
pub const MAX_PENDING: usize = 8;
/// Descriptors those deposits hold together.
pub const MAX_PENDING_FDS: usize = 2 * memory_door::MAX_FDS;
/// Descriptors deposits still being read may hold together (the kernel installs a group's
/// as it is read, before the deposit is complete).
pub const MAX_INFLIGHT_FDS: usize = 2 * memory_door::MAX_FDS;
/// How long a deposit waits for its `RegisterPool`.
pub const DEPOSIT_TTL: Duration = Duration::from_secs(60);

/// A deposit's name in `RegisterPool`.
pub type Ticket = [u8; TICKET_LEN];

/// Why a ticket gave no descriptors.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TakeError {
    /// Not a ticket the door gave, or one taken or expired already.
    #[error("no deposit has this ticket (taken already, expired after {}s, or never given)", DEPOSIT_TTL.as_secs())]
    Unknown,
    /// The ticket is not [`TICKET_LEN`] bytes.
    #[error("{0} bytes; a ticket has {TICKET_LEN}")]
    Malformed(usize),
    /// Another uid deposited it.
    #[error("deposited by uid {depositor}, and this caller is uid {caller}")]
    OtherUid {
        /// Who deposited.
        depositor: u32,
        /// Who asks.
        caller: u32,
    },
}

struct Deposit {
    fds: Vec<OwnedFd>,
    uid: u32,
    at: Instant,
}

/// The deposits waiting for their registration, and the door's counters.
pub struct Deposits {
    pending: Mutex<HashMap<Ticket, Deposit>>,
    /// Descriptors set aside for deposits being read ([`MAX_INFLIGHT_FDS`] at most).
    inflight: std::sync::atomic::AtomicUsize,
    answers: prometheus::IntCounterVec,
}

impl std::fmt::Debug for Deposits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.pending.lock().len();
        f.debug_struct("Deposits").field("pending", &n).finish()
    }
}

/// The door's outcomes (a label each).
const OUTCOMES: [&str; 7] = [
    "deposited",
    "malformed",
    "not_a_file",
    "full",
    "busy",
    "timeout",
    "failed",
];

impl Deposits {
    /// Declares `kvtier_agent_memory_door_answers_total` in `metrics`.
    pub fn new(metrics: &MetricRegistry) -> prometheus::Result<Self> {
        let answers = metrics.counter_vec(
            "kvtier_agent_memory_door_answers_total",
            "memory door deposits, by outcome: deposited (a ticket given), malformed, not_a_file (a descriptor that is not a regular file), full (too many deposits wait), timeout, failed (the answer could not be sent)",
            &["outcome"],
        )?;
        for o in OUTCOMES {
            answers.with_label_values(&[o]);
        }
        Ok(Self {
            pending: Mutex::new(HashMap::new()),
            inflight: Default::default(),
            answers,
        })
    }

    /// Keeps `fds`, deposited by `uid`, under a new ticket; `None` when the bounds are
    /// reached (after dropping expired deposits). A uid has one deposit waiting at most: its
    /// newest (an engine registers one pool at a time), so no uid can hold the places
    /// another needs.
    fn put(&self, fds: Vec<OwnedFd>, uid: u32) -> Option<Ticket> {
        let mut p = self.pending.lock();
        p.retain(|_, d| d.at.elapsed() < DEPOSIT_TTL && d.uid != uid);
        let held: usize = p.values().map(|d| d.fds.len()).sum();
        if p.len() >= MAX_PENDING || held + fds.len() > MAX_PENDING_FDS {
            return None;
        }
        let mut ticket = [0u8; TICKET_LEN];
        getrandom::fill(&mut ticket).ok()?;
        p.insert(
            ticket,
            Deposit {
                fds,
                uid,
                at: Instant::now(),
            },
        );
        Some(ticket)
    }

    /// The descriptors deposited under `ticket`, for a caller of uid `caller` (`None`: not a
    /// Unix peer, which the engine socket never has). A ticket is taken once; one another
    /// uid deposited stays for its own registration.
    pub fn take(&self, ticket: &[u8], caller: Option<u32>) -> Result<Vec<OwnedFd>, TakeError> {
        let ticket: Ticket = ticket
            .try_into()
            .map_err(|_| TakeError::Malformed(ticket.len()))?;
        let mut p = self.pending.lock();
        let d = p.get(&ticket).ok_or(TakeError::Unknown)?;
        if d.at.elapsed() >= DEPOSIT_TTL {
            p.remove(&ticket);
            return Err(TakeError::Unknown);
        }
        if let Some(caller) = caller
            && caller != d.uid
        {
            return Err(TakeError::OtherUid {
                depositor: d.uid,
                caller,
            });
        }
        Ok(p.remove(&ticket).map(|d| d.fds).unwrap_or_default())
    }

    /// Sets `n` more descriptors aside for a deposit being read; false past
    /// [`MAX_INFLIGHT_FDS`].
    fn take_inflight(&self, n: usize) -> bool {
        use std::sync::atomic::Ordering;
        self.inflight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |cur| {
                (cur + n <= MAX_INFLIGHT_FDS).then_some(cur + n)
            })
            .is_ok()
    }

    fn give_inflight(&self, n: usize) {
        self.inflight
            .fetch_sub(n, std::sync::atomic::Ordering::AcqRel);
    }

    /// Deposits waiting now (tests and stats).
    pub fn pending(&self) -> usize {
        self.pending.lock().len()
    }
}

/// Serves the door on `listener` until `stop`.
pub async fn serve(listener: GatedListener, deposits: Arc<Deposits>, tasks: Tasks) {
    let stop = tasks.shutdown.clone();
    let timeout = listener.cap().handshake_timeout();
    loop {
        let (stream, permit) = tokio::select! {
            c = listener.accept() => c,
            () = stop.cancelled() => return,
        };
        let deposits = deposits.clone();
        tasks.spawn(async move {
            // What the deposit set aside goes back however it ends (a timeout drops `answer`
            // mid-read, and the descriptors it read with it).
            let mut aside = 0usize;
            let outcome = tokio::time::timeout(timeout, answer(&stream, &deposits, &mut aside))
                .await
                .unwrap_or("timeout");
            deposits.give_inflight(aside);
            deposits.answers.with_label_values(&[outcome]).inc();
            drop(permit);
        });
    }
}

/// Reads one deposit on `stream` and answers it; returns the outcome's label. `aside` is
/// how many descriptors it set aside (its caller gives them back).
async fn answer(stream: &UnixStream, deposits: &Deposits, aside: &mut usize) -> &'static str {
    let Ok(uid) = stream.peer_cred().map(|c| c.uid()) else {
        return "failed";
    };
    let mut req = Request::default();
    let got = loop {
        let mut room = |held: usize| {
            // Room for the next group before it is read: the whole door holds at most
            // MAX_INFLIGHT_FDS descriptors of deposits being read.
            let want = held + memory_door::FDS_PER_MESSAGE;
            if want <= *aside {
                return true;
            }
            let more = want - *aside;
            deposits.take_inflight(more) && {
                *aside += more;
                true
            }
        };
        match stream
            .async_io(Interest::READABLE, || req.recv(stream.as_fd(), &mut room))
            .await
        {
            Ok(true) => break Ok(std::mem::take(&mut req).into_fds()),
            Ok(false) => {}
            Err(e) => break Err(e),
        }
    };
    let fds = match got {
        Ok(fds) => fds,
        Err(e) if e.kind() == std::io::ErrorKind::InvalidData => {
            return send(stream, Answer::Refused(e.to_string()), "malformed").await;
        }
        Err(e) if e.kind() == std::io::ErrorKind::ResourceBusy => {
            let why = format!(
                "{MAX_INFLIGHT_FDS} descriptors of other deposits are on their way in; retry"
            );
            return send(stream, Answer::Refused(why), "busy").await;
        }
        Err(_) => return "malformed",
    };
    // Only regular files map (a memfd, a shared-memory file): a socket, pipe or device
    // descriptor is refused here, by its index.
    for (i, fd) in fds.iter().enumerate() {
        let regular = rustix::fs::fstat(fd)
            .is_ok_and(|st| rustix::fs::FileType::from_raw_mode(st.st_mode).is_file());
        if !regular {
            let why =
                format!("descriptor {i} is not a regular file (a memfd or shared-memory file)");
            return send(stream, Answer::Refused(why), "not_a_file").await;
        }
    }
    match deposits.put(fds, uid) {
        Some(t) => send(stream, Answer::Deposited(t), "deposited").await,
        None => {
            let why = format!(
                "{MAX_PENDING} deposits (or {MAX_PENDING_FDS} descriptors) wait for their \
                 RegisterPool already; register, or retry within {}s",
                DEPOSIT_TTL.as_secs()
            );
            send(stream, Answer::Refused(why), "full").await
        }
    }
}

async fn send(stream: &UnixStream, answer: Answer, outcome: &'static str) -> &'static str {
    let bytes = memory_door::encode(&answer);
    let mut off = 0;
    while off < bytes.len() {
        if stream.writable().await.is_err() {
            return "failed";
        }
        match stream.try_write(&bytes[off..]) {
            Ok(n) => off += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(_) => return "failed",
        }
    }
    outcome
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fd() -> OwnedFd {
        rustix::fs::memfd_create("t", rustix::fs::MemfdFlags::CLOEXEC).unwrap()
    }

    #[test]
    fn a_ticket_is_taken_once_by_its_uid_and_deposits_are_bounded() {
        let d = Deposits::new(&MetricRegistry::new()).unwrap();
        let t = d.put(vec![fd(), fd()], 1000).unwrap();
        assert_eq!(
            d.take(&t, Some(1001)).unwrap_err(),
            TakeError::OtherUid {
                depositor: 1000,
                caller: 1001
            }
        );
        assert_eq!(d.take(&t, Some(1000)).unwrap().len(), 2);
        assert_eq!(d.take(&t, Some(1000)).unwrap_err(), TakeError::Unknown);
        assert_eq!(d.take(&t[..3], None).unwrap_err(), TakeError::Malformed(3));
        assert_eq!(
            d.take(&[0; TICKET_LEN], None).unwrap_err(),
            TakeError::Unknown
        );
        // A uid's newer deposit replaces its older one: one uid cannot fill the places.
        let old = d.put(vec![fd()], 7).unwrap();
        let new = d.put(vec![fd()], 7).unwrap();
        assert_eq!(d.take(&old, Some(7)).unwrap_err(), TakeError::Unknown);
        assert_eq!(d.take(&new, Some(7)).unwrap().len(), 1);
        for uid in 0..MAX_PENDING as u32 {
            assert!(d.put(vec![fd()], uid).is_some());
        }
        assert!(
            d.put(vec![fd()], 99).is_none(),
            "more deposits than the bound"
        );
        assert_eq!(d.pending(), MAX_PENDING);
    }
}
