//! kvtier-shm: the shared-memory page pool that the daemon creates and every agent on the node
//! maps. This crate and kvtier-device are the only ones with `unsafe`.
//!
//! A pool is `slots × stride` bytes of shared memory: a file under `/dev/shm` (default) or a
//! memfd, mapped `MAP_SHARED` with [`memmap2::MmapRaw`]. One slot holds one page in page-first
//! layout; the stride is a multiple of 4 KiB. The daemon makes its pool files in a directory of
//! its own ([`OwnDir`]: `O_CREAT|O_EXCL|O_NOFOLLOW`, no name anyone else can plant) and hands
//! each client the pool's descriptor ([`door`], `SCM_RIGHTS`), never a path; clients map it
//! ([`ShmPool::from_fd`]), so bytes move by memcpy/DMA and never through gRPC.
//!
//! The memory is written by other processes, so this crate never hands out Rust references
//! into it: every access is a bounds-checked raw copy ([`ShmPool::write`], [`ShmPool::read`]) or
//! a raw pointer for DMA ([`ShmPool::slot_ptr`]). Who may touch which slot when is decided by
//! the daemon's protocol (reserve → write → commit; acquire → read → release), not here.
//!
//! [`ShmRegion`] maps a whole file another process created (an engine's KV pool, an SGLang
//! host pool received over a socket). Such a file can shrink under the mapping; where it
//! cannot be sealed against that, [`ShmRegion::read_guarded`] / [`ShmRegion::write_guarded`]
//! copy with SIGBUS absorbed inside the copy (module `guard`).
//!
//! [`malloc`] fixes the C allocator's mmap threshold for processes that move pages through
//! heap buffers; [`peer`] reads a socket peer's supplementary groups (raw `getsockopt`).
//!
//! Size: about 620 lines of code (the pool and its unsafe mapping, kept in one file so every
//! `unsafe` block of the pool and its SAFETY note can be reviewed together; `region.rs` holds
//! [`ShmRegion`]'s) and the unit tests of both.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;

use memmap2::{Advice, MmapOptions, MmapRaw};

mod access;
pub mod door;
mod guard;
pub mod malloc;
pub mod memory_door;
mod own_dir;
pub mod peer;
mod region;
mod scm;
mod slot_table;

pub use access::open_own;
pub use guard::guarded;
pub use own_dir::{OwnDir, check_trusted_dir};
pub use region::ShmRegion;

/// This machine's physical memory in bytes (at least 1 GiB where it cannot be read): the
/// most shared memory another process's file may ask a mapper to map.
pub fn physical_memory() -> u64 {
    let info = rustix::system::sysinfo();
    u64::from(info.mem_unit)
        .saturating_mul(info.totalram as u64)
        .max(1 << 30)
}
pub use slot_table::{MAX_DESCRIPTION, SlotRecord, SlotTable, TableHeader, table_name};

/// Alignment of the slot stride.
pub const STRIDE_ALIGN: usize = 4096;

/// Errors of the shared-memory pool.
#[derive(Debug, thiserror::Error)]
pub enum ShmError {
    /// A system call failed.
    #[error("{op} {path}: {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The pool's path.
        path: String,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The pool's shape is invalid (zero slots, unaligned stride, overflow).
    #[error("invalid pool shape: {0}")]
    Shape(String),
    /// The file behind a region shrank under a copy: the copy's bytes are meaningless and the
    /// region no longer maps the file there.
    #[error("{0}: the file shrank under the mapping")]
    Truncated(String),
    /// Not enough room for the pool where it would live.
    #[error("{path}: {need} bytes needed, {free} free")]
    NoSpace {
        /// Where the pool would live.
        path: String,
        /// Bytes the pool needs.
        need: u64,
        /// Bytes available there.
        free: u64,
    },
    /// A slot access outside the pool or its slot.
    #[error(
        "out of bounds: slot {slot}, offset {offset}, length {len} (pool of {slots} slots of {stride} bytes)"
    )]
    OutOfBounds {
        /// Slot asked for.
        slot: u32,
        /// Offset within the slot.
        offset: usize,
        /// Bytes asked for.
        len: usize,
        /// Slots in the pool.
        slots: u32,
        /// Slot stride.
        stride: usize,
    },
    /// A file that is not this process's own (a symlink, another owner, writable by group or
    /// others, a hard link): never opened as one of ours.
    #[error("{path}: not ours to open: {why}")]
    Untrusted {
        /// The file.
        path: String,
        /// What is wrong with it.
        why: String,
    },
}

impl ShmError {
    /// Whether the file was refused as not this process's own ([`open_own`]).
    pub fn is_untrusted(&self) -> bool {
        matches!(self, ShmError::Untrusted { .. })
    }
}

impl ShmError {
    /// Whether retrying could succeed (transient OS conditions only).
    pub fn is_retryable(&self) -> bool {
        matches!(self, ShmError::Io { source, .. } if source.kind() == io::ErrorKind::Interrupted)
    }
}

