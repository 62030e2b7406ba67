//! No name kvtierd creates can be planted by anyone else (issue 62 item 1): its pools and slot
//! tables live in a directory of its own, `kvtierd-<uid>` in `l2.shm_dir`, mode 0700, opened
//! without following a symlink and checked to be kvtierd's before anything is made in it.
//! What another user can do in a shared `/dev/shm` is plant that directory's name, and then
//! kvtierd refuses to start (naming the path and the owner) rather than use it. A real
//! kvtierd; other uids through `chown` where the test runs as root.
#![allow(missing_docs)]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;
use kvtier_client::HostClient;

/// A directory shaped like /dev/shm (mode 1777: every local user may create names in it).
fn shared_shm(dir: &Path) -> PathBuf {
    let shm = dir.join("shm");
    std::fs::create_dir_all(&shm).unwrap();
    std::fs::set_permissions(&shm, std::fs::Permissions::from_mode(0o1777)).unwrap();
    shm
}

fn own(shm: &Path) -> PathBuf {
    shm.join(format!("kvtierd-{}", rustix::process::geteuid().as_raw()))
}

/// Runs kvtierd on `dir` with `shm` as `l2.shm_dir`, expecting it to refuse to start: its
/// stderr.
fn refused_start(dir: &Path, shm: &Path) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_kvtierd"))
        .args(["--set", &format!("data_dir={}", dir.display())])
        .args(["--set", &format!("l2.shm_dir={}", shm.display())])
        .args(["--set", "metrics.listen=", "--set", "l3.backend=none"])
        .output()
        .unwrap();
    assert!(!out.status.success(), "kvtierd started");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn a_planted_pool_directory_stops_kvtierd_and_a_wide_one_of_its_own_is_narrowed() {
    let dir = std::env::temp_dir().join(format!("kvtierd-test-{}-planted-dir", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let shm = shared_shm(&dir);

    // A symlink at the directory's name (to a directory kvtierd's uid may write: here one of
    // its own, standing for any): kvtierd does not start, and creates nothing through it.
    let elsewhere = dir.join("elsewhere");
    std::fs::create_dir_all(&elsewhere).unwrap();
    std::os::unix::fs::symlink(&elsewhere, own(&shm)).unwrap();
    let e = refused_start(&dir, &shm);
    assert!(e.contains("symlink"), "{e}");
    assert_eq!(std::fs::read_dir(&elsewhere).unwrap().count(), 0);
    std::fs::remove_file(own(&shm)).unwrap();

    // The directory made first by another user, with a "pool" of its own in it: refused,
    // named with its owner; the planted file is never opened.
    if is_root() {
        std::fs::create_dir(own(&shm)).unwrap();
        std::fs::set_permissions(own(&shm), std::fs::Permissions::from_mode(0o777)).unwrap();
        let planted = own(&shm).join("planted");
        std::fs::write(&planted, b"theirs").unwrap();
        for p in [own(&shm), planted.clone()] {
            std::os::unix::fs::chown(&p, Some(NOBODY), Some(NOBODY)).unwrap();
        }
        let e = refused_start(&dir, &shm);
        assert!(e.contains(&format!("owned by uid {NOBODY}")), "{e}");
        assert_eq!(std::fs::read(&planted).unwrap(), b"theirs");
        std::fs::remove_dir_all(own(&shm)).unwrap();
    } else {
        eprintln!("skipped the other-owner case: it needs root");
    }

    // kvtierd's own directory left open to others (a hand-made one): narrowed to 0700 at
    // start; then pools are made there and nowhere else in the shared directory.
    std::fs::create_dir(own(&shm)).unwrap();
    std::fs::set_permissions(own(&shm), std::fs::Permissions::from_mode(0o777)).unwrap();
    let d = Daemon::start_in(
        dir.clone(),
        &[
            &format!("l2.shm_dir={}", shm.display()),
            "l2.pool_pages=16",
            "l3.backend=none",
        ],
    );
    assert_eq!(std::fs::metadata(own(&shm)).unwrap().mode() & 0o7777, 0o700);
    rt().block_on(async {
        let mut c = HostClient::connect(&d.target()).await.unwrap();
        let s = c.register("engine", &layout("m")).await.unwrap();
        assert!(
            s.pool_path.starts_with(own(&shm)),
            "{}",
            s.pool_path.display()
        );
        let meta = std::fs::metadata(&s.pool_path).unwrap();
        assert_eq!(meta.mode() & 0o777, 0o600);
    });
    let names: Vec<_> = std::fs::read_dir(&shm)
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(names, [own(&shm).file_name().unwrap()], "{names:?}");
    drop(d);
    let _ = std::fs::remove_dir_all(&dir);
}
