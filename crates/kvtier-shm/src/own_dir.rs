//! The one place kvtier creates a file that holds pages or page keys: a directory only this
//! process's uid may use ([`OwnDir`]), opened once and held by descriptor, and in it files
//! made with `O_CREAT|O_EXCL|O_NOFOLLOW` and checked on the new descriptor (`fstat`). No
//! name in it can be planted by anyone else (they cannot write the directory), no existing
//! file is ever truncated or reused (`O_EXCL`), and no symlink is followed (`O_NOFOLLOW`,
//! and the directory itself is opened with it).
//!
//! A file of the same name that is already there can only be this uid's (a dead process's,
//! say): [`OwnDir::create`] refuses it, [`OwnDir::create_replacing`] removes it and says so.
//! Files a dead predecessor left are opened with [`OwnDir::open_own`], under the same checks
//! as [`crate::open_own`].

use std::fs::File;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustix::fs::{AtFlags, Mode, OFlags};

use crate::ShmError;

/// Checks that only this process's uid (or root) can change what is at `path`, an existing
/// directory kvtier keeps its own files under (kvtierd's `data_dir`, the file store's root):
/// - the path is resolved here, one name at a time: every directory passed through is owned
///   by this uid or root, and writable by its group or others only when sticky (then no one
///   else can rename or remove what is in it), and every symlink met (however deep in the
///   resolution) is owned by this uid or root, so no one else can repoint it later;
/// - the directory itself is owned by this uid or root and is not writable by its group or
///   others (anyone could have planted a name in it: fix its mode after checking what is
///   inside).
///
/// Refused with [`ShmError::Untrusted`] naming the directory or symlink and why. The
/// directory may be readable and searchable by others: sockets live in it.
pub fn check_trusted_dir(path: &Path) -> Result<(), ShmError> {
    use std::collections::VecDeque;
    use std::os::unix::fs::MetadataExt as _;
    use std::path::Component;

    let me = rustix::process::geteuid().as_raw();
    let untrusted = |at: &Path, why: String| ShmError::Untrusted {
        path: at.display().to_string(),
        why,
    };
    let owner_ok = |at: &Path, m: &std::fs::Metadata, what: &str| {
        if m.uid() == me || m.uid() == 0 {
            Ok(())
        } else {
            Err(untrusted(
                at,
                format!(
                    "{what} owned by uid {}: only this process's uid ({me}) or root may own \
                     what leads to {}",
                    m.uid(),
                    path.display()
                ),
            ))
        }
    };
    // A directory passed through: others may not rename what is in it.
    let passable = |at: &Path| -> Result<(), ShmError> {
        let m = std::fs::symlink_metadata(at).map_err(crate::io_err("stat", at))?;
        owner_ok(at, &m, "a directory")?;
        if m.mode() & 0o022 != 0 && m.mode() & 0o1000 == 0 {
            return Err(untrusted(
                at,
                format!(
                    "mode {:o} lets others rename what is in it (it is not sticky)",
                    m.mode() & 0o7777
                ),
            ));
        }
        Ok(())
    };
    let abs = if path.is_absolute() {
        path.to_path_buf()
    } else {
        std::env::current_dir()
            .map_err(crate::io_err("find the working directory of", path))?
            .join(path)
    };
    // The names still to walk (a symlink's target is put in front as it is met).
    let mut names: VecDeque<std::path::PathBuf> = abs
        .components()
        .map(|c| PathBuf::from(c.as_os_str()))
        .collect();
    let mut cur = PathBuf::from("/");
    passable(&cur)?;
    let mut links = 0;
    while let Some(name) = names.pop_front() {
        match name.components().next() {
            None | Some(Component::CurDir) => {}
            Some(Component::RootDir | Component::Prefix(_)) => {
                cur = PathBuf::from("/");
            }
            Some(Component::ParentDir) => {
                cur.pop();
            }
            Some(Component::Normal(n)) => {
                let next = cur.join(n);
                let m = std::fs::symlink_metadata(&next).map_err(crate::io_err("stat", &next))?;
                if m.file_type().is_symlink() {
                    owner_ok(&next, &m, "a symlink")?;
                    links += 1;
                    if links > 40 {
                        return Err(untrusted(&next, "too many symlinks".into()));
                    }
                    let target =
                        std::fs::read_link(&next).map_err(crate::io_err("read the link", &next))?;
                    for c in target.components().rev() {
                        names.push_front(PathBuf::from(c.as_os_str()));
                    }
                } else if m.is_dir() {
                    cur = next;
                    passable(&cur)?;
                } else {
                    return Err(untrusted(&next, "not a directory".into()));
                }
            }
        }
    }
    let m = std::fs::metadata(&cur).map_err(crate::io_err("stat", &cur))?;
    if m.mode() & 0o022 != 0 {
        return Err(untrusted(
            &cur,
            format!(
                "mode {:o} lets others create, rename or remove names in it: fix its mode \
                 after checking what is inside, or choose another directory",
                m.mode() & 0o7777
            ),
        ));
    }
    Ok(())
}

