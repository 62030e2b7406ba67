//! `file`: one file per object under a directory — the embedded default backend.
//!
//! - **Atomic**: an object is written to a temp file beside it (`.t<pid>-<n>`, a name no object
//!   can have) and renamed to its name, so a reader sees a whole file or none; a crash leaves
//!   at most a temp file, removed at the next start. An object written again replaces the old
//!   one (the last writer wins); the old name is removed just before the rename (see
//!   [`publish`]), so a reader in between gets a miss. The rename stays within one directory:
//!   a rename across directories takes the filesystem-wide rename lock, and one shared temp
//!   directory serialises every create on its lock (profiled: 60% of kvtierd's time under a
//!   concurrent replay went there). With
//!   `sync = true` the data is fsynced before the rename (durable across power loss); without,
//!   a power cut can leave a renamed but empty or torn file, which the page checksum turns into
//!   a miss.
//! - **Bounded**: an in-memory index (size and last access per object) evicts least recently
//!   used objects above `capacity_bytes`, and writes are refused while the filesystem has less
//!   than `min_free_bytes` free. Objects older than `ttl` are misses (and deleted).
//! - **Restartable**: the files are the truth; the index is rebuilt in the background at start
//!   (it serves only eviction and accounting), so start is immediate and reads work at once.
//! - A file that cannot be deleted is counted and forgotten by the index, never retried in a loop.
//! - **Its own directory only**: the root holds a marker file ([`MARKER`]) written when kvtier
//!   first takes the directory. A directory that holds anything else and no marker is refused,
//!   and the clean-ups (stale temp files at start, `clear`) delete only files named as kvtier
//!   names them, in real directories (symlinks are never followed), so pointing a store at a
//!   directory with other files in it deletes none of them.
//!
//! Blocking file I/O runs on tokio's blocking pool, never on the async workers.

use parking_lot::Mutex;
use std::io::{ErrorKind, Write as _};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use bytes::Bytes;
use kvtier_config::Capacity;
use kvtier_config::l3::{FileIo, FileSection};
use kvtier_core::TenantTag;

use crate::direct::{self, DirectReader};
use crate::lru::{Index, blocking, check_fits, now_ns};
use crate::{ObjectSink, Removed, SinkReadError, StorageError, Store, StoreStats, check_name};

/// Bytes per read of [`Store::read_into`]: large enough for few syscalls, small enough to
/// stay in cache between the read and the copy out.
const READ_CHUNK: usize = 256 << 10;

thread_local! {
    static CHUNK: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The file backend.
#[derive(Debug)]
pub struct FileStore {
    /// The directory holding `objects/`.
    root: PathBuf,
    /// `[l3.file]`: bound, free-space guard, expiry, fsync.
    cfg: FileSection,
    objects: PathBuf,
    index: Arc<Mutex<Index>>,
    seq: AtomicU64,
    /// The bound in bytes (0: none): `cfg.capacity_bytes` resolved. A share of the space is
    /// resolved once the index is rebuilt (it counts the bytes the store holds) and is no
    /// bound until then, so a write meanwhile never evicts what the listing has not reached.
    capacity: Arc<AtomicU64>,
}

impl FileStore {
    /// How old an object may get before it is a miss (`None`: no expiry).
    fn ttl(&self) -> Option<Duration> {
        let ttl = self.cfg.ttl.0;
        (!ttl.is_zero()).then_some(ttl)
    }

    /// Whether page bytes go to and from the device with `O_DIRECT` (`l3.file.io`).
    fn direct(&self) -> bool {
        self.cfg.io == FileIo::Direct
    }
}

/// A new temporary file at `tmp`: `O_CREAT|O_EXCL|O_NOFOLLOW`, so a file or symlink someone
/// planted at the name is an error (the write fails: a miss), never written through or
/// truncated; mode 0600 whatever the umask allows beyond it: pages are kvtierd's alone (each
/// tenant reads its own through kvtierd).
/// With `direct`, the file is opened for `O_DIRECT` writes.
fn new_file(tmp: &Path, direct: bool) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let flags =
        rustix::fs::OFlags::NOFOLLOW.bits() as i32 | if direct { direct::flag() } else { 0 };
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(flags)
        .open(tmp)
}

/// Opens object file `path` to read it, with `O_DIRECT` when `direct`: a regular file only.
/// `O_NONBLOCK` (no effect on a regular file) keeps a FIFO planted at the name from holding
/// the opening thread until a writer comes; anything but a regular file is refused. Returns
/// the file and its metadata (one `fstat` serves the check and the caller).
fn open_object(path: &Path, direct: bool) -> std::io::Result<(std::fs::File, std::fs::Metadata)> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut o = std::fs::OpenOptions::new();
    o.read(true).custom_flags(
        rustix::fs::OFlags::NONBLOCK.bits() as i32 | if direct { direct::flag() } else { 0 },
    );
    let f = o.open(path)?;
    let meta = f.metadata()?;
    if !meta.is_file() {
        return Err(std::io::Error::new(
            ErrorKind::InvalidData,
            "not a regular file (kvtier writes only regular files)",
        ));
    }
    Ok((f, meta))
}

