//! `O_DIRECT` file I/O for the file backend (`l3.file.io = "direct"`): reads and writes that
//! go to the device, never through the page cache.
//!
//! `O_DIRECT` wants the memory, the file offset and the length of each transfer aligned to
//! the device's block. Objects are a head and a body of any length, and L2's pages are not
//! laid out for it, so every transfer goes through an aligned buffer and is copied between it
//! and its destination: one copy, as a buffered read makes from the page cache. Buffers come
//! from one pool for the process ([`with_aligned`]), sized to the transfer and kept for the
//! next while the idle ones hold at most [`IDLE_BYTES`]: reused (no page-sized allocation,
//! and no page faults, per object), and bounded however many threads the blocking pool runs
//! (a buffer per thread once made a burst of reads keep 2 GiB).
//! - A read ([`DirectReader`]) fetches the file in aligned pieces of up to [`DIRECT_CHUNK`]
//!   (one transfer for a 2 MiB page and its head: the device sees one request, not the
//!   read-ahead window's pieces) and hands bytes out as a [`Read`].
//! - A write ([`write_direct`]) fills the buffer with head and body, pads the last piece to
//!   the alignment, writes it, and cuts the file back to the object's length.
//!
//! No `unsafe`: the aligned part of an ordinary byte vector is found with `align_offset`.

use std::fs::File;
use std::io::{ErrorKind, Read};
use std::os::unix::fs::FileExt as _;

use parking_lot::Mutex;

/// The alignment of every transfer's memory, offset and length: the largest logical block a
/// device has (4 KiB), so it suits 512-byte devices too.
pub(crate) const ALIGN: usize = 4096;

/// The most bytes one transfer moves: a 2 MiB page with its head in one request.
pub(crate) const DIRECT_CHUNK: usize = 4 << 20;

/// Most bytes of idle buffers the pool keeps: 16 transfers of the largest size.
pub(crate) const IDLE_BYTES: usize = 16 * (DIRECT_CHUNK + ALIGN);

/// Idle aligned buffers, and their bytes.
static IDLE: Mutex<(Vec<Vec<u8>>, usize)> = Mutex::new((Vec::new(), 0));

/// Runs `f` with an aligned buffer of `len` bytes (`len` ≤ [`DIRECT_CHUNK`], a multiple of
/// [`ALIGN`]) from the pool: an idle one large enough, or a new one; kept for the next
/// transfer after, unless the idle ones already hold [`IDLE_BYTES`].
pub(crate) fn with_aligned<T>(len: usize, f: impl FnOnce(&mut [u8]) -> T) -> T {
    debug_assert!(len <= DIRECT_CHUNK && len.is_multiple_of(ALIGN));
    let want = len + ALIGN;
    let reused = {
        let mut g = IDLE.lock();
        let found = g.0.iter().position(|v| v.len() >= want);
        found.map(|i| {
            let v = g.0.swap_remove(i);
            g.1 -= v.len();
            v
        })
    };
    let mut v = reused.unwrap_or_else(|| vec![0u8; want]);
    let off = v.as_ptr().align_offset(ALIGN);
    let r = f(&mut v[off..off + len]);
    let mut g = IDLE.lock();
    if g.1 + v.len() <= IDLE_BYTES {
        g.1 += v.len();
        g.0.push(v);
    }
    r
}

/// Bytes the pool's idle buffers hold now.
#[cfg(test)]
fn idle_bytes() -> usize {
    IDLE.lock().1
}

/// `n` rounded up to [`ALIGN`].
pub(crate) fn round_up(n: usize) -> usize {
    n.div_ceil(ALIGN) * ALIGN
}

/// The flag that opens a file for direct I/O.
pub(crate) fn flag() -> i32 {
    rustix::fs::OFlags::DIRECT.bits() as i32
}

/// Reads a file opened with `O_DIRECT`, `len` bytes long, from its start, in aligned pieces
/// through an aligned buffer from the pool, which it borrows for its life: a thread holds one at
/// a time.
pub(crate) struct DirectReader<'a> {
    file: &'a File,
    len: u64,
    /// The file offset of the next piece (aligned).
    next: u64,
    buf: &'a mut [u8],
    /// What of `buf` is still to hand out.
    start: usize,
    end: usize,
}

impl<'a> DirectReader<'a> {
    /// A reader of `file` (`len` bytes) over `buf` (aligned, a multiple of [`ALIGN`]).
    pub(crate) fn new(file: &'a File, len: u64, buf: &'a mut [u8]) -> Self {
        Self {
            file,
            len,
            next: 0,
            buf,
            start: 0,
            end: 0,
        }
    }

