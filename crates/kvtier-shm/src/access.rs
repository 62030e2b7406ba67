//! Who may open a file kvtier makes or finds in a shared directory: its mode and group set
//! explicitly whatever the umask ([`FileAccess`]), read and write granted to named uids and
//! gids by a POSIX ACL ([`Grant`]), and the check that a file found there is this process's
//! own before it is opened as such ([`open_own`]).

use std::fs::{File, OpenOptions};
use std::path::Path;

use crate::{ShmError, io_err};

/// The permission bits and group a file is given when it is created, whatever the creating
/// process's umask (which would otherwise decide: under the common 022 every local user could
/// read the pages).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileAccess {
    /// Permission bits (read and write for the owner, optionally for the group; never for
    /// others, never execute).
    pub mode: u32,
    /// The group to give the file; `None` keeps the creator's.
    pub gid: Option<u32>,
}

impl FileAccess {
    /// The owner alone (0600).
    pub const OWNER: FileAccess = FileAccess {
        mode: 0o600,
        gid: None,
    };

    /// The owner and the members of `gid` (or of the creator's group) (0660).
    pub fn with_group(gid: Option<u32>) -> Self {
        FileAccess { mode: 0o660, gid }
    }

    /// Gives `file` (at `path`, for errors) this access.
    pub fn apply(self, file: &File, path: &Path) -> Result<(), ShmError> {
        use std::os::unix::fs::PermissionsExt;
        if let Some(gid) = self.gid {
            std::os::unix::fs::fchown(file, None, Some(gid)).map_err(io_err("chown", path))?;
        }
        // After chown, which may clear bits; fchmod ignores the umask.
        file.set_permissions(std::fs::Permissions::from_mode(self.mode & 0o660))
            .map_err(io_err("chmod", path))
    }
}

/// Read and write for these uids and gids, and for no one else but the owner: a POSIX access
/// ACL (`system.posix_acl_access`) on top of mode 0600. A tenant's pool file gets its
/// tenant's uids and gids, so another tenant in the socket's group cannot open it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Grant {
    /// Users given read and write.
    pub uids: Vec<u32>,
    /// Groups given read and write.
    pub gids: Vec<u32>,
}

impl Grant {
    /// The ACL in the kernel's xattr format: version 2, then (tag, perm, id) entries sorted
    /// by tag and, within users and groups, by id.
    fn xattr(&self) -> Vec<u8> {
        const USER_OBJ: u16 = 0x01;
        const USER: u16 = 0x02;
        const GROUP_OBJ: u16 = 0x04;
        const GROUP: u16 = 0x08;
        const MASK: u16 = 0x10;
        const OTHER: u16 = 0x20;
        const RW: u16 = 6;
        const NO_ID: u32 = u32::MAX;
        let sorted = |ids: &[u32]| {
            let mut v = ids.to_vec();
            v.sort_unstable();
            v.dedup();
            v
        };
        let mut e: Vec<(u16, u16, u32)> = vec![(USER_OBJ, RW, NO_ID)];
        e.extend(sorted(&self.uids).into_iter().map(|u| (USER, RW, u)));
        e.push((GROUP_OBJ, 0, NO_ID));
        e.extend(sorted(&self.gids).into_iter().map(|g| (GROUP, RW, g)));
        e.push((MASK, RW, NO_ID));
        e.push((OTHER, 0, NO_ID));
        let mut out = 2u32.to_le_bytes().to_vec();
        for (tag, perm, id) in e {
            out.extend_from_slice(&tag.to_le_bytes());
            out.extend_from_slice(&perm.to_le_bytes());
            out.extend_from_slice(&id.to_le_bytes());
        }
        out
    }

    /// Sets the ACL on `file` (at `path`, for errors). A filesystem without ACLs is an error
    /// naming it: the file would otherwise be open to fewer peers than meant, or to more.
    pub fn apply(&self, file: &File, path: &Path) -> Result<(), ShmError> {
        rustix::fs::fsetxattr(
            file,
            "system.posix_acl_access",
            &self.xattr(),
            rustix::fs::XattrFlags::empty(),
        )
        .map_err(|e| io_err("set the access ACL of", path)(std::io::Error::from(e)))
    }
}

/// Opens `path` read-write only if it is this process's own file: not a symlink (`O_NOFOLLOW`),
/// a regular file with one link, owned by this process's effective uid, writable by nobody
/// else. The checks run on the opened descriptor (`fstat`), so the file cannot be swapped
/// between check and use. For files found in a shared directory such as /dev/shm, where any
/// local user may plant one under the name kvtier would look for.
pub fn open_own(path: &Path) -> Result<File, ShmError> {
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let untrusted = |why: String| ShmError::Untrusted {
        path: path.display().to_string(),
        why,
    };
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NOCTTY | libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ELOOP) => untrusted("it is a symlink".into()),
            _ => io_err("open", path)(e),
        })?;
    let meta = file.metadata().map_err(io_err("stat", path))?;
    let me = rustix::process::geteuid().as_raw();
    if !meta.file_type().is_file() {
        return Err(untrusted("not a regular file".into()));
    }
    if meta.uid() != me {
        return Err(untrusted(format!("owned by uid {}, not {me}", meta.uid())));
    }
    if meta.mode() & 0o022 != 0 {
        return Err(untrusted(format!(
            "mode {:o} lets the group or others write it",
            meta.mode() & 0o777
        )));
    }
    if meta.nlink() != 1 {
        return Err(untrusted(format!("{} hard links", meta.nlink())));
    }
    Ok(file)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_acl_is_sorted_deduplicated_and_shaped_as_the_kernel_wants() {
        let g = Grant {
            uids: vec![7, 3, 7],
            gids: vec![9],
        };
        let x = g.xattr();
        // Header, then owner, users 3 and 7, group class, group 9, mask, other.
        assert_eq!(x.len(), 4 + 7 * 8);
        assert_eq!(&x[..4], &2u32.to_le_bytes());
        let entry = |i: usize| {
            let e = &x[4 + i * 8..12 + i * 8];
            (
                u16::from_le_bytes([e[0], e[1]]),
                u16::from_le_bytes([e[2], e[3]]),
                u32::from_le_bytes([e[4], e[5], e[6], e[7]]),
            )
        };
        assert_eq!(entry(1), (0x02, 6, 3));
        assert_eq!(entry(2), (0x02, 6, 7));
        assert_eq!(entry(4), (0x08, 6, 9));
        assert_eq!(entry(6), (0x20, 0, u32::MAX));
    }

    #[test]
    fn a_granted_file_keeps_its_owner_and_gives_no_one_else_anything() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = std::env::temp_dir().join(format!("kvtier-acl-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("pool");
        let f = File::create(&path).unwrap();
        FileAccess::OWNER.apply(&f, &path).unwrap();
        let g = Grant {
            uids: vec![65534],
            gids: vec![],
        };
        match g.apply(&f, &path) {
            // The mask shows as the group bits; others get nothing.
            Ok(()) => assert_eq!(f.metadata().unwrap().permissions().mode() & 0o777, 0o660),
            Err(e) => eprintln!("skipped: this filesystem has no ACLs: {e}"),
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