/// Reads all of `f` (`len` bytes) into `out`: through an aligned buffer where it was opened
/// with `O_DIRECT`.
fn read_whole(
    f: &mut std::fs::File,
    len: u64,
    direct: bool,
    out: &mut Vec<u8>,
) -> std::io::Result<()> {
    use std::io::Read as _;
    out.reserve_exact(len as usize);
    if direct {
        direct::with_aligned(DirectReader::buffer_for(len), |buf| {
            DirectReader::new(f, len, buf).read_to_end(out)
        })?;
    } else {
        f.read_to_end(out)?;
    }
    Ok(())
}

/// Creates `dir` and any missing parents with mode 0700 (kvtierd's alone, whatever the
/// umask allows beyond it); directories already there keep their mode.
fn private_dirs(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt as _;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| match e.kind() {
            // (Recursive creation says only "File exists" of a file in the directory's place.)
            std::io::ErrorKind::AlreadyExists => {
                std::io::Error::new(e.kind(), "it exists and is not a directory")
            }
            _ => e,
        })
}

/// Refuses a directory of the store that another uid could change (own it, or write it):
/// they could rename, swap or remove kvtier's objects in it.
fn trusted(dir: &Path) -> Result<(), StorageError> {
    kvtier_shm::check_trusted_dir(dir)
        .map_err(|e| StorageError::Invalid(format!("the file store's directory: {e}")))
}

/// Refuses a store with a directory under `objects/` that is not kvtierd's alone (another
/// uid's, one others may write, or a symlink another uid owns or that leads to such a
/// directory): whoever owns it could swap the files in it.
/// Every directory kvtierd makes there is 0700 inside 0700 ones, so such a one was planted
/// before (in a store another uid could write then). Only the directories are looked at
/// (`objects/<layout>/` and the 256 prefixes under each, [`FileStore::path_of`]), never the
/// objects in them.
fn own_tree(objects: &Path) -> Result<(), StorageError> {
    use std::os::unix::fs::MetadataExt as _;
    let me = rustix::process::geteuid().as_raw();
    let mut dirs = vec![(objects.to_path_buf(), 0)];
    while let Some((dir, depth)) = dirs.pop() {
        for e in std::fs::read_dir(&dir).map_err(io("list", &dir))? {
            let e = e.map_err(io("list", &dir))?;
            let ft = e.file_type().map_err(io("stat", &e.path()))?;
            if !ft.is_dir() && !ft.is_symlink() {
                continue;
            }
            let p = e.path();
            let m = std::fs::symlink_metadata(&p).map_err(io("stat", &p))?;
            let bad = |why: String| {
                StorageError::Invalid(format!(
                    "the file store's directory {}: {why}; remove it (or fix it after checking \
                     what is inside)",
                    p.display()
                ))
            };
            if m.file_type().is_symlink() {
                // An operator's (a layout moved to another disk): it and where it leads must
                // be no one else's to change.
                if m.uid() != me && m.uid() != 0 {
                    return Err(bad(format!("a symlink owned by uid {}", m.uid())));
                }
                kvtier_shm::check_trusted_dir(&p).map_err(|e| bad(e.to_string()))?;
                continue;
            }
            if !m.is_dir() {
                continue;
            }
            if m.uid() != me && m.uid() != 0 {
                return Err(bad(format!("owned by uid {}", m.uid())));
            }
            if m.mode() & 0o022 != 0 {
                return Err(bad(format!(
                    "mode {:o} lets others write it",
                    m.mode() & 0o7777
                )));
            }
            if depth < 1 {
                dirs.push((p, depth + 1));
            }
        }
    }
    Ok(())
}

/// Moves the written temp file `tmp` to its object's `path`, replacing what is there.
///
/// Never by renaming over an existing file: ext4 (with its default `auto_da_alloc`) then
/// allocates and starts writing back the new file's data inside the rename, which made
/// rewriting 2 MiB objects run at 0.7 GiB/s against 1.3 for a rename to a free name (this
/// project's VM, docs/BENCHMARKS.md). So the rename asks for a free name (`RENAME_NOREPLACE`)
/// and, finding the name taken, removes the old file and asks again. A reader in between
/// sees no object, a miss, never a torn one (and should the rename then fail, the name holds
/// none: a miss as well). A filesystem without `RENAME_NOREPLACE`, or a name a concurrent
/// writer keeps taking, gets the plain rename.
fn publish(tmp: &Path, path: &Path) -> std::io::Result<()> {
    use rustix::fs::{CWD, RenameFlags, renameat_with};
    use rustix::io::Errno;
    for _ in 0..3 {
        match renameat_with(CWD, tmp, CWD, path, RenameFlags::NOREPLACE) {
            Ok(()) => return Ok(()),
            Err(Errno::EXIST) => match std::fs::remove_file(path) {
                Err(e) if e.kind() != ErrorKind::NotFound => return Err(e),
                _ => {}
            },
            Err(Errno::INVAL | Errno::NOSYS | Errno::OPNOTSUPP) => break,
            Err(e) => return Err(e.into()),
        }
    }
    std::fs::rename(tmp, path)
}