/// A directory only this process's uid may list, read or write (mode 0700, owned by the
/// effective uid, not a symlink), held open: every file kvtierd shares as memory lives in one.
#[derive(Clone, Debug)]
pub struct OwnDir {
    fd: Arc<OwnedFd>,
    path: PathBuf,
}

fn os_err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(rustix::io::Errno) -> ShmError + 'a {
    move |e| crate::io_err(op, path)(std::io::Error::from(e))
}

impl OwnDir {
    /// Opens `path` as this process's own directory, creating it (mode 0700; its parent
    /// must exist) when it is missing. Refused with [`ShmError::Untrusted`] when it is a
    /// symlink, not a directory, owned by another uid, or writable by its group or others
    /// (anyone could have planted a name in it, a directory they keep writing through, say);
    /// one of this uid that others could only list or enter is narrowed to 0700 and said in
    /// the log by the caller (the returned flag is true).
    pub fn open_or_create(path: &Path) -> Result<(Self, bool), ShmError> {
        match rustix::fs::mkdir(path, Mode::from_raw_mode(0o700)) {
            Ok(()) | Err(rustix::io::Errno::EXIST) => {}
            Err(e) => return Err(os_err("create the directory", path)(e)),
        }
        let untrusted = |why: String| ShmError::Untrusted {
            path: path.display().to_string(),
            why,
        };
        let fd = rustix::fs::open(
            path,
            OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::RDONLY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| match e {
            rustix::io::Errno::LOOP | rustix::io::Errno::NOTDIR => {
                untrusted("it is a symlink or not a directory".into())
            }
            e => os_err("open the directory", path)(e),
        })?;
        let st = rustix::fs::fstat(&fd).map_err(os_err("stat", path))?;
        let me = rustix::process::geteuid().as_raw();
        if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::Directory {
            return Err(untrusted("not a directory".into()));
        }
        if st.st_uid != me {
            return Err(untrusted(format!(
                "owned by uid {}, not {me}: kvtier keeps shared memory only in a directory \
                 of its own (remove it, or choose another directory)",
                st.st_uid
            )));
        }
        if st.st_mode & 0o022 != 0 {
            return Err(untrusted(format!(
                "mode {:o} lets others create names in it: remove it, or chmod 0700 it after \
                 checking what is inside",
                st.st_mode & 0o7777
            )));
        }
        let narrowed = st.st_mode & 0o777 != 0o700;
        if narrowed {
            rustix::fs::fchmod(&fd, Mode::from_raw_mode(0o700)).map_err(os_err("chmod", path))?;
        }
        Ok((
            Self {
                fd: Arc::new(fd),
                path: path.to_path_buf(),
            },
            narrowed,
        ))
    }

    /// The directory's path (for logs, and for processes of this uid that look in it).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The path of `name` in this directory.
    pub fn join(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }

    fn check_name(&self, name: &str) -> Result<(), ShmError> {
        if name.is_empty()
            || name == "."
            || name == ".."
            || name.contains('/')
            || name.contains('\0')
        {
            return Err(ShmError::Shape(format!(
                "{name:?} is not a file name in {}",
                self.path.display()
            )));
        }
        Ok(())
    }

    /// Creates `name`, empty, read-write for this uid alone (0600): `O_CREAT|O_EXCL|
    /// O_NOFOLLOW`, then checked on its descriptor (a regular file of this uid with one
    /// link and no bytes). An existing file of that name is an error (`AlreadyExists`).
    pub fn create(&self, name: &str) -> Result<File, ShmError> {
        self.check_name(name)?;
        let path = self.join(name);
        let fd = rustix::fs::openat(
            &*self.fd,
            name,
            OFlags::CREATE
                | OFlags::EXCL
                | OFlags::NOFOLLOW
                | OFlags::RDWR
                | OFlags::CLOEXEC
                | OFlags::NOCTTY,
            Mode::from_raw_mode(0o600),
        )
        .map_err(os_err("create", &path))?;
        let st = rustix::fs::fstat(&fd).map_err(os_err("stat", &path))?;
        let me = rustix::process::geteuid().as_raw();
        let why = if rustix::fs::FileType::from_raw_mode(st.st_mode)
            != rustix::fs::FileType::RegularFile
        {
            Some("not a regular file".to_string())
        } else if st.st_uid != me {
            Some(format!("owned by uid {}, not {me}", st.st_uid))
        } else if st.st_nlink != 1 || st.st_size != 0 {
            Some(format!(
                "{} links and {} bytes just after creation",
                st.st_nlink, st.st_size
            ))
        } else if st.st_mode & 0o077 != 0 {
            Some(format!("mode {:o}", st.st_mode & 0o777))
        } else {
            None
        };
        if let Some(why) = why {
            // Not ours after all (cannot happen in a directory only we write): leave it.
            return Err(ShmError::Untrusted {
                path: path.display().to_string(),
                why,
            });
        }
        Ok(File::from(fd))
    }

