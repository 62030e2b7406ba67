//! Page keys: the content address of a token prefix.
//!
//! `key_i = SHA-256(key_{i-1} as 32 raw bytes ‖ tokens of page i as u32 little-endian)`.
//! In the default namespace the first page has no parent, which makes the chain byte-identical
//! to SGLang's `get_hash_str`. Any other namespace seeds the chain with a digest of the
//! namespace (see [`Namespace::seed`]); the full specification with test vectors is
//! `docs/hash-spec.md`, and `tests/hash_spec.rs` checks that document against this code.

use std::fmt;
use std::str::FromStr;

use sha2::{Digest, Sha256};

use crate::Error;

/// Length of a page key in bytes.
pub const KEY_LEN: usize = 32;

/// The content address of one full page of tokens and everything before it.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PageKey(pub [u8; KEY_LEN]);

impl PageKey {
    /// The raw digest bytes.
    pub fn as_bytes(&self) -> &[u8; KEY_LEN] {
        &self.0
    }

    /// Builds a key from a byte slice, which must be exactly [`KEY_LEN`] bytes.
    pub fn from_slice(field: &'static str, bytes: &[u8]) -> Result<Self, Error> {
        let arr: [u8; KEY_LEN] = bytes.try_into().map_err(|_| Error::InvalidField {
            field,
            reason: format!("a page key is {KEY_LEN} bytes, got {}", bytes.len()),
        })?;
        Ok(Self(arr))
    }

    /// Lower-case hex, 64 characters.
    pub fn to_hex(&self) -> String {
        hex(&self.0)
    }
}

/// `bytes` in lower-case hex, in one allocation.
pub(crate) fn hex(bytes: &[u8]) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for &b in bytes {
        s.push(HEX[(b >> 4) as usize] as char);
        s.push(HEX[(b & 0xf) as usize] as char);
    }
    s
}

impl fmt::Display for PageKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Debug for PageKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Eight hex digits identify a key in logs without flooding them.
        write!(f, "PageKey({}…)", &self.to_hex()[..8])
    }
}

impl FromStr for PageKey {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        let bad = |reason: String| Error::InvalidField {
            field: "page_key",
            reason,
        };
        if s.len() != KEY_LEN * 2 {
            return Err(bad(format!(
                "expected {} hex digits, got {}",
                KEY_LEN * 2,
                s.len()
            )));
        }
        let mut out = [0u8; KEY_LEN];
        for (i, pair) in s.as_bytes().chunks_exact(2).enumerate() {
            let hi = hex_val(pair[0]);
            let lo = hex_val(pair[1]);
            match (hi, lo) {
                (Some(h), Some(l)) => out[i] = (h << 4) | l,
                _ => return Err(bad(format!("non-hex digit near offset {}", i * 2))),
            }
        }
        Ok(Self(out))
    }
}

fn hex_val(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

/// Who a prefix belongs to. Two namespaces never share a page key.
///
/// The default (all fields empty) is the namespace in which keys equal SGLang's. Fields are
/// free-form UTF-8; an empty field is the same as an absent one.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Namespace {
    /// Tenant or user isolation domain.
    pub tenant: String,
    /// A per-request cache salt (vLLM's `cache_salt`).
    pub cache_salt: String,
    /// The LoRA adapter id whose weights produced the KV.
    pub lora_id: String,
    /// Any other discriminator (SGLang's `extra_key`).
    pub extra_key: String,
}

/// Domain-separation tag that opens every namespace seed preimage.
pub const NAMESPACE_TAG: &[u8] = b"kvtier/namespace/v1";

impl Namespace {
    /// True when every field is empty: keys are SGLang-compatible and unseeded.
    pub fn is_default(&self) -> bool {
        self.tenant.is_empty()
            && self.cache_salt.is_empty()
            && self.lora_id.is_empty()
            && self.extra_key.is_empty()
    }

