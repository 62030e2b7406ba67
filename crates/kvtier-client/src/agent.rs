//! [`AgentClient`]: the engine's side of `kvtier.v1.Agent`, in domain terms.
//!
//! An engine registers its device KV pool once, then per request: matches its prompt (the
//! agent locks the cached device prefix under a handle), optionally prefetches L3 pages into
//! L2, loads L2 pages back into free device pages it lends, inserts what it computed, and
//! releases the handle. When it runs short of device pages it asks the agent to evict.

use std::path::PathBuf;

use kvtier_core::keys::KEY_LEN;
use kvtier_core::{LayoutSpec, Namespace, PageKey};
use kvtier_proto::v1;
use kvtier_proto::v1::agent_client::AgentClient as RawAgentClient;
use tonic::transport::Channel;

use crate::{ClientError, connect};

/// A match's lock on its device prefix: valid until [`AgentClient::release`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Handle(pub u64);

/// Where the engine's KV pool lives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PoolMemory {
    /// A CPU pool: a file (in /dev/shm) the agent maps.
    Cpu {
        /// The file holding the pool's buffers.
        path: PathBuf,
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

impl From<PoolMemory> for v1::register_pool_request::Device {
    fn from(p: PoolMemory) -> Self {
        match p {
            PoolMemory::Cpu { path } => Self::Cpu(v1::CpuPool {
                path: path.display().to_string(),
            }),
            PoolMemory::Cuda {
                ordinal,
                ipc_handles,
            } => Self::Cuda(v1::CudaPool {
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
            } => Self::Cuda(v1::CudaPool {
                device_ordinal: ordinal,
                ipc_handles,
                allocation_bytes,
                pieces: pieces
                    .into_iter()
                    .map(|r| v1::PagePiece {
                        allocation: r.allocation,
                        offset: r.offset,
                        page_stride: r.page_stride,
                        length: r.length,
                    })
                    .collect(),
            }),
        }
    }
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
    fn wire(self) -> (bytes::Bytes, Vec<u8>) {
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

/// The metadata header that carries the pool's owner token (see `RegisterPoolResponse`).
pub const OWNER_HEADER: &str = "kvtier-pool-owner";

/// A client of a kvtier-agent. After a registration it presents the owner token the agent
/// returned on every call (clones made afterwards too).
#[derive(Debug, Clone)]
pub struct AgentClient {
    inner: RawAgentClient<Channel>,
    owner: Option<tonic::metadata::AsciiMetadataValue>,
}

impl AgentClient {
    /// Connects to the agent at a socket path or `http://` address.
    pub async fn connect(target: &str) -> Result<Self, ClientError> {
        Ok(Self {
            inner: RawAgentClient::new(connect(target).await?).max_decoding_message_size(64 << 20),
            owner: None,
        })
    }

    /// The raw generated client, for requests the typed methods do not cover (wrap their
    /// messages in [`Self::request`] to present the owner token).
    pub fn raw(&mut self) -> &mut RawAgentClient<Channel> {
        &mut self.inner
    }

    /// `msg` as a request that presents this client's owner token, if it registered.
    pub fn request<T>(&self, msg: T) -> tonic::Request<T> {
        Self::with_owner(&self.owner, msg)
    }

    fn with_owner<T>(
        owner: &Option<tonic::metadata::AsciiMetadataValue>,
        msg: T,
    ) -> tonic::Request<T> {
        let mut r = tonic::Request::new(msg);
        if let Some(v) = owner {
            r.metadata_mut().insert(OWNER_HEADER, v.clone());
        }
        r
    }

    /// Registers the engine's KV pool: `token_slots` token slots per buffer, laid out as
    /// `spec`. The agent starts over with an empty tree (every device page is free).
    pub async fn register_pool(
        &mut self,
        spec: &LayoutSpec,
        token_slots: u64,
        pool: PoolMemory,
    ) -> Result<PoolInfo, ClientError> {
        self.register(spec, token_slots, pool, false).await
    }

    /// Registers a pool whose prefix cache the engine keeps itself (vLLM): the agent keeps
    /// no tree, and the engine uses [`Self::lookup_pages`], [`Self::load_pages`] and
    /// [`Self::save_pages`].
    pub async fn register_engine_cache(
        &mut self,
        spec: &LayoutSpec,
        token_slots: u64,
        pool: PoolMemory,
    ) -> Result<PoolInfo, ClientError> {
        self.register(spec, token_slots, pool, true).await
    }

    async fn register(
        &mut self,
        spec: &LayoutSpec,
        token_slots: u64,
        pool: PoolMemory,
        engine_cache: bool,
    ) -> Result<PoolInfo, ClientError> {
        let req = self.request(v1::RegisterPoolRequest {
            layout: Some(spec.into()),
            num_token_slots: token_slots,
            device: Some(pool.into()),
            engine_cache,
        });
        let r = self.inner.register_pool(req).await?.into_inner();
        self.owner = Some(r.owner.parse().map_err(|_| {
            ClientError::Protocol(format!(
                "the agent's owner token {:?} is not a metadata value",
                r.owner
            ))
        })?);
        Ok(PoolInfo {
            pages: r.num_pages,
            daemon_connected: r.daemon_connected,
        })
    }

    /// Matches a prompt's full pages against every tier and locks the device prefix.
    pub async fn match_prefix(
        &mut self,
        tokens: &[u32],
        namespace: Option<&Namespace>,
    ) -> Result<Match, ClientError> {
        let r = self
            .inner
            .r#match(Self::with_owner(
                &self.owner,
                match_request(tokens, namespace),
            ))
            .await?
            .into_inner();
        Ok(r.into())
    }

    /// Matches several prompts in one call.
    pub async fn match_batch(
        &mut self,
        prompts: Vec<(Vec<u32>, Option<Namespace>)>,
    ) -> Result<Vec<Match>, ClientError> {
        let n = prompts.len();
        let requests = prompts
            .into_iter()
            .map(|(t, ns)| match_request(&t, ns.as_ref()))
            .collect();
        let r = self
            .inner
            .match_batch(Self::with_owner(
                &self.owner,
                v1::MatchBatchRequest { requests },
            ))
            .await?
            .into_inner();
        if r.responses.len() != n {
            return Err(ClientError::Protocol(format!(
                "{n} prompts matched, {} answers",
                r.responses.len()
            )));
        }
        Ok(r.responses.into_iter().map(Match::from).collect())
    }

    /// Loads the handle's L2 pages (after its device prefix) into `free_pages`, in order.
    pub async fn load_back(
        &mut self,
        handle: Handle,
        free_pages: Vec<u32>,
    ) -> Result<Loaded, ClientError> {
        let r = self
            .inner
            .load_back(Self::with_owner(
                &self.owner,
                v1::LoadBackRequest {
                    handle: handle.0,
                    free_pages,
                },
            ))
            .await?
            .into_inner();
        Ok(Loaded {
            loaded: r.loaded,
            device_pages: r.device_pages,
            unused_pages: r.unused_pages,
        })
    }

    /// Prefetches the handle's L3 pages into L2 under `policy` (unspecified: the daemon's
    /// configuration); returns the progress stream, whose last message is final.
    pub async fn prefetch(
        &mut self,
        handle: Handle,
        policy: v1::PrefetchPolicy,
        hints: Option<v1::PrefetchHints>,
    ) -> Result<tonic::Streaming<v1::PrefetchProgress>, ClientError> {
        Ok(self
            .inner
            .prefetch(Self::with_owner(
                &self.owner,
                v1::AgentPrefetchRequest {
                    handle: handle.0,
                    policy: policy as i32,
                    hints,
                },
            ))
            .await?
            .into_inner())
    }

    /// Inserts computed pages: one device page per full page of `tokens`.
    pub async fn insert(
        &mut self,
        tokens: Vec<u32>,
        namespace: Option<&Namespace>,
        device_pages: Vec<u32>,
    ) -> Result<Inserted, ClientError> {
        let r = self
            .inner
            .insert(Self::with_owner(
                &self.owner,
                insert_request(Insert {
                    tokens,
                    namespace: namespace.cloned(),
                    device_pages,
                }),
            ))
            .await?
            .into_inner();
        Ok(inserted(r))
    }

    /// Inserts several prompts in one call.
    pub async fn insert_batch(
        &mut self,
        inserts: Vec<Insert>,
    ) -> Result<Vec<Inserted>, ClientError> {
        let n = inserts.len();
        let requests = inserts.into_iter().map(insert_request).collect();
        let r = self
            .inner
            .insert_batch(Self::with_owner(
                &self.owner,
                v1::InsertBatchRequest { requests },
            ))
            .await?
            .into_inner();
        if r.responses.len() != n {
            return Err(ClientError::Protocol(format!(
                "{n} inserts sent, {} answers",
                r.responses.len()
            )));
        }
        Ok(r.responses.into_iter().map(inserted).collect())
    }

    /// Unlocks a match's pages.
    pub async fn release(&mut self, handle: Handle) -> Result<(), ClientError> {
        self.inner
            .release(Self::with_owner(
                &self.owner,
                v1::AgentReleaseRequest { handle: handle.0 },
            ))
            .await?;
        Ok(())
    }

    /// Unlocks several matches' pages.
    pub async fn release_batch(&mut self, handles: &[Handle]) -> Result<(), ClientError> {
        self.inner
            .release_batch(Self::with_owner(
                &self.owner,
                v1::ReleaseBatchRequest {
                    handles: handles.iter().map(|h| h.0).collect(),
                },
            ))
            .await?;
        Ok(())
    }

    /// Frees up to `pages` device pages, least recently used first, each backed up to L2
    /// first when the write policy keeps it.
    pub async fn evict(&mut self, pages: u32) -> Result<Evicted, ClientError> {
        let r = self
            .inner
            .evict(Self::with_owner(&self.owner, v1::EvictRequest { pages }))
            .await?
            .into_inner();
        Ok(Evicted {
            pages: r.pages,
            backed_up: r.backed_up,
            lost: r.lost,
        })
    }

    /// Engine-cache mode: pages of the prompt after its first `start_page` that L2 holds,
    /// then L3 (and the prompt's full pages).
    pub async fn lookup_pages<'a>(
        &mut self,
        tokens: impl Into<PromptTokens<'a>>,
        namespace: Option<&Namespace>,
        start_page: u32,
    ) -> Result<PagesLookup, ClientError> {
        self.lookup_with_keys(tokens, namespace, start_page, false)
            .await
    }

    /// [`Self::lookup_pages`], also returning the keys of the pages `tokens` cover when
    /// `want_keys`.
    pub async fn lookup_with_keys<'a>(
        &mut self,
        tokens: impl Into<PromptTokens<'a>>,
        namespace: Option<&Namespace>,
        start_page: u32,
        want_keys: bool,
    ) -> Result<PagesLookup, ClientError> {
        let (packed_tokens, parent_key) = tokens.into().wire();
        self.inner
            .lookup(Self::with_owner(
                &self.owner,
                v1::PagesLookupRequest {
                    packed_tokens,
                    namespace: namespace.map(Into::into),
                    start_page,
                    parent_key,
                    want_keys,
                },
            ))
            .await?
            .into_inner()
            .try_into()
    }

    /// Engine-cache mode: loads pages `start_page..` of the prompt into `device_pages`, in
    /// order; returns how many leading ones were loaded (the rest the engine computes).
    pub async fn load_pages<'a>(
        &mut self,
        tokens: impl Into<PromptTokens<'a>>,
        namespace: Option<&Namespace>,
        start_page: u32,
        device_pages: Vec<u32>,
        policy: v1::PrefetchPolicy,
    ) -> Result<u32, ClientError> {
        let (packed_tokens, parent_key) = tokens.into().wire();
        Ok(self
            .inner
            .load(Self::with_owner(
                &self.owner,
                v1::LoadPagesRequest {
                    packed_tokens,
                    namespace: namespace.map(Into::into),
                    start_page,
                    device_pages,
                    policy: policy as i32,
                    hints: None,
                    parent_key,
                },
            ))
            .await?
            .into_inner()
            .loaded)
    }

    /// Engine-cache mode: saves the computed pages `start_page..` of the prompt, held in
    /// `device_pages`, into L2 per the write policy; the pages are free to reuse on return.
    pub async fn save_pages<'a>(
        &mut self,
        tokens: impl Into<PromptTokens<'a>>,
        namespace: Option<&Namespace>,
        start_page: u32,
        device_pages: Vec<u32>,
    ) -> Result<Saved, ClientError> {
        self.save_selected(tokens, namespace, start_page, device_pages, None)
            .await
    }

    /// [`Self::save_pages`] with the write policy's selection as a Lookup answered it
    /// (`save_pages`, possibly another rank's agent's): pages before `selected` are saved,
    /// the rest skipped.
    pub async fn save_selected<'a>(
        &mut self,
        tokens: impl Into<PromptTokens<'a>>,
        namespace: Option<&Namespace>,
        start_page: u32,
        device_pages: Vec<u32>,
        selected: Option<u32>,
    ) -> Result<Saved, ClientError> {
        let (packed_tokens, parent_key) = tokens.into().wire();
        Ok(self
            .inner
            .save(Self::with_owner(
                &self.owner,
                v1::SavePagesRequest {
                    packed_tokens,
                    namespace: namespace.map(Into::into),
                    start_page,
                    device_pages,
                    selected,
                    parent_key,
                },
            ))
            .await?
            .into_inner()
            .into())
    }

    /// Engine-cache mode: several Saves in one call (an engine step's new pages for all its
    /// requests). Every request is checked before any page moves; a malformed one refuses
    /// the call, naming `requests[i]`. Answers in request order.
    pub async fn save_batch(
        &mut self,
        saves: &[SaveRequest<'_>],
    ) -> Result<Vec<Saved>, ClientError> {
        let requests = saves
            .iter()
            .map(|s| {
                let (packed_tokens, parent_key) = s.tokens.wire();
                v1::SavePagesRequest {
                    packed_tokens,
                    namespace: s.namespace.map(Into::into),
                    start_page: s.start_page,
                    device_pages: s.device_pages.clone(),
                    selected: s.selected,
                    parent_key,
                }
            })
            .collect();
        let r = self
            .inner
            .save_batch(Self::with_owner(
                &self.owner,
                v1::SaveBatchRequest { requests },
            ))
            .await?
            .into_inner();
        if r.responses.len() != saves.len() {
            return Err(ClientError::Protocol(format!(
                "{} answers to {} Saves",
                r.responses.len(),
                saves.len()
            )));
        }
        Ok(r.responses.into_iter().map(Into::into).collect())
    }

    /// The agent's counters.
    pub async fn stats(&mut self) -> Result<v1::AgentStatsResponse, ClientError> {
        Ok(self
            .inner
            .agent_stats(v1::AgentStatsRequest {})
            .await?
            .into_inner())
    }
}

/// Tokens as the wire's `packed_tokens`: little-endian u32s, a copy to encode and decode
/// where the varint `tokens` field costs a loop over every token.
fn packed(tokens: &[u32]) -> bytes::Bytes {
    let mut out = Vec::with_capacity(tokens.len() * 4);
    for t in tokens {
        out.extend_from_slice(&t.to_le_bytes());
    }
    out.into()
}

fn match_request(tokens: &[u32], namespace: Option<&Namespace>) -> v1::MatchRequest {
    v1::MatchRequest {
        tokens: Vec::new(),
        namespace: namespace.map(Into::into),
        packed_tokens: packed(tokens),
    }
}

fn insert_request(i: Insert) -> v1::InsertRequest {
    v1::InsertRequest {
        tokens: Vec::new(),
        namespace: i.namespace.as_ref().map(Into::into),
        device_pages: i.device_pages,
        packed_tokens: packed(&i.tokens),
    }
}

fn inserted(r: v1::InsertResponse) -> Inserted {
    Inserted {
        inserted: r.inserted,
        duplicate_pages: r.duplicate_pages,
    }
}