    /// [`OwnDir::create`], removing a file of that name first if there is one (it can only
    /// be this uid's: a dead process's leftover). Returns the file and whether one was
    /// removed, for the caller to count.
    pub fn create_replacing(&self, name: &str) -> Result<(File, bool), ShmError> {
        match self.create(name) {
            Ok(f) => Ok((f, false)),
            Err(ShmError::Io { source, .. })
                if source.kind() == std::io::ErrorKind::AlreadyExists =>
            {
                self.remove(name)?;
                Ok((self.create(name)?, true))
            }
            Err(e) => Err(e),
        }
    }

    /// Opens `name` read-write if it is this process's own file (see [`crate::open_own`]).
    pub fn open_own(&self, name: &str) -> Result<File, ShmError> {
        self.check_name(name)?;
        crate::open_own(&self.join(name))
    }

    /// Removes `name` (not following a symlink: the link itself goes). Already gone is fine.
    pub fn remove(&self, name: &str) -> Result<(), ShmError> {
        self.check_name(name)?;
        match rustix::fs::unlinkat(&*self.fd, name, AtFlags::empty()) {
            Ok(()) | Err(rustix::io::Errno::NOENT) => Ok(()),
            Err(e) => Err(os_err("remove", &self.join(name))(e)),
        }
    }

    /// Whether `name` exists (not following a symlink).
    pub fn contains(&self, name: &str) -> bool {
        self.check_name(name).is_ok()
            && rustix::fs::statat(&*self.fd, name, AtFlags::SYMLINK_NOFOLLOW).is_ok()
    }