    /// The bytes hashed to make the seed: the tag, each field as a u32 little-endian length
    /// followed by its bytes, then zero padding to a length of 2 mod 4.
    ///
    /// Every page-key preimage is a multiple of 4 bytes long (32 + 4·P or 4·P), so no seed
    /// preimage is ever a page-key preimage: a crafted prompt cannot make its page key equal to
    /// a namespace seed and so reach into another namespace's chain.
    pub fn seed_preimage(&self) -> Vec<u8> {
        let fields = [
            self.tenant.as_bytes(),
            self.cache_salt.as_bytes(),
            self.lora_id.as_bytes(),
            self.extra_key.as_bytes(),
        ];
        let mut pre = Vec::with_capacity(NAMESPACE_TAG.len() + 32);
        pre.extend_from_slice(NAMESPACE_TAG);
        for f in fields {
            // Fields longer than 4 GiB cannot arrive here (config and wire limits are far
            // smaller); saturate rather than wrap so the encoding stays injective in practice.
            let len = u32::try_from(f.len()).unwrap_or(u32::MAX);
            pre.extend_from_slice(&len.to_le_bytes());
            pre.extend_from_slice(f);
        }
        while pre.len() % 4 != 2 {
            pre.push(0);
        }
        pre
    }

    /// The chain seed: `None` for the default namespace, else SHA-256 of [`Self::seed_preimage`].
    pub fn seed(&self) -> Option<PageKey> {
        if self.is_default() {
            return None;
        }
        Some(PageKey(Sha256::digest(self.seed_preimage()).into()))
    }
}

/// Hashes token pages into page keys for one page size and namespace.
///
/// Cheap to clone; the namespace seed is computed once at construction.
#[derive(Clone, Debug)]
pub struct PageHasher {
    page_size: usize,
    seed: Option<PageKey>,
}

/// Tokens are converted to little-endian bytes through a stack buffer this many tokens long.
const CHUNK_TOKENS: usize = 256;

impl PageHasher {
    /// A hasher for `page_size` tokens per page in namespace `ns`.
    pub fn new(page_size: usize, ns: &Namespace) -> Result<Self, Error> {
        if page_size == 0 {
            return Err(Error::InvalidField {
                field: "page_size",
                reason: "must be at least 1".into(),
            });
        }
        Ok(Self {
            page_size,
            seed: ns.seed(),
        })
    }

    /// Tokens per page.
    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// The namespace seed (`None` in the default namespace).
    pub fn seed(&self) -> Option<&PageKey> {
        self.seed.as_ref()
    }

    /// Number of full pages in `n_tokens` tokens (a partial trailing page has no key).
    pub fn full_pages(&self, n_tokens: usize) -> usize {
        n_tokens / self.page_size
    }

    /// Keys of every full page of `tokens`, from the start of the sequence.
    pub fn keys(&self, tokens: &[u32]) -> Vec<PageKey> {
        let mut out = Vec::with_capacity(self.full_pages(tokens.len()));
        self.extend(None, tokens, &mut out);
        out
    }

    /// Appends to `out` the keys of the full pages of `tokens`, continuing the chain after
    /// `parent` (the key of the page just before `tokens[0]`; `None` when `tokens` starts the
    /// sequence).
    pub fn extend(&self, parent: Option<&PageKey>, tokens: &[u32], out: &mut Vec<PageKey>) {
        self.extend_ids(parent, TokenIds::U32(tokens), out);
    }

