//! Session ids: what a kvtierd client presents on every call.
//!
//! An id is 128 random bits plus the start epoch of the kvtierd run that issued it. Random so
//! that no client can guess another's session; stamped with the epoch so that an id a client
//! kept across a daemon restart is told apart from the new run's ids, and refused with a clear
//! reason. (Counted ids started at 1 again after a restart: a client still holding its old
//! session then wrote into the new run's pool under another client's session, with its own
//! mapping of the old pool, and the new run sealed pages nobody had written.)
//!
//! Drawing the random bits is the issuer's job (kvtier-core does no I/O); this module owns the
//! shape, the wire form and its parsing.

use std::fmt;

/// A kvtierd run: its start time in microseconds since the Unix epoch. Two runs of one daemon
/// never share one, so it names the run that issued an id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Epoch(pub u64);

impl fmt::Display for Epoch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:x}", self.0)
    }
}

/// A session id: the issuing run's [`Epoch`] and 16 random bytes.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct SessionId {
    epoch: Epoch,
    nonce: [u8; 16],
}

impl SessionId {
    /// Bytes on the wire: the epoch (little-endian u64), then the nonce.
    pub const WIRE_LEN: usize = 24;

    /// An id of run `epoch` with the random `nonce`.
    pub fn new(epoch: Epoch, nonce: [u8; 16]) -> Self {
        Self { epoch, nonce }
    }

    /// The run that issued it.
    pub fn epoch(&self) -> Epoch {
        self.epoch
    }

    /// The wire form.
    pub fn to_bytes(&self) -> [u8; Self::WIRE_LEN] {
        let mut b = [0u8; Self::WIRE_LEN];
        b[..8].copy_from_slice(&self.epoch.0.to_le_bytes());
        b[8..].copy_from_slice(&self.nonce);
        b
    }

    /// Parses the wire form; the error says what is wrong with it.
    pub fn from_bytes(b: &[u8]) -> Result<Self, crate::Error> {
        let invalid = |reason: String| crate::Error::InvalidField {
            field: "session_id",
            reason,
        };
        if b.is_empty() {
            return Err(invalid("missing; Register returns one".into()));
        }
        if b.len() != Self::WIRE_LEN {
            return Err(invalid(format!(
                "{} bytes, not the {} Register returns",
                b.len(),
                Self::WIRE_LEN
            )));
        }
        let mut epoch = [0u8; 8];
        epoch.copy_from_slice(&b[..8]);
        let mut nonce = [0u8; 16];
        nonce.copy_from_slice(&b[8..]);
        Ok(Self {
            epoch: Epoch(u64::from_le_bytes(epoch)),
            nonce,
        })
    }
}

impl fmt::Display for SessionId {
    /// `epoch-nonce` in hex; logs show the first 8 nonce digits, enough to tell sessions apart.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-", self.epoch)?;
        let n = if f.alternate() { 16 } else { 4 };
        for b in &self.nonce[..n] {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SessionId({self:#})")
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_wire_form_round_trips_and_bad_lengths_are_named() {
        let id = SessionId::new(Epoch(0x0123_4567_89ab_cdef), [7; 16]);
        let b = id.to_bytes();
        assert_eq!(&b[..8], &0x0123_4567_89ab_cdef_u64.to_le_bytes());
        assert_eq!(SessionId::from_bytes(&b), Ok(id));
        assert_eq!(id.epoch(), Epoch(0x0123_4567_89ab_cdef));
        for bad in [&b[..0], &b[..8], &b[..23], &[0u8; 25][..]] {
            let e = SessionId::from_bytes(bad).unwrap_err().to_string();
            assert!(e.contains("session_id"), "{e}");
        }
        assert!(
            SessionId::from_bytes(&[])
                .unwrap_err()
                .to_string()
                .contains("missing")
        );
    }

    #[test]
    fn display_shows_the_epoch_and_the_nonce() {
        let id = SessionId::new(Epoch(0xabc), [0xfe; 16]);
        assert_eq!(id.to_string(), "abc-fefefefe");
        assert_eq!(format!("{id:#}"), format!("abc-{}", "fe".repeat(16)));
        let other = SessionId::new(Epoch(0xabc), [0xfd; 16]);
        assert_ne!(id, other);
        assert_ne!(id.to_string(), other.to_string());
    }
}