    /// The names in the directory (UTF-8 ones; kvtier makes no other).
    pub fn names(&self) -> Result<Vec<String>, ShmError> {
        let rd = std::fs::read_dir(&self.path).map_err(crate::io_err("list", &self.path))?;
        Ok(rd
            .filter_map(|e| e.ok())
            .filter_map(|e| e.file_name().into_string().ok())
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    fn scratch(test: &str) -> PathBuf {
        let p = std::env::temp_dir().join(format!("kvtier-own-{test}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        let _ = std::fs::remove_file(&p);
        p
    }

    #[test]
    fn a_trusted_directory_is_one_no_other_uid_can_change_on_the_way() {
        let top = scratch("trusted");
        let mode = |p: &Path, m: u32| {
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).unwrap()
        };
        let data = top.join("a").join("data");
        std::fs::create_dir_all(&data).unwrap();
        mode(&data, 0o755);
        mode(&top.join("a"), 0o755);
        check_trusted_dir(&data).unwrap();
        // The directory itself writable by others: refused, naming it.
        mode(&data, 0o775);
        let e = check_trusted_dir(&data).unwrap_err();
        assert!(
            e.is_untrusted() && e.to_string().contains("mode 775"),
            "{e}"
        );
        mode(&data, 0o755);
        // A parent others may write: refused, unless sticky (as /tmp is).
        mode(&top.join("a"), 0o777);
        assert!(check_trusted_dir(&data).unwrap_err().is_untrusted());
        mode(&top.join("a"), 0o1777);
        check_trusted_dir(&data).unwrap();
        // A relative path is checked as the absolute one it names.
        let cwd = std::env::current_dir().unwrap();
        let rel = pathdiff(&data, &cwd);
        check_trusted_dir(&rel).unwrap();
        // Through a symlink of this uid: the directory it names is checked.
        let link = top.join("link");
        std::os::unix::fs::symlink(&data, &link).unwrap();
        check_trusted_dir(&link).unwrap();
        mode(&data, 0o777);
        assert!(check_trusted_dir(&link).unwrap_err().is_untrusted());
        mode(&data, 0o755);
        if rustix::process::geteuid().is_root() {
            // Another uid's directory, or its symlink on the way: refused.
            std::os::unix::fs::chown(&data, Some(65534), None).unwrap();
            assert!(
                check_trusted_dir(&data)
                    .unwrap_err()
                    .to_string()
                    .contains("uid 65534")
            );
            std::os::unix::fs::chown(&data, Some(0), None).unwrap();
            rustix::fs::chownat(
                rustix::fs::CWD,
                &link,
                Some(rustix::fs::Uid::from_raw(65534)),
                None,
                AtFlags::SYMLINK_NOFOLLOW,
            )
            .unwrap();
            let e = check_trusted_dir(&link).unwrap_err().to_string();
            assert!(e.contains("a symlink owned by uid 65534"), "{e}");
            // Met deeper in the resolution, behind a symlink of this uid: refused too.
            let front = top.join("front");
            std::os::unix::fs::symlink(&link, &front).unwrap();
            let e = check_trusted_dir(&front).unwrap_err().to_string();
            assert!(e.contains("a symlink owned by uid 65534"), "{e}");
        }
        let _ = std::fs::remove_dir_all(&top);
    }

    /// `to` relative to `from` (both absolute).
    fn pathdiff(to: &Path, from: &Path) -> PathBuf {
        let (t, f): (Vec<_>, Vec<_>) = (to.components().collect(), from.components().collect());
        let same = t.iter().zip(&f).take_while(|(a, b)| a == b).count();
        let mut out = PathBuf::new();
        for _ in same..f.len() {
            out.push("..");
        }
        for c in &t[same..] {
            out.push(c);
        }
        out
    }

    #[test]
    fn a_new_directory_is_0700_a_readable_one_is_narrowed_and_a_writable_one_refused() {
        let p = scratch("mode");
        let (d, narrowed) = OwnDir::open_or_create(&p).unwrap();
        assert!(!narrowed);
        assert_eq!(std::fs::metadata(&p).unwrap().mode() & 0o777, 0o700);
        drop(d);
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        let (_d, narrowed) = OwnDir::open_or_create(&p).unwrap();
        assert!(narrowed);
        assert_eq!(std::fs::metadata(&p).unwrap().mode() & 0o7777, 0o700);
        for wide in [0o1777, 0o770, 0o702] {
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(wide)).unwrap();
            let e = OwnDir::open_or_create(&p).unwrap_err();
            assert!(
                e.is_untrusted() && e.to_string().contains("create names"),
                "{e}"
            );
            assert_eq!(
                std::fs::metadata(&p).unwrap().mode() & 0o7777,
                wide,
                "left alone"
            );
        }
        std::fs::remove_dir_all(&p).unwrap();
    }

    #[test]
    fn a_symlink_or_a_file_at_the_directory_name_is_refused() {
        let p = scratch("link");
        let target = scratch("link-target");
        std::fs::create_dir(&target).unwrap();
        std::os::unix::fs::symlink(&target, &p).unwrap();
        let e = OwnDir::open_or_create(&p).unwrap_err();
        assert!(e.is_untrusted(), "{e}");
        std::fs::remove_file(&p).unwrap();
        std::fs::write(&p, b"x").unwrap();
        assert!(OwnDir::open_or_create(&p).unwrap_err().is_untrusted());
        std::fs::remove_file(&p).unwrap();
        std::fs::remove_dir_all(&target).unwrap();
    }

    #[test]
    fn files_are_new_0600_and_never_reused_or_followed() {
        let p = scratch("files");
        let (d, _) = OwnDir::open_or_create(&p).unwrap();
        let f = d.create("pool").unwrap();
        assert_eq!(f.metadata().unwrap().mode() & 0o777, 0o600);
        // O_EXCL: the same name again is an error, and the file keeps its bytes.
        std::fs::write(d.join("pool"), b"kept").unwrap();
        let e = d.create("pool").unwrap_err().to_string();
        assert!(e.contains("exists"), "{e}");
        assert_eq!(std::fs::read(d.join("pool")).unwrap(), b"kept");
        // A symlink at the name is never followed, not even by create_replacing: the link
        // goes, its target is untouched.
        let victim = scratch("files-victim");
        std::fs::write(&victim, b"victim").unwrap();
        std::os::unix::fs::symlink(&victim, d.join("table")).unwrap();
        assert!(d.create("table").is_err());
        let (f, replaced) = d.create_replacing("table").unwrap();
        assert!(replaced);
        assert!(f.metadata().unwrap().file_type().is_file());
        assert_eq!(std::fs::read(&victim).unwrap(), b"victim");
        for bad in ["", ".", "..", "a/b", "../x"] {
            assert!(d.create(bad).is_err(), "{bad:?}");
        }
        assert!(d.contains("table") && !d.contains("nothing"));
        d.remove("table").unwrap();
        d.remove("table").unwrap();
        std::fs::remove_file(&victim).unwrap();
        std::fs::remove_dir_all(&p).unwrap();
    }
}
