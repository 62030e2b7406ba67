//! Who may use kvtierd's Unix sockets (`[server.unix]`): the socket files' mode, and the
//! SO_PEERCRED allow-list checked on every connection. Peers of another uid are real
//! processes run as `nobody` (the test needs root to start them; CI runs as root).
#![allow(missing_docs)]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;
use std::process::Command;

use common::*;
use kvtier_client::HostClient;

/// What a peer running as `nobody` gets from the socket at `path`: "EACCES" (the kernel
/// refused the connect), "CLOSED" (kvtierd closed it unanswered) or "SERVED" (kvtierd
/// answered the HTTP/2 preface with its SETTINGS).
fn probe_as_nobody(path: &Path) -> String {
    probe_as(path, "")
}

/// [`probe_as_nobody`] with supplementary `groups` (comma-separated), through util-linux's
/// `setpriv`.
fn probe_as(path: &Path, groups: &str) -> String {
    const PROBE: &str = r#"
import socket, sys
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(sys.argv[1])
except PermissionError:
    print("EACCES"); sys.exit(0)
try:
    s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0]))
    s.settimeout(10)
    print("SERVED" if s.recv(9) else "CLOSED")
except (ConnectionResetError, BrokenPipeError):
    print("CLOSED")
"#;
    let nobody = NOBODY.to_string();
    let mut cmd = Command::new("setpriv");
    cmd.args(["--reuid", &nobody, "--regid", &nobody]);
    match groups {
        "" => cmd.arg("--clear-groups"),
        g => cmd.args(["--groups", g]),
    };
    let out = cmd
        // Debian's interpreter: one under root's home is not readable by nobody.
        .args(["/usr/bin/python3", "-c", PROBE])
        .arg(path)
        .output()
        .expect("setpriv (util-linux) and /usr/bin/python3 run");
    assert!(out.status.success(), "{out:?}");
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

fn mode(path: &Path) -> u32 {
    std::fs::metadata(path).unwrap().permissions().mode() & 0o777
}

fn denied(d: &Daemon, socket: &str) -> f64 {
    metric(
        &d.metrics(),
        &format!("kvtier_server_denied_connections_total{{socket=\"{socket}\"}}"),
    )
}

#[test]
fn the_default_mode_keeps_other_users_out_at_connect() {
    if !is_root() {
        eprintln!("skipped: starting a peer as another uid needs root");
        return;
    }
    let d = Daemon::start("uds-default", &["sglang_rpc.enable=true"]);
    for sock in ["kvtierd.sock", "sglang-mempool.sock", "sglang-grpc.sock"] {
        let p = d.dir.join(sock);
        assert_eq!(mode(&p), 0o600, "{sock}");
        assert_eq!(probe_as_nobody(&p), "EACCES", "{sock}");
    }
    // Its own uid is served.
    rt().block_on(async {
        let mut c = HostClient::connect(&d.target()).await.unwrap();
        c.register("owner", &layout("m")).await.unwrap();
    });
}

#[test]
fn peers_outside_the_allow_list_are_closed_logged_and_counted() {
    if !is_root() {
        eprintln!("skipped: starting a peer as another uid needs root");
        return;
    }
    // A world-writable socket: only the peer check stands between nobody and kvtierd.
    let d = Daemon::start(
        "uds-refuse",
        &["server.unix.mode=0666", "sglang_rpc.enable=true"],
    );
    let control = d.dir.join("kvtierd.sock");
    assert_eq!(mode(&control), 0o666);
    // Many refused peers at once, while the owner's calls keep working.
    let probes: Vec<_> = (0..8)
        .map(|_| {
            let p = control.clone();
            std::thread::spawn(move || probe_as_nobody(&p))
        })
        .collect();
    rt().block_on(async {
        let mut c = HostClient::connect(&d.target()).await.unwrap();
        let s = c.register("owner", &layout("m")).await.unwrap();
        let keys = chain(3, 4);
        store(&mut c, &s, &keys).await;
        assert_eq!(c.lookup(s.id, &keys).await.unwrap(), keys.len());
    });
    for p in probes {
        assert_eq!(p.join().unwrap(), "CLOSED");
    }
    assert_eq!(denied(&d, "control"), 8.0);
    assert_eq!(
        probe_as_nobody(&d.dir.join("sglang-mempool.sock")),
        "CLOSED"
    );
    assert_eq!(denied(&d, "sglang_mempool"), 1.0);
}

#[test]
fn listed_uids_and_gids_are_admitted() {
    if !is_root() {
        eprintln!("skipped: starting a peer as another uid needs root");
        return;
    }
    for (name, allow) in [
        ("uds-uid", format!("server.unix.allow_uids=1,{NOBODY}")),
        ("uds-gid", format!("server.unix.allow_gids={NOBODY}")),
    ] {
        let d = Daemon::start(name, &["server.unix.mode=0666", &allow]);
        assert_eq!(
            probe_as_nobody(&d.dir.join("kvtierd.sock")),
            "SERVED",
            "{allow}"
        );
        assert_eq!(denied(&d, "control"), 0.0);
    }
    // A supplementary group counts (engines join a service's group that way); another
    // group does not.
    let d = Daemon::start(
        "uds-groups",
        &["server.unix.mode=0666", "server.unix.allow_gids=4242"],
    );
    let sock = d.dir.join("kvtierd.sock");
    assert_eq!(probe_as(&sock, "4243,4242"), "SERVED");
    assert_eq!(probe_as(&sock, "4243"), "CLOSED");
    assert_eq!(denied(&d, "control"), 1.0);
}

#[test]
fn socket_owner_and_group_come_from_config() {
    if !is_root() {
        eprintln!("skipped: chown needs root");
        return;
    }
    use std::os::unix::fs::MetadataExt as _;
    let d = Daemon::start(
        "uds-owner",
        &[
            &format!("server.unix.uid={NOBODY}"),
            &format!("server.unix.gid={NOBODY}"),
            "server.unix.mode=0660",
        ],
    );
    let meta = std::fs::metadata(d.dir.join("kvtierd.sock")).unwrap();
    assert_eq!(
        (meta.uid(), meta.gid(), meta.mode() & 0o777),
        (NOBODY, NOBODY, 0o660)
    );
    // The file now lets nobody connect, but the peer check still refuses it: two locks.
    assert_eq!(probe_as_nobody(&d.dir.join("kvtierd.sock")), "CLOSED");
}