fn io(op: &'static str, target: &Path) -> impl FnOnce(std::io::Error) -> StorageError {
    let target = target.display().to_string();
    move |source| StorageError::Io { op, target, source }
}

/// Whether a file last written per `meta` is older than `ttl`.
fn expired(ttl: Option<Duration>, meta: &std::fs::Metadata) -> bool {
    ttl.is_some_and(|ttl| {
        meta.modified()
            .ok()
            .and_then(|m| m.elapsed().ok())
            .is_some_and(|age| age > ttl)
    })
}

impl FileStore {
    /// Opens (creating if needed) a store in `root` as `cfg` (`[l3.file]`) says, tracking
    /// `tenant_quotas` (each tenant by the tag its objects' keys start with, with its most
    /// bytes, 0: counted only; a tenant past its quota evicts its own least recently used
    /// objects): removes temp files a crash left behind and rebuilds the index in the
    /// background. `cfg.path` is not read: `root` is where the caller resolved it to.
    pub async fn open(
        root: impl Into<PathBuf>,
        cfg: &FileSection,
        tenant_quotas: &[(TenantTag, u64)],
    ) -> Result<Arc<Self>, StorageError> {
        let root = root.into();
        claim(&root)?;
        let objects = root.join("objects");
        private_dirs(&objects).map_err(io("create", &objects))?;
        trusted(&objects)?;
        own_tree(&objects)?;
        if cfg.io == FileIo::Direct {
            let probe = objects.join(format!(".t{}-probe", std::process::id()));
            direct::probe(&probe, || new_file(&probe, true)).map_err(|why| {
                StorageError::Invalid(format!(
                    "l3.file.io = \"direct\": {} does not take O_DIRECT writes and reads ({why}); \
                     set l3.file.io = \"buffered\"",
                    objects.display()
                ))
            })?;
        }
        // Versions before 0.2 wrote temp files to `tmp/`: its temp files go, then it, if empty.
        let old_tmp = root.join("tmp");
        if std::fs::symlink_metadata(&old_tmp).is_ok_and(|m| m.is_dir()) {
            for e in std::fs::read_dir(&old_tmp).into_iter().flatten().flatten() {
                if is_old_temp(&e.file_name()) && e.file_type().is_ok_and(|t| t.is_file()) {
                    let _ = std::fs::remove_file(e.path());
                }
            }
            let _ = std::fs::remove_dir(&old_tmp);
        }
        let share = match cfg.capacity_bytes {
            Capacity::Percent(_) => {
                let st =
                    rustix::fs::statvfs(&objects).map_err(|e| io("statvfs", &objects)(e.into()))?;
                Some(st.f_bavail.saturating_mul(st.f_frsize))
            }
            Capacity::Unbounded | Capacity::Bytes(_) => None,
        };
        let store = Arc::new(Self {
            objects,
            index: Arc::new(Mutex::new(Index::with_quotas(tenant_quotas))),
            seq: AtomicU64::new(0),
            root,
            cfg: cfg.clone(),
            // A share: no bound until the rebuild resolves it.
            capacity: Arc::new(AtomicU64::new(match share {
                Some(_) => 0,
                None => cfg.capacity_bytes.resolve(0, 0),
            })),
        });
        let (root, index) = (store.objects.clone(), store.index.clone());
        let (bound, capacity) = (cfg.capacity_bytes, store.capacity.clone());
        let opened = SystemTime::now();
        // Writers serve while the listing runs: what they insert or evict meanwhile wins
        // over what the listing finds (an evicted object's file may not be gone yet).
        store.index.lock().start_rebuild();
        tokio::task::spawn_blocking(move || {
            // What the store held when it opened: the listing's bytes, not the index's,
            // which also counts writes made since, already out of `free`.
            let (n, held) = rebuild(&root, &root, &index, opened);
            index.lock().end_rebuild();
            tracing::info!(root = %root.display(), objects = n, "file store index rebuilt");
            if let Some(free) = share {
                let cap = bound.resolve(free, held);
                capacity.store(cap, Ordering::Relaxed);
                tracing::info!(
                    root = %root.display(),
                    capacity_bytes = cap,
                    free_at_start = free,
                    held,
                    "file store bounded at {bound} of the free space plus what it holds"
                );
            }
        });
        Ok(store)
    }

    /// The path of object `name`: `objects/<dirs>/<2 hex>/<last segment>`, spreading files
    /// over 256 directories per prefix.
    pub fn path_of(&self, name: &str) -> PathBuf {
        let (dir, file) = name.rsplit_once('/').unwrap_or(("", name));
        let fan = &file[..file.len().min(2)];
        let mut p = self.objects.clone();
        if !dir.is_empty() {
            p.push(dir);
        }
        p.push(fan);
        p.push(file);
        p
    }

