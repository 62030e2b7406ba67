//! KV layouts: the geometry of a page on the device (layer-first) and on the host and in
//! storage (page-first), and the layout fingerprint that keeps pages of different layouts apart.
//!
//! Device (L1), the engine's own layout: per layer a K and a V buffer of
//! `[token_slot][kv_head][head_dim]` (MHA) or one `[token_slot][kv_lora_rank + rope_dim]` buffer
//! (MLA). Page `p` is token slots `p*P .. (p+1)*P`, so each (page, layer, part) is one contiguous
//! *run* of `P * token_bytes` bytes.
//!
//! Host (L2) and storage (L3): one slot holds a whole page, `[part][layer][token][...]`, so the
//! page is one blob and each run is contiguous too. Copying a page between the tiers is
//! [`Layout::runs_per_page`] memcpys of [`Layout::run_bytes`] each.

use std::fmt;
use std::str::FromStr;

use sha2::{Digest, Sha256};

use crate::Error;

/// Version of the page format (layout of bytes within a slot and object). Part of every
/// fingerprint: bump it when the bytes of a page would mean something else.
pub const LAYOUT_FORMAT_VERSION: u32 = 1;

/// Host slots are padded to a multiple of this, so O_DIRECT and host registration work.
pub const SLOT_ALIGN: usize = 4096;

/// Largest page accepted (bytes of one page across all layers).
pub const MAX_PAGE_BYTES: u64 = 1 << 30;

/// Element type of the KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE 754 binary32.
    F32,
    /// IEEE 754 binary16.
    F16,
    /// bfloat16.
    Bf16,
    /// 8-bit float, 4 exponent bits, 3 mantissa bits.
    Fp8E4M3,
    /// 8-bit float, 5 exponent bits, 2 mantissa bits.
    Fp8E5M2,
    /// Plain bytes (a [`KvKind::State`] pool whose parts have mixed element types).
    U8,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::Bf16 => 2,
            DType::Fp8E4M3 | DType::Fp8E5M2 | DType::U8 => 1,
        }
    }

    /// The canonical name, as in config files.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "fp32",
            DType::F16 => "fp16",
            DType::Bf16 => "bf16",
            DType::Fp8E4M3 => "fp8_e4m3",
            DType::Fp8E5M2 => "fp8_e5m2",
            DType::U8 => "uint8",
        }
    }

    /// Every dtype, for help texts and tests.
    pub const ALL: [DType; 6] = [
        DType::F32,
        DType::F16,
        DType::Bf16,
        DType::Fp8E4M3,
        DType::Fp8E5M2,
        DType::U8,
    ];

    fn code(self) -> u8 {
        match self {
            DType::F32 => 1,
            DType::F16 => 2,
            DType::Bf16 => 3,
            DType::Fp8E4M3 => 4,
            DType::Fp8E5M2 => 5,
            DType::U8 => 6,
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        let lower = s.to_ascii_lowercase();
        let found = match lower.as_str() {
            "fp32" | "f32" | "float32" => Some(DType::F32),
            "fp16" | "f16" | "float16" | "half" => Some(DType::F16),
            "bf16" | "bfloat16" => Some(DType::Bf16),
            "fp8_e4m3" | "fp8" | "float8_e4m3fn" | "e4m3" => Some(DType::Fp8E4M3),
            "fp8_e5m2" | "float8_e5m2" | "e5m2" => Some(DType::Fp8E5M2),
            "uint8" | "u8" | "bytes" => Some(DType::U8),
            _ => None,
        };
        found.ok_or_else(|| Error::InvalidField {
            field: "dtype",
            reason: format!(
                "unknown dtype {s:?}; expected one of {}",
                DType::ALL.map(DType::name).join(", ")
            ),
        })
    }
}

/// The attention KV kind and its per-token shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvKind {
    /// Multi-head (and grouped-query) attention: separate K and V of `kv_heads × head_dim`.
    Mha {
        /// KV heads held by this rank.
        kv_heads: u32,
        /// Elements per head.
        head_dim: u32,
    },
    /// Multi-head latent attention: one `kv_lora_rank + rope_dim` vector per token, identical on
    /// every tensor-parallel rank.
    Mla {
        /// Width of the compressed latent.
        kv_lora_rank: u32,
        /// Width of the decoupled rotary part.
        rope_dim: u32,
    },
    /// A pool that is not attention KV (a recurrent model's state, an indexer cache): `elems`
    /// elements per token per layer, one run per layer. kvtier stores its pages as bytes;
    /// it is sharded per tensor-parallel rank like MHA.
    State {
        /// Elements of the dtype per token per layer.
        elems: u32,
    },
}

