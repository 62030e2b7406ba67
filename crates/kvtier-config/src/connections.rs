//! `[server.connections]`: how many connections each listener of a process holds, per peer
//! and in all, and how long a new one has to start speaking. Shared by kvtierd (its control
//! socket, its TCP listener and SGLang's two sockets) and kvtier-agent (the engine's socket).

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::{ConfigError, Dur};

/// The commented `[server.connections]` table of both processes' default files, as a
/// literal for `concat!`.
#[macro_export]
macro_rules! connections_default_toml {
    () => {
        r#"
[server.connections]
# Most connections one listener holds open at once (1 to 65536). A connection past it is
# closed at accept, logged (at most every 10 s) and counted in
# kvtier_server_refused_connections_total{reason="limit"}, so no client can use up the
# process's file descriptors. Every listener (the sockets, TCP, the metrics endpoint,
# kvtierd's pool door, the agent's memory door) has its own. The process raises its own descriptor limit to the hard limit at
# start, and lowers max (and per_peer) to an equal share per listener of that limit less 64
# where that is smaller (logged), so a flood on one listener never starves another.
max = 1024
# Most of them from one peer: one uid on a Unix socket, one IP address over TCP (1 to max).
per_peer = 256
# How long a new connection has to send its first bytes: the HTTP/2 preface, the TLS
# handshake over TCP, SGLang's pool registration, a pool door request, a memory door
# deposit, an HTTP request's headers on the metrics endpoint (100ms to 5m). A connection that stays silent is closed
# and counted in kvtier_server_connection_timeouts_total.
handshake_timeout = "10s"
"#
    };
}

/// `[server.connections]`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ConnectionLimits {
    /// Most connections per listener.
    pub max: u32,
    /// Most connections per peer (uid or IP) per listener.
    pub per_peer: u32,
    /// Time a new connection has for its first bytes.
    pub handshake_timeout: Dur,
}

impl ConnectionLimits {
    /// Checks the bounds; `section` names the table (`server.connections`).
    pub fn validate(&self, section: &str) -> Result<(), ConfigError> {
        let (max, per_peer) = (format!("{section}.max"), format!("{section}.per_peer"));
        crate::check_ranges(&[
            (&max, u64::from(self.max), 1, 65536),
            (&per_peer, u64::from(self.per_peer), 1, u64::from(self.max)),
        ])?;
        let t = self.handshake_timeout.0;
        if t < Duration::from_millis(100) || t > Duration::from_secs(300) {
            return Err(ConfigError::invalid(
                format!("{section}.handshake_timeout"),
                format!("{} is outside 100ms..=5m", self.handshake_timeout),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_are_bounded_and_errors_name_the_key() {
        ConnectionLimits::default()
            .validate("server.connections")
            .unwrap();
        let over = ConnectionLimits {
            per_peer: 2000,
            ..ConnectionLimits::default()
        };
        let e = over.validate("server.connections").unwrap_err().to_string();
        assert!(e.contains("server.connections.per_peer"), "{e}");
        let quick = ConnectionLimits {
            handshake_timeout: Dur(Duration::from_millis(10)),
            ..ConnectionLimits::default()
        };
        let e = quick
            .validate("server.connections")
            .unwrap_err()
            .to_string();
        assert!(e.contains("handshake_timeout"), "{e}");
    }
}
