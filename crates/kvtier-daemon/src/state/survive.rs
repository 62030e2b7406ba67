//! L2 that survives a kvtierd crash.
//!
//! Each `shm_file` pool has a [`SlotTable`] beside it. A slot's record is cleared when the
//! slot is handed out for writing (reserve, or a prefetch's reservation) and sealed after its
//! page is committed: the sealer ([`HostState::seal_jobs`], run by a background task)
//! checksums committed pages outside the state lock, then seals each record under the lock
//! only if the slot has not been handed out again meanwhile (its epoch is unchanged). So a
//! record only ever describes bytes that were committed and have not been rewritten since.
//!
//! L2Pool files are named `kvtier-<instance>-<pid>-<run>-<fingerprint>`, the instance being a
//! hash of the daemon's socket path, the same across restarts, and the run this kvtierd
//! run's epoch (no two runs share a name, even when both were pid 1 in a container). At start ([`take_over_dead_pools`])
//! kvtierd looks in its own pool directory (`kvtierd-<uid>` in `l2.shm_dir`) for pools of its own instance whose kvtierd is gone (another
//! instance's are left to that instance's successor). For each with an intact table and a layout it can rebuild, it creates its own
//! pool of that layout and copies in every page whose record is sealed and whose bytes still
//! have the recorded CRC32C, parents before children, giving each old slot's memory back as
//! it goes (so the takeover needs no second pool's worth of RAM). Then the dead pool and its
//! table are removed. The copy also means that an agent still mapping the dead pool can
//! never write into the new one.

use std::collections::{HashMap, VecDeque};
use std::path::Path;
use std::sync::Arc;

use kvtier_config::daemon::DaemonConfig;
use kvtier_core::host_index::PageState;
use kvtier_core::{Layout, LayoutFingerprint, PageKey};
use kvtier_proto::v1;
use kvtier_shm::{OwnDir, ShmPool, SlotRecord, SlotTable, table_name};
use prost::Message;

use super::{HostState, L2Pool};

/// The seal bookkeeping of one pool.
#[derive(Debug)]
pub struct Seals {
    table: SlotTable,
    /// Bumped each time a slot is handed out for writing.
    epochs: Vec<u32>,
    /// Committed slots not yet sealed, oldest first: (slot, key, epoch at commit). Taken
    /// from the front in batches, so a backlog costs nothing per batch (a `Vec` drained from
    /// the front moved the whole backlog under the state lock each time).
    pending: VecDeque<(u32, PageKey, u32)>,
}

impl Seals {
    /// The table for a new pool named `pool` in `dir` (its file beside the pool).
    pub fn create(dir: &OwnDir, pool: &str, layout: &Layout, slots: u32) -> Result<Self, String> {
        let description = v1::LayoutDescriptor::from(layout.spec()).encode_to_vec();
        let table = SlotTable::create(
            dir,
            &table_name(pool),
            slots,
            layout.slot_stride() as u64,
            &description,
        )
        .map_err(|e| e.to_string())?;
        Ok(Self {
            table,
            epochs: vec![0; slots as usize],
            pending: VecDeque::new(),
        })
    }

    /// `slot` is about to be written: nothing vouches for it any more.
    pub fn handed_out(&mut self, slot: u32) {
        if let Some(e) = self.epochs.get_mut(slot as usize) {
            *e = e.wrapping_add(1);
        }
        if let Err(e) = self.table.clear(slot) {
            tracing::error!(slot, "clearing a slot record: {e}");
        }
    }

    /// `key` was committed into `slot`: to be checksummed and sealed.
    pub fn committed(&mut self, slot: u32, key: PageKey) {
        let epoch = self.epochs.get(slot as usize).copied().unwrap_or(0);
        // Each slot has one current epoch, so at most `slots` entries are live; the rest
        // name slots handed out again since, which `seal` would skip. Dropping those when the
        // backlog reaches twice the pool keeps a sealer that falls behind from growing it
        // without bound.
        if self.pending.len() >= 2 * self.epochs.len().max(1) {
            let epochs = &self.epochs;
            self.pending
                .retain(|&(slot, _, e)| epochs.get(slot as usize) == Some(&e));
        }
        self.pending.push_back((slot, key, epoch));
    }

