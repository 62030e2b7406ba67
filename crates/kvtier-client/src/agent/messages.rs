//! The agent's calls in domain terms, and their wire edge both ways: the agent answers in
//! these types, [`super::AgentClient`] reads them back and builds its requests here.

use std::os::fd::OwnedFd;
use std::sync::Arc;

use kvtier_core::keys::KEY_LEN;
use kvtier_core::{Namespace, PageKey};
use kvtier_proto::v1;

use crate::ClientError;

/// A match's lock on its device prefix: valid until [`AgentClient::release`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Handle(pub u64);

/// Where the engine's KV pool lives. CPU memory goes to the agent as descriptors (the
/// client deposits them at the agent's memory door as it registers): a memfd made with
/// sealing allowed (`kvtier_shm::ShmRegion::memfd`) is sealed against shrinking there.
#[derive(Clone, Debug)]
pub enum PoolMemory {
    /// A CPU pool: a file of layer-first buffers, by its descriptor.
    Cpu {
        /// The file holding the pool's buffers.
        fd: Arc<OwnedFd>,
    },
    /// A CPU pool in the engine's own allocations (memfds or shared-memory files), with
    /// where each piece of a page lives in them: the agent reads and writes the engine's
    /// blocks in place.
    CpuMapped {
        /// The file of each allocation, by its descriptor.
        allocations: Vec<Arc<OwnedFd>>,
        /// Bytes of each allocation the pieces use, from the file's start.
        allocation_bytes: Vec<u64>,
        /// A page's pieces, in the order of its bytes in a host slot.
        pieces: Vec<PagePiece>,
    },
    /// A CUDA pool: one IPC handle per buffer, on device `ordinal`.
    Cuda {
        /// The CUDA device.
        ordinal: u32,
        /// `cudaIpcMemHandle_t` bytes per buffer, in the layout's buffer order.
        ipc_handles: Vec<Vec<u8>>,
    },
    /// A CUDA pool in a few allocations (vLLM's layouts): one IPC handle per allocation and
    /// where each piece of a page lives in them.
    CudaMapped {
        /// The CUDA device.
        ordinal: u32,
        /// `cudaIpcMemHandle_t` bytes per allocation.
        ipc_handles: Vec<Vec<u8>>,
        /// Bytes of each allocation the pieces use, from the handle's address.
        allocation_bytes: Vec<u64>,
        /// A page's pieces, in the order of its bytes in a host slot.
        pieces: Vec<PagePiece>,
    },
}

/// `length` bytes of every page: page p's at `allocation` + `offset` + p × `page_stride`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PagePiece {
    /// Index into the pool's allocations.
    pub allocation: u32,
    /// Bytes from the allocation's start to page 0's piece.
    pub offset: u64,
    /// Bytes between consecutive pages' pieces.
    pub page_stride: u64,
    /// Bytes of the piece.
    pub length: u64,
}

impl PoolMemory {
    /// The CPU descriptors to deposit at the memory door (none for a CUDA pool).
    pub(crate) fn descriptors(&self) -> Vec<Arc<OwnedFd>> {
        match self {
            PoolMemory::Cpu { fd } => vec![fd.clone()],
            PoolMemory::CpuMapped { allocations, .. } => allocations.clone(),
            PoolMemory::Cuda { .. } | PoolMemory::CudaMapped { .. } => Vec::new(),
        }
    }

    /// The wire's device, naming CPU memory by the memory door's `ticket`.
    pub(crate) fn wire(self, ticket: Vec<u8>) -> v1::register_pool_request::Device {
        use v1::register_pool_request::Device;
        match self {
            PoolMemory::Cpu { .. } => Device::Cpu(v1::CpuPool {
                memory: ticket,
                ..Default::default()
            }),
            PoolMemory::CpuMapped {
                allocation_bytes,
                pieces,
                ..
            } => Device::Cpu(v1::CpuPool {
                memory: ticket,
                allocation_bytes,
                pieces: wire_pieces(pieces),
            }),
            PoolMemory::Cuda {
                ordinal,
                ipc_handles,
            } => Device::Cuda(v1::CudaPool {
                device_ordinal: ordinal,
                ipc_handles,
                allocation_bytes: Vec::new(),
                pieces: Vec::new(),
            }),
            PoolMemory::CudaMapped {
                ordinal,
                ipc_handles,
                allocation_bytes,
                pieces,
            } => Device::Cuda(v1::CudaPool {
                device_ordinal: ordinal,
                ipc_handles,
                allocation_bytes,
                pieces: wire_pieces(pieces),
            }),
        }
    }
}

