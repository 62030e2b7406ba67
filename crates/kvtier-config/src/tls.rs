//! The rules for kvtier's TCP endpoints, in one place: who must use TLS, where a token comes
//! from, and which combinations of keys make sense. The daemon's `[server]` and the remote
//! backend's `[l3.remote]` both check through here.

use std::path::Path;

use crate::{ConfigError, Secret};

/// A bearer token: `token`, or the trimmed contents of `token_file`; `None` when neither is
/// set. `key` names the token key in errors (its `_file` sibling is named after it).
pub fn resolve_token(
    token: &Secret,
    token_file: Option<&Path>,
    key: &str,
) -> Result<Option<String>, ConfigError> {
    one_token_source(token, token_file, key)?;
    let file_key = format!("{key}_file");
    let t = match (token.expose().is_empty(), token_file) {
        (true, None) => return Ok(None),
        (false, _) => token.expose().to_string(),
        (true, Some(file)) => std::fs::read_to_string(file)
            .map_err(|e| ConfigError::invalid(&file_key, format!("reading {file:?}: {e}")))?
            .trim()
            .to_string(),
    };
    let from = if token_file.is_none() {
        key.to_string()
    } else {
        file_key
    };
    if t.is_empty() {
        return Err(ConfigError::invalid(&from, "the token is empty"));
    }
    if !t.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(ConfigError::invalid(
            &from,
            "a token is printable ASCII without spaces (it travels in an HTTP header)",
        ));
    }
    Ok(Some(t))
}

/// Equality of tokens in time that depends neither on where they differ nor on the secret's
/// length: both are hashed (SHA-256) and the digests compared byte by byte, so a caller
/// learns nothing from how long a wrong guess took, not even whether its length was right.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    use sha2::{Digest, Sha256};
    let (x, y) = (Sha256::digest(a), Sha256::digest(b));
    x.iter()
        .zip(y.iter())
        .fold(0u8, |acc, (p, q)| acc | (p ^ q))
        == 0
}

/// A token comes from `key` or `<key>_file`, not both.
pub fn one_token_source(
    token: &Secret,
    token_file: Option<&Path>,
    key: &str,
) -> Result<(), ConfigError> {
    if !token.expose().is_empty() && token_file.is_some() {
        return Err(ConfigError::invalid(
            key,
            format!("set {key} or {key}_file, not both"),
        ));
    }
    Ok(())
}

/// The `[server]` keys about TCP, borrowed for [`check_server`].
#[derive(Debug)]
pub struct ServerTls<'a> {
    /// `server.tcp`.
    pub tcp: Option<&'a str>,
    /// `server.tls_cert`.
    pub tls_cert: Option<&'a Path>,
    /// `server.tls_key`.
    pub tls_key: Option<&'a Path>,
    /// `server.tls_client_ca`.
    pub tls_client_ca: Option<&'a Path>,
    /// `server.token`.
    pub token: &'a Secret,
    /// `server.token_file`.
    pub token_file: Option<&'a Path>,
    /// `server.tcp_insecure`.
    pub tcp_insecure: bool,
}

