//! The slot table: what each slot of a pool holds, kept beside the pool in shared memory so
//! that a daemon started after a crash can take over the pages a dead one had committed.
//!
//! The table is a file next to the pool (`<pool>.slots`): a 4 KiB header (shape of the pool and
//! an opaque description of its layout, CRC-protected), then one 128-byte record per slot.
//! Only the daemon writes it. A record is *sealed* for a slot whose page is committed and whose
//! bytes have been checksummed: key, parent key, length and CRC32C of the page, and a CRC32C
//! of the record itself, so a record torn by a crash mid-write is never trusted. Before a
//! slot is handed out for writing again its record is cleared (one aligned store), so a
//! record never describes bytes that are being rewritten.
//!
//! A daemon that finds a dead one's pool and table ([`SlotTable::open`]) trusts a page only
//! if its record is sealed and intact *and* the slot's bytes still have the recorded CRC
//! ([`ShmPool::checksum`]): a half-written page, a torn record or bytes changed after sealing
//! are all refused.
//!
//! [`ShmPool::checksum`]: crate::ShmPool::checksum

use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::{MmapOptions, MmapRaw};

use crate::{OwnDir, ShmError, io_err};

const MAGIC: &[u8; 8] = b"KVTSLOT1";
const HEADER: usize = 4096;
const RECORD: usize = 128;
/// Most bytes of the layout description the header holds.
pub const MAX_DESCRIPTION: usize = 3968;
const SEALED: u32 = 0x4c41_4553;

/// A page the table vouches for (after its record's own CRC checked out).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotRecord {
    /// The page's key.
    pub key: [u8; 32],
    /// The key of the page before it in its sequence, if any.
    pub parent: Option<[u8; 32]>,
    /// Bytes of the page at the start of the slot.
    pub len: u32,
    /// CRC32C of those bytes.
    pub crc: u32,
}

/// The shape a table was created with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TableHeader {
    /// Slots in the pool.
    pub slots: u32,
    /// Bytes per slot.
    pub stride: u64,
    /// Opaque description of the pool's layout (the daemon stores an encoded layout).
    pub description: Vec<u8>,
}

/// A mapped slot table. Its creator removes the file on drop; one opened from a dead daemon
/// is removed on drop once taken over ([`SlotTable::remove_on_drop`]).
#[derive(Debug)]
pub struct SlotTable {
    map: MmapRaw,
    _file: File,
    path: PathBuf,
    slots: u32,
    unlink_on_drop: bool,
}

// SAFETY: the table hands out no references into its mapping; every access is a bounds-checked
// raw copy, and only the owning daemon writes (under its own state lock).
unsafe impl Send for SlotTable {}
// SAFETY: as above.
unsafe impl Sync for SlotTable {}

/// The name of the table file of the pool named `pool` (beside it, in the same directory).
pub fn table_name(pool: &str) -> String {
    format!("{pool}.slots")
}

fn table_len(slots: u32) -> usize {
    HEADER + slots as usize * RECORD
}

fn crc(parts: &[&[u8]]) -> u32 {
    parts
        .iter()
        .fold(0, |c, p| kvtier_core::checksum::crc32c_append(c, p))
}

impl SlotTable {
    /// Creates the table `name` in `dir` for a pool of `slots` × `stride`, every record
    /// clear: a new file ([`OwnDir::create_replacing`]; a dead process's file of that name
    /// is removed first, never reused).
    pub fn create(
        dir: &OwnDir,
        name: &str,
        slots: u32,
        stride: u64,
        description: &[u8],
    ) -> Result<Self, ShmError> {
        if description.len() > MAX_DESCRIPTION {
            return Err(ShmError::Shape(format!(
                "a layout description of {} bytes does not fit the table header ({MAX_DESCRIPTION})",
                description.len()
            )));
        }
        let (file, _) = dir.create_replacing(name)?;
        let path = &dir.join(name);
        // Held while this table is open: a successor knows its creator is alive by it.
        lock(&file, path)?;
        let len = table_len(slots);
        file.set_len(len as u64).map_err(io_err("size", path))?;
        let map = MmapOptions::new()
            .len(len)
            .map_raw(&file)
            .map_err(io_err("mmap", path))?;
        let t = Self {
            map,
            _file: file,
            path: path.to_path_buf(),
            slots,
            unlink_on_drop: true,
        };
        let mut h = vec![0u8; HEADER];
        h[..8].copy_from_slice(MAGIC);
        h[8..12].copy_from_slice(&slots.to_le_bytes());
        h[12..20].copy_from_slice(&stride.to_le_bytes());
        h[20..24].copy_from_slice(&(description.len() as u32).to_le_bytes());
        h[28..28 + description.len()].copy_from_slice(description);
        let sum = crc(&[&h[..24], &h[28..]]);
        h[24..28].copy_from_slice(&sum.to_le_bytes());
        t.put(0, &h);
        Ok(t)
    }

