//! Why the daemon's state refuses a call, in the state's own terms. The gRPC edge maps each
//! reason to its status code (`wire.rs`); nothing in the state knows about codes.

use kvtier_core::{Epoch, SessionId};

/// A refusal of the L2 state or of a prefetch.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    /// A session this run did not issue (`issued_by` another run's epoch), or one that
    /// expired or was closed.
    #[error("{}", unknown_session(*.id, *.epoch))]
    UnknownSession {
        /// The id the caller gave.
        id: SessionId,
        /// This run's epoch.
        epoch: Epoch,
    },
    /// A prefetch the session has not open (revoked, taken, released, or never started).
    #[error("no open prefetch {0:?} in this session (revoked, taken, released, or never started)")]
    UnknownPrefetch(String),
    /// A field of the call the state refuses, named.
    #[error("{field}: {reason}")]
    Invalid {
        /// The field, as the wire names it (`keys[3]`, `layout`).
        field: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A limit was reached (pools, shared-memory space, open prefetches); it may pass later.
    #[error("{0}")]
    Full(String),
    /// Refused in the current state (a pool smaller than one page, a prefetch still running).
    #[error("{0}")]
    Refused(String),
    /// kvtierd is draining: it takes nothing new.
    #[error("{0}")]
    Draining(String),
    /// A broken invariant or an unexpected OS failure.
    #[error("{0}")]
    Internal(String),
}

fn unknown_session(id: SessionId, epoch: Epoch) -> String {
    if id.epoch() != epoch {
        return format!(
            "session {id} was issued by another kvtierd run (epoch {}; this run's is {epoch}); \
             register again",
            id.epoch()
        );
    }
    format!("session {id} is unknown or expired; register again")
}

impl StateError {
    /// An [`StateError::Invalid`] naming `field`.
    pub fn invalid(field: impl Into<String>, reason: impl Into<String>) -> Self {
        Self::Invalid {
            field: field.into(),
            reason: reason.into(),
        }
    }
}

impl From<kvtier_core::Error> for StateError {
    fn from(e: kvtier_core::Error) -> Self {
        match e {
            kvtier_core::Error::InvalidField { field, reason } => Self::invalid(field, reason),
            other @ kvtier_core::Error::StaleHandle(_) => {
                Self::invalid("handle", other.to_string())
            }
        }
    }
}
