//! The live client sessions, a component of [`HostState`](super::HostState): who they are,
//! the run's epoch every id carries, the owner ids of their reservations, and their lease.
//! It answers "which session is this" once, with the one error an unknown id gets; what a
//! session holds in a pool (pins, reservations) the state releases through the pool.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kvtier_core::host_index::OwnerId;
use kvtier_core::{Epoch, SessionId};

use super::{Session, StateError};

/// The live sessions.
#[derive(Debug)]
pub(crate) struct Sessions {
    live: HashMap<SessionId, Session>,
    /// This run's start: every session id it issues carries it.
    epoch: Epoch,
    /// Index owner of the next session (internal; never on the wire).
    next_owner: OwnerId,
    /// How long a session lives without a request or heartbeat.
    ttl: Duration,
}

impl Sessions {
    pub(crate) fn new(epoch: Epoch, ttl: Duration) -> Self {
        Self {
            live: HashMap::new(),
            epoch,
            next_owner: 1,
            ttl,
        }
    }

    /// The error of an id no live session has (expired, closed, or another run's).
    pub(crate) fn unknown(&self, id: SessionId) -> StateError {
        StateError::UnknownSession {
            id,
            epoch: self.epoch,
        }
    }

    /// A fresh id of this run that no live session has: random, so no client can name
    /// another's session; a draw that repeats a live id (2^-128) is drawn again.
    pub(crate) fn new_id(&self) -> Result<SessionId, StateError> {
        loop {
            let id = SessionId::new(
                self.epoch,
                crate::ids::random().map_err(|e| StateError::Internal(e.to_string()))?,
            );
            if !self.live.contains_key(&id) {
                return Ok(id);
            }
        }
    }

    /// The owner id the next session's reservations take in the index.
    pub(crate) fn next_owner(&mut self) -> OwnerId {
        let owner = self.next_owner;
        self.next_owner += 1;
        owner
    }

    pub(crate) fn insert(&mut self, id: SessionId, s: Session) {
        self.live.insert(id, s);
    }

    pub(crate) fn get(&self, id: SessionId) -> Result<&Session, StateError> {
        self.live.get(&id).ok_or_else(|| self.unknown(id))
    }

    pub(crate) fn get_mut(&mut self, id: SessionId) -> Result<&mut Session, StateError> {
        let epoch = self.epoch;
        self.live
            .get_mut(&id)
            .ok_or(StateError::UnknownSession { id, epoch })
    }

    pub(crate) fn remove(&mut self, id: SessionId) -> Result<Session, StateError> {
        let epoch = self.epoch;
        self.live
            .remove(&id)
            .ok_or(StateError::UnknownSession { id, epoch })
    }

    pub(crate) fn contains(&self, id: SessionId) -> bool {
        self.live.contains_key(&id)
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (&SessionId, &Session)> {
        self.live.iter()
    }

    pub(crate) fn values(&self) -> impl Iterator<Item = &Session> {
        self.live.values()
    }

    /// The run's epoch.
    pub(crate) fn epoch(&self) -> Epoch {
        self.epoch
    }

    pub(crate) fn len(&self) -> usize {
        self.live.len()
    }

    /// The lease.
    pub(crate) fn ttl(&self) -> Duration {
        self.ttl
    }

    /// The sessions idle past the lease at `now`.
    pub(crate) fn expired(&self, now: Instant) -> Vec<SessionId> {
        self.live
            .iter()
            .filter(|(_, s)| !s.own && now.saturating_duration_since(s.last_seen) > self.ttl)
            .map(|(&id, _)| id)
            .collect()
    }
}
