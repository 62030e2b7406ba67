//! kvtierd's TCP listener under TLS and bearer tokens: real certificates made with Debian's
//! `openssl`, a real daemon process, the real clients (HostClient, the remote L3 backend,
//! kvtierctl's environment).
#![allow(missing_docs)]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;
use kvtier_client::{ClientError, HostClient, TcpSecurity};
use kvtier_storage::Store as _;

const TOKEN: &str = "t0ken-for-tcp";

/// A throwaway CA, a server certificate for 127.0.0.1 and a client certificate.
struct Pki {
    dir: PathBuf,
}

impl Pki {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("kvtier-pki-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let run = |args: &[&str]| {
            let out = Command::new("openssl")
                .args(args)
                .current_dir(&dir)
                .output()
                .expect("openssl runs (Debian package openssl; scripts/setup installs it)");
            assert!(out.status.success(), "openssl {args:?}: {out:?}");
        };
        let ec = [
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
        ];
        run(&[
            &["req", "-x509"][..],
            &ec,
            &[
                "-keyout",
                "ca.key",
                "-out",
                "ca.pem",
                "-days",
                "2",
                "-subj",
                "/CN=kvtier test CA",
            ],
        ]
        .concat());
        for (who, ext) in [
            (
                "server",
                "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\nbasicConstraints=CA:FALSE\n",
            ),
            (
                "client",
                "extendedKeyUsage=clientAuth\nbasicConstraints=CA:FALSE\n",
            ),
        ] {
            std::fs::write(dir.join(format!("{who}.ext")), ext).unwrap();
            let (key, csr, pem, extf) = (
                format!("{who}.key"),
                format!("{who}.csr"),
                format!("{who}.pem"),
                format!("{who}.ext"),
            );
            run(&[
                &["req"][..],
                &ec,
                &[
                    "-keyout",
                    &key,
                    "-out",
                    &csr,
                    "-subj",
                    &format!("/CN={who}"),
                ],
            ]
            .concat());
            run(&[
                "x509",
                "-req",
                "-in",
                &csr,
                "-CA",
                "ca.pem",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-out",
                &pem,
                "-days",
                "2",
                "-extfile",
                &extf,
            ]);
        }
        Self { dir }
    }

    fn path(&self, f: &str) -> String {
        self.dir.join(f).display().to_string()
    }

    fn client(&self, token: Option<&str>, with_cert: bool) -> TcpSecurity {
        let (cert, key) = (self.dir.join("client.pem"), self.dir.join("client.key"));
        let (cert, key) = if with_cert {
            (Some(cert.as_path()), Some(key.as_path()))
        } else {
            (None, None)
        };
        let ca = self.dir.join("ca.pem");
        TcpSecurity::from_files(token.map(String::from), Some(&ca), cert, key).unwrap()
    }
}

impl Drop for Pki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn tls_daemon(name: &str, pki: &Pki, extra: &[&str]) -> Daemon {
    let sets: Vec<String> = [
        "l2.pool_pages=16".to_string(),
        "l3.backend=memory".to_string(),
        "server.tcp=127.0.0.1:0".to_string(),
        format!("server.tls_cert={}", pki.path("server.pem")),
        format!("server.tls_key={}", pki.path("server.key")),
        format!("server.token={TOKEN}"),
    ]
    .into_iter()
    .chain(extra.iter().map(|s| s.to_string()))
    .collect();
    Daemon::start(name, &sets.iter().map(String::as_str).collect::<Vec<_>>())
}

fn code(e: ClientError) -> tonic::Code {
    e.code()
        .unwrap_or_else(|| panic!("expected a status, got {e}"))
}

fn denied(d: &Daemon) -> u64 {
    d.metrics()
        .lines()
        .find_map(|l| l.strip_prefix("kvtier_server_denied_calls_total "))
        .map_or(0, |v| v.trim().parse().unwrap())
}

#[test]
fn tls_with_a_token_serves_every_call_and_refuses_the_rest() {
    let pki = Pki::new("tls");
    let d = tls_daemon("tls", &pki, &[]);
    let target = format!("https://{}", d.tcp);
    rt().block_on(async {
        // With the CA and the token: the host tier works, pages round-trip.
        let good = pki.client(Some(TOKEN), false);
        let mut c = HostClient::connect_with(&target, &good).await.unwrap();
        let s = c.register("over-tls", &layout("m")).await.unwrap();
        let keys = chain(7, 3);
        let bytes = store(&mut c, &s, &keys).await;
        let mut u = HostClient::connect(&d.target()).await.unwrap();
        let s2 = u.register("over-uds", &layout("m")).await.unwrap();
        let found = u.lookup(s2.id, &keys).await.unwrap();
        assert_eq!(found, keys.len(), "the Unix socket sees what TLS stored");
        drop(bytes);

        // Many calls at once without a token or with a wrong one: every one refused.
        let before = denied(&d);
        let mut tasks = Vec::new();
        for i in 0..16 {
            let t = target.clone();
            let sec = pki.client((i % 2 == 0).then_some("wrong-token"), false);
            tasks.push(tokio::spawn(async move {
                let mut c = HostClient::connect_with(&t, &sec).await.unwrap();
                c.register("intruder", &layout("m")).await.map(|s| s.id)
            }));
        }
        for t in tasks {
            let e = t
                .await
                .unwrap()
                .expect_err("a call without the token was served");
            assert_eq!(code(e), tonic::Code::Unauthenticated);
        }
        assert_eq!(denied(&d) - before, 16, "each refusal is counted");

        // Health checks need no token (probes); plain HTTP/2 on the TLS port gets nothing.
        let no_token = pki.client(None, false);
        assert_eq!(
            kvtier_client::health_with(&target, &no_token)
                .await
                .unwrap(),
            "SERVING"
        );
        let plain = format!("http://{}", d.tcp);
        assert!(kvtier_client::health(&plain).await.is_err());
        // https without a CA is a clear local error, not a silent insecure connection.
        let e = kvtier_client::health_with(&target, &TcpSecurity::default())
            .await
            .unwrap_err();
        assert!(e.to_string().contains("CA"), "{e}");

        // The remote L3 backend over the same listener, with and without the token.
        let remote = kvtier_storage::remote::RemoteStore::connect_with(&target, &good).unwrap();
        kvtier_storage::conformance::round_trip(&remote).await;
        let anon = kvtier_storage::remote::RemoteStore::connect_with(&target, &no_token).unwrap();
        assert!(
            anon.get("ab/01").await.is_err(),
            "an object read without the token"
        );
    });
    // What was stored over TLS is still there for the rightful client.
    assert!(denied(&d) >= 17);
}