    /// Committed slots waiting to be sealed (stale ones included until dropped).
    #[cfg(test)]
    pub fn backlog(&self) -> usize {
        self.pending.len()
    }
}

/// One committed page to checksum, outside the state lock.
#[derive(Debug)]
pub struct SealJob {
    fp: LayoutFingerprint,
    shm: Arc<ShmPool>,
    slot: u32,
    key: PageKey,
    epoch: u32,
    len: usize,
}

impl SealJob {
    /// Reads the page and computes its CRC32C (slow: run off the state lock).
    pub fn checksum(self) -> Option<(Self, u32)> {
        let crc = self.shm.checksum(self.slot, self.len).ok()?;
        Some((self, crc))
    }
}

/// What a start-up takeover did, by outcome.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct TakeoverCounts {
    /// Pages taken over (now in L2).
    pub adopted: u64,
    /// Sealed pages whose bytes no longer had the recorded CRC (or length): refused.
    pub refused_checksum: u64,
    /// Pages that did not fit the new pool (smaller, or the key was there already).
    pub no_room: u64,
    /// Dead pools taken over.
    pub pools: u64,
    /// Dead pools removed without a takeover (no table, a damaged one, a foreign layout, or
    /// takeover turned off).
    pub pools_removed: u64,
    /// Files named as this instance's pools that were not its own (a symlink, another
    /// owner, writable by others) or that a live process holds: neither read nor removed.
    pub pools_ignored: u64,
}

impl L2Pool {
    /// Clears the records of freshly reserved slots.
    pub(super) fn handed_out(&mut self, slots: impl IntoIterator<Item = u32>) {
        if let Some(s) = &mut self.seals {
            for slot in slots {
                s.handed_out(slot);
            }
        }
    }

    /// Seals committed `key` at once with `crc`, the CRC32C of its bytes as a verified L3
    /// read wrote them into the slot: the same value the sealer would compute, without a
    /// second pass over the page. (Had anything written the slot since, the record would not
    /// match the bytes and a takeover refuses the page: the same guarantee as a sealer's.)
    /// `false` when there is no table or the page is not ready in a slot.
    pub(super) fn committed_read(&mut self, key: PageKey, crc: u32) -> bool {
        match self.index.get(&key) {
            Some((slot, PageState::Ready)) => self.seal_slot(slot, key, crc),
            _ => false,
        }
    }

    /// Writes `slot`'s record: it holds page `key` (with its parent), whose bytes have CRC32C
    /// `crc`. `false` when the pool has no table or the write failed (logged).
    fn seal_slot(&mut self, slot: u32, key: PageKey, crc: u32) -> bool {
        let Some(s) = &self.seals else {
            return false;
        };
        let rec = SlotRecord {
            key: key.0,
            parent: self.index.parent(&key).map(|p| p.0),
            len: self.layout.page_bytes() as u32,
            crc,
        };
        match s.table.seal(slot, &rec) {
            Ok(()) => true,
            Err(e) => {
                tracing::error!(slot, "sealing a slot record: {e}");
                false
            }
        }
    }

    /// [`Self::committed`] for keys whose slots the commit already found (`slots[i]` holds
    /// `keys[i]`, ready): no second lookup per key.
    pub(super) fn committed_at(&mut self, keys: &[PageKey], slots: &[u32]) {
        if let Some(s) = &mut self.seals {
            for (k, &slot) in keys.iter().zip(slots) {
                s.committed(slot, *k);
            }
        }
    }

    /// Queues committed keys for sealing.
    pub(super) fn committed(&mut self, keys: &[PageKey]) {
        if let Some(s) = &mut self.seals {
            for k in keys {
                if let Some((slot, PageState::Ready)) = self.index.get(k) {
                    s.committed(slot, *k);
                }
            }
        }
    }
}

