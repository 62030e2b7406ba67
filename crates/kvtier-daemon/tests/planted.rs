//! No name kvtierd creates can be planted by anyone else (issue 62 item 1): its pools and slot
//! tables live in a directory of its own, `kvtierd-<uid>` in `l2.shm_dir`, mode 0700, opened
//! without following a symlink and checked to be kvtierd's before anything is made in it.
//! What another user can do in a shared `/dev/shm` is plant that directory's name, and then
//! kvtierd refuses to start (naming the path and the owner) rather than use it. And what a
//! client holding a pool's descriptor can do to the file (shrink it) costs that pool, never
//! kvtierd. A real kvtierd; other uids through `chown` where the test runs as root.
#![allow(missing_docs)]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

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
fn a_planted_or_writable_pool_directory_stops_kvtierd_and_a_readable_one_is_narrowed() {
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

    // kvtierd's own directory writable by others (a hand-made one): anyone could have
    // planted a name in it, so kvtierd does not start; one others could only read is
    // narrowed to 0700 at start, and then pools are made there and nowhere else.
    std::fs::create_dir(own(&shm)).unwrap();
    std::fs::set_permissions(own(&shm), std::fs::Permissions::from_mode(0o777)).unwrap();
    let e = refused_start(&dir, &shm);
    assert!(e.contains("lets others create names"), "{e}");
    std::fs::set_permissions(own(&shm), std::fs::Permissions::from_mode(0o755)).unwrap();
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

/// Makes the symlink at `link` (not what it names) nobody's.
fn give_link_to_nobody(link: &Path) {
    std::os::unix::fs::lchown(link, Some(NOBODY), Some(NOBODY)).unwrap();
}

/// Runs kvtierd with `data_dir` (and an L3 file store under it, its default), expecting it
/// to refuse to start: its stderr.
fn refused_data_dir(data: &Path, extra: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_kvtierd"))
        .args(["--set", &format!("data_dir={}", data.display())])
        .args(["--set", "metrics.listen=", "--set", "l2.backing=memfd"])
        .args(extra.iter().flat_map(|s| ["--set", s]))
        .output()
        .unwrap();
    assert!(
        !out.status.success(),
        "kvtierd started on {}",
        data.display()
    );
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn a_data_dir_or_l3_root_another_uid_can_change_stops_kvtierd() {
    // Review finding F2: another uid made `data_dir` first (0777, in a sticky /tmp-like
    // directory); kvtierd used it, and the other uid then renamed kvtierd's sockets away to
    // bind its own at their names, and swapped `l3/` for a directory of its own.
    let dir =
        std::env::temp_dir().join(format!("kvtierd-test-{}-planted-data", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let public = shared_shm(&dir);
    let data = public.join("data");
    std::fs::create_dir(&data).unwrap();
    std::fs::set_permissions(&data, std::fs::Permissions::from_mode(0o777)).unwrap();
    let e = refused_data_dir(&data, &[]);
    assert!(e.contains("data_dir") && e.contains("mode 777"), "{e}");
    assert_eq!(
        std::fs::read_dir(&data).unwrap().count(),
        0,
        "it made something there"
    );
    if is_root() {
        std::fs::set_permissions(&data, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::os::unix::fs::chown(&data, Some(NOBODY), Some(NOBODY)).unwrap();
        let e = refused_data_dir(&data, &[]);
        assert!(e.contains(&format!("owned by uid {NOBODY}")), "{e}");
        // A symlink another uid planted on the way, to a directory kvtierd could use.
        let mine = dir.join("mine");
        std::fs::create_dir(&mine).unwrap();
        let link = public.join("link");
        std::os::unix::fs::symlink(&mine, &link).unwrap();
        give_link_to_nobody(&link);
        let e = refused_data_dir(&link, &[]);
        assert!(
            e.contains(&format!("a symlink owned by uid {NOBODY}")),
            "{e}"
        );
        assert_eq!(std::fs::read_dir(&mine).unwrap().count(), 0);
        // The same symlink one hop further, behind one of kvtierd's own (second review): the
        // other uid could repoint it later, so it is refused all the same.
        let front = dir.join("front");
        std::os::unix::fs::symlink(&link, &front).unwrap();
        let e = refused_data_dir(&front, &[]);
        assert!(
            e.contains(&format!("a symlink owned by uid {NOBODY}")),
            "{e}"
        );
        assert_eq!(std::fs::read_dir(&mine).unwrap().count(), 0);
    } else {
        eprintln!("skipped the other-owner cases: they need root");
    }
    // Its own data_dir, but an L3 root others may write (l3.file.path elsewhere): refused.
    let ok = dir.join("ok");
    std::fs::create_dir(&ok).unwrap();
    let l3 = public.join("l3");
    std::fs::create_dir(&l3).unwrap();
    std::fs::set_permissions(&l3, std::fs::Permissions::from_mode(0o777)).unwrap();
    let e = refused_data_dir(&ok, &[&format!("l3.file.path={}", l3.display())]);
    assert!(e.contains("file store") && e.contains("mode 777"), "{e}");
    // Fixed, kvtierd starts on the same directories.
    std::fs::set_permissions(&l3, std::fs::Permissions::from_mode(0o700)).unwrap();
    let d = Daemon::start_in(
        ok.clone(),
        &[
            &format!("l3.file.path={}", l3.display()),
            "l2.pool_pages=16",
        ],
    );
    drop(d);
    // A directory under objects/ that others may write (planted while the store was open
    // to them): whoever owns it could swap the pages in it, so the store does not open.
    let planted = l3.join("objects").join("0123456789abcdef0123456789abcdef");
    std::fs::create_dir(&planted).unwrap();
    std::fs::set_permissions(&planted, std::fs::Permissions::from_mode(0o777)).unwrap();
    let e = refused_data_dir(&ok, &[&format!("l3.file.path={}", l3.display())]);
    assert!(
        e.contains("0123456789abcdef") && e.contains("mode 777"),
        "{e}"
    );
    std::fs::set_permissions(&planted, std::fs::Permissions::from_mode(0o700)).unwrap();
    if is_root() {
        std::os::unix::fs::chown(&planted, Some(NOBODY), Some(NOBODY)).unwrap();
        let e = refused_data_dir(&ok, &[&format!("l3.file.path={}", l3.display())]);
        assert!(e.contains(&format!("owned by uid {NOBODY}")), "{e}");
        // In its place, a symlink of theirs (to a directory kvtierd could use): refused.
        std::fs::remove_dir(&planted).unwrap();
        std::os::unix::fs::symlink(&ok, &planted).unwrap();
        give_link_to_nobody(&planted);
        let e = refused_data_dir(&ok, &[&format!("l3.file.path={}", l3.display())]);
        assert!(
            e.contains(&format!("a symlink owned by uid {NOBODY}")),
            "{e}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A client holding a file-backed pool's descriptor can shrink the file: then no mapping of it
/// shows the pages, and every new mapping is refused. kvtierd retires such a pool within a
/// sweep: its sessions end (their clients register again, into a new pool that works), its
/// pages are counted lost, and kvtierd lives on. Before, it kept serving the broken pool with
/// no log or metric, and retried its writes to L3 forever.
#[test]
fn a_pool_a_client_shrinks_is_retired_and_its_sessions_register_again() {
    let d = Daemon::start(
        "shrunk-pool",
        &["l2.pool_pages=16", "l3.backend=none", "sessions.ttl=1s"],
    );
    let keys = chain(3, 4);
    rt().block_on(async {
        let mut a = HostClient::connect(&d.target()).await.unwrap();
        let sa = a.register("victim", &layout("m")).await.unwrap();
        store(&mut a, &sa, &keys).await;
        // Another client of the same pool shrinks the file its descriptor names.
        let mut b = HostClient::connect(&d.target()).await.unwrap();
        let sb = b.register("vandal", &layout("m")).await.unwrap();
        let fd = sb.pool.fd().try_clone_to_owned().unwrap();
        std::fs::File::from(fd).set_len(4096).unwrap();
        // Keep the victim's session alive meanwhile: only the retirement ends it.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            match a.heartbeat(sa.id).await {
                Ok(()) => {}
                Err(e) => {
                    assert_eq!(e.code(), Some(tonic::Code::NotFound), "{e}");
                    break;
                }
            }
            assert!(std::time::Instant::now() < deadline, "never retired");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // Registered again: a new pool, whole, that works.
        let s2 = a.register("victim", &layout("m")).await.unwrap();
        assert_ne!(s2.pool.file_id().unwrap(), sa.pool.file_id().unwrap());
        let again = chain(4, 2);
        store(&mut a, &s2, &again).await;
        assert_eq!(a.lookup(s2.id, &again).await.unwrap(), 2);
    });
    let m = d.metrics();
    assert_eq!(metric(&m, "kvtier_l2_damaged_pools_total"), 1.0, "{m}");
    assert_eq!(
        metric(&m, "kvtier_l2_lost_pages_total{reason=\"pool_damaged\"}"),
        4.0
    );
}
