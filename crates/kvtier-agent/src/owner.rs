//! Who the registered pool belongs to: the client that registered it.
//!
//! One agent serves one engine worker. When two workers reach the same agent (vLLM's DP
//! ranks or PP stages all have TP rank 0, so a socket named by TP rank alone is shared), the
//! second registration used to replace the first's pool, and the first worker's calls were
//! then served against the second's memory: its saves stored another worker's bytes under
//! its keys. Now:
//!
//! - `RegisterPool` answers an owner token (128 random bits, hex); every later call that
//!   touches the pool presents it in the `kvtier-pool-owner` metadata header, and the
//!   [`Caller`] built from each request carries it to the pool's accessors.
//! - A registration from another client is refused (`ALREADY_EXISTS`, naming the owner's
//!   pid and uid) while the owner lives: while its process exists (its pid and start time,
//!   from the socket's peer credentials) or, when its pid is not visible (another pid
//!   namespace, TCP), until it has made no call for the lease (`server.pool_lease`).
//! - The owner registering again (a new staging pool, an engine restart in the same
//!   process) gets a new token; a call with a stale or missing token is `NOT_FOUND`, never
//!   served against another registration's pool.

use std::time::{Duration, Instant};

use kvtier_proto::{ApiError, Lost};

/// The metadata header that carries the owner token.
pub const OWNER_HEADER: &str = "kvtier-pool-owner";

/// One registration's token: 16 random bytes, hex on the wire.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct OwnerToken([u8; 16]);

impl std::fmt::Debug for OwnerToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // A capability: never printed whole.
        write!(f, "OwnerToken({:02x}{:02x}..)", self.0[0], self.0[1])
    }
}

impl OwnerToken {
    /// A fresh token from the OS's random source.
    pub fn random() -> Result<Self, ApiError> {
        let mut b = [0u8; 16];
        getrandom::fill(&mut b)
            .map_err(|e| ApiError::Internal(format!("no random bytes for a pool owner: {e}")))?;
        Ok(Self(b))
    }

    /// The wire form (32 lowercase hex digits).
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Parses the wire form; the error names the header.
    pub fn parse(s: &str) -> Result<Self, ApiError> {
        let bad = || {
            ApiError::invalid(
                OWNER_HEADER,
                format!(
                    "{} characters; an owner token is the 32 hex digits RegisterPool returned",
                    s.len()
                ),
            )
        };
        if s.len() != 32 {
            return Err(bad());
        }
        let mut b = [0u8; 16];
        for (i, out) in b.iter_mut().enumerate() {
            *out = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
        }
        Ok(Self(b))
    }
}

/// The process on the other end of a Unix socket, as the kernel reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Peer {
    /// Its pid in the agent's pid namespace; `None` when not visible there.
    pub pid: Option<u32>,
    /// Its uid.
    pub uid: u32,
}

/// Who made a call: the owner token it presented and its peer credentials.
#[derive(Clone, Copy, Debug, Default)]
pub struct Caller {
    /// The token in `kvtier-pool-owner`, if any.
    pub token: Option<OwnerToken>,
    /// The socket peer, on a Unix socket.
    pub peer: Option<Peer>,
}

impl Caller {
    /// The caller of `req`; a malformed token header is refused, naming it.
    pub fn of<T>(req: &tonic::Request<T>) -> Result<Self, ApiError> {
        let token = match req.metadata().get(OWNER_HEADER) {
            None => None,
            Some(v) => Some(OwnerToken::parse(v.to_str().map_err(|_| {
                ApiError::invalid(OWNER_HEADER, "not ASCII; an owner token is 32 hex digits")
            })?)?),
        };
        let peer = req
            .extensions()
            .get::<tonic::transport::server::UdsConnectInfo>()
            .and_then(|i| i.peer_cred)
            .map(|c| Peer {
                pid: c
                    .pid()
                    .and_then(|p| u32::try_from(p).ok())
                    .filter(|&p| p > 0),
                uid: c.uid(),
            });
        Ok(Self { token, peer })
    }
}

/// The registered pool's owner.
#[derive(Debug)]
pub struct Owner {
    token: OwnerToken,
    peer: Option<Peer>,
    /// The owner process's start time (`/proc/<pid>/stat` field 22), to tell it from a later
    /// process that reuses its pid.
    started: Option<u64>,
    /// When it last presented its token (for owners whose pid is not visible).
    last_seen: parking_lot::Mutex<Instant>,
}

/// Why a registration was refused: the pool belongs to a live client.
#[derive(Debug)]
pub struct Owned {
    peer: Option<Peer>,
    idle: Duration,
}

impl From<Owned> for ApiError {
    fn from(o: Owned) -> Self {
        let who = match o.peer {
            Some(Peer {
                pid: Some(pid),
                uid,
            }) => format!("pid {pid} (uid {uid})"),
            Some(Peer { pid: None, uid }) => {
                format!("a process of uid {uid} in another pid namespace")
            }
            None => "a client over TCP".to_string(),
        };
        ApiError::AlreadyExists(format!(
            "pool: this agent's pool is registered by {who}, last seen {:.1}s ago; one agent \
             serves one engine worker: give each worker its own agent (vLLM: the connector's \
             socket template takes {{local_rank}}, {{dp_rank}}, {{pp_rank}} and {{tp_rank}})",
            o.idle.as_secs_f64()
        ))
    }
}

fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses: count from the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    // After ')' come field 3 (state) onwards; the start time is field 22.
    rest.split_whitespace().nth(19)?.parse().ok()
}

impl Owner {
    /// A new registration by `caller`, with a fresh token.
    pub fn new(caller: &Caller) -> Result<Self, ApiError> {
        let started = caller.peer.and_then(|p| p.pid).and_then(start_time);
        Ok(Self {
            token: OwnerToken::random()?,
            peer: caller.peer,
            started,
            last_seen: parking_lot::Mutex::new(Instant::now()),
        })
    }

    /// The token the owner presents.
    pub fn token(&self) -> OwnerToken {
        self.token
    }

    fn last_seen(&self) -> Instant {
        *self.last_seen.lock()
    }

    /// Whether `caller` is this owner: it presents the token, or it is the owner's own
    /// process (the same pid and start time).
    fn is(&self, caller: &Caller) -> bool {
        if caller.token == Some(self.token) {
            return true;
        }
        match (
            self.peer.and_then(|p| p.pid),
            caller.peer.and_then(|p| p.pid),
        ) {
            (Some(mine), Some(theirs)) => {
                mine == theirs && self.started.is_some() && self.started == start_time(theirs)
            }
            _ => false,
        }
    }

    /// Whether the owner still lives: its process, when its pid is visible; else a call
    /// within `lease`.
    fn alive(&self, lease: Duration) -> bool {
        match (self.peer.and_then(|p| p.pid), self.started) {
            (Some(pid), Some(started)) => start_time(pid) == Some(started),
            _ => self.last_seen().elapsed() < lease,
        }
    }

    /// May `caller` register (replacing this owner's pool)? Yes for the owner itself and
    /// once the owner is gone.
    pub fn yields_to(&self, caller: &Caller, lease: Duration) -> Result<(), Owned> {
        if self.is(caller) || !self.alive(lease) {
            return Ok(());
        }
        Err(Owned {
            peer: self.peer,
            idle: self.last_seen().elapsed(),
        })
    }

    /// Checks a call's token against this owner's; a match renews the lease.
    pub fn admits(&self, caller: &Caller) -> Result<(), ApiError> {
        match caller.token {
            Some(t) if t == self.token => {
                *self.last_seen.lock() = Instant::now();
                Ok(())
            }
            Some(_) => Err(ApiError::Lost(
                Lost::Pool,
                format!(
                    "{OWNER_HEADER}: the token names no pool registered here (the pool was \
                     registered again, by this client or after its owner was gone, or the \
                     agent restarted); call RegisterPool again"
                ),
            )),
            None => Err(ApiError::Lost(
                Lost::Pool,
                format!("{OWNER_HEADER}: missing; present the owner token RegisterPool returned"),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caller(token: Option<OwnerToken>, pid: Option<u32>) -> Caller {
        Caller {
            token,
            peer: Some(Peer { pid, uid: 1000 }),
        }
    }

    #[test]
    fn tokens_round_trip_and_bad_ones_name_the_header() {
        let t = OwnerToken::random().unwrap();
        assert_eq!(OwnerToken::parse(&t.to_hex()).unwrap(), t);
        assert_ne!(OwnerToken::random().unwrap(), t);
        for bad in ["", "abc", &"g".repeat(32), &"0".repeat(33)] {
            let e = OwnerToken::parse(bad).unwrap_err().to_string();
            assert!(e.contains(OWNER_HEADER), "{e}");
        }
    }

    #[test]
    fn a_live_owner_keeps_its_pool_and_only_its_token_is_served() {
        let me = std::process::id();
        let owner = Owner::new(&caller(None, Some(me))).unwrap();
        let t = owner.token();
        // Another live process (pid 1 exists in every namespace) is refused, with the owner
        // named; the owner itself, by token or by its process, is not.
        let other = caller(None, Some(1));
        let e = ApiError::from(owner.yields_to(&other, Duration::ZERO).unwrap_err());
        assert!(e.to_string().contains(&format!("pid {me}")), "{e}");
        assert!(
            owner
                .yields_to(&caller(Some(t), Some(1)), Duration::ZERO)
                .is_ok()
        );
        assert!(
            owner
                .yields_to(&caller(None, Some(me)), Duration::ZERO)
                .is_ok()
        );
        // Calls: the token or nothing.
        assert!(owner.admits(&caller(Some(t), Some(1))).is_ok());
        let stale = OwnerToken::random().unwrap();
        assert!(matches!(
            owner.admits(&caller(Some(stale), Some(me))),
            Err(ApiError::Lost(Lost::Pool, _))
        ));
        assert!(matches!(
            owner.admits(&caller(None, Some(me))),
            Err(ApiError::Lost(Lost::Pool, _))
        ));
    }

    #[test]
    fn a_dead_owner_yields_and_an_invisible_one_after_its_lease() {
        // A process that has exited: its pid no longer has its start time.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        let owner = Owner::new(&caller(None, Some(pid))).unwrap();
        child.wait().unwrap();
        assert!(
            owner
                .yields_to(&caller(None, Some(1)), Duration::ZERO)
                .is_ok()
        );
        // No pid (another namespace): alive while it calls within the lease.
        let owner = Owner::new(&caller(None, None)).unwrap();
        let other = caller(None, None);
        assert!(owner.yields_to(&other, Duration::from_secs(60)).is_err());
        assert!(owner.yields_to(&other, Duration::ZERO).is_ok());
    }
}