impl HostState {
    /// Up to `max` committed pages waiting to be sealed.
    pub fn seal_jobs(&mut self, max: usize) -> Vec<SealJob> {
        let mut out = Vec::new();
        for pool in self.pools.values_mut() {
            let Some(s) = &mut pool.seals else { continue };
            let n = s.pending.len().min(max - out.len());
            let len = pool.layout.page_bytes();
            out.extend(s.pending.drain(..n).map(|(slot, key, epoch)| SealJob {
                fp: pool.key,
                shm: pool.shm.clone(),
                slot,
                key,
                epoch,
                len,
            }));
            if out.len() >= max {
                break;
            }
        }
        out
    }

    /// Seals the checksummed pages whose slots still hold them, untouched since commit.
    /// Returns how many were sealed.
    pub fn seal(&mut self, done: Vec<(SealJob, u32)>) -> usize {
        let mut sealed = 0;
        for (job, crc) in done {
            let Some(pool) = self.pools.get_mut(&job.fp) else {
                continue;
            };
            let Some(s) = &pool.seals else { continue };
            let same = s.epochs.get(job.slot as usize) == Some(&job.epoch)
                && pool.index.get(&job.key) == Some((job.slot, PageState::Ready));
            if same && pool.seal_slot(job.slot, job.key, crc) {
                sealed += 1;
                self.counters.sealed_pages += 1;
            }
        }
        sealed
    }

    /// Copies the verified pages of a dead kvtierd's pool of `layout` into this daemon's pool
    /// of that layout (created here), and gives the dead pool's memory back page by page.
    fn adopt_pool(
        &mut self,
        layout: &Layout,
        old: &ShmPool,
        table: &SlotTable,
        counts: &mut TakeoverCounts,
    ) -> Result<(), String> {
        let page_bytes = layout.page_bytes();
        // One of kvtierd's own pools comes back as one, of its size.
        let own = layout
            .spec()
            .model_id
            .starts_with(super::OWN_LAYOUT_PREFIX)
            .then(|| table.slots().min(old.slots()));
        let pool = self.pool_for(layout, "", own).map_err(|e| e.to_string())?;
        let mut records: HashMap<PageKey, (u32, SlotRecord)> = HashMap::new();
        for slot in 0..table.slots().min(old.slots()) {
            if let Some(r) = table.record(slot) {
                records.insert(PageKey(r.key), (slot, r));
            }
        }
        let mut buf = vec![0u8; page_bytes];
        let mut done: HashMap<PageKey, bool> = HashMap::new();
        let keys: Vec<PageKey> = records.keys().copied().collect();
        for start in keys {
            // Parents first: walk up while the parent has a record not yet handled.
            let mut chain = vec![start];
            while let Some(p) = records
                .get(chain.last().unwrap_or(&start))
                .and_then(|(_, r)| r.parent)
                .map(PageKey)
                .filter(|p| records.contains_key(p) && !done.contains_key(p) && !chain.contains(p))
            {
                chain.push(p);
            }
            for key in chain.into_iter().rev() {
                if done.contains_key(&key) {
                    continue;
                }
                let Some(&(slot, rec)) = records.get(&key) else {
                    continue;
                };
                let ok = rec.len as usize == page_bytes
                    && old.read(slot, 0, &mut buf).is_ok()
                    && kvtier_core::checksum::crc32c(&buf) == rec.crc;
                if !ok {
                    counts.refused_checksum += 1;
                } else if let Some(new) = pool.index.adopt(key, rec.parent.map(PageKey)) {
                    // Under an admission filter, a page comes back as one it has not admitted
                    // (the filter's memory died with the old kvtierd): seen again, it is
                    // written; else it leaves unwritten, as before the crash. Not a burst of
                    // writes of every page L2 held.
                    if pool.admission.kind() != kvtier_core::AdmissionKind::All {
                        pool.index.decline_l3(&key);
                    }
                    if let Err(e) = pool.shm.write(new, 0, &buf) {
                        return Err(format!("copying into slot {new}: {e}"));
                    }
                    if let Some(s) = &mut pool.seals
                        && let Err(e) = s.table.seal(new, &rec)
                    {
                        tracing::error!(slot = new, "sealing a slot record: {e}");
                    }
                    counts.adopted += 1;
                } else {
                    counts.no_room += 1;
                }
                if let Err(e) = old.punch(slot) {
                    tracing::debug!(slot, "giving a dead pool's slot back: {e}");
                }
                done.insert(key, ok);
            }
        }
        Ok(())
    }
}