/// Which half of a token's KV a run holds. MLA has only [`KvPart::K`] (the latent).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum KvPart {
    /// Keys (or the MLA latent).
    K = 0,
    /// Values (MHA only).
    V = 1,
}

/// A layout as a client describes it: unvalidated. [`Layout::new`] checks it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct LayoutSpec {
    /// Model identity, e.g. `meta-llama/Llama-3.1-8B-Instruct`.
    pub model_id: String,
    /// Weight version or revision; empty when there is only one.
    pub model_version: String,
    /// Element type.
    pub dtype: DType,
    /// Attention layers holding KV.
    pub num_layers: u32,
    /// MHA or MLA and the per-token shape.
    pub kind: KvKind,
    /// Tokens per page.
    pub page_size: u32,
    /// Tensor-parallel rank of this worker.
    pub tp_rank: u32,
    /// Tensor-parallel world size.
    pub tp_size: u32,
}

/// A validated layout with its derived geometry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    spec: LayoutSpec,
    token_bytes: usize,
    run_bytes: usize,
    runs_per_page: usize,
    page_bytes: usize,
    slot_stride: usize,
    fingerprint: LayoutFingerprint,
}

const MAX_MODEL_ID_BYTES: usize = 512;

fn invalid(field: &'static str, reason: impl Into<String>) -> Error {
    Error::InvalidField {
        field,
        reason: reason.into(),
    }
}

fn positive(field: &'static str, v: u32) -> Result<u64, Error> {
    if v == 0 {
        return Err(invalid(field, "must be at least 1"));
    }
    Ok(u64::from(v))
}

impl Layout {
    /// Validates `spec` and derives the geometry. Errors name the offending field.
    pub fn new(spec: LayoutSpec) -> Result<Self, Error> {
        if spec.model_id.is_empty() {
            return Err(invalid("model_id", "must not be empty"));
        }
        if spec.model_id.len() > MAX_MODEL_ID_BYTES {
            return Err(invalid(
                "model_id",
                format!("longer than {MAX_MODEL_ID_BYTES} bytes"),
            ));
        }
        if spec.model_version.len() > MAX_MODEL_ID_BYTES {
            return Err(invalid(
                "model_version",
                format!("longer than {MAX_MODEL_ID_BYTES} bytes"),
            ));
        }
        let layers = positive("num_layers", spec.num_layers)?;
        let page = positive("page_size", spec.page_size)?;
        let tp_size = positive("tp_size", spec.tp_size)?;
        if u64::from(spec.tp_rank) >= tp_size {
            return Err(invalid(
                "tp_rank",
                format!("{} is not below tp_size {}", spec.tp_rank, spec.tp_size),
            ));
        }
        let (elems, parts) = match spec.kind {
            KvKind::Mha { kv_heads, head_dim } => {
                let h = positive("kv_heads", kv_heads)?;
                let d = positive("head_dim", head_dim)?;
                (h * d, 2u64)
            }
            KvKind::Mla {
                kv_lora_rank,
                rope_dim,
            } => {
                let r = positive("kv_lora_rank", kv_lora_rank)?;
                (r + u64::from(rope_dim), 1u64)
            }
            KvKind::State { elems } => (positive("elems", elems)?, 1u64),
        };
        // Factors are below 2^32, so heads × dim fits in u64; every further product is checked.
        let overflow = || {
            invalid(
                "page_size",
                format!(
                    "a page of {} tokens × {} layers of this shape exceeds {} bytes",
                    spec.page_size, spec.num_layers, MAX_PAGE_BYTES
                ),
            )
        };
        let token_bytes = elems
            .checked_mul(spec.dtype.size() as u64)
            .ok_or_else(overflow)?;
        let run_bytes = token_bytes.checked_mul(page).ok_or_else(overflow)?;
        let runs = parts * layers;
        let page_bytes = run_bytes.checked_mul(runs).ok_or_else(overflow)?;
        if page_bytes > MAX_PAGE_BYTES {
            return Err(overflow());
        }
        let page_bytes = page_bytes as usize;
        let slot_stride = page_bytes.div_ceil(SLOT_ALIGN) * SLOT_ALIGN;
        let fingerprint = LayoutFingerprint::of(&spec);
        Ok(Self {
            token_bytes: token_bytes as usize,
            run_bytes: run_bytes as usize,
            runs_per_page: runs as usize,
            page_bytes,
            slot_stride,
            fingerprint,
            spec,
        })
    }

