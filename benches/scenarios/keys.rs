//! Page-key hashing against raw SHA-256 over the same bytes, same run.
//!
//! Two baselines:
//! - `stream`: one SHA-256 over all the token bytes — the machine's hashing speed. The chain
//!   cannot reach it: each page also hashes its 32-byte parent and pays its own final block.
//! - `per-page`: the same per-page preimages hashed by sha2 directly (parent ‖ tokens, the
//!   tokens already as bytes) — the cost of the specification itself; the gap to it is the
//!   overhead of kvtier's code.
#![allow(clippy::unwrap_used)]

use kvtier_core::{Namespace, PageHasher};
use sha2::{Digest, Sha256};

use crate::{compare, tokens};

/// Tokens hashed per run.
pub const TOKENS: usize = 1 << 20;

/// One SHA-256 over all the bytes.
pub fn stream(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

/// The per-page chain hashed by sha2 directly.
pub fn per_page(bytes: &[u8], page_bytes: usize) -> [u8; 32] {
    let mut prev: Option<[u8; 32]> = None;
    for page in bytes.chunks_exact(page_bytes) {
        let mut h = Sha256::new();
        if let Some(p) = &prev {
            h.update(p);
        }
        h.update(page);
        prev = Some(h.finalize().into());
    }
    prev.unwrap_or_default()
}

/// Runs the scenario (1M tokens; `quick`: fewer rounds).
pub fn run(quick: bool) {
    let toks = tokens(TOKENS, 7);
    let bytes: Vec<u8> = toks.iter().flat_map(|t| t.to_le_bytes()).collect();
    crate::say!(
        "page keys over {TOKENS} tokens ({} MiB), ratio = kvtier / baseline speed",
        bytes.len() >> 20
    );
    for page in [16usize, 64, 256] {
        let h = PageHasher::new(page, &Namespace::default()).unwrap();
        let c = compare(
            &format!("keys P={page} vs sha2 stream"),
            bytes.len() as u64,
            if quick { 3 } else { 15 },
            || stream(&bytes),
            || h.keys(&toks),
        );
        crate::say!("{}", c.line("GiB/s", (1u64 << 30) as f64));
        let c = compare(
            &format!("keys P={page} vs sha2 per-page"),
            bytes.len() as u64,
            if quick { 3 } else { 15 },
            || per_page(&bytes, page * 4),
            || h.keys(&toks),
        );
        crate::say!("{}", c.line("GiB/s", (1u64 << 30) as f64));
    }
}
