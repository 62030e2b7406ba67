//! [`ShmRegion`]: a whole file another process created and shares (an engine's KV pool, an
//! SGLang host pool received over a socket), mapped with its copies guarded against the file
//! shrinking under them.

use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;

use memmap2::MmapRaw;

use crate::{ShmError, guard, io_err, map_existing};

/// A flat shared-memory region: a file of a given length, mapped `MAP_SHARED`. The cpu device
/// uses it for an engine's KV pool (layer-first buffers laid end to end), which the engine
/// creates and hands over as a descriptor; like [`ShmPool`], only raw, bounds-checked copies and raw pointers.
#[derive(Debug)]
pub struct ShmRegion {
    map: MmapRaw,
    _file: File,
    path: PathBuf,
    len: usize,
    /// A guarded copy hit the end of a shrunk file: part of the mapping is anonymous memory now.
    damaged: guard::Damage,
}

// SAFETY: as for `ShmPool`: no Rust references into the shared bytes are ever handed out.
unsafe impl Send for ShmRegion {}
// SAFETY: as above; every method takes `&self` and performs only raw, bounds-checked copies.
unsafe impl Sync for ShmRegion {}

impl ShmRegion {
    /// Creates a zeroed region of `len` bytes in a new memfd (`name` shows in
    /// `/proc/<pid>/fd`; sealing allowed, so the receiver can forbid shrinking): what an
    /// engine, or a test or the simulator standing in for one, does before it hands the
    /// memory to the agent as a descriptor ([`Self::fd`]).
    pub fn memfd(name: &str, len: usize) -> Result<Self, ShmError> {
        use rustix::fs::{MemfdFlags, memfd_create};
        if len == 0 {
            return Err(ShmError::Shape("a region needs at least one byte".into()));
        }
        let path = PathBuf::from(format!("memfd:{name}"));
        let fd = memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
            .map_err(|e| io_err("create", &path)(e.into()))?;
        let file = File::from(fd);
        file.set_len(len as u64).map_err(io_err("size", &path))?;
        Self::map(file, &path, len)
    }

    /// Maps a whole file received from another process (a memfd or shared-memory file passed
    /// over a Unix socket), at its current size; `name` is for errors and logs.
    pub fn from_fd(fd: OwnedFd, name: &str) -> Result<Self, ShmError> {
        let file = File::from(fd);
        let path = PathBuf::from(name);
        let len = file.metadata().map_err(io_err("stat", &path))?.len();
        let len = usize::try_from(len)
            .map_err(|_| ShmError::Shape(format!("{name}: {len} bytes do not fit in memory")))?;
        Self::from_fd_at_least(file.into(), len, name)
    }

    /// Maps the first `len` bytes of a file received from another process, which must be a
    /// regular file (a memfd, a tmpfs file) at least that long (an engine's allocation may be
    /// larger than the part of it a pool uses: only that part is mapped, so a client that
    /// grows its file to any size costs the mapper nothing); `name` is for errors and logs.
    pub fn from_fd_at_least(fd: OwnedFd, len: usize, name: &str) -> Result<Self, ShmError> {
        let file = File::from(fd);
        let path = PathBuf::from(name);
        let meta = file.metadata().map_err(io_err("stat", &path))?;
        if !meta.file_type().is_file() {
            return Err(ShmError::Untrusted {
                path: name.to_string(),
                why: "not a regular file (a memfd or a shared-memory file)".into(),
            });
        }
        let actual = meta.len();
        if actual < len.max(1) as u64 {
            return Err(ShmError::Shape(format!(
                "{name} is {actual} bytes, expected at least {}",
                len.max(1)
            )));
        }
        Self::map(file, &path, len)
    }