    /// Maps an existing table (a dead daemon's) and checks its header. Only a file that is
    /// this process's own ([`crate::open_own`]) and that no live process holds (the
    /// creator's lock, [`SlotTable::create`]) is opened.
    pub fn open(dir: &OwnDir, name: &str) -> Result<(Self, TableHeader), ShmError> {
        let file = dir.open_own(name)?;
        let path = &dir.join(name);
        lock(&file, path)?;
        let actual = file.metadata().map_err(io_err("stat", path))?.len();
        let bad = |why: String| ShmError::Shape(format!("{}: {why}", path.display()));
        if actual < HEADER as u64 {
            return Err(bad(format!("{actual} bytes is too short for a slot table")));
        }
        let mut h = vec![0u8; HEADER];
        {
            use std::os::unix::fs::FileExt;
            file.read_exact_at(&mut h, 0)
                .map_err(io_err("read", path))?;
        }
        if &h[..8] != MAGIC {
            return Err(bad("not a kvtier slot table".into()));
        }
        let word = |r: std::ops::Range<usize>| {
            let mut b = [0u8; 4];
            b.copy_from_slice(&h[r]);
            u32::from_le_bytes(b)
        };
        let slots = word(8..12);
        let mut s = [0u8; 8];
        s.copy_from_slice(&h[12..20]);
        let stride = u64::from_le_bytes(s);
        let dlen = word(20..24) as usize;
        if dlen > MAX_DESCRIPTION || word(24..28) != crc(&[&h[..24], &h[28..]]) {
            return Err(bad("the header is damaged".into()));
        }
        let len = table_len(slots);
        if actual != len as u64 {
            return Err(bad(format!(
                "{actual} bytes, expected {len} for {slots} slots"
            )));
        }
        let map = MmapOptions::new()
            .len(len)
            .map_raw(&file)
            .map_err(io_err("mmap", path))?;
        let header = TableHeader {
            slots,
            stride,
            description: h[28..28 + dlen].to_vec(),
        };
        Ok((
            Self {
                map,
                _file: file,
                path: path.to_path_buf(),
                slots,
                unlink_on_drop: false,
            },
            header,
        ))
    }

    /// Removes the file when this handle drops (a dead daemon's table, once read).
    pub fn remove_on_drop(&mut self) {
        self.unlink_on_drop = true;
    }

    /// Where it lives.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Records in the table.
    pub fn slots(&self) -> u32 {
        self.slots
    }

    fn offset(&self, slot: u32) -> Result<usize, ShmError> {
        if slot >= self.slots {
            return Err(ShmError::Shape(format!(
                "slot {slot} is outside the table of {} slots",
                self.slots
            )));
        }
        Ok(HEADER + slot as usize * RECORD)
    }

    fn put(&self, at: usize, src: &[u8]) {
        debug_assert!(at + src.len() <= self.map.len());
        // SAFETY: every caller passes a range inside the mapping (header, or a record whose
        // slot `offset` checked); `src` is a Rust buffer, never a reference into the mapping.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.map.as_mut_ptr().add(at), src.len())
        }
    }

    fn get(&self, at: usize, dst: &mut [u8]) {
        debug_assert!(at + dst.len() <= self.map.len());
        // SAFETY: as in `put`, with the mapping as the source.
        unsafe {
            std::ptr::copy_nonoverlapping(self.map.as_ptr().add(at), dst.as_mut_ptr(), dst.len())
        }
    }

    /// Clears the record of `slot`: from now on nothing vouches for its bytes. Call before
    /// the slot is handed out for writing.
    pub fn clear(&self, slot: u32) -> Result<(), ShmError> {
        let at = self.offset(slot)?;
        self.put(at, &0u32.to_le_bytes());
        Ok(())
    }

    /// Seals `slot` as holding `rec`: the fields first, the state word last, so a crash
    /// part-way leaves the record clear or torn (refused by its CRC), never a false one.
    pub fn seal(&self, slot: u32, rec: &SlotRecord) -> Result<(), ShmError> {
        let at = self.offset(slot)?;
        self.clear(slot)?;
        let mut r = [0u8; RECORD];
        r[4..8].copy_from_slice(&rec.len.to_le_bytes());
        r[8..12].copy_from_slice(&rec.crc.to_le_bytes());
        r[16..48].copy_from_slice(&rec.key);
        if let Some(p) = rec.parent {
            r[48] = 1;
            r[49..81].copy_from_slice(&p);
        }
        let sum = crc(&[&SEALED.to_le_bytes(), &r[4..12], &r[16..]]);
        r[12..16].copy_from_slice(&sum.to_le_bytes());
        self.put(at + 4, &r[4..]);
        self.put(at, &SEALED.to_le_bytes());
        Ok(())
    }

    /// The record of `slot`, if it is sealed and intact.
    pub fn record(&self, slot: u32) -> Option<SlotRecord> {
        let at = self.offset(slot).ok()?;
        let mut r = [0u8; RECORD];
        self.get(at, &mut r);
        let word = |i: usize| {
            let mut b = [0u8; 4];
            b.copy_from_slice(&r[i..i + 4]);
            u32::from_le_bytes(b)
        };
        if word(0) != SEALED || word(12) != crc(&[&r[..4], &r[4..12], &r[16..]]) {
            return None;
        }
        let mut key = [0u8; 32];
        key.copy_from_slice(&r[16..48]);
        let parent = (r[48] == 1).then(|| {
            let mut p = [0u8; 32];
            p.copy_from_slice(&r[49..81]);
            p
        });
        Some(SlotRecord {
            key,
            parent,
            len: word(4),
            crc: word(8),
        })
    }
}