    fn delete_files(index: &Mutex<Index>, paths: Vec<PathBuf>) {
        for p in paths {
            match std::fs::remove_file(&p) {
                Ok(()) => {}
                Err(e) if e.kind() == ErrorKind::NotFound => {}
                Err(e) => {
                    index.lock().delete_failures += 1;
                    tracing::warn!(path = %p.display(), "cannot delete an evicted object: {e}");
                }
            }
        }
    }
}

/// The file that marks a directory as a kvtier file store's root.
pub const MARKER: &str = ".kvtier-file-store";

/// Takes `root` for a store: creates it, or checks that it is kvtier's (it holds [`MARKER`],
/// or only what a store before the marker left: `objects/` and `tmp/`), or empty, and marks
/// it. Anything else is refused, naming the directory: a store there would clear files it did
/// not write.
fn claim(root: &Path) -> Result<(), StorageError> {
    private_dirs(root).map_err(io("create", root))?;
    trusted(root)?;
    let marker = root.join(MARKER);
    if std::fs::symlink_metadata(&marker).is_ok_and(|m| m.is_file()) {
        return Ok(());
    }
    let mut foreign = Vec::new();
    for e in std::fs::read_dir(root).map_err(io("list", root))? {
        let e = e.map_err(io("list", root))?;
        let name = e.file_name();
        let ours = (name == "objects" || name == "tmp") && e.file_type().is_ok_and(|t| t.is_dir());
        if !ours {
            foreign.push(name.to_string_lossy().into_owned());
        }
    }
    if !foreign.is_empty() {
        foreign.sort();
        foreign.truncate(3);
        return Err(StorageError::Invalid(format!(
            "{} holds files kvtier did not write ({}{}) and no {MARKER}: a file store takes an \
             empty or new directory, or one it made",
            root.display(),
            foreign.join(", "),
            if foreign.len() == 3 { ", ..." } else { "" }
        )));
    }
    std::fs::write(
        &marker,
        b"kvtier file store: the directories under objects/ are kvtier's\n",
    )
    .map_err(io("create", &marker))
}

/// A temp file's name in the `tmp/` of versions before 0.2: `<pid>-<n>.tmp`.
fn is_old_temp(file_name: &std::ffi::OsStr) -> bool {
    file_name
        .to_str()
        .and_then(|n| n.strip_suffix(".tmp"))
        .is_some_and(|stem| {
            !stem.is_empty() && stem.bytes().all(|b| b.is_ascii_digit() || b == b'-')
        })
}

/// A temp file's name: it holds a dot, which no object name does.
fn is_temp(file_name: &std::ffi::OsStr) -> bool {
    file_name.as_encoded_bytes().first() == Some(&b'.')
}

/// How much older than the store's opening a temp file of another process must be to count
/// as a write that never completed. File times come from the kernel's coarse clock, which
/// can read a few milliseconds behind `SystemTime::now()`: a write that starts right after
/// the store opens may carry an earlier time than `opened`.
const STALE_TEMP: Duration = Duration::from_secs(5);

/// Whether a temp file (`.t<pid>-<n>`) belongs to this process: a write of this process is
/// still running (a crashed one's process is gone).
fn is_own_temp(file_name: &std::ffi::OsStr) -> bool {
    let name = file_name.as_encoded_bytes();
    let pid = std::process::id().to_string();
    name.strip_prefix(b".t")
        .and_then(|rest| rest.strip_prefix(pid.as_bytes()))
        .is_some_and(|rest| rest.first() == Some(&b'-'))
}

/// Adds every object file under `dir` to the index (entries already there are newer) and
/// removes temp files: a write that never completed, never visible. (Temp files of this
/// process, and of writes still running elsewhere, which are younger than the store's
/// opening by more than [`STALE_TEMP`], are left.)
/// Lists the objects under `dir` into `index`: how many it found, and their bytes.
fn rebuild(objects: &Path, dir: &Path, index: &Mutex<Index>, opened: SystemTime) -> (usize, u64) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return (0, 0);
    };
    let (mut n, mut bytes) = (0, 0);
    for e in rd.flatten() {
        let path = e.path();
        // The entry's own type: symlinks are never followed (nor deleted).
        let Ok(ty) = e.file_type() else { continue };
        if ty.is_dir() {
            let (m, b) = rebuild(objects, &path, index, opened);
            n += m;
            bytes += b;
            continue;
        }
        if !ty.is_file() {
            continue;
        }
        let Ok(meta) = e.metadata() else { continue };
        if is_temp(&e.file_name()) {
            if !is_own_temp(&e.file_name())
                && meta.modified().is_ok_and(|m| m + STALE_TEMP < opened)
                && let Err(err) = std::fs::remove_file(&path)
                && err.kind() != ErrorKind::NotFound
            {
                tracing::warn!(path = %path.display(), "cannot remove a stale temp file: {err}");
            }
            continue;
        }
        let Some(name) = object_name(objects, &path) else {
            continue;
        };
        let at = meta
            .modified()
            .ok()
            .and_then(|m| m.duration_since(UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_nanos() as u64);
        if index.lock().found(&name, meta.len(), at) {
            n += 1;
            bytes += meta.len();
        }
    }
    (n, bytes)
}