    /// The mapped file's descriptor (to hand it to another process).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self._file.as_fd()
    }

    /// The size of the underlying file now: a client may shrink a file it shared after we
    /// mapped it, and touching the mapping past the new end would fault. Check before use.
    pub fn current_file_len(&self) -> Result<u64, ShmError> {
        self._file
            .metadata()
            .map(|m| m.len())
            .map_err(io_err("stat", &self.path))
    }

    /// Forbids the file to shrink from now on (`F_SEAL_SHRINK`), where its creator allowed
    /// sealing (`MFD_ALLOW_SEALING`). True when the file can no longer shrink — then the
    /// mapping can never fault — false when sealing is not allowed.
    pub fn seal_shrink(&self) -> bool {
        use std::os::fd::AsRawFd;
        let fd = self._file.as_raw_fd();
        // SAFETY: plain fcntl calls on a descriptor this region owns; no memory is passed.
        let added = unsafe { libc::fcntl(fd, libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) } == 0;
        // SAFETY: as above.
        let seals = unsafe { libc::fcntl(fd, libc::F_GET_SEALS) };
        added || (seals > 0 && seals & libc::F_SEAL_SHRINK != 0)
    }

    /// Copies bytes at `offset` into `dst` through the mapping, surviving a file that shrinks
    /// under the copy: then `Truncated`, and every later guarded copy of this region fails
    /// too (the mapping no longer shows the file). Falls back to [`Self::pread`] where the
    /// guard cannot be installed.
    pub fn read_guarded(&self, offset: usize, dst: &mut [u8]) -> Result<(), ShmError> {
        self.check(offset, dst.len())?;
        self.damaged.check(&self.path)?;
        // SAFETY: `check` proved the source range lies inside the live mapping; `dst` is a
        // distinct Rust buffer. A fault inside the range is absorbed by the guard.
        let src = unsafe { self.map.as_ptr().add(offset) };
        let copied = guard::guarded(src as usize, dst.len(), || {
            // SAFETY: the range was checked above; a SIGBUS inside it is absorbed.
            unsafe { std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), dst.len()) }
        });
        self.damaged
            .after(copied, &self.path, || self.pread(offset, dst))
    }

    /// Copies `src` to `offset` through the mapping, surviving a file that shrinks under the
    /// copy (see [`Self::read_guarded`]).
    pub fn write_guarded(&self, offset: usize, src: &[u8]) -> Result<(), ShmError> {
        self.check(offset, src.len())?;
        self.damaged.check(&self.path)?;
        // SAFETY: as in `read_guarded`, with the mapping as the destination.
        let dst = unsafe { self.map.as_mut_ptr().add(offset) };
        let copied = guard::guarded(dst as usize, src.len(), || {
            // SAFETY: the range was checked above; a SIGBUS inside it is absorbed.
            unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) }
        });
        self.damaged
            .after(copied, &self.path, || self.pwrite(offset, src))
    }

    /// Whether a guarded copy found the file shrunk (the region is of no further use).
    pub fn is_damaged(&self) -> bool {
        self.damaged.is_set()
    }

    /// Copies bytes at `offset` of the file into `dst` with `pread`, not through the mapping:
    /// a file that shrank under us gives an error here, never a fault.
    pub fn pread(&self, offset: usize, dst: &mut [u8]) -> Result<(), ShmError> {
        use std::os::unix::fs::FileExt;
        self.check(offset, dst.len())?;
        self._file
            .read_exact_at(dst, offset as u64)
            .map_err(io_err("pread", &self.path))
    }

    /// Copies `src` into the file at `offset` with `pwrite`, not through the mapping: never a
    /// fault (a file that shrank under us grows back to cover the write).
    pub fn pwrite(&self, offset: usize, src: &[u8]) -> Result<(), ShmError> {
        use std::os::unix::fs::FileExt;
        self.check(offset, src.len())?;
        self._file
            .write_all_at(src, offset as u64)
            .map_err(io_err("pwrite", &self.path))
    }

    fn map(file: File, path: &Path, len: usize) -> Result<Self, ShmError> {
        if len == 0 {
            return Err(ShmError::Shape("a region needs at least one byte".into()));
        }
        let map = map_existing(&file, path, len)?;
        Ok(Self {
            map,
            _file: file,
            path: path.to_path_buf(),
            len,
            damaged: Default::default(),
        })
    }

    /// The mapped file's identity (device, inode): two mappings with the same one are the
    /// same memory, whatever paths opened them.
    pub fn file_id(&self) -> Result<(u64, u64), ShmError> {
        crate::file_id(&self._file, &self.path)
    }

    /// Where it lives.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Mapped bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: a region has at least one byte.
    pub fn is_empty(&self) -> bool {
        false
    }

    fn check(&self, offset: usize, len: usize) -> Result<(), ShmError> {
        if offset.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(ShmError::Shape(format!(
                "bytes {offset}..+{len} are outside the region of {} bytes",
                self.len
            )));
        }
        Ok(())
    }

    /// Copies `src` into the region at `offset`.
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<(), ShmError> {
        self.check(offset, src.len())?;
        // SAFETY: `check` proved the destination lies inside the live mapping, and `src` is a
        // Rust slice, never a reference into the mapping.
        unsafe {
            std::ptr::copy_nonoverlapping(
                src.as_ptr(),
                self.map.as_mut_ptr().add(offset),
                src.len(),
            );
        }
        Ok(())
    }

    /// Copies bytes at `offset` into `dst`.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), ShmError> {
        self.check(offset, dst.len())?;
        // SAFETY: as in `write`.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.map.as_ptr().add(offset),
                dst.as_mut_ptr(),
                dst.len(),
            );
        }
        Ok(())
    }

    /// A raw pointer to the start of the region, valid while `self` lives, for device copies.
    pub fn ptr(&self) -> NonNull<u8> {
        // The mapping of a non-empty region is never at address zero.
        NonNull::new(self.map.as_mut_ptr()).unwrap_or(NonNull::dangling())
    }
}