pub(crate) fn io_err<'a>(
    op: &'static str,
    path: &'a Path,
) -> impl FnOnce(io::Error) -> ShmError + 'a {
    move |source| ShmError::Io {
        op,
        path: path.display().to_string(),
        source,
    }
}

/// What backs the pool's memory.
#[derive(Clone, Debug)]
pub enum Backing {
    /// A named file in this process's own directory on a tmpfs ([`OwnDir`], under
    /// `/dev/shm` by default), created there new ([`OwnDir::create_replacing`]); unlinked
    /// when the pool is dropped. Its name outlives a crash, for the successor's takeover.
    ShmFile(OwnDir),
    /// An anonymous memfd.
    Memfd,
}

impl Backing {
    /// Whether the pool has a name in a directory (it can outlive its process).
    pub fn is_file(&self) -> bool {
        matches!(self, Backing::ShmFile(_))
    }
}

/// How to create a pool.
#[derive(Clone, Debug)]
pub struct PoolSpec {
    /// File name (without directory) for [`Backing::ShmFile`]; the memfd name otherwise.
    pub name: String,
    /// What backs the memory.
    pub backing: Backing,
    /// Number of slots.
    pub slots: u32,
    /// Bytes per slot, a multiple of [`STRIDE_ALIGN`].
    pub stride: usize,
    /// Lock the pool in RAM (`mlock`), so pages are never swapped and DMA stays fast.
    pub mlock: bool,
    /// Ask for transparent huge pages (`MADV_HUGEPAGE`).
    pub huge_pages: bool,
    /// Allocate all the memory now (`fallocate`), after checking the directory has room: a
    /// full `/dev/shm` is then an error here, not a SIGBUS in whichever process first touches
    /// a page, and no copy pays first-touch faults.
    pub reserve: bool,
}

/// A mapped pool. The creating process owns it (and unlinks its file on drop); other processes
/// map it from the descriptor it hands them ([`ShmPool::from_fd`]).
#[derive(Debug)]
pub struct ShmPool {
    map: MmapRaw,
    _file: File,
    path: PathBuf,
    unlink_on_drop: bool,
    slots: u32,
    stride: usize,
    locked: bool,
    huge_pages: bool,
    /// A guarded copy hit the end of a file another holder of its descriptor shrank: part of
    /// the mapping is anonymous memory now, and every later copy fails.
    damaged: guard::Damage,
}

// SAFETY: `ShmPool` only exposes the mapping through bounds-checked raw copies and raw pointers;
// it holds no Rust references into the shared bytes, so moving or sharing the handle between
// threads cannot create aliasing references. Concurrent access to one slot is excluded by the
// daemon's reserve/commit/acquire protocol, as it must be across processes anyway.
unsafe impl Send for ShmPool {}
// SAFETY: as above; every method takes `&self` and performs only raw, bounds-checked copies.
unsafe impl Sync for ShmPool {}

fn total_len(slots: u32, stride: usize) -> Result<usize, ShmError> {
    if slots == 0 {
        return Err(ShmError::Shape("a pool needs at least one slot".into()));
    }
    if stride == 0 || !stride.is_multiple_of(STRIDE_ALIGN) {
        return Err(ShmError::Shape(format!(
            "stride {stride} is not a positive multiple of {STRIDE_ALIGN}"
        )));
    }
    (slots as usize)
        .checked_mul(stride)
        .ok_or_else(|| ShmError::Shape(format!("{slots} slots × {stride} bytes overflows")))
}

/// Fails with [`ShmError::NoSpace`] when the filesystem of `dir` has less than `need` bytes
/// available.
fn check_room(dir: &Path, need: u64) -> Result<(), ShmError> {
    let c = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes())
        .map_err(|_| ShmError::Shape("pool directory contains a NUL byte".into()))?;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::zeroed();
    // SAFETY: a NUL-terminated path and a buffer of the right type, both alive for the call.
    let r = unsafe { libc::statvfs(c.as_ptr(), st.as_mut_ptr()) };
    if r != 0 {
        return Err(io_err("statvfs", dir)(io::Error::last_os_error()));
    }
    // SAFETY: statvfs succeeded, so it filled the buffer.
    let st = unsafe { st.assume_init() };
    // The field types differ between platforms (u32 on some 32-bit ones).
    #[allow(clippy::unnecessary_cast)]
    let free = (st.f_bavail as u64).saturating_mul(st.f_frsize as u64);
    if free < need {
        return Err(ShmError::NoSpace {
            path: dir.display().to_string(),
            need,
            free,
        });
    }
    Ok(())
}