    /// The spec this layout was validated from.
    pub fn spec(&self) -> &LayoutSpec {
        &self.spec
    }

    /// Tokens per page.
    pub fn page_size(&self) -> usize {
        self.spec.page_size as usize
    }

    /// Layers.
    pub fn num_layers(&self) -> usize {
        self.spec.num_layers as usize
    }

    /// Parts per layer: 2 (K, V) for MHA, 1 for MLA.
    pub fn parts(&self) -> usize {
        match self.spec.kind {
            KvKind::Mha { .. } => 2,
            KvKind::Mla { .. } | KvKind::State { .. } => 1,
        }
    }

    /// Bytes of one token of one (layer, part).
    pub fn token_bytes(&self) -> usize {
        self.token_bytes
    }

    /// Bytes of one contiguous run: one page of one (layer, part).
    pub fn run_bytes(&self) -> usize {
        self.run_bytes
    }

    /// Runs in a page: `2 × layers` (MHA) or `layers` (MLA).
    pub fn runs_per_page(&self) -> usize {
        self.runs_per_page
    }

    /// Payload bytes of one page.
    pub fn page_bytes(&self) -> usize {
        self.page_bytes
    }

    /// Distance between host slots: page bytes rounded up to [`SLOT_ALIGN`].
    pub fn slot_stride(&self) -> usize {
        self.slot_stride
    }

    /// The layout fingerprint.
    pub fn fingerprint(&self) -> LayoutFingerprint {
        self.fingerprint
    }

    /// The index of run `(layer, part)` in page-first order (`part`-major, then layer).
    pub fn run_index(&self, layer: usize, part: KvPart) -> usize {
        part as usize * self.num_layers() + layer
    }

    /// Byte offset of run `(layer, part)` inside a host slot (page-first layout).
    pub fn host_run_offset(&self, layer: usize, part: KvPart) -> usize {
        self.run_index(layer, part) * self.run_bytes
    }

    /// Every `(layer, part)` of a page in page-first order.
    pub fn runs(&self) -> impl Iterator<Item = (usize, KvPart)> + '_ {
        let parts: &[KvPart] = if self.parts() == 2 {
            &[KvPart::K, KvPart::V]
        } else {
            &[KvPart::K]
        };
        parts
            .iter()
            .flat_map(move |&p| (0..self.num_layers()).map(move |l| (l, p)))
    }
}

/// Where one run of a device page lives in the engine's layer-first pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceRun {
    /// Which buffer: `part × layers + layer` (the engine's K buffers, then its V buffers).
    pub buffer: usize,
    /// Byte offset inside that buffer.
    pub offset: usize,
    /// Length in bytes ([`Layout::run_bytes`]).
    pub len: usize,
}

/// The engine's device KV pool: a layout plus how many token slots each buffer holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DevicePool {
    layout: Layout,
    num_pages: usize,
    buffer_bytes: usize,
}

impl DevicePool {
    /// Validates a pool of `num_token_slots` token slots per buffer.
    pub fn new(layout: Layout, num_token_slots: u64) -> Result<Self, Error> {
        if num_token_slots == 0 {
            return Err(invalid("num_token_slots", "must be at least one page"));
        }
        let page = layout.page_size() as u64;
        if !num_token_slots.is_multiple_of(page) {
            return Err(invalid(
                "num_token_slots",
                format!("{num_token_slots} is not a multiple of page_size {page}"),
            ));
        }
        let buffer_bytes = num_token_slots
            .checked_mul(layout.token_bytes() as u64)
            .and_then(|b| usize::try_from(b).ok())
            .ok_or_else(|| invalid("num_token_slots", "buffer size overflows"))?;
        let num_pages = usize::try_from(num_token_slots / page)
            .map_err(|_| invalid("num_token_slots", "too many pages for this platform"))?;
        Ok(Self {
            layout,
            num_pages,
            buffer_bytes,
        })
    }

    /// The page layout.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Pages the pool holds.
    pub fn num_pages(&self) -> usize {
        self.num_pages
    }

    /// Buffers: one per (layer, part).
    pub fn num_buffers(&self) -> usize {
        self.layout.runs_per_page()
    }