impl Drop for SlotTable {
    fn drop(&mut self) {
        if self.unlink_on_drop {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Takes the table's exclusive lock (`flock`), which its holder keeps while the file is
/// open; refused at once when a live process holds it.
fn lock(file: &std::fs::File, path: &Path) -> Result<(), ShmError> {
    use rustix::fs::{FlockOperation, flock};
    flock(file, FlockOperation::NonBlockingLockExclusive).map_err(|e| {
        if e == rustix::io::Errno::WOULDBLOCK {
            ShmError::Untrusted {
                path: path.display().to_string(),
                why: "a live process holds it".into(),
            }
        } else {
            io_err("lock", path)(std::io::Error::from(e))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(i: u8) -> SlotRecord {
        SlotRecord {
            key: [i; 32],
            parent: (i > 0).then(|| [i - 1; 32]),
            len: 4096 + u32::from(i),
            crc: 0xdead_0000 | u32::from(i),
        }
    }

    #[test]
    fn sealed_records_survive_the_writer_and_cleared_ones_do_not() {
        let dir = std::env::temp_dir().join(format!("kvtier-slots-{}", std::process::id()));
        let (own, _) = OwnDir::open_or_create(&dir).unwrap();
        let path = own.join("pool.slots");
        let t = SlotTable::create(&own, "pool.slots", 8, 8192, b"layout").unwrap();
        for i in 0..8u8 {
            t.seal(u32::from(i), &rec(i)).unwrap();
        }
        t.clear(3).unwrap();
        assert!(t.seal(8, &rec(0)).is_err());
        // While its writer lives (holds it open), nobody takes it over.
        let e = SlotTable::open(&own, "pool.slots").unwrap_err();
        assert!(e.is_untrusted(), "{e}");
        // The writer dies: its descriptor (and lock) go, the file stays.
        let mut t = t;
        t.unlink_on_drop = false;
        drop(t);
        let (mut t, h) = SlotTable::open(&own, "pool.slots").unwrap();
        assert_eq!(
            h,
            TableHeader {
                slots: 8,
                stride: 8192,
                description: b"layout".to_vec()
            }
        );
        for i in 0..8u8 {
            let want = (i != 3).then(|| rec(i));
            assert_eq!(t.record(u32::from(i)), want, "slot {i}");
        }
        // A torn record (a crash between fields and state): refused by its CRC.
        let at = HEADER + 5 * RECORD;
        t.put(at + 20, &[0xff; 4]);
        assert_eq!(t.record(5), None);
        t.remove_on_drop();
        drop(t);
        assert!(!path.exists());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_damaged_or_foreign_header_is_refused() {
        let dir = std::env::temp_dir().join(format!("kvtier-slots-h-{}", std::process::id()));
        let (own, _) = OwnDir::open_or_create(&dir).unwrap();
        let name = "pool.slots";
        std::fs::write(own.join(name), vec![7u8; HEADER + RECORD]).unwrap();
        assert!(SlotTable::open(&own, name).is_err());
        let t = SlotTable::create(&own, name, 2, 4096, b"x").unwrap();
        t.put(30, b"y");
        std::mem::forget(t);
        assert!(SlotTable::open(&own, name).is_err(), "description changed");
        assert!(SlotTable::create(&own, name, 1, 4096, &[0; MAX_DESCRIPTION + 1]).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