/// TCP needs a token, and TLS or an explicit `tcp_insecure` on a loopback address.
pub fn check_server(s: &ServerTls<'_>) -> Result<(), ConfigError> {
    if s.tls_cert.is_none() != s.tls_key.is_none() {
        return Err(ConfigError::invalid(
            if s.tls_cert.is_none() {
                "server.tls_cert"
            } else {
                "server.tls_key"
            },
            "server.tls_cert and server.tls_key go together",
        ));
    }
    let tls = s.tls_cert.is_some();
    if s.tls_client_ca.is_some() && !tls {
        return Err(ConfigError::invalid(
            "server.tls_client_ca",
            "client certificates need TLS: set server.tls_cert and server.tls_key",
        ));
    }
    one_token_source(s.token, s.token_file, "server.token")?;
    let Some(tcp) = s.tcp else {
        return Ok(());
    };
    let Ok(addr) = tcp.parse::<std::net::SocketAddr>() else {
        return Err(ConfigError::invalid(
            "server.tcp",
            format!("{tcp:?} is not an address such as 0.0.0.0:50051"),
        ));
    };
    if tls && s.tcp_insecure {
        return Err(ConfigError::invalid(
            "server.tcp_insecure",
            "is true, but server.tls_cert is set too: choose one",
        ));
    }
    if !tls && !s.tcp_insecure {
        return Err(ConfigError::invalid(
            "server.tcp",
            "TCP needs TLS (server.tls_cert and server.tls_key) and server.token; or, on a \
             loopback address only, server.tcp_insecure = true",
        ));
    }
    if s.tcp_insecure && !addr.ip().is_loopback() {
        return Err(ConfigError::invalid(
            "server.tcp_insecure",
            format!(
                "only on a loopback address, and server.tcp is {addr}: use TLS \
                 (server.tls_cert, server.tls_key, server.token) to listen there"
            ),
        ));
    }
    // Without a token, a TCP listener on loopback would let every local user past
    // server.unix's mode and allow-lists.
    if s.token.expose().is_empty() && s.token_file.is_none() {
        return Err(ConfigError::invalid(
            "server.token",
            "TCP needs a token, with TLS or tcp_insecure (server.token, KVTIER_SERVER_TOKEN \
             or server.token_file): without one every local user could reach kvtierd past \
             server.unix's allow-lists",
        ));
    }
    Ok(())
}

/// The client-side keys of a TCP target (`[l3.remote]`), checked against its address.
pub fn check_client(
    section: &str,
    address: &str,
    tls_ca: Option<&Path>,
    tls_cert: Option<&Path>,
    tls_key: Option<&Path>,
) -> Result<(), ConfigError> {
    if tls_cert.is_none() != tls_key.is_none() {
        return Err(ConfigError::invalid(
            format!("{section}.tls_cert"),
            format!("{section}.tls_cert and {section}.tls_key go together"),
        ));
    }
    let https = address.starts_with("https://");
    if https && tls_ca.is_none() {
        return Err(ConfigError::invalid(
            format!("{section}.tls_ca"),
            format!("{address} is https: name the PEM CA bundle its certificate chains to"),
        ));
    }
    if !https && (tls_ca.is_some() || tls_cert.is_some()) {
        return Err(ConfigError::invalid(
            format!("{section}.address"),
            format!("TLS keys are set, so the address must be https://host:port, not {address:?}"),
        ));
    }
    // Plaintext only where the bytes never leave the host: the pages and the token would
    // cross the network in clear.
    if let Some(hostport) = address.strip_prefix("http://")
        && !is_loopback(hostport)
    {
        return Err(ConfigError::invalid(
            format!("{section}.address"),
            format!(
                "{address:?} is plaintext off this host: http:// is for loopback (127.0.0.1, \
                 [::1], localhost) only; use https:// with {section}.tls_ca"
            ),
        ));
    }
    Ok(())
}