    /// Bytes of each buffer.
    pub fn buffer_bytes(&self) -> usize {
        self.buffer_bytes
    }

    /// Bytes of all buffers laid end to end (the size of a cpu-device pool file).
    pub fn total_bytes(&self) -> usize {
        self.buffer_bytes * self.num_buffers()
    }

    /// Where run `(layer, part)` of device page `page` lives.
    pub fn run(&self, page: usize, layer: usize, part: KvPart) -> Result<DeviceRun, Error> {
        if page >= self.num_pages {
            return Err(invalid(
                "page",
                format!("{page} is outside the pool of {} pages", self.num_pages),
            ));
        }
        if layer >= self.layout.num_layers() || (part as usize) >= self.layout.parts() {
            return Err(invalid(
                "layer",
                format!("({layer}, {part:?}) is not a run of this layout"),
            ));
        }
        let len = self.layout.run_bytes();
        Ok(DeviceRun {
            buffer: self.layout.run_index(layer, part),
            offset: page * len,
            len,
        })
    }
}

/// A stable 128-bit identity of a layout, prefixed to every stored object's key and written
/// into every object's header.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LayoutFingerprint(pub [u8; 16]);

/// Domain-separation tag of the fingerprint preimage.
pub const FINGERPRINT_TAG: &[u8] = b"kvtier/layout/v1";

impl LayoutFingerprint {
    /// Computes the fingerprint. TP rank and size are left out for MLA, whose KV is the same on
    /// every rank, so all ranks share one copy.
    pub fn of(spec: &LayoutSpec) -> Self {
        let mut pre = Vec::with_capacity(128);
        let str_field = |pre: &mut Vec<u8>, s: &str| {
            pre.extend_from_slice(&(s.len() as u32).to_le_bytes());
            pre.extend_from_slice(s.as_bytes());
        };
        pre.extend_from_slice(FINGERPRINT_TAG);
        pre.extend_from_slice(&LAYOUT_FORMAT_VERSION.to_le_bytes());
        str_field(&mut pre, &spec.model_id);
        str_field(&mut pre, &spec.model_version);
        pre.push(spec.dtype.code());
        pre.extend_from_slice(&spec.num_layers.to_le_bytes());
        let (kind, a, b, tp_rank, tp_size) = match spec.kind {
            KvKind::Mha { kv_heads, head_dim } => {
                (1u8, kv_heads, head_dim, spec.tp_rank, spec.tp_size)
            }
            KvKind::Mla {
                kv_lora_rank,
                rope_dim,
            } => (2u8, kv_lora_rank, rope_dim, 0, 1),
            KvKind::State { elems } => (3u8, elems, 0, spec.tp_rank, spec.tp_size),
        };
        pre.push(kind);
        pre.extend_from_slice(&a.to_le_bytes());
        pre.extend_from_slice(&b.to_le_bytes());
        pre.extend_from_slice(&spec.page_size.to_le_bytes());
        pre.push(1); // host layout: page-first
        pre.extend_from_slice(&tp_rank.to_le_bytes());
        pre.extend_from_slice(&tp_size.to_le_bytes());
        let digest: [u8; 32] = Sha256::digest(&pre).into();
        let mut out = [0u8; 16];
        out.copy_from_slice(&digest[..16]);
        Self(out)
    }

    /// Lower-case hex, 32 characters.
    pub fn to_hex(&self) -> String {
        crate::keys::hex(&self.0)
    }

    /// Parses [`Self::to_hex`]'s form; an error names `field`.
    pub fn from_hex(field: &'static str, hex: &str) -> Result<Self, Error> {
        let bad = |why: &str| Error::InvalidField {
            field,
            reason: format!("{hex:?}: {why}"),
        };
        if hex.len() != 32 || !hex.is_ascii() {
            return Err(bad("not 32 hex digits"));
        }
        let mut out = [0u8; 16];
        for (i, b) in out.iter_mut().enumerate() {
            *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16)
                .map_err(|_| bad("not 32 hex digits"))?;
        }
        Ok(Self(out))
    }
}