/// Maps `len` bytes of a file another process created, shared. When its memory is allocated
/// already (a reserved kvtierd pool, an engine's host pool), the mapping is populated
/// (`MAP_POPULATE`): this process's page tables are built once, here, rather than by a fault
/// on the first touch of every 4 KiB on the data path. A file allocated lazily is mapped
/// lazily, so mapping it costs no memory.
pub(crate) fn map_existing(file: &File, path: &Path, len: usize) -> Result<MmapRaw, ShmError> {
    let meta = file.metadata().map_err(io_err("stat", path))?;
    let allocated = std::os::unix::fs::MetadataExt::blocks(&meta).saturating_mul(512);
    let mut opts = MmapOptions::new();
    opts.len(len);
    if allocated >= len as u64 {
        opts.populate();
    }
    opts.map_raw(file).map_err(io_err("mmap", path))
}

/// Allocates the file's blocks (tmpfs and memfd: its pages) now. A filesystem that cannot
/// (EOPNOTSUPP) keeps the file sparse.
fn reserve(file: &File, path: &Path, len: u64) -> Result<(), ShmError> {
    let Ok(n) = libc::off_t::try_from(len) else {
        return Err(ShmError::Shape(format!("{len} bytes do not fit in off_t")));
    };
    // SAFETY: a descriptor this function borrows, and plain integers.
    let r = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, n) };
    match r {
        0 => Ok(()),
        libc::EOPNOTSUPP | libc::EINVAL => Ok(()),
        libc::ENOSPC => Err(ShmError::NoSpace {
            path: path.display().to_string(),
            need: len,
            free: 0,
        }),
        e => Err(io_err("fallocate", path)(io::Error::from_raw_os_error(e))),
    }
}

/// A file's identity (device, inode): two mappings with the same one are the same memory.
pub(crate) fn file_id(file: &File, path: &Path) -> Result<(u64, u64), ShmError> {
    use std::os::unix::fs::MetadataExt;
    let m = file.metadata().map_err(io_err("stat", path))?;
    Ok((m.dev(), m.ino()))
}

/// Fixes a memfd's size for good (`F_SEAL_SHRINK | F_SEAL_GROW`, then `F_SEAL_SEAL`).
fn seal_size(file: &File, path: &Path) -> Result<(), ShmError> {
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
    // SAFETY: a plain fcntl on a descriptor this function borrows; no memory is passed.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
        return Err(io_err("seal the size of", path)(io::Error::last_os_error()));
    }
    Ok(())
}

impl ShmPool {
    /// Creates a pool as `spec` says. A file of the same name already in the directory (a
    /// dead process's: nobody else can write there) is removed first, never reused; the
    /// second value says whether one was.
    pub fn create(spec: &PoolSpec) -> Result<(Self, bool), ShmError> {
        let len = total_len(spec.slots, spec.stride)?;
        let (file, path, unlink, replaced) = match &spec.backing {
            Backing::ShmFile(dir) => {
                let (file, replaced) = dir.create_replacing(&spec.name)?;
                (file, dir.join(&spec.name), true, replaced)
            }
            Backing::Memfd => {
                let cname = std::ffi::CString::new(spec.name.clone())
                    .map_err(|_| ShmError::Shape("pool name contains a NUL byte".into()))?;
                // SAFETY: `cname` is a valid NUL-terminated string that outlives the call.
                let fd = unsafe {
                    libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
                };
                if fd < 0 {
                    return Err(ShmError::Io {
                        op: "memfd_create",
                        path: spec.name.clone(),
                        source: io::Error::last_os_error(),
                    });
                }
                // SAFETY: `fd` was just returned by memfd_create and is owned by nobody else.
                let file = unsafe { File::from_raw_fd(fd) };
                (
                    file,
                    PathBuf::from(format!("memfd:{}", spec.name)),
                    false,
                    false,
                )
            }
        };
        let guard = UnlinkGuard(unlink.then(|| path.clone()));
        if spec.reserve
            && let Backing::ShmFile(dir) = &spec.backing
        {
            check_room(dir.path(), len as u64)?;
        }
        file.set_len(len as u64).map_err(io_err("size", &path))?;
        if !spec.backing.is_file() {
            // Clients hold its descriptor: none of them can shrink it under kvtierd's copies
            // (a SIGBUS) or grow it.
            seal_size(&file, &path)?;
        }
        if spec.reserve {
            reserve(&file, &path, len as u64)?;
        }
        let map = MmapOptions::new()
            .len(len)
            .map_raw(&file)
            .map_err(io_err("mmap", &path))?;
        let huge_pages = spec.huge_pages && map.advise(Advice::HugePage).is_ok();
        if spec.mlock {
            map.lock()
                .map_err(io_err("mlock (raise RLIMIT_MEMLOCK / LimitMEMLOCK)", &path))?;
        }
        std::mem::forget(guard);
        let pool = Self {
            map,
            _file: file,
            path,
            unlink_on_drop: unlink,
            slots: spec.slots,
            stride: spec.stride,
            locked: spec.mlock,
            huge_pages,
            damaged: Default::default(),
        };
        Ok((pool, replaced))
    }