/// Whether `host:port` (an http URL's authority, perhaps with a path after it) names this
/// host: a loopback IP address or `localhost`.
fn is_loopback(hostport: &str) -> bool {
    let authority = hostport.split('/').next().unwrap_or_default();
    if let Ok(a) = authority.parse::<std::net::SocketAddr>() {
        return a.ip().is_loopback();
    }
    let host = authority
        .rsplit_once(':')
        .map_or(authority, |(h, _)| h)
        .trim_start_matches('[')
        .trim_end_matches(']');
    host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

#[cfg(test)]
mod tests {

    #[test]
    fn plaintext_remotes_stay_on_this_host() {
        let ok = |a: &str| check_client("l3.remote", a, None, None, None).is_ok();
        for a in [
            "http://127.0.0.1:5000",
            "http://127.9.0.1:5000",
            "http://[::1]:5000",
            "http://localhost:5000",
            "https://10.0.0.1:5000",
            "/run/kvtier/peer.sock",
        ] {
            assert!(ok(a) || a.starts_with("https"), "{a}");
        }
        for a in [
            "http://10.0.0.1:5000",
            "http://peer.example:5000",
            "http://[fe80::1]:1",
        ] {
            let e = check_client("l3.remote", a, None, None, None)
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("l3.remote.address") && e.contains("loopback"),
                "{a}: {e}"
            );
        }
    }

    #[test]
    fn tokens_compare_equal_only_when_equal_whatever_their_lengths() {
        assert!(constant_time_eq(b"hunter2", b"hunter2"));
        assert!(!constant_time_eq(b"hunter2", b"hunter3"));
        assert!(!constant_time_eq(b"hunter2", b"hunter22"));
        assert!(!constant_time_eq(b"", b"x"));
        assert!(constant_time_eq(b"", b""));
    }

    use super::*;

    fn server<'a>(tcp: &'a str, cert: &'a str, token: &'a Secret, insecure: bool) -> ServerTls<'a> {
        let cert = (!cert.is_empty()).then(|| Path::new(cert));
        ServerTls {
            tcp: (!tcp.is_empty()).then_some(tcp),
            tls_cert: cert,
            tls_key: cert,
            tls_client_ca: None,
            token,
            token_file: None,
            tcp_insecure: insecure,
        }
    }

    #[test]
    fn tcp_needs_tls_and_a_token_or_insecure_loopback() {
        let none = Secret::default();
        let tok = Secret("abc".into());
        let err = |s: ServerTls<'_>| check_server(&s).unwrap_err().to_string();
        assert!(check_server(&server("", "", &none, false)).is_ok());
        assert!(err(server("0.0.0.0:1", "", &none, false)).contains("server.tcp"));
        assert!(err(server("0.0.0.0:1", "", &none, true)).contains("loopback"));
        // Loopback without TLS still needs a token: other local users are no tenants.
        assert!(err(server("127.0.0.1:0", "", &none, true)).contains("server.token"));
        assert!(check_server(&server("127.0.0.1:0", "", &tok, true)).is_ok());
        assert!(check_server(&server("[::1]:0", "", &tok, true)).is_ok());
        assert!(err(server("0.0.0.0:1", "c.pem", &none, false)).contains("server.token"));
        assert!(check_server(&server("0.0.0.0:1", "c.pem", &tok, false)).is_ok());
        assert!(err(server("0.0.0.0:1", "c.pem", &tok, true)).contains("tcp_insecure"));
    }

    #[test]
    fn a_token_comes_from_one_place_and_is_header_safe() {
        let dir = std::env::temp_dir().join(format!("kvtier-token-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("t");
        std::fs::write(&f, "  s3cret\n").unwrap();
        let f = Some(f.as_path());
        let none = Secret::default();
        assert_eq!(resolve_token(&none, None, "server.token").unwrap(), None);
        assert_eq!(
            resolve_token(&none, f, "server.token").unwrap().as_deref(),
            Some("s3cret")
        );
        let both = resolve_token(&Secret("x".into()), f, "server.token").unwrap_err();
        assert!(both.to_string().contains("not both"), "{both}");
        let bad = resolve_token(&Secret("a b".into()), None, "server.token").unwrap_err();
        assert!(bad.to_string().contains("server.token"), "{bad}");
        let missing =
            resolve_token(&none, Some(Path::new("/nonexistent/t")), "l3.remote.token").unwrap_err();
        assert!(
            missing.to_string().contains("l3.remote.token_file"),
            "{missing}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn client_keys_match_the_address() {
        assert!(check_client("l3.remote", "http://localhost:1", None, None, None).is_ok());
        assert!(
            check_client(
                "l3.remote",
                "https://h:1",
                Some(Path::new("ca.pem")),
                None,
                None
            )
            .is_ok()
        );
        let e = check_client("l3.remote", "https://h:1", None, None, None).unwrap_err();
        assert!(e.to_string().contains("l3.remote.tls_ca"), "{e}");
        let e = check_client(
            "l3.remote",
            "http://h:1",
            Some(Path::new("ca.pem")),
            None,
            None,
        )
        .unwrap_err();
        assert!(e.to_string().contains("https"), "{e}");
        let e = check_client(
            "l3.remote",
            "https://h:1",
            Some(Path::new("ca.pem")),
            Some(Path::new("c")),
            None,
        )
        .unwrap_err();
        assert!(e.to_string().contains("tls_key"), "{e}");
    }
}