fn wire_pieces(pieces: Vec<PagePiece>) -> Vec<v1::PagePiece> {
    pieces
        .into_iter()
        .map(|r| v1::PagePiece {
            allocation: r.allocation,
            offset: r.offset,
            page_stride: r.page_stride,
            length: r.length,
        })
        .collect()
}

/// The agent's answer to a pool registration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolInfo {
    /// Device pages in the pool.
    pub pages: u32,
    /// Whether the agent has a kvtierd session now (it serves L1 alone while it has not).
    pub daemon_connected: bool,
}

/// What the tiers hold of a prompt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Match {
    /// Locks `device_pages` until released.
    pub handle: Handle,
    /// Device pages of the cached prefix, in order.
    pub device_pages: Vec<u32>,
    /// Pages after those that L2 holds (ready to load back).
    pub l2_pages: u32,
    /// Pages after those that L3 holds (prefetch them into L2 first).
    pub l3_pages: u32,
    /// Full pages in the prompt.
    pub total_pages: u32,
}

impl From<v1::MatchResponse> for Match {
    fn from(m: v1::MatchResponse) -> Self {
        Self {
            handle: Handle(m.handle),
            device_pages: m.device_pages,
            l2_pages: m.l2_pages,
            l3_pages: m.l3_pages,
            total_pages: m.total_pages,
        }
    }
}

/// The outcome of a load-back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Loaded {
    /// Pages loaded, into the first lent pages; now locked under the handle.
    pub loaded: u32,
    /// The handle's whole device prefix after loading.
    pub device_pages: Vec<u32>,
    /// Lent pages the engine gets back unused.
    pub unused_pages: Vec<u32>,
}

/// The outcome of an insert.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Inserted {
    /// Pages newly in the tree.
    pub inserted: u32,
    /// Pages the engine passed for positions the tree already had elsewhere: free these.
    pub duplicate_pages: Vec<u32>,
}

/// The outcome of an eviction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Evicted {
    /// Device pages now free, in eviction order (may be fewer than asked).
    pub pages: Vec<u32>,
    /// Of those, with a copy in L2.
    pub backed_up: u32,
    /// Of those, given up without a copy (counted by reason in the agent's metrics).
    pub lost: u32,
}

/// What the tiers hold of a prompt's pages after the engine's own (engine-cache mode).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PagesLookup {
    /// Pages after the engine's that L2 holds.
    pub l2_pages: u32,
    /// Pages after those that L3 holds.
    pub l3_pages: u32,
    /// Full pages in the prompt.
    pub total_pages: u32,
    /// Under write_through_selective: how many leading pages of the prompt the write policy
    /// saves (pass it to every rank's Save).
    pub save_pages: Option<u32>,
    /// When asked for: the keys of the full pages the lookup's tokens cover, from page 0 (or
    /// from its start page under a parent key), for naming later calls by parent key.
    pub keys: Vec<PageKey>,
}

/// A prompt's tokens as an engine-cache call sends them: the whole prompt from its first
/// token, or only the tokens from the call's start page on, after the key of the page
/// before it (O(pages asked about) on the wire and in the agent).
#[derive(Clone, Copy, Debug)]
pub enum PromptTokens<'a> {
    /// Every token of the prompt from the first.
    Whole(&'a [u32]),
    /// The tokens from the start page on, which follow the page keyed `parent`.
    After {
        /// The key of the page before the start page.
        parent: PageKey,
        /// The tokens from the start page on.
        tokens: &'a [u32],
    },
}

impl<'a> From<&'a [u32]> for PromptTokens<'a> {
    fn from(t: &'a [u32]) -> Self {
        Self::Whole(t)
    }
}

impl<'a> From<&'a Vec<u32>> for PromptTokens<'a> {
    fn from(t: &'a Vec<u32>) -> Self {
        Self::Whole(t)
    }
}

impl PromptTokens<'_> {
    /// (packed_tokens, parent_key) as the wire carries them.
    pub(super) fn wire(self) -> (bytes::Bytes, Vec<u8>) {
        match self {
            Self::Whole(t) => (packed(t), Vec::new()),
            Self::After { parent, tokens } => (packed(tokens), parent.as_bytes().to_vec()),
        }
    }
}

/// One Save of a [`AgentClient::save_batch`]: as [`AgentClient::save_selected`]'s arguments.
#[derive(Clone, Debug)]
pub struct SaveRequest<'a> {
    /// The prompt, whole or after its start page's parent key.
    pub tokens: PromptTokens<'a>,
    /// The prompt's namespace (none: the default).
    pub namespace: Option<&'a Namespace>,
    /// The first page to save.
    pub start_page: u32,
    /// The engine's pages holding pages `start_page..`.
    pub device_pages: Vec<u32>,
    /// The write policy's selection as a Lookup answered it (none: the agent's own counts).
    pub selected: Option<u32>,
}