/// The instance id of the kvtierd serving `socket`: 8 hex digits of its SHA-256.
pub(super) fn instance_id(socket: &Path) -> String {
    use sha2::Digest;
    let d = sha2::Sha256::digest(socket.as_os_str().as_encoded_bytes());
    d[..4].iter().map(|b| format!("{b:02x}")).collect()
}

/// Whose a file in kvtierd's pool directory is.
#[derive(Debug, PartialEq, Eq)]
enum Found<'a> {
    /// A pool of this instance whose kvtierd is gone (its layout fingerprint, hex).
    Mine(&'a str),
    /// A pool of a dead kvtierd from before pools carried an instance id.
    Legacy,
    /// A pool of another kvtierd instance on this node, dead: its own successor takes it
    /// over.
    Foreign,
    /// Not a dead kvtierd's pool.
    Other,
}

/// Reads a pool file name: `kvtier-<instance>-<pid>-<run>-<fingerprint>` (the run being the
/// kvtierd run's epoch, so no two runs ever share a name, not even two that were both pid 1
/// in their containers), or the older `kvtier-<instance>-<pid>-<fingerprint>` and
/// `kvtier-<pid>-<fingerprint>`. `run` is this run's.
fn classify<'a>(name: &'a str, instance: &str, run: &str) -> Found<'a> {
    let Some(rest) = name.strip_prefix("kvtier-") else {
        return Found::Other;
    };
    let parts: Vec<&str> = rest.split('-').collect();
    let (inst, pid, pool_run, fp) = match parts.as_slice() {
        [pid, fp] => (None, *pid, None, *fp),
        [inst, pid, fp] => (Some(*inst), *pid, None, *fp),
        [inst, pid, r, fp] => (Some(*inst), *pid, Some(*r), *fp),
        _ => return Found::Other,
    };
    let Ok(pid) = pid.parse::<u32>() else {
        return Found::Other;
    };
    if fp.len() != 32 || !fp.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Found::Other;
    }
    // Our own instance's pools from another run: no other kvtierd of this instance runs
    // (this one holds the socket), whatever runs under that pid now, this process
    // included (in a container every kvtierd is pid 1); the slot table's lock settles it
    // for sure. This run's own pools are not dead.
    if inst == Some(instance) {
        return if pool_run == Some(run) {
            Found::Other
        } else {
            Found::Mine(fp)
        };
    }
    if pid == std::process::id() || Path::new(&format!("/proc/{pid}")).exists() {
        return Found::Other;
    }
    match inst {
        None => Found::Legacy,
        Some(_) => Found::Foreign,
    }
}