    /// The buffer length a reader of a `len`-byte file wants: the file, or the largest piece.
    pub(crate) fn buffer_for(len: u64) -> usize {
        round_up((len as usize).min(DIRECT_CHUNK)).max(ALIGN)
    }

    /// Fetches the next piece; false at the end of the file.
    fn fill(&mut self) -> std::io::Result<bool> {
        if self.next >= self.len {
            return Ok(false);
        }
        let want = ((self.len - self.next) as usize).min(self.buf.len());
        let piece = round_up(want).min(self.buf.len());
        let mut got = 0;
        while got < want {
            match self
                .file
                .read_at(&mut self.buf[got..piece], self.next + got as u64)
            {
                Ok(0) => break,
                // Direct reads end short only at the end of the file; a short piece that is
                // not the last would leave the next offset unaligned.
                Ok(n) if !(got + n).is_multiple_of(ALIGN) && got + n < want => {
                    return Err(std::io::Error::new(
                        ErrorKind::UnexpectedEof,
                        format!(
                            "a direct read ended short at {}",
                            self.next + (got + n) as u64
                        ),
                    ));
                }
                Ok(n) => got += n,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        if got == 0 {
            // The file is shorter than when it was opened: never the case for kvtier's
            // files, which are written once under a temp name.
            return Err(std::io::Error::new(
                ErrorKind::UnexpectedEof,
                format!("the file ended at {} of {} bytes", self.next, self.len),
            ));
        }
        let got = got.min(want);
        self.next += got as u64;
        (self.start, self.end) = (0, got);
        Ok(true)
    }
}

impl Read for DirectReader<'_> {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        if self.start == self.end && !self.fill()? {
            return Ok(0);
        }
        let n = out.len().min(self.end - self.start);
        out[..n].copy_from_slice(&self.buf[self.start..self.start + n]);
        self.start += n;
        Ok(n)
    }

    /// Appends each piece as it lands: one copy, where `Read`'s own would zero the spare
    /// capacity before every read into it.
    fn read_to_end(&mut self, out: &mut Vec<u8>) -> std::io::Result<usize> {
        let before = out.len();
        out.reserve((self.len - self.next) as usize + (self.end - self.start));
        loop {
            if self.start == self.end && !self.fill()? {
                return Ok(out.len() - before);
            }
            out.extend_from_slice(&self.buf[self.start..self.end]);
            self.start = self.end;
        }
    }
}

/// Writes `head` then `body` to `file` (new, empty, opened with `O_DIRECT`) in aligned pieces
/// and cuts it to their length.
pub(crate) fn write_direct(file: &File, head: &[u8], body: &[u8]) -> std::io::Result<()> {
    let total = head.len() + body.len();
    let piece = round_up(total.min(DIRECT_CHUNK)).max(ALIGN);
    with_aligned(piece, |buf| {
        let mut at = 0;
        while at < total {
            let n = (total - at).min(piece);
            gather(head, body, at, &mut buf[..n]);
            let padded = round_up(n);
            buf[n..padded].fill(0);
            file.write_all_at(&buf[..padded], at as u64)?;
            at += n;
        }
        Ok::<_, std::io::Error>(())
    })?;
    if !total.is_multiple_of(ALIGN) {
        file.set_len(total as u64)?;
    }
    Ok(())
}

/// Copies bytes `at..at + out.len()` of `head ++ body` into `out`.
fn gather(head: &[u8], body: &[u8], at: usize, out: &mut [u8]) {
    let mut done = 0;
    if at < head.len() {
        let n = (head.len() - at).min(out.len());
        out[..n].copy_from_slice(&head[at..at + n]);
        done = n;
    }
    let from = at + done - head.len();
    let rest = out.len() - done;
    out[done..].copy_from_slice(&body[from..from + rest]);
}

/// Whether the directory `dir`'s filesystem takes `O_DIRECT`: writes and reads back one
/// aligned block in a new temp file at `probe` (removed after). `Err` names what refused.
pub(crate) fn probe(
    probe: &std::path::Path,
    create: impl Fn() -> std::io::Result<File>,
) -> Result<(), String> {
    let run = || -> std::io::Result<()> {
        let f = create()?;
        write_direct(&f, b"kvtier", &[7u8; 100])?;
        drop(f);
        let f = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags_direct()
            .open(probe)?;
        let mut back = Vec::new();
        with_aligned(ALIGN, |buf| {
            DirectReader::new(&f, 106, buf).read_to_end(&mut back)
        })?;
        if back.len() != 106 || &back[..6] != b"kvtier" || back[6..].iter().any(|&b| b != 7) {
            return Err(std::io::Error::other(
                "the block read back differs from the one written",
            ));
        }
        Ok(())
    };
    let r = run();
    let _ = std::fs::remove_file(probe);
    r.map_err(|e| e.to_string())
}