/// Deletes every object file under `dir` (temp files of writes in flight are left: they
/// become objects after the clear) and takes it out of the index; returns how many.
fn clear_dir(objects: &Path, dir: &Path, index: &Mutex<Index>) -> Result<u64, StorageError> {
    let rd = match std::fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(io("list", dir)(e)),
    };
    let mut n = 0;
    for e in rd {
        let e = e.map_err(io("list", dir))?;
        let path = e.path();
        // The entry's own type: a symlink is neither followed nor deleted.
        let ty = e.file_type().map_err(io("stat", &path))?;
        if ty.is_dir() {
            n += clear_dir(objects, &path, index)?;
            continue;
        }
        // Only what kvtier names an object: no temp file, no stranger.
        let Some(name) = object_name(objects, &path).filter(|n| check_name(n).is_ok()) else {
            continue;
        };
        if !ty.is_file() {
            continue;
        }
        match std::fs::remove_file(&path) {
            Ok(()) => n += 1,
            Err(err) if err.kind() == ErrorKind::NotFound => {}
            Err(err) => return Err(io("delete", &path)(err)),
        }
        index.lock().remove(&name);
    }
    Ok(n)
}

/// The object name of file `path` under `objects` (`objects/<dir>/<fan>/<file>` is
/// `<dir>/<file>`).
fn object_name(objects: &Path, path: &Path) -> Option<String> {
    let rel = path.strip_prefix(objects).ok()?;
    let parts: Vec<&str> = rel.iter().filter_map(|s| s.to_str()).collect();
    match parts.as_slice() {
        [dir, _fan, file] => Some(format!("{dir}/{file}")),
        [_fan, file] => Some((*file).to_string()),
        _ => None,
    }
}

/// Reads the `total` bytes after the head of `f` into `sink`: into memory of the sink's own
/// that it need not zero first where it takes the file itself, else straight into the sink's
/// memory where it lends it (one copy, page cache to destination), else through one reused,
/// cache-sized buffer per thread (no page-sized allocation, and its page faults, per read).
/// Returns how many bytes went.
fn read_rest(
    f: &mut dyn std::io::Read,
    total: u64,
    sink: &dyn ObjectSink,
) -> Result<u64, SinkReadError> {
    if let Some(r) = sink.append_from(0, total, f, &mut |_| {}) {
        return r;
    }
    let mut off = 0u64;
    let mut failed = None;
    while off < total {
        let n = (total - off).min(READ_CHUNK as u64) as usize;
        let lent = sink.fill_at(off, n, &mut |dst| {
            f.read_exact(dst).map_err(|e| {
                let why = e.to_string();
                failed = Some(e);
                why
            })
        });
        match lent {
            Some(Ok(())) => off += n as u64,
            Some(Err(why)) => {
                return Err(failed
                    .take()
                    .map_or(SinkReadError::Sink(why), SinkReadError::Io));
            }
            None => break,
        }
    }
    if off == total {
        return Ok(off);
    }
    CHUNK.with_borrow_mut(|buf| {
        buf.resize(READ_CHUNK, 0);
        loop {
            let n = match f.read(buf) {
                Ok(0) => return Ok(off),
                Ok(n) => n,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => return Err(SinkReadError::Io(e)),
            };
            sink.write_at(off, &buf[..n]).map_err(SinkReadError::Sink)?;
            off += n as u64;
        }
    })
}