/// Takes over (or, when that is off or impossible, removes) the pools of dead kvtierd
/// processes in kvtierd's own pool directory ([`super::pool_dir`]). Runs at start, before the
/// daemon serves.
pub fn take_over_dead_pools(cfg: &DaemonConfig, state: &mut HostState) -> TakeoverCounts {
    let mut counts = TakeoverCounts::default();
    let dir = match state.pools.dir() {
        Some(dir) => dir.clone(),
        // memfd pools: only an earlier run's files to remove, if it left any.
        None => {
            if !super::pool_dir(cfg).is_dir() {
                return counts;
            }
            match super::open_pool_dir(cfg) {
                Ok(d) => d,
                Err(e) => {
                    tracing::warn!("not looking for a dead kvtierd's pools: {e}");
                    return counts;
                }
            }
        }
    };
    let Ok(mut names) = dir.names() else {
        return counts;
    };
    names.sort();
    let instance = state.pools.instance().to_string();
    let run = state.sessions.epoch().to_string();
    for name in &names {
        // A table of ours whose pool file is gone is of no use.
        if let Some(pool) = name.strip_suffix(".slots")
            && matches!(
                classify(pool, &instance, &run),
                Found::Mine(_) | Found::Legacy
            )
            && !dir.contains(pool)
        {
            let _ = dir.remove(name);
            continue;
        }
        let path = dir.join(name);
        let result = match classify(name, &instance, &run) {
            Found::Other => continue,
            Found::Foreign => {
                tracing::info!(path = %path.display(), "a dead kvtierd of another instance left this pool; its successor takes it over (or remove it by hand)");
                continue;
            }
            Found::Legacy => Err("it has no slot table".to_string()),
            Found::Mine(_) if !(cfg.l2.take_over_after_crash && state.seals_enabled()) => {
                Err("l2.take_over_after_crash is off (or pools are memfds)".to_string())
            }
            Found::Mine(fp) => match take_over_one(&dir, name, fp, state, &mut counts) {
                Err(Refusal::NotOurs(why)) => {
                    // Planted, or held by a live process: neither read nor removed.
                    counts.pools_ignored += 1;
                    tracing::warn!(path = %path.display(), "ignored a file named as one of this kvtierd's pools: {why}");
                    continue;
                }
                Err(Refusal::Unusable(why)) => Err(why),
                Ok(adopted) => Ok(adopted),
            },
        };
        match result {
            Ok(adopted) => {
                counts.pools += 1;
                tracing::info!(path = %path.display(), pages = adopted, "took over a dead kvtierd's pool");
            }
            Err(why) => {
                counts.pools_removed += 1;
                tracing::info!(path = %path.display(), "removed a dead kvtierd's pool: {why}");
            }
        }
        for n in [name.clone(), table_name(name)] {
            if let Err(e) = dir.remove(&n) {
                tracing::warn!("cannot remove a stale pool file: {e}");
            }
        }
    }
    counts
}

/// Why a pool of this instance was not taken over.
enum Refusal {
    /// The pool or its table is not this kvtierd's own file (a symlink, another owner,
    /// writable by others, a hard link) or a live process holds it: left alone.
    NotOurs(String),
    /// Ours, but of no use (damaged, a foreign layout): removed.
    Unusable(String),
}

impl From<String> for Refusal {
    fn from(why: String) -> Self {
        Refusal::Unusable(why)
    }
}

impl From<&str> for Refusal {
    fn from(why: &str) -> Self {
        Refusal::Unusable(why.to_string())
    }
}

impl From<kvtier_shm::ShmError> for Refusal {
    fn from(e: kvtier_shm::ShmError) -> Self {
        if e.is_untrusted() {
            Refusal::NotOurs(e.to_string())
        } else {
            Refusal::Unusable(e.to_string())
        }
    }
}