    /// [`PageHasher::extend`] for token ids in either form: packed little-endian bytes are
    /// hashed as they arrived, with no conversion to u32s and back.
    pub fn extend_ids(
        &self,
        parent: Option<&PageKey>,
        tokens: TokenIds<'_>,
        out: &mut Vec<PageKey>,
    ) {
        let mut prev = parent.copied().or(self.seed);
        let pages = self.full_pages(tokens.len());
        out.reserve(pages);
        if self.page_size <= CHUNK_TOKENS {
            // Common case: the whole preimage (parent ‖ tokens) fits one stack buffer and is
            // hashed in one call, and each key is written where the next page's parent goes.
            let mut buf = [0u8; KEY_LEN + CHUNK_TOKENS * 4];
            let body = self.page_size * 4;
            for page in 0..pages {
                tokens.write_le(page * self.page_size, &mut buf[KEY_LEN..KEY_LEN + body]);
                let pre = match &prev {
                    Some(p) => {
                        buf[..KEY_LEN].copy_from_slice(&p.0);
                        &buf[..KEY_LEN + body]
                    }
                    None => &buf[KEY_LEN..KEY_LEN + body],
                };
                let key = PageKey(Sha256::digest(pre).into());
                out.push(key);
                prev = Some(key);
            }
            return;
        }
        let mut buf = [0u8; CHUNK_TOKENS * 4];
        for page in 0..pages {
            let mut h = Sha256::new();
            if let Some(p) = &prev {
                h.update(p.0);
            }
            let first = page * self.page_size;
            for at in (first..first + self.page_size).step_by(CHUNK_TOKENS) {
                let n = CHUNK_TOKENS.min(first + self.page_size - at);
                tokens.write_le(at, &mut buf[..n * 4]);
                h.update(&buf[..n * 4]);
            }
            let key = PageKey(h.finalize().into());
            out.push(key);
            prev = Some(key);
        }
    }
}