#[async_trait]
impl Store for FileStore {
    fn kind(&self) -> &'static str {
        "file"
    }

    async fn get(&self, name: &str) -> Result<Option<Bytes>, StorageError> {
        check_name(name)?;
        let path = self.path_of(name);
        let ttl = self.ttl();
        let (name_owned, index) = (name.to_string(), self.index.clone());
        let direct = self.direct();
        blocking("file", move || {
            let (mut f, meta) = match open_object(&path, direct) {
                Ok(opened) => opened,
                Err(e) if e.kind() == ErrorKind::NotFound => {
                    index.lock().remove(&name_owned);
                    return Ok(None);
                }
                Err(e) => return Err(io("open", &path)(e)),
            };
            if expired(ttl, &meta) {
                index.lock().remove(&name_owned);
                // Best effort: an undeletable expired file is still never served.
                let _ = std::fs::remove_file(&path);
                return Ok(None);
            }
            let mut buf = Vec::new();
            read_whole(&mut f, meta.len(), direct, &mut buf).map_err(io("read", &path))?;
            index.lock().touch(&name_owned, now_ns());
            Ok(Some(Bytes::from(buf)))
        })
        .await
    }

    async fn read_into(
        &self,
        name: &str,
        split: usize,
        sink: Arc<dyn ObjectSink>,
    ) -> Result<Option<(Bytes, u64)>, StorageError> {
        check_name(name)?;
        let path = self.path_of(name);
        let ttl = self.ttl();
        let (name_owned, index) = (name.to_string(), self.index.clone());
        let direct = self.direct();
        blocking("file", move || {
            let (mut f, meta) = match open_object(&path, direct) {
                Ok(opened) => opened,
                Err(e) if e.kind() == ErrorKind::NotFound => {
                    index.lock().remove(&name_owned);
                    return Ok(None);
                }
                Err(e) => return Err(io("open", &path)(e)),
            };
            if expired(ttl, &meta) {
                index.lock().remove(&name_owned);
                let _ = std::fs::remove_file(&path);
                return Ok(None);
            }
            let head_len = split.min(meta.len() as usize);
            let mut head = vec![0u8; head_len];
            let total = meta.len() - head_len as u64;
            let mut read = |f: &mut dyn std::io::Read| {
                f.read_exact(&mut head).map_err(io("read", &path))?;
                read_rest(f, total, sink.as_ref()).map_err(|e| match e {
                    SinkReadError::Io(e) => io("read", &path)(e),
                    SinkReadError::Sink(why) => StorageError::Refused(why),
                })
            };
            let rest = if direct {
                direct::with_aligned(DirectReader::buffer_for(meta.len()), |buf| {
                    read(&mut DirectReader::new(&f, meta.len(), buf))
                })?
            } else {
                read(&mut f)?
            };
            index.lock().touch(&name_owned, now_ns());
            Ok(Some((Bytes::from(head), rest)))
        })
        .await
    }

    async fn exists_prefix(&self, names: &[String]) -> Result<usize, StorageError> {
        for n in names {
            check_name(n)?;
        }
        // One hand-off for the whole batch rather than one per name.
        let paths: Vec<PathBuf> = names.iter().map(|n| self.path_of(n)).collect();
        let ttl = self.ttl();
        blocking("file", move || {
            for (i, p) in paths.iter().enumerate() {
                match std::fs::metadata(p) {
                    Ok(meta) if !expired(ttl, &meta) => {}
                    Ok(_) => return Ok(i),
                    Err(e) if e.kind() == ErrorKind::NotFound => return Ok(i),
                    Err(e) => return Err(io("stat", p)(e)),
                }
            }
            Ok(paths.len())
        })
        .await
    }

    async fn set(&self, name: &str, head: Bytes, body: Bytes) -> Result<(), StorageError> {
        check_name(name)?;
        let size = (head.len() + body.len()) as u64;
        let cap = self.capacity.load(Ordering::Relaxed);
        check_fits(size, cap)?;
        self.index.lock().check_quota(name, size)?;
        let min_free = self.cfg.min_free_bytes.0;
        let sync = self.cfg.sync;
        let direct = self.direct();
        let path = self.path_of(name);
        let tmp = path.with_file_name(format!(
            ".t{}-{}",
            std::process::id(),
            self.seq.fetch_add(1, Ordering::Relaxed)
        ));
        let root = self.root.clone();
        let (name_owned, index) = (name.to_string(), self.index.clone());
        let paths: Vec<PathBuf> = blocking("file", move || {
            if min_free > 0 {
                let st = rustix::fs::statvfs(&root).map_err(|e| io("statvfs", &root)(e.into()))?;
                let free = st.f_bavail.saturating_mul(st.f_frsize);
                if free < min_free.saturating_add(size) {
                    return Err(StorageError::NoSpace(format!(
                        "{} has {free} bytes free, min_free_bytes is {min_free}",
                        root.display()
                    )));
                }
            }
            let write = || -> std::io::Result<()> {
                let mut f = match new_file(&tmp, direct) {
                    Err(e) if e.kind() == ErrorKind::NotFound => {
                        if let Some(dir) = path.parent() {
                            private_dirs(dir)?;
                        }
                        new_file(&tmp, direct)?
                    }
                    r => r?,
                };
                if direct {
                    direct::write_direct(&f, &head, &body)?;
                } else {
                    f.write_all(&head)?;
                    f.write_all(&body)?;
                }
                if sync {
                    f.sync_data()?;
                }
                drop(f);
                publish(&tmp, &path)
            };
            if let Err(e) = write() {
                let _ = std::fs::remove_file(&tmp);
                return Err(io("write", &path)(e));
            }
            let mut g = index.lock();
            g.insert(&name_owned, size, now_ns());
            Ok(g.victims(cap, &name_owned))
        })
        .await?
        .into_iter()
        .map(|victim| self.path_of(&victim))
        .collect();
        if !paths.is_empty() {
            let index = self.index.clone();
            blocking("file", move || {
                Self::delete_files(&index, paths);
                Ok(())
            })
            .await?;
        }
        Ok(())
    }

    async fn exists(&self, name: &str) -> Result<bool, StorageError> {
        check_name(name)?;
        let path = self.path_of(name);
        match tokio::fs::metadata(&path).await {
            Ok(meta) => Ok(!expired(self.ttl(), &meta)),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(false),
            Err(e) => Err(io("stat", &path)(e)),
        }
    }

    async fn delete(&self, name: &str) -> Result<(), StorageError> {
        check_name(name)?;
        let path = self.path_of(name);
        self.index.lock().remove(name);
        match tokio::fs::remove_file(&path).await {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(()),
            Err(e) => {
                self.index.lock().delete_failures += 1;
                Err(io("delete", &path)(e))
            }
        }
    }

    async fn clear(&self) -> Result<u64, StorageError> {
        let (objects, index) = (self.objects.clone(), self.index.clone());
        blocking("file", move || clear_dir(&objects, &objects, &index)).await
    }

    fn take_removed(&self) -> Removed {
        self.index.lock().removed.take()
    }

    fn stats(&self) -> StoreStats {
        let g = self.index.lock();
        StoreStats {
            objects: g.entries.len() as u64,
            bytes: g.bytes,
            capacity: self.capacity.load(Ordering::Relaxed),
            evictions: g.evictions,
            delete_failures: g.delete_failures,
            tenants: g.tenants(),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::Fill;

    /// A sink over a heap buffer that lends it (`lend`) or not, and refuses bytes past `limit`.
    struct Sink {
        buf: Mutex<Vec<u8>>,
        lend: bool,
        limit: usize,
        lent: AtomicU64,
    }

    impl Sink {
        fn new(lend: bool, limit: usize) -> Self {
            Self {
                buf: Mutex::new(Vec::new()),
                lend,
                limit,
                lent: AtomicU64::new(0),
            }
        }
    }

    impl ObjectSink for Sink {
        fn write_at(&self, offset: u64, bytes: &[u8]) -> Result<(), String> {
            self.put(offset, bytes.len(), &mut |d| {
                d.copy_from_slice(bytes);
                Ok(())
            })
        }

        fn fill_at(&self, offset: u64, len: usize, fill: Fill<'_>) -> Option<Result<(), String>> {
            self.lend.then(|| {
                self.lent.fetch_add(1, Ordering::Relaxed);
                self.put(offset, len, fill)
            })
        }
    }

    impl Sink {
        fn put(&self, offset: u64, len: usize, fill: Fill<'_>) -> Result<(), String> {
            let end = offset as usize + len;
            if end > self.limit {
                return Err(format!("{end} bytes do not fit"));
            }
            let mut b = self.buf.lock();
            assert_eq!(b.len(), offset as usize, "pieces arrive in order");
            b.resize(end, 0);
            fill(&mut b[offset as usize..end])
        }
    }

    /// A sink that reads the rest itself when it is no longer than `expect`.
    struct Appending {
        plain: Sink,
        expect: u64,
        calls: AtomicU64,
    }

    impl ObjectSink for Appending {
        fn write_at(&self, offset: u64, bytes: &[u8]) -> Result<(), String> {
            self.plain.write_at(offset, bytes)
        }

        fn fill_at(&self, offset: u64, len: usize, fill: Fill<'_>) -> Option<Result<(), String>> {
            self.plain.fill_at(offset, len, fill)
        }

        fn append_from(
            &self,
            offset: u64,
            len: u64,
            src: &mut dyn std::io::Read,
            seen: &mut dyn FnMut(&[u8]),
        ) -> Option<Result<u64, SinkReadError>> {
            if offset != 0 || len > self.expect {
                return None;
            }
            self.calls.fetch_add(1, Ordering::Relaxed);
            let mut b = self.plain.buf.lock();
            Some(match src.read_to_end(&mut b) {
                Ok(n) => {
                    seen(&b);
                    Ok(n as u64)
                }
                Err(e) => Err(SinkReadError::Io(e)),
            })
        }
    }

    /// A temporary file is always new: a symlink or file planted at its name is an error,
    /// never followed, truncated or written. It is 0600 and the directories made for it 0700
    /// (they took the umask: 0644 objects in 0755 directories were every local user's to
    /// read, and with kvtierd.service's UMask=0007, another tenant's in the group to write).
    #[test]
    fn a_planted_temp_name_is_never_written_through() {
        let dir = std::env::temp_dir().join(format!("kvtier-file-planted-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let victim = dir.join("victim");
        std::fs::write(&victim, b"theirs").unwrap();
        std::os::unix::fs::symlink(&victim, dir.join(".t1")).unwrap();
        std::fs::write(dir.join(".t2"), b"planted").unwrap();
        assert!(new_file(&dir.join(".t1"), false).is_err());
        assert!(new_file(&dir.join(".t2"), false).is_err());
        assert!(new_file(&dir.join(".t1"), true).is_err());
        assert_eq!(std::fs::read(&victim).unwrap(), b"theirs");
        assert_eq!(std::fs::read(dir.join(".t2")).unwrap(), b"planted");
        let f = new_file(&dir.join(".t3"), false).unwrap();
        use std::os::unix::fs::PermissionsExt as _;
        assert_eq!(f.metadata().unwrap().permissions().mode() & 0o777, 0o600);
        private_dirs(&dir.join("a/b")).unwrap();
        for d in ["a", "a/b"] {
            let mode = std::fs::metadata(dir.join(d)).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o700, "{d}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A written object lands on a free name and replaces a taken one, whole, with its temp
    /// file gone either way; a directory in the way is an error that leaves it alone.
    /// `io = "direct"` really asks the kernel for O_DIRECT, for reads and for writes.
    #[test]
    fn direct_files_are_opened_with_o_direct_and_buffered_ones_without() {
        let dir = std::env::temp_dir().join(format!("kvtier-file-odirect-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let direct = |f: &std::fs::File| {
            rustix::fs::fcntl_getfl(f)
                .unwrap()
                .contains(rustix::fs::OFlags::DIRECT)
        };
        let w = new_file(&dir.join(".t1"), true).unwrap();
        assert!(direct(&w));
        assert!(!direct(&new_file(&dir.join(".t2"), false).unwrap()));
        assert!(direct(&open_object(&dir.join(".t1"), true).unwrap().0));
        assert!(!direct(&open_object(&dir.join(".t1"), false).unwrap().0));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn publish_lands_on_free_names_and_replaces_taken_ones() {
        let dir = std::env::temp_dir().join(format!("kvtier-file-publish-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (tmp, obj) = (dir.join(".t1"), dir.join("obj"));
        for content in [&b"first"[..], b"second, longer than the first"] {
            std::fs::write(&tmp, content).unwrap();
            publish(&tmp, &obj).unwrap();
            assert_eq!(std::fs::read(&obj).unwrap(), content);
            assert!(!tmp.exists(), "the temp file stays behind");
        }
        let sub = dir.join("sub");
        std::fs::create_dir_all(sub.join("inner")).unwrap();
        std::fs::write(&tmp, b"x").unwrap();
        assert!(publish(&tmp, &sub).is_err());
        assert!(
            sub.join("inner").is_dir(),
            "a directory in the way was touched"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A temp file of this process is a write still running; one of another pid, or one
    /// whose name only starts with this pid's digits, is not.
    #[test]
    fn own_temp_files_are_told_by_their_pid() {
        use std::ffi::OsStr;
        let pid = std::process::id();
        assert!(is_own_temp(OsStr::new(&format!(".t{pid}-3"))));
        assert!(!is_own_temp(OsStr::new(&format!(".t{pid}7-3"))));
        assert!(!is_own_temp(OsStr::new(&format!(".t{}-3", pid + 1))));
        assert!(!is_own_temp(OsStr::new(".tmp")));
    }

    /// Sinks that lend their memory receive the same bytes as sinks that do not, in pieces of
    /// at most one chunk; a file shorter than its size said is a read error, a refusing sink a
    /// sink error, neither a short success.
    #[test]
    fn rest_reaches_lending_and_plain_sinks_alike() {
        let dir = std::env::temp_dir().join(format!("kvtier-file-rest-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("obj");
        let data: Vec<u8> = (0..READ_CHUNK * 3 + 1234)
            .map(|i| (i * 7 + i / 5000) as u8)
            .collect();
        std::fs::write(&path, &data).unwrap();
        for (lend, pieces) in [(true, 4), (false, 0)] {
            let sink = Sink::new(lend, usize::MAX);
            let mut f = std::fs::File::open(&path).unwrap();
            let n = read_rest(&mut f, data.len() as u64, &sink).ok().unwrap();
            assert_eq!(n, data.len() as u64);
            assert_eq!(*sink.buf.lock(), data, "lend: {lend}");
            assert_eq!(
                sink.lent.load(Ordering::Relaxed),
                pieces,
                "one piece per chunk"
            );
        }
        // A sink that reads the file itself gets it in one call, and sees every byte; one
        // that declines (the rest is longer than it expects) gets it piece by piece instead.
        for (expect, appended) in [(data.len(), 1), (data.len() - 1, 0)] {
            let sink = Appending {
                plain: Sink::new(true, usize::MAX),
                expect: expect as u64,
                calls: AtomicU64::new(0),
            };
            let mut f = std::fs::File::open(&path).unwrap();
            let n = read_rest(&mut f, data.len() as u64, &sink).ok().unwrap();
            assert_eq!(n, data.len() as u64);
            assert_eq!(*sink.plain.buf.lock(), data, "expect {expect}");
            assert_eq!(sink.calls.load(Ordering::Relaxed), appended);
        }
        // The file is shorter than the caller was told: an I/O error.
        let mut f = std::fs::File::open(&path).unwrap();
        let short = read_rest(&mut f, data.len() as u64 + 10, &Sink::new(true, usize::MAX));
        assert!(matches!(short, Err(SinkReadError::Io(_))));
        // The sink refuses part-way: its reason comes back.
        let mut f = std::fs::File::open(&path).unwrap();
        match read_rest(&mut f, data.len() as u64, &Sink::new(true, READ_CHUNK + 5)) {
            Err(SinkReadError::Sink(why)) => assert!(why.contains("do not fit"), "{why}"),
            _ => panic!("a refusing sink must stop the read"),
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