impl fmt::Display for LayoutFingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Debug for LayoutFingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LayoutFingerprint({})", self.to_hex())
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_fingerprint_reads_back_from_its_hex_and_bad_hex_names_the_field() {
        let fp = LayoutFingerprint([0xa5; 16]);
        assert_eq!(
            LayoutFingerprint::from_hex("layout", &fp.to_hex()).unwrap(),
            fp
        );
        for bad in ["", "zz", &"g".repeat(32), &"a".repeat(33)] {
            let e = LayoutFingerprint::from_hex("layout", bad).unwrap_err();
            assert!(e.to_string().contains("layout"), "{e}");
        }
    }

    use super::*;

    pub(crate) fn llama() -> LayoutSpec {
        LayoutSpec {
            model_id: "meta-llama/Llama-3.1-8B-Instruct".into(),
            model_version: String::new(),
            dtype: DType::Bf16,
            num_layers: 32,
            kind: KvKind::Mha {
                kv_heads: 8,
                head_dim: 128,
            },
            page_size: 64,
            tp_rank: 0,
            tp_size: 1,
        }
    }

    fn deepseek(rank: u32) -> LayoutSpec {
        LayoutSpec {
            model_id: "deepseek-ai/DeepSeek-V3".into(),
            model_version: "0324".into(),
            dtype: DType::Fp8E4M3,
            num_layers: 61,
            kind: KvKind::Mla {
                kv_lora_rank: 512,
                rope_dim: 64,
            },
            page_size: 64,
            tp_rank: rank,
            tp_size: 8,
        }
    }

    type Mutation = Box<dyn Fn(&mut LayoutSpec)>;

    #[test]
    fn mha_geometry() {
        let l = Layout::new(llama()).unwrap();
        assert_eq!(l.token_bytes(), 8 * 128 * 2);
        assert_eq!(l.run_bytes(), 64 * 2048);
        assert_eq!(l.runs_per_page(), 64);
        assert_eq!(l.page_bytes(), 64 * 64 * 2048);
        assert_eq!(l.slot_stride(), l.page_bytes()); // already aligned
        assert_eq!(l.host_run_offset(0, KvPart::K), 0);
        assert_eq!(l.host_run_offset(31, KvPart::K), 31 * l.run_bytes());
        assert_eq!(l.host_run_offset(0, KvPart::V), 32 * l.run_bytes());
        let runs: Vec<_> = l.runs().collect();
        assert_eq!(runs.len(), 64);
        assert_eq!(runs[32], (0, KvPart::V));
        // Runs tile the page exactly, in order, without gaps.
        for (i, (layer, part)) in runs.iter().enumerate() {
            assert_eq!(l.host_run_offset(*layer, *part), i * l.run_bytes());
        }
    }

    #[test]
    fn mla_geometry_and_stride_alignment() {
        let l = Layout::new(deepseek(3)).unwrap();
        assert_eq!(l.parts(), 1);
        assert_eq!(l.token_bytes(), 576);
        assert_eq!(l.page_bytes(), 576 * 64 * 61);
        assert_eq!(l.slot_stride() % SLOT_ALIGN, 0);
        assert!(l.slot_stride() >= l.page_bytes() && l.slot_stride() - l.page_bytes() < SLOT_ALIGN);
        assert_eq!(l.runs().count(), 61);
    }

    #[test]
    fn device_runs() {
        let l = Layout::new(llama()).unwrap();
        let pool = DevicePool::new(l.clone(), 64 * 100).unwrap();
        assert_eq!(pool.num_pages(), 100);
        assert_eq!(pool.num_buffers(), 64);
        assert_eq!(pool.buffer_bytes(), 6400 * 2048);
        let r = pool.run(7, 3, KvPart::V).unwrap();
        assert_eq!(r.buffer, 32 + 3);
        assert_eq!(r.offset, 7 * l.run_bytes());
        assert_eq!(r.len, l.run_bytes());
        assert!(pool.run(100, 0, KvPart::K).is_err());
        assert!(pool.run(0, 32, KvPart::K).is_err());
        let mla = DevicePool::new(Layout::new(deepseek(0)).unwrap(), 64).unwrap();
        assert!(mla.run(0, 0, KvPart::V).is_err());
    }

    #[test]
    fn contradictions_name_the_field() {
        let cases: Vec<(&str, Mutation)> = vec![
            ("model_id", Box::new(|s| s.model_id.clear())),
            ("num_layers", Box::new(|s| s.num_layers = 0)),
            ("page_size", Box::new(|s| s.page_size = 0)),
            ("tp_size", Box::new(|s| s.tp_size = 0)),
            ("tp_rank", Box::new(|s| s.tp_rank = 1)),
            (
                "kv_heads",
                Box::new(|s| {
                    s.kind = KvKind::Mha {
                        kv_heads: 0,
                        head_dim: 128,
                    }
                }),
            ),
            (
                "head_dim",
                Box::new(|s| {
                    s.kind = KvKind::Mha {
                        kv_heads: 8,
                        head_dim: 0,
                    }
                }),
            ),
            (
                "page_size",
                Box::new(|s| {
                    s.kind = KvKind::Mha {
                        kv_heads: u32::MAX,
                        head_dim: u32::MAX,
                    };
                    s.page_size = u32::MAX;
                    s.num_layers = u32::MAX;
                }),
            ),
        ];
        for (field, mutate) in cases {
            let mut spec = llama();
            mutate(&mut spec);
            match Layout::new(spec) {
                Err(Error::InvalidField { field: f, .. }) => assert_eq!(f, field),
                other => panic!("expected an error on {field}, got {other:?}"),
            }
        }
        let l = Layout::new(llama()).unwrap();
        let err = DevicePool::new(l, 100).unwrap_err().to_string();
        assert!(err.contains("num_token_slots"), "{err}");
    }

    #[test]
    fn fingerprint_is_stable_and_discriminating() {
        let base = LayoutFingerprint::of(&llama());
        // Pinned: changing this value orphans every stored page. Bump LAYOUT_FORMAT_VERSION
        // deliberately instead.
        assert_eq!(base.to_hex(), PINNED_LLAMA_FINGERPRINT);
        let mutations: Vec<Mutation> = vec![
            Box::new(|s| s.model_id.push('x')),
            Box::new(|s| s.model_version = "v2".into()),
            Box::new(|s| s.dtype = DType::F16),
            Box::new(|s| s.num_layers += 1),
            Box::new(|s| {
                s.kind = KvKind::Mha {
                    kv_heads: 4,
                    head_dim: 256,
                }
            }),
            Box::new(|s| s.page_size = 32),
            Box::new(|s| {
                s.tp_size = 2;
                s.tp_rank = 1
            }),
            Box::new(|s| s.tp_size = 2),
        ];
        let mut seen = std::collections::HashSet::from([base]);
        for m in mutations {
            let mut s = llama();
            m(&mut s);
            assert!(seen.insert(LayoutFingerprint::of(&s)), "{s:?} collided");
        }
        // MLA KV is identical on every rank: one fingerprint for all of them.
        assert_eq!(
            LayoutFingerprint::of(&deepseek(0)),
            LayoutFingerprint::of(&deepseek(5))
        );
    }

    #[test]
    fn state_pools_are_bytes_sharded_per_rank() {
        let state = |rank: u32| LayoutSpec {
            model_id: "Qwen/Qwen3-Next-80B-A3B".into(),
            model_version: "sglang/mamba".into(),
            dtype: DType::U8,
            num_layers: 1,
            kind: KvKind::State { elems: 3360 },
            page_size: 1,
            tp_rank: rank,
            tp_size: 2,
        };
        let l = Layout::new(state(1)).unwrap();
        assert_eq!(l.parts(), 1);
        assert_eq!(l.page_bytes(), 3360);
        assert_eq!(l.runs().count(), 1);
        assert_eq!(l.slot_stride(), SLOT_ALIGN);
        // A state pool's shards differ per rank, unlike MLA.
        assert_ne!(
            LayoutFingerprint::of(&state(0)),
            LayoutFingerprint::of(&state(1))
        );
        // The same bytes described as MLA are another layout.
        let mut as_mla = state(0);
        as_mla.kind = KvKind::Mla {
            kv_lora_rank: 3360,
            rope_dim: 0,
        };
        assert_ne!(
            LayoutFingerprint::of(&as_mla),
            LayoutFingerprint::of(&state(0))
        );
        let mut empty = state(0);
        empty.kind = KvKind::State { elems: 0 };
        match Layout::new(empty) {
            Err(Error::InvalidField { field, .. }) => assert_eq!(field, "elems"),
            other => panic!("expected an error on elems, got {other:?}"),
        }
    }

    const PINNED_LLAMA_FINGERPRINT: &str = "cf80ad93d28d184f574559fe096bb489";

    #[test]
    fn dtype_names_round_trip() {
        for d in DType::ALL {
            assert_eq!(d.name().parse::<DType>().unwrap(), d);
        }
        assert_eq!("BFloat16".parse::<DType>().unwrap(), DType::Bf16);
        let err = "int4".parse::<DType>().unwrap_err().to_string();
        assert!(err.contains("dtype") && err.contains("bf16"), "{err}");
    }
}
