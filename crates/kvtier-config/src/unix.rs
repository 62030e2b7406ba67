//! `[server.unix]`: who may use a process's Unix sockets. Shared by kvtierd (its control
//! socket and SGLang's two sockets) and kvtier-agent (the engine's socket).
//!
//! Two locks, each enough on its own: the socket file's mode and owner, which the kernel checks
//! at `connect`, and an allow-list of peer uids and gids, which the server checks with
//! `SO_PEERCRED` on every accepted connection. The server's own uid is always allowed.

use serde::{Deserialize, Serialize};

use crate::ConfigError;

/// The commented `[server.unix]` table of both processes' default files, as a literal for
/// `concat!`.
#[macro_export]
macro_rules! unix_default_toml {
    () => {
        r#"
[server.unix]
# Permission bits of the socket files, in octal. Connecting needs write permission, so
# "0600" admits only the owner, "0660" the owner and the group, "0666" anyone (the peer
# allow-list below still applies). The owner must keep read and write.
mode = "0600"
# Owner and group given to the socket files (numeric ids; needs the privilege to chown).
# -1: leave them as created (the server's own uid and gid).
uid = -1
gid = -1
# Peers admitted, checked on every connection with SO_PEERCRED and SO_PEERGROUPS: a peer
# whose uid is listed, or one of whose groups (primary or supplementary) is listed, is
# served; every other is closed at once, logged, and counted in
# kvtier_server_denied_connections_total. The server's own uid is always admitted. Root
# (uid 0) is not admitted unless listed or the server runs as root. Environment and --set
# take comma-separated lists, e.g. KVTIER_SERVER_UNIX_ALLOW_UIDS=1000,1001.
allow_uids = []
allow_gids = []
"#
    };
}

/// `[server.unix]`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct UnixAccess {
    /// Permission bits of the socket files.
    pub mode: FileMode,
    /// Owner of the socket files; -1 keeps the creator.
    pub uid: i64,
    /// Group of the socket files; -1 keeps the creator's.
    pub gid: i64,
    /// Peer uids admitted besides the server's own.
    pub allow_uids: Vec<u32>,
    /// Peer gids (primary or supplementary) admitted.
    pub allow_gids: Vec<u32>,
}

impl UnixAccess {
    /// Checks the ids are -1 or a valid id; `section` names the table (`server.unix`).
    pub fn validate(&self, section: &str) -> Result<(), ConfigError> {
        for (key, v) in [("uid", self.uid), ("gid", self.gid)] {
            if v != -1 && !(0..i64::from(u32::MAX)).contains(&v) {
                return Err(ConfigError::invalid(
                    format!("{section}.{key}"),
                    format!("{v} is neither -1 (leave as created) nor an id in 0..=4294967294"),
                ));
            }
        }
        Ok(())
    }

    /// The owner to set, if any.
    pub fn owner(&self) -> Option<u32> {
        u32::try_from(self.uid).ok()
    }

    /// The group to set, if any.
    pub fn group(&self) -> Option<u32> {
        u32::try_from(self.gid).ok()
    }

    /// Whether a peer with `uid` may connect to a server running as `own` without looking at
    /// its groups.
    pub fn admits_uid(&self, own: u32, uid: u32) -> bool {
        uid == own || self.allow_uids.contains(&uid)
    }

    /// Whether any of a peer's groups (primary and supplementary) is allowed.
    pub fn admits_groups(&self, groups: &[u32]) -> bool {
        groups.iter().any(|g| self.allow_gids.contains(g))
    }
}

/// Unix permission bits, written in config as an octal string ("0660").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileMode(pub u32);

impl FileMode {
    /// The bits.
    pub fn bits(self) -> u32 {
        self.0
    }
}

impl std::str::FromStr for FileMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let digits = s.trim();
        let bits = u32::from_str_radix(digits, 8)
            .ok()
            .filter(|b| !digits.is_empty() && *b <= 0o777)
            .ok_or_else(|| {
                format!("{s:?} is not permission bits in octal, 0000 to 0777 (e.g. \"0660\")")
            })?;
        if bits & 0o600 != 0o600 {
            return Err(format!(
                "{s:?} takes read or write from the socket's owner; the owner needs both (0600 at least)"
            ));
        }
        Ok(Self(bits))
    }
}

impl<'de> Deserialize<'de> for FileMode {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

impl Serialize for FileMode {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format!("{:04o}", self.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_parse_in_octal_and_keep_the_owner() {
        assert_eq!("0660".parse::<FileMode>().unwrap().bits(), 0o660);
        assert_eq!("600".parse::<FileMode>().unwrap().bits(), 0o600);
        for bad in ["", "0999", "01777", "rw", "0400", "0200", "0066"] {
            let e = bad.parse::<FileMode>().unwrap_err();
            assert!(e.contains(&format!("{bad:?}")), "{e}");
        }
    }

    #[test]
    fn ids_are_minus_one_or_real() {
        let ok = UnixAccess {
            uid: 1000,
            gid: -1,
            ..UnixAccess::default()
        };
        ok.validate("server.unix").unwrap();
        assert_eq!((ok.owner(), ok.group()), (Some(1000), None));
        for (uid, gid, key) in [(-2, -1, "server.unix.uid"), (0, 1 << 32, "server.unix.gid")] {
            let bad = UnixAccess {
                uid,
                gid,
                ..UnixAccess::default()
            };
            let e = bad.validate("server.unix").unwrap_err().to_string();
            assert!(e.contains(key), "{e}");
        }
    }

    #[test]
    fn own_uid_listed_uids_and_listed_groups_are_admitted() {
        let a = UnixAccess {
            allow_uids: vec![1001],
            allow_gids: vec![50],
            ..UnixAccess::default()
        };
        assert!(a.admits_uid(1000, 1000));
        assert!(a.admits_uid(1000, 1001));
        assert!(!a.admits_uid(1000, 4242));
        assert!(!a.admits_uid(1000, 0), "root is not admitted implicitly");
        assert!(a.admits_groups(&[7, 50]));
        assert!(!a.admits_groups(&[7, 1000]));
        assert!(!UnixAccess::default().admits_groups(&[1000]));
    }
}
