//! Where the daemon's ids come from: random bytes from the OS, and this run's start epoch.
//! Session ids (kvtier-core's [`kvtier_core::SessionId`]) and SGLang pool ids are drawn here,
//! never counted, so a restarted kvtierd does not hand out its predecessor's ids again.

use kvtier_core::Epoch;
use kvtier_proto::ApiError;

/// `N` random bytes from the OS (getrandom(2)). An OS that cannot give them fails the call
/// that needed an id, with the reason; an id is never made up from something guessable.
pub fn random<const N: usize>() -> Result<[u8; N], ApiError> {
    let mut b = [0u8; N];
    getrandom::fill(&mut b).map_err(|e| {
        ApiError::Unavailable(format!("no random bytes from the OS for an id: {e}"))
    })?;
    Ok(b)
}

/// This moment as a run epoch: microseconds since the Unix epoch.
pub fn epoch_now() -> Epoch {
    let us = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0);
    Epoch(us)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn draws_differ_and_epochs_advance() {
        let a: [u8; 16] = random().unwrap();
        let b: [u8; 16] = random().unwrap();
        assert_ne!(a, b);
        let e1 = epoch_now();
        std::thread::sleep(std::time::Duration::from_millis(2));
        assert!(epoch_now() > e1);
    }
}