/// `OpenOptions` with `O_DIRECT` added.
pub(crate) trait DirectOpen {
    /// Adds `O_DIRECT` to the flags.
    fn custom_flags_direct(&mut self) -> &mut Self;
}

impl DirectOpen for std::fs::OpenOptions {
    fn custom_flags_direct(&mut self) -> &mut Self {
        use std::os::unix::fs::OpenOptionsExt as _;
        self.custom_flags(flag())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn bytes(n: usize, seed: u8) -> Vec<u8> {
        (0..n)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect()
    }

    /// Every length around the alignment and the piece size comes back whole, read in reads
    /// of every awkward size.
    #[test]
    fn what_is_written_directly_reads_back_directly_at_every_length() {
        let dir = std::env::temp_dir().join(format!("kvtier-direct-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for len in [
            1,
            ALIGN - 1,
            ALIGN,
            ALIGN + 1,
            (2 << 20) + 64,
            DIRECT_CHUNK - 1,
            DIRECT_CHUNK,
            DIRECT_CHUNK + ALIGN + 3,
            2 * DIRECT_CHUNK + 5,
        ] {
            let path = dir.join(format!("o{len}"));
            let _ = std::fs::remove_file(&path);
            let (head, body) = (bytes(len.min(64), 1), bytes(len - len.min(64), 2));
            let f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .custom_flags_direct()
                .open(&path);
            let Ok(f) = f else {
                eprintln!("skipped: {} refuses O_DIRECT", dir.display());
                return;
            };
            write_direct(&f, &head, &body).unwrap();
            drop(f);
            assert_eq!(std::fs::metadata(&path).unwrap().len(), len as u64);
            let f = std::fs::OpenOptions::new()
                .read(true)
                .custom_flags_direct()
                .open(&path)
                .unwrap();
            let mut back = Vec::new();
            let mut piece = vec![0u8; 4097];
            with_aligned(DirectReader::buffer_for(len as u64), |buf| {
                let mut r = DirectReader::new(&f, len as u64, buf);
                loop {
                    let n = r.read(&mut piece).unwrap();
                    if n == 0 {
                        break;
                    }
                    back.extend_from_slice(&piece[..n]);
                }
            });
            assert_eq!(back.len(), len, "length {len}");
            assert!(
                back[..head.len()] == head[..] && back[head.len()..] == body[..],
                "length {len}"
            );
            std::fs::remove_file(&path).unwrap();
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Many threads reading at once share the pool's buffers: what stays after holds at most
    /// [`IDLE_BYTES`], however many threads there were, and a small transfer takes a small
    /// buffer.
    #[test]
    fn buffers_are_sized_to_the_transfer_and_the_idle_ones_are_bounded() {
        std::thread::scope(|s| {
            for _ in 0..64 {
                s.spawn(|| {
                    with_aligned(DIRECT_CHUNK, |b| {
                        assert_eq!(b.as_ptr().align_offset(ALIGN), 0);
                        assert_eq!(b.len(), DIRECT_CHUNK);
                        std::thread::sleep(std::time::Duration::from_millis(20));
                    });
                });
            }
        });
        assert!(idle_bytes() <= IDLE_BYTES, "{} idle", idle_bytes());
        with_aligned(ALIGN, |b| assert_eq!(b.len(), ALIGN));
    }

    /// A filesystem that takes the `O_DIRECT` open but fails the transfer is refused, and
    /// the probe's file is gone after.
    #[test]
    fn the_probe_names_a_transfer_that_fails_and_leaves_no_file() {
        let dir = std::env::temp_dir().join(format!("kvtier-probe-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let at = dir.join(".t1-probe");
        // Opened for reading only: the write fails as a refusing filesystem's would.
        let refused = probe(&at, || {
            std::fs::write(&at, b"")?;
            std::fs::File::open(&at)
        });
        assert!(refused.is_err(), "{refused:?}");
        assert!(!at.exists());
        let taken = probe(&at, || {
            std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .custom_flags_direct()
                .open(&at)
        });
        assert_eq!(taken, Ok(()));
        assert!(!at.exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
