//! The check that a file found in a directory is this process's own before it is opened as
//! such ([`open_own`]): a dead predecessor's pool and slot table, at takeover.

use std::fs::{File, OpenOptions};
use std::path::Path;

use crate::{ShmError, io_err};

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