    /// Maps a pool from the descriptor its creator handed over (kvtierd's pool door); `name`
    /// is for errors and logs. Its size must be `slots × stride`.
    pub fn from_fd(
        fd: std::os::fd::OwnedFd,
        name: &str,
        slots: u32,
        stride: usize,
    ) -> Result<Self, ShmError> {
        Self::map_file(File::from(fd), Path::new(name), slots, stride)
    }

    /// [`ShmPool::open`] for a pool a dead predecessor of this process left in `dir`: only
    /// a file that is this process's own ([`open_own`]).
    pub fn open_own(dir: &OwnDir, name: &str, slots: u32, stride: usize) -> Result<Self, ShmError> {
        Self::map_file(dir.open_own(name)?, &dir.join(name), slots, stride)
    }

    /// The pool's descriptor, for handing to a client (`SCM_RIGHTS`).
    pub fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self._file.as_fd()
    }

    fn map_file(file: File, path: &Path, slots: u32, stride: usize) -> Result<Self, ShmError> {
        let len = total_len(slots, stride)?;
        let actual = file.metadata().map_err(io_err("stat", path))?.len();
        if actual != len as u64 {
            return Err(ShmError::Shape(format!(
                "{} is {actual} bytes, expected {slots} slots × {stride} = {len}",
                path.display()
            )));
        }
        let map = map_existing(&file, path, len)?;
        Ok(Self {
            map,
            _file: file,
            path: path.to_path_buf(),
            unlink_on_drop: false,
            slots,
            stride,
            locked: false,
            huge_pages: false,
            damaged: Default::default(),
        })
    }

    /// The mapped file's identity (device, inode): two mappings with the same one are the
    /// same memory, whatever paths opened them.
    pub fn file_id(&self) -> Result<(u64, u64), ShmError> {
        crate::file_id(&self._file, &self.path)
    }

    /// The path other processes open to map this pool.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Slots in the pool.
    pub fn slots(&self) -> u32 {
        self.slots
    }

    /// Bytes per slot.
    pub fn stride(&self) -> usize {
        self.stride
    }

    /// Total mapped bytes.
    pub fn len(&self) -> usize {
        self.slots as usize * self.stride
    }

    /// Always false: a pool has at least one slot.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Whether the pool is locked in RAM.
    pub fn is_locked(&self) -> bool {
        self.locked
    }

    /// Whether transparent huge pages were granted.
    pub fn huge_pages(&self) -> bool {
        self.huge_pages
    }

    /// Removes the pool's name now (owner of a [`Backing::ShmFile`] pool only): processes that
    /// have it mapped keep their mapping, nobody new can open it. Idempotent.
    pub fn unlink(&self) {
        if self.unlink_on_drop {
            // Already gone is fine: that is the goal.
            let _ = std::fs::remove_file(&self.path);
        }
    }

    /// The raw file descriptor (for passing to other processes).
    pub fn raw_fd(&self) -> i32 {
        self._file.as_raw_fd()
    }

    fn check(&self, slot: u32, offset: usize, len: usize) -> Result<usize, ShmError> {
        let oob = || ShmError::OutOfBounds {
            slot,
            offset,
            len,
            slots: self.slots,
            stride: self.stride,
        };
        if slot >= self.slots || offset.checked_add(len).is_none_or(|end| end > self.stride) {
            return Err(oob());
        }
        Ok(slot as usize * self.stride + offset)
    }

    /// Copies `src` into slot `slot` at byte `offset`. Every process holding the pool's
    /// descriptor could shrink a file-backed pool (a memfd pool is sealed): the copy is
    /// guarded, so that is [`ShmError::Truncated`] here, and for every later copy, never a
    /// SIGBUS.
    pub fn write(&self, slot: u32, offset: usize, src: &[u8]) -> Result<(), ShmError> {
        let at = self.check(slot, offset, src.len())?;
        self.damaged.check(&self.path)?;
        // SAFETY: `check` proved `at + src.len() <= len()`, so the destination lies inside the
        // live mapping.
        let dst = unsafe { self.map.as_mut_ptr().add(at) };
        let copied = guard::guarded(dst as usize, src.len(), || {
            // SAFETY: the destination range was checked above; `src` is a Rust slice and
            // cannot overlap the shared mapping's bytes because this crate never creates
            // references into the mapping. A fault inside the range is absorbed by the guard.
            unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) }
        });
        self.damaged.after(copied, &self.path, || {
            use std::os::unix::fs::FileExt;
            self._file
                .write_all_at(src, at as u64)
                .map_err(io_err("pwrite", &self.path))
        })
    }

    /// Copies bytes from slot `slot` at byte `offset` into `dst` (guarded as
    /// [`ShmPool::write`] is).
    pub fn read(&self, slot: u32, offset: usize, dst: &mut [u8]) -> Result<(), ShmError> {
        let at = self.check(slot, offset, dst.len())?;
        self.damaged.check(&self.path)?;
        // SAFETY: as in `write`: the source range is inside the mapping.
        let src = unsafe { self.map.as_ptr().add(at) };
        let copied = guard::guarded(src as usize, dst.len(), || {
            // SAFETY: the range was checked above and `dst` is a distinct Rust buffer; a
            // fault inside the range is absorbed by the guard.
            unsafe { std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), dst.len()) }
        });
        self.damaged.after(copied, &self.path, || {
            use std::os::unix::fs::FileExt;
            self._file
                .read_exact_at(dst, at as u64)
                .map_err(io_err("pread", &self.path))
        })
    }

    /// Whether the pool's file still has the pool's size and no copy found it shrunk. Any
    /// holder of a file-backed pool's descriptor can shrink or grow it (a memfd pool's size
    /// is sealed); then the pool is of no further use to anyone who maps it.
    pub fn file_intact(&self) -> bool {
        !self.is_damaged()
            && self
                ._file
                .metadata()
                .is_ok_and(|m| m.len() == self.len() as u64)
    }

    /// Whether a guarded copy found the pool's file shrunk (the pool is of no further use).
    pub fn is_damaged(&self) -> bool {
        self.damaged.is_set()
    }

    /// CRC32C of the first `len` bytes of `slot`, read through a small buffer (no reference
    /// into the shared bytes is ever made). The buffer is the calling thread's, reused: 64 KiB
    /// stays in the core's cache between the copy and the checksum, and sealing a page costs
    /// no allocation.
    pub fn checksum(&self, slot: u32, len: usize) -> Result<u32, ShmError> {
        const CHUNK: usize = 64 << 10;
        thread_local! {
            static BUF: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
        }
        self.check(slot, 0, len)?;
        BUF.with_borrow_mut(|buf| {
            if buf.len() < CHUNK {
                buf.resize(CHUNK, 0);
            }
            let (mut crc, mut done) = (0u32, 0usize);
            while done < len {
                let n = CHUNK.min(len - done);
                self.read(slot, done, &mut buf[..n])?;
                crc = kvtier_core::checksum::crc32c_append(crc, &buf[..n]);
                done += n;
            }
            Ok(crc)
        })
    }

    /// Gives the memory of `slot` back to the system (`FALLOC_FL_PUNCH_HOLE`): its bytes read
    /// as zeros afterwards. Used on a dead daemon's pool as its pages are taken over, so the
    /// takeover never needs twice the memory. A filesystem that cannot punch holes keeps the
    /// bytes (no error).
    pub fn punch(&self, slot: u32) -> Result<(), ShmError> {
        let at = self.check(slot, 0, self.stride)?;
        let (Ok(off), Ok(len)) = (
            libc::off_t::try_from(at),
            libc::off_t::try_from(self.stride),
        ) else {
            return Err(ShmError::Shape(format!(
                "slot {slot} does not fit in off_t"
            )));
        };
        // SAFETY: a descriptor this pool owns, and plain integers.
        let r = unsafe {
            libc::fallocate(
                self._file.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                off,
                len,
            )
        };
        if r != 0 {
            let e = io::Error::last_os_error();
            if !matches!(e.raw_os_error(), Some(libc::EOPNOTSUPP)) {
                return Err(io_err("punch hole", &self.path)(e));
            }
        }
        Ok(())
    }

    /// Removes the file when this handle drops (a dead daemon's pool, once taken over).
    pub fn remove_on_drop(&mut self) {
        self.unlink_on_drop = true;
    }

    /// A raw pointer to the start of `slot`, valid while `self` lives, for DMA engines and
    /// batched copies. Callers must keep to `stride()` bytes and to the daemon's protocol.
    pub fn slot_ptr(&self, slot: u32) -> Result<NonNull<u8>, ShmError> {
        let at = self.check(slot, 0, 0)?;
        // SAFETY: `at` is inside the mapping (checked above), whose base is non-null.
        let p = unsafe { self.map.as_mut_ptr().add(at) };
        NonNull::new(p).ok_or(ShmError::Shape("null mapping".into()))
    }
}