#[test]
fn client_certificates_are_required_when_the_server_names_a_ca() {
    let pki = Pki::new("mtls");
    let ca = format!("server.tls_client_ca={}", pki.path("ca.pem"));
    let d = tls_daemon("mtls", &pki, &[&ca]);
    let target = format!("https://{}", d.tcp);
    rt().block_on(async {
        let with = pki.client(Some(TOKEN), true);
        assert_eq!(
            kvtier_client::health_with(&target, &with).await.unwrap(),
            "SERVING"
        );
        let mut c = HostClient::connect_with(&target, &with).await.unwrap();
        c.register("mtls", &layout("m")).await.unwrap();
        let without = pki.client(Some(TOKEN), false);
        assert!(
            kvtier_client::health_with(&target, &without).await.is_err(),
            "a client without a certificate got through"
        );
    });
}

#[test]
fn tcp_without_tls_is_refused_off_loopback_and_names_the_key() {
    let dir = std::env::temp_dir().join(format!("kvtierd-test-{}-notls", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_kvtierd"))
        .args(["--set", &format!("data_dir={}", dir.display())])
        .args(["--set", "server.tcp=0.0.0.0:0", "--check-config"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("server.tcp") && err.contains("TLS"), "{err}");
    let out = Command::new(env!("CARGO_BIN_EXE_kvtierd"))
        .args([
            "--set",
            "server.tcp=0.0.0.0:0",
            "--set",
            "server.tcp_insecure=true",
        ])
        .arg("--check-config")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("loopback"), "{err}");
    assert!(!Path::new(&dir).join("kvtierd.sock").exists());
}

#[test]
fn a_remote_l3_configured_with_tls_and_a_token_file_stores_on_its_peer() {
    let pki = Pki::new("remote");
    let peer = tls_daemon("tls-peer", &pki, &[]);
    let token_file = pki.path("token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).unwrap();
    let user = Daemon::start(
        "tls-user",
        &[
            "l2.pool_pages=32",
            "l3.backend=remote",
            "l3.write_policy=write_through",
            &format!("l3.remote.address=https://{}", peer.tcp),
            &format!("l3.remote.tls_ca={}", pki.path("ca.pem")),
            &format!("l3.remote.token_file={token_file}"),
        ],
    );
    rt().block_on(async {
        let mut c = HostClient::connect(&user.target()).await.unwrap();
        let s = c.register("w", &layout("m")).await.unwrap();
        let keys = chain(11, 5);
        store(&mut c, &s, &keys).await;
        // The pages reach the peer's own tier, over TLS with the token from the file.
        let mut p = HostClient::connect(&peer.target()).await.unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while p.stats().await.unwrap().l3.unwrap().objects < keys.len() as u64 {
            assert!(
                std::time::Instant::now() < deadline,
                "the peer never got the pages"
            );
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    });
    assert_eq!(denied(&peer), 0, "the configured client was refused");
}

#[test]
fn tcp_connections_that_never_start_tls_are_closed_and_the_listener_keeps_serving() {
    use std::io::Read as _;
    let pki = Pki::new("tls-silent");
    let d = tls_daemon(
        "tls-silent",
        &pki,
        &["server.connections.handshake_timeout=300ms"],
    );
    // Connections that never send a ClientHello, and one that stops inside it.
    let mut silent: Vec<std::net::TcpStream> = (0..40)
        .map(|_| std::net::TcpStream::connect(&d.tcp).unwrap())
        .collect();
    let mut partial = std::net::TcpStream::connect(&d.tcp).unwrap();
    let _ = std::io::Write::write_all(&mut partial, &[0x16, 0x03, 0x01, 0x02, 0x00]);
    silent.push(partial);
    for s in &mut silent {
        s.set_read_timeout(Some(std::time::Duration::from_secs(5)))
            .unwrap();
        let mut b = [0u8; 64];
        let closed = match s.read(&mut b) {
            Ok(0) => true,
            Ok(_) => false,
            Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
        };
        assert!(closed, "a connection that never finished TLS was kept");
    }
    rt().block_on(async {
        let good = pki.client(Some(TOKEN), false);
        let target = format!("https://{}", d.tcp);
        let mut c = HostClient::connect_with(&target, &good).await.unwrap();
        c.register("after-the-flood", &layout("m")).await.unwrap();
    });
}