/// Takes over one dead pool; returns the pages taken.
fn take_over_one(
    dir: &OwnDir,
    name: &str,
    fp: &str,
    state: &mut HostState,
    counts: &mut TakeoverCounts,
) -> Result<u64, Refusal> {
    let (table, header) = SlotTable::open(dir, &table_name(name))?;
    let desc = v1::LayoutDescriptor::decode(header.description.as_slice())
        .map_err(|e| format!("its layout does not decode: {e}"))?;
    let layout = Layout::try_from(desc).map_err(|e| format!("its layout is invalid: {e}"))?;
    if layout.fingerprint().to_hex() != fp.to_ascii_lowercase() {
        return Err("its layout does not match its name".into());
    }
    if header.stride != layout.slot_stride() as u64 {
        return Err("its stride does not match its layout".into());
    }
    let stride = usize::try_from(header.stride).map_err(|e| e.to_string())?;
    let old = ShmPool::open_own(dir, name, header.slots, stride)?;
    let before = counts.adopted;
    state.adopt_pool(&layout, &old, &table, counts)?;
    Ok(counts.adopted - before)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sealer_that_never_runs_keeps_at_most_twice_the_pool_in_its_backlog() {
        let layout = crate::state::testing::tiny_layout();
        let dir = std::env::temp_dir().join(format!("kvtier-seals-{}", std::process::id()));
        let (own, _) = OwnDir::open_or_create(&dir).unwrap();
        let slots = 8u32;
        let mut s = Seals::create(&own, "pool", &layout, slots).unwrap();
        let key = |i: u32| PageKey([(i % 251) as u8; 32]);
        // Every slot written and committed 100 times over: only the last round is live.
        for i in 0..100 * slots {
            let slot = i % slots;
            s.handed_out(slot);
            s.committed(slot, key(i));
        }
        assert!(s.backlog() <= 2 * slots as usize, "backlog {}", s.backlog());
        let live: Vec<_> = s
            .pending
            .iter()
            .filter(|&&(slot, _, e)| s.epochs[slot as usize] == e)
            .map(|&(slot, k, _)| (slot, k))
            .collect();
        let last: Vec<_> = (99 * slots..100 * slots)
            .map(|i| (i % slots, key(i)))
            .collect();
        assert_eq!(live, last, "the live commits are kept, in order");
        drop(s);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn pool_names_are_classified_by_instance_run_and_liveness() {
        // A pid that cannot be running (above pid_max on any Linux).
        let dead = 4_194_399u32;
        let fp = "0123456789abcdef0123456789abcdef";
        let me = instance_id(Path::new("/run/kvtier/kvtierd.sock"));
        assert_eq!(me.len(), 8);
        assert_ne!(me, instance_id(Path::new("/run/other/kvtierd.sock")));
        let (run, old_run) = ("18a2b3c4d5e6f", "18a2b3c4d0000");
        let name = |inst: &str, pid: u32, r: &str| format!("kvtier-{inst}-{pid}-{r}-{fp}");
        fn c<'a>(n: &'a str, me: &str, run: &str) -> Found<'a> {
            classify(n, me, run)
        }
        assert_eq!(c(&name(&me, dead, old_run), &me, run), Found::Mine(fp));
        assert_eq!(
            c(&name("deadbeef", dead, old_run), &me, run),
            Found::Foreign
        );
        assert_eq!(c(&format!("kvtier-{dead}-{fp}"), &me, run), Found::Legacy);
        // Another run of our instance is dead whatever its pid: this process's own (a
        // container's kvtierd is pid 1 every time) or a live one (this process holds the
        // instance's socket). This run's own pools are not dead.
        assert_eq!(
            c(&name(&me, std::process::id(), old_run), &me, run),
            Found::Mine(fp)
        );
        assert_eq!(c(&name(&me, 1, old_run), &me, run), Found::Mine(fp));
        assert_eq!(
            c(&name(&me, std::process::id(), run), &me, run),
            Found::Other
        );
        // The name before runs were in it: ours too, whatever its pid.
        let before_runs = format!("kvtier-{me}-{}-{fp}", std::process::id());
        assert_eq!(c(&before_runs, &me, run), Found::Mine(fp));
        // Other instances' live pids are theirs.
        assert_eq!(c(&name("deadbeef", 1, old_run), &me, run), Found::Other);
        assert_eq!(c(&format!("kvtier-1-{fp}"), &me, run), Found::Other);
        assert_eq!(
            c(&format!("{}.slots", name(&me, dead, old_run)), &me, run),
            Found::Other
        );
        assert_eq!(c("kvtier-x-y", &me, run), Found::Other);
        assert_eq!(c("engine-pool", &me, run), Found::Other);
    }
}