/// The outcome of an engine-cache Save.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Saved {
    /// Pages copied into L2.
    pub stored: u32,
    /// Pages L2 held already.
    pub present: u32,
    /// Pages the write policy does not save.
    pub skipped: u32,
    /// Pages that did not reach L2 (counted lost, by reason, in the agent's metrics).
    pub failed: u32,
}

// The wire edge, both ways: the agent answers in these types, the client reads them back.

impl From<Match> for v1::MatchResponse {
    fn from(m: Match) -> Self {
        Self {
            handle: m.handle.0,
            device_pages: m.device_pages,
            l2_pages: m.l2_pages,
            l3_pages: m.l3_pages,
            total_pages: m.total_pages,
        }
    }
}

impl From<Loaded> for v1::LoadBackResponse {
    fn from(l: Loaded) -> Self {
        Self {
            loaded: l.loaded,
            device_pages: l.device_pages,
            unused_pages: l.unused_pages,
        }
    }
}

impl From<Inserted> for v1::InsertResponse {
    fn from(i: Inserted) -> Self {
        Self {
            duplicate_pages: i.duplicate_pages,
            inserted: i.inserted,
        }
    }
}

impl From<Evicted> for v1::EvictResponse {
    fn from(e: Evicted) -> Self {
        Self {
            pages: e.pages,
            backed_up: e.backed_up,
            lost: e.lost,
        }
    }
}

impl From<PagesLookup> for v1::PagesLookupResponse {
    fn from(l: PagesLookup) -> Self {
        Self {
            l2_pages: l.l2_pages,
            l3_pages: l.l3_pages,
            total_pages: l.total_pages,
            save_pages: l.save_pages,
            packed_keys: l.keys.iter().flat_map(|k| k.0).collect(),
        }
    }
}

impl TryFrom<v1::PagesLookupResponse> for PagesLookup {
    type Error = ClientError;

    fn try_from(l: v1::PagesLookupResponse) -> Result<Self, ClientError> {
        if !l.packed_keys.len().is_multiple_of(KEY_LEN) {
            return Err(ClientError::Protocol(format!(
                "packed_keys: {} bytes is not a whole number of {KEY_LEN}-byte keys",
                l.packed_keys.len()
            )));
        }
        Ok(Self {
            l2_pages: l.l2_pages,
            l3_pages: l.l3_pages,
            total_pages: l.total_pages,
            save_pages: l.save_pages,
            keys: l
                .packed_keys
                .chunks_exact(KEY_LEN)
                .map(|c| {
                    let mut k = [0u8; KEY_LEN];
                    k.copy_from_slice(c);
                    PageKey(k)
                })
                .collect(),
        })
    }
}

impl From<Saved> for v1::SavePagesResponse {
    fn from(s: Saved) -> Self {
        Self {
            stored: s.stored,
            present: s.present,
            skipped: s.skipped,
            failed: s.failed,
        }
    }
}

impl From<v1::SavePagesResponse> for Saved {
    fn from(s: v1::SavePagesResponse) -> Self {
        Self {
            stored: s.stored,
            present: s.present,
            skipped: s.skipped,
            failed: s.failed,
        }
    }
}

/// One prompt of a batched insert.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Insert {
    /// The tokens, full pages of which are inserted.
    pub tokens: Vec<u32>,
    /// Their namespace (None: the default).
    pub namespace: Option<Namespace>,
    /// One device page per full page of tokens.
    pub device_pages: Vec<u32>,
}

/// Tokens as the wire's `packed_tokens`: little-endian u32s, a copy to encode and decode
/// where the varint `tokens` field costs a loop over every token.
pub(super) fn packed(tokens: &[u32]) -> bytes::Bytes {
    let mut out = Vec::with_capacity(tokens.len() * 4);
    for t in tokens {
        out.extend_from_slice(&t.to_le_bytes());
    }
    out.into()
}

pub(super) fn match_request(tokens: &[u32], namespace: Option<&Namespace>) -> v1::MatchRequest {
    v1::MatchRequest {
        tokens: Vec::new(),
        namespace: namespace.map(Into::into),
        packed_tokens: packed(tokens),
    }
}

pub(super) fn insert_request(i: Insert) -> v1::InsertRequest {
    v1::InsertRequest {
        tokens: Vec::new(),
        namespace: i.namespace.as_ref().map(Into::into),
        device_pages: i.device_pages,
        packed_tokens: packed(&i.tokens),
    }
}

pub(super) fn inserted(r: v1::InsertResponse) -> Inserted {
    Inserted {
        inserted: r.inserted,
        duplicate_pages: r.duplicate_pages,
    }
}