impl Drop for ShmPool {
    fn drop(&mut self) {
        if self.unlink_on_drop {
            // Best effort: the file may already be gone (operator cleanup); nothing to do then.
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Removes a half-created pool file if creation fails part-way.
struct UnlinkGuard(Option<PathBuf>);

impl Drop for UnlinkGuard {
    fn drop(&mut self) {
        if let Some(p) = &self.0 {
            let _ = std::fs::remove_file(p);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A spec whose name is unique to the calling test (tests run in parallel).
    fn spec(backing: Backing, test: &str) -> PoolSpec {
        PoolSpec {
            name: format!(
                "kvtier-shm-test-{}-{test}-{}",
                std::process::id(),
                backing.is_file()
            ),
            backing,
            slots: 4,
            stride: 8192,
            mlock: false,
            huge_pages: false,
            reserve: false,
        }
    }

    fn own() -> OwnDir {
        let d = std::env::temp_dir().join(format!("kvtier-shm-own-{}", std::process::id()));
        OwnDir::open_or_create(&d).unwrap().0
    }

    fn file() -> Backing {
        Backing::ShmFile(own())
    }

    /// What a client of kvtierd's pool door does: maps the pool from its descriptor.
    fn client(owner: &ShmPool, slots: u32) -> Result<ShmPool, ShmError> {
        let fd = owner.fd().try_clone_to_owned().unwrap();
        ShmPool::from_fd(fd, "client", slots, owner.stride())
    }

    #[test]
    fn pool_and_table_files_are_new_and_the_owners_alone_whatever_the_umask() {
        use std::os::unix::fs::PermissionsExt;
        // SAFETY: umask only sets this process's file-creation mask; the most permissive one
        // here shows the mode below is set, not inherited (other tests only get laxer
        // masks, and set their files' modes themselves).
        unsafe { libc::umask(0) };
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        let s = spec(file(), "mode-owner");
        let (p, replaced) = ShmPool::create(&s).unwrap();
        assert!(!replaced);
        assert_eq!(mode(p.path()), 0o600);
        assert_eq!(mode(own().path()), 0o700);
        let table = format!("kvtier-shm-test-{}-mode.slots", std::process::id());
        let t = crate::slot_table::SlotTable::create(&own(), &table, 2, 4096, b"x").unwrap();
        assert_eq!(mode(&own().join(&table)), 0o600);
        drop((p, t));
        // A leftover of the same name (a dead kvtierd's) is removed, never reused: the new
        // pool is a new file, and the old one's holder keeps its own bytes.
        let (old, _) = ShmPool::create(&s).unwrap();
        let mut old = old;
        old.unlink_on_drop = false;
        old.write(0, 0, &[9; 16]).unwrap();
        let (new, replaced) = ShmPool::create(&s).unwrap();
        assert!(replaced);
        assert_ne!(old.file_id().unwrap(), new.file_id().unwrap());
        let mut b = [0u8; 16];
        new.read(0, 0, &mut b).unwrap();
        assert_eq!(b, [0; 16]);
    }

    #[test]
    fn a_file_pool_shrunk_by_a_client_fails_the_owners_copies_never_kills_it() {
        let (owner, _) = ShmPool::create(&spec(file(), "shrunk")).unwrap();
        owner.write(3, 0, &[1; 64]).unwrap();
        assert!(owner.file_intact());
        // A client holding the descriptor shrinks the file under the owner's mapping.
        let fd = owner.fd().try_clone_to_owned().unwrap();
        File::from(fd).set_len(4096).unwrap();
        let mut b = [0u8; 64];
        assert!(matches!(
            owner.read(3, 0, &mut b),
            Err(ShmError::Truncated(_))
        ));
        assert!(owner.is_damaged());
        // Every later copy fails too, even of a slot still inside the file.
        assert!(matches!(
            owner.write(0, 0, &[2; 8]),
            Err(ShmError::Truncated(_))
        ));
        assert!(owner.checksum(0, 64).is_err());
    }

    #[test]
    fn a_memfd_pools_size_is_sealed_against_its_clients() {
        let (owner, _) = ShmPool::create(&spec(Backing::Memfd, "sealed")).unwrap();
        let fd = owner.fd().try_clone_to_owned().unwrap();
        let f = File::from(fd);
        assert!(f.set_len(4096).is_err(), "a client cannot shrink it");
        assert!(f.set_len(1 << 20).is_err(), "nor grow it");
        assert_eq!(f.metadata().unwrap().len(), 4 * 8192);
    }

    #[test]
    fn two_mappings_see_the_same_bytes() {
        for backing in [file(), Backing::Memfd] {
            let (owner, _) = ShmPool::create(&spec(backing.clone(), "two")).unwrap();
            let client = client(&owner, 4).unwrap();
            let page: Vec<u8> = (0..8192u32).map(|i| (i * 7 % 251) as u8).collect();
            client.write(3, 0, &page).unwrap();
            let mut back = vec![0u8; 8192];
            owner.read(3, 0, &mut back).unwrap();
            assert_eq!(back, page, "{backing:?}");
            assert!(super::tests::client(&owner, 5).is_err(), "size is checked");
        }
    }

    #[test]
    fn regions_are_shared_sized_and_bounded() {
        let engine = ShmRegion::memfd("region", 10_000).unwrap();
        let fd = || engine.fd().try_clone_to_owned().unwrap();
        let agent = ShmRegion::from_fd_at_least(fd(), 10_000, "agent").unwrap();
        engine.write(9_990, &[5; 10]).unwrap();
        let mut back = [0u8; 10];
        agent.read(9_990, &mut back).unwrap();
        assert_eq!(back, [5; 10]);
        assert!(agent.write(9_995, &[1; 10]).is_err(), "past the end");
        assert!(agent.read(usize::MAX, &mut back).is_err(), "overflow");
        let e = ShmRegion::from_fd_at_least(fd(), 12_000, "short")
            .unwrap_err()
            .to_string();
        assert!(e.contains("expected at least 12000"), "{e}");
        assert!(ShmRegion::memfd("empty", 0).is_err());
        // A descriptor of something that is not a regular file maps nothing.
        let dir = std::fs::File::open("/").unwrap();
        let e = ShmRegion::from_fd(dir.into(), "dir").unwrap_err();
        assert!(e.is_untrusted(), "{e}");
    }

    /// Resident bytes of this process's mapping starting at `addr` (from /proc/self/smaps).
    fn resident(addr: usize) -> u64 {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut lines = smaps.lines();
        while let Some(l) = lines.next() {
            let start = l
                .split('-')
                .next()
                .and_then(|h| usize::from_str_radix(h, 16).ok());
            if start == Some(addr) {
                for l in lines.by_ref() {
                    if let Some(kb) = l.strip_prefix("Rss:") {
                        return kb
                            .trim()
                            .trim_end_matches("kB")
                            .trim()
                            .parse::<u64>()
                            .unwrap()
                            * 1024;
                    }
                }
            }
        }
        panic!("no mapping at {addr:#x}");
    }

    #[test]
    fn a_reserved_pool_is_mapped_populated_and_a_lazy_one_lazily() {
        for (reserve, name) in [(true, "populated"), (false, "lazy")] {
            let mut sp = spec(Backing::Memfd, name);
            sp.reserve = reserve;
            sp.slots = 64;
            let (owner, _) = ShmPool::create(&sp).unwrap();
            let client = client(&owner, 64).unwrap();
            let addr = client.slot_ptr(0).unwrap().as_ptr() as usize;
            let rss = resident(addr);
            if reserve {
                assert_eq!(rss, 64 * 8192, "the page tables are built at open");
            } else {
                assert_eq!(rss, 0, "a lazy pool costs nothing to map");
            }
        }
    }

    #[test]
    fn a_reserved_pool_is_allocated_up_front_and_refused_when_it_cannot_fit() {
        let mut sp = spec(file(), "reserve");
        sp.reserve = true;
        let (p, _) = ShmPool::create(&sp).unwrap();
        // Every block is allocated: the file is not sparse.
        let meta = std::fs::metadata(p.path()).unwrap();
        use std::os::unix::fs::MetadataExt;
        assert!(meta.blocks() * 512 >= 4 * 8192, "{} blocks", meta.blocks());
        drop(p);
        // Far more than the directory's filesystem has: refused at once, nothing left behind.
        let mut huge = spec(file(), "huge");
        huge.reserve = true;
        huge.slots = u32::MAX;
        huge.stride = 1 << 30;
        match ShmPool::create(&huge) {
            Err(ShmError::NoSpace { need, free, .. }) => assert!(need > free),
            other => panic!("expected NoSpace, got {other:?}"),
        }
        assert!(!own().contains(&huge.name));
    }

    #[test]
    fn bounds_are_enforced() {
        let (p, _) = ShmPool::create(&spec(file(), "bounds")).unwrap();
        assert!(matches!(
            p.write(4, 0, &[1]),
            Err(ShmError::OutOfBounds { .. })
        ));
        assert!(matches!(
            p.write(0, 8190, &[1, 2, 3]),
            Err(ShmError::OutOfBounds { .. })
        ));
        assert!(matches!(
            p.read(0, usize::MAX, &mut [0]),
            Err(ShmError::OutOfBounds { .. })
        ));
        p.write(0, 8189, &[1, 2, 3]).unwrap();
        assert!(p.slot_ptr(3).is_ok() && p.slot_ptr(4).is_err());
    }

    #[test]
    fn file_is_unlinked_on_drop_and_shapes_are_checked() {
        let s = spec(file(), "unlink");
        let path = {
            let (p, _) = ShmPool::create(&s).unwrap();
            assert!(p.path().exists());
            p.path().to_path_buf()
        };
        assert!(!path.exists());
        let mut bad = s.clone();
        bad.stride = 100;
        assert!(matches!(ShmPool::create(&bad), Err(ShmError::Shape(_))));
        bad.stride = 4096;
        bad.slots = 0;
        assert!(matches!(ShmPool::create(&bad), Err(ShmError::Shape(_))));
    }

    fn memfd(len: u64, sealable: bool) -> std::os::fd::OwnedFd {
        use std::os::fd::FromRawFd;
        let flags = libc::MFD_CLOEXEC | if sealable { libc::MFD_ALLOW_SEALING } else { 0 };
        // SAFETY: a NUL-terminated name and plain flags; the returned descriptor is checked
        // and then owned by the OwnedFd alone.
        let fd = unsafe { libc::memfd_create(c"kvtier-shm-test".as_ptr(), flags) };
        assert!(fd >= 0, "memfd_create failed");
        // SAFETY: `fd` is a fresh descriptor nobody else owns.
        let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
        File::from(fd.try_clone().unwrap()).set_len(len).unwrap();
        fd
    }

    #[test]
    fn a_sealable_file_is_sealed_against_shrinking_and_pread_never_faults() {
        // Sealing allowed: after seal_shrink the owner can no longer shrink it.
        let fd = memfd(65536, true);
        let owner = File::from(fd.try_clone().unwrap());
        let r = ShmRegion::from_fd(fd, "sealable").unwrap();
        assert!(r.seal_shrink());
        assert!(r.seal_shrink(), "sealing twice still reports sealed");
        assert!(owner.set_len(4096).is_err(), "a sealed file shrank");
        assert_eq!(r.current_file_len().unwrap(), 65536);

        // Not allowed: seal_shrink says so; the owner shrinks it, and pread/pwrite past the new
        // end give an error or grow it back — no SIGBUS, which the mapping would raise.
        let fd = memfd(65536, false);
        let owner = File::from(fd.try_clone().unwrap());
        let r = ShmRegion::from_fd(fd, "unsealable").unwrap();
        assert!(!r.seal_shrink());
        r.pwrite(60000, &[7u8; 100]).unwrap();
        let mut b = [0u8; 100];
        r.pread(60000, &mut b).unwrap();
        assert_eq!(b, [7u8; 100]);
        owner.set_len(4096).unwrap();
        assert!(r.pread(60000, &mut b).is_err());
        assert!(
            r.pread(70000, &mut b).is_err(),
            "outside the mapping is refused"
        );
        r.pwrite(60000, &[9u8; 100]).unwrap();
        r.pread(60000, &mut b).unwrap();
        assert_eq!(b, [9u8; 100]);
    }

    #[test]
    fn guarded_copies_survive_a_file_shrinking_under_them() {
        let fd = memfd(256 << 10, false);
        let owner = File::from(fd.try_clone().unwrap());
        let r = ShmRegion::from_fd(fd, "shrinking").unwrap();
        // Intact: guarded copies are plain copies.
        r.write_guarded(200_000, &[5u8; 1000]).unwrap();
        let mut b = vec![0u8; 1000];
        r.read_guarded(200_000, &mut b).unwrap();
        assert_eq!(b, vec![5u8; 1000]);
        assert!(!r.is_damaged());
        // The owner shrinks it: a copy past the new end would be SIGBUS; guarded, it fails.
        owner.set_len(8192).unwrap();
        let mut big = vec![0u8; 100_000];
        assert!(matches!(
            r.read_guarded(4096, &mut big),
            Err(ShmError::Truncated(_))
        ));
        assert!(r.is_damaged());
        // From then on the region refuses guarded copies, even inside the remaining file.
        assert!(r.write_guarded(0, &[1u8; 16]).is_err());
        assert!(r.read_guarded(0, &mut b[..16]).is_err());
        // A write that faults is absorbed the same way, on another region.
        let fd = memfd(256 << 10, false);
        let owner = File::from(fd.try_clone().unwrap());
        let w = ShmRegion::from_fd(fd, "shrinking-w").unwrap();
        owner.set_len(0).unwrap();
        assert!(matches!(
            w.write_guarded(100, &[7u8; 50_000]),
            Err(ShmError::Truncated(_))
        ));
        // The file itself did not grow back: the bytes went nowhere.
        assert_eq!(w.current_file_len().unwrap(), 0);
    }

    /// A fault outside any guarded copy is not swallowed: the process dies of SIGBUS as it
    /// would without the guard. Run in a child process (this test binary, re-executed).
    #[test]
    fn a_fault_outside_a_guarded_copy_still_kills_the_process() {
        const CHILD: &str = "KVTIER_SHM_SIGBUS_CHILD";
        let fd = memfd(64 << 10, false);
        let owner = File::from(fd.try_clone().unwrap());
        let r = ShmRegion::from_fd(fd, "unguarded").unwrap();
        if std::env::var_os(CHILD).is_some() {
            // Installs the guard, then faults outside it.
            r.read_guarded(0, &mut [0u8; 8]).unwrap();
            owner.set_len(0).unwrap();
            let mut b = [0u8; 8];
            let _ = r.read(60_000, &mut b);
            std::hint::black_box(&b);
            std::process::exit(0); // not reached
        }
        use std::os::unix::process::ExitStatusExt;
        let status = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "tests::a_fault_outside_a_guarded_copy_still_kills_the_process",
                "--test-threads=1",
            ])
            .env(CHILD, "1")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .unwrap();
        assert_eq!(status.signal(), Some(libc::SIGBUS), "{status:?}");
    }
}