/// A prompt's token ids, as u32s or as the little-endian bytes (4 a token) clients send in
/// `packed_tokens`. Page keys hash the bytes, so packed ids need no conversion.
#[derive(Clone, Copy, Debug)]
pub enum TokenIds<'a> {
    /// One u32 per token.
    U32(&'a [u32]),
    /// 4 little-endian bytes per token; a length that is not a multiple of 4 ignores the
    /// trailing bytes (callers check it first, naming their field).
    Le(&'a [u8]),
}

impl TokenIds<'_> {
    /// Number of tokens.
    pub fn len(&self) -> usize {
        match self {
            Self::U32(t) => t.len(),
            Self::Le(b) => b.len() / 4,
        }
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Writes tokens `from..from + dst.len() / 4` as little-endian bytes into `dst`.
    fn write_le(&self, from: usize, dst: &mut [u8]) {
        match self {
            Self::U32(t) => {
                for (d, t) in dst.chunks_exact_mut(4).zip(&t[from..]) {
                    d.copy_from_slice(&t.to_le_bytes());
                }
            }
            Self::Le(b) => dst.copy_from_slice(&b[from * 4..from * 4 + dst.len()]),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(keys: &[PageKey]) -> Vec<String> {
        keys.iter().map(PageKey::to_hex).collect()
    }

    #[test]
    fn default_namespace_matches_sglang_vectors() {
        let h = PageHasher::new(4, &Namespace::default()).unwrap();
        let tokens: Vec<u32> = (1..=9).collect();
        assert_eq!(
            hex(&h.keys(&tokens)),
            [
                "cf97adeedb59e05bfd73a2b4c2a8885708c4f4f70c84c64b27120e72ab733b72",
                "4ebfa8a1f3c341517621838c6e1b9aa350307e3f00b3cbd1a07ef740f54396d6"
            ]
        );
        let h16 = PageHasher::new(16, &Namespace::default()).unwrap();
        let tokens: Vec<u32> = (100..=163).collect();
        let keys = h16.keys(&tokens);
        assert_eq!(keys.len(), 4);
        assert_eq!(
            keys[3].to_hex(),
            "39e67e352b1d922d1258c7a22a1daadd120e5e4a107940d26c79eccc32b40e6f"
        );
    }

    #[test]
    fn extend_continues_the_chain() {
        let h = PageHasher::new(3, &Namespace::default()).unwrap();
        let tokens: Vec<u32> = (0..30).collect();
        let all = h.keys(&tokens);
        let mut tail = Vec::new();
        h.extend(Some(&all[3]), &tokens[12..], &mut tail);
        assert_eq!(&all[4..], &tail[..]);
    }

    #[test]
    fn packed_ids_hash_as_their_u32s() {
        let tokens: Vec<u32> = (0..3000u32).map(|t| t.wrapping_mul(2654435761)).collect();
        let packed: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        let ns = Namespace {
            tenant: "t".into(),
            ..Namespace::default()
        };
        for page in [1, 16, CHUNK_TOKENS, CHUNK_TOKENS + 1, 1000] {
            for ns in [Namespace::default(), ns.clone()] {
                let h = PageHasher::new(page, &ns).unwrap();
                let all = h.keys(&tokens);
                assert_eq!(all.len(), tokens.len() / page);
                let mut got = Vec::new();
                h.extend_ids(None, TokenIds::Le(&packed), &mut got);
                assert_eq!(got, all, "page size {page}");
                // Continuing after a parent, with a ragged tail that has no key.
                let mut tail = Vec::new();
                let cut = (page * 4).min(packed.len());
                h.extend_ids(all.first(), TokenIds::Le(&packed[cut..]), &mut tail);
                assert_eq!(
                    tail,
                    all[1.min(all.len())..],
                    "page size {page}, after a parent"
                );
            }
        }
        assert_eq!(TokenIds::Le(&packed[..7]).len(), 1);
    }

    #[test]
    fn long_pages_cross_the_chunk_buffer() {
        // Pages longer than the conversion buffer must hash the same as one flat update.
        let page = CHUNK_TOKENS * 2 + 7;
        let tokens: Vec<u32> = (0..page as u32 * 2)
            .map(|t| t.wrapping_mul(2654435761))
            .collect();
        let h = PageHasher::new(page, &Namespace::default()).unwrap();
        let keys = h.keys(&tokens);
        let mut manual = Sha256::new();
        for t in &tokens[..page] {
            manual.update(t.to_le_bytes());
        }
        let k0: [u8; 32] = manual.finalize().into();
        assert_eq!(keys[0].0, k0);
        let mut manual = Sha256::new();
        manual.update(k0);
        for t in &tokens[page..] {
            manual.update(t.to_le_bytes());
        }
        assert_eq!(keys[1].0, <[u8; 32]>::from(manual.finalize()));
    }

    #[test]
    fn namespaces_separate_and_are_field_unambiguous() {
        let tokens: Vec<u32> = (1..=8).collect();
        let ns = |t: &str, s: &str, l: &str, e: &str| Namespace {
            tenant: t.into(),
            cache_salt: s.into(),
            lora_id: l.into(),
            extra_key: e.into(),
        };
        let variants = [
            ns("", "", "", ""),
            ns("a", "", "", ""),
            ns("", "a", "", ""),
            ns("", "", "a", ""),
            ns("", "", "", "a"),
            ns("ab", "", "", ""),
            ns("a", "b", "", ""),
            ns("", "ab", "", ""),
        ];
        let mut seen = std::collections::HashSet::new();
        for v in &variants {
            let keys = PageHasher::new(4, v).unwrap().keys(&tokens);
            assert!(seen.insert(keys[0]), "namespace {v:?} collided");
            assert_eq!(v.is_default(), v.seed().is_none());
            if !v.is_default() {
                assert_eq!(v.seed_preimage().len() % 4, 2);
            }
        }
    }

    #[test]
    fn hex_round_trip_and_errors() {
        let k = PageHasher::new(1, &Namespace::default())
            .unwrap()
            .keys(&[7])[0];
        assert_eq!(k.to_hex().parse::<PageKey>().unwrap(), k);
        assert_eq!(k.to_hex().to_uppercase().parse::<PageKey>().unwrap(), k);
        assert!("abc".parse::<PageKey>().is_err());
        let bad = format!("zz{}", &k.to_hex()[2..]);
        let err = bad.parse::<PageKey>().unwrap_err().to_string();
        assert!(err.contains("page_key"), "{err}");
        assert!(PageKey::from_slice("key", &[0u8; 31]).is_err());
        assert!(PageHasher::new(0, &Namespace::default()).is_err());
    }
}
