//! kvtier-core: the pure, synchronous heart of kvtier. No I/O, no async, no unsafe.
//!
//! - [`keys`]: page keys, the SHA-256 chain that content-addresses token prefixes (SGLang's
//!   chain in the default namespace, seeded per namespace otherwise); [`key_map`]: hash maps
//!   keyed by them, with a seeded hasher that does not re-hash a digest through SipHash.
//! - [`layout`]: page geometry on the device (layer-first) and host (page-first), and the
//!   layout fingerprint that keeps pages of different models and shapes apart.
//! - [`policy`]: the seven eviction policies, each a small type behind [`policy::EvictionPolicy`],
//!   shared by the agent's radix tree and the daemon's L2 index.
//! - [`radix`]: the agent's prefix cache, a page-granular radix tree with locks, tier state and
//!   incremental eviction.
//! - [`host_index`]: the daemon's L2 index (key → slot, two-phase writes, pins, leaf-first
//!   eviction) and [`slots`], the free-slot allocator under it.
//! - [`write_policy`]: when a tier copies pages to the tier below (`write_through`,
//!   `write_through_selective`, `write_back`), one type for the agent and the daemon.
//!
//! - [`copy_method`]: how a GPU device moves a batch of runs (`device.copy_method`), and
//!   which method it uses once each has passed or failed its start-up self-check.
//! - [`checksum`]: CRC32C, the checksum of stored pages and records, in one place.
//! - [`events`]: the events that publish what a kvtierd's L2 holds (stored, removed,
//!   cleared, resync), and which tenant sees which.
//! - [`ids`]: session ids (random, stamped with the issuing kvtierd run) and their wire form.
//!
//! Everything that decides *which* page goes *where* lives here, so it can be tested
//! exhaustively without processes, sockets or devices; the crates that move bytes never decide
//! policy.

pub mod admission;
pub mod checksum;
pub mod copy_method;
pub mod events;
pub mod hit_ceiling;
pub mod host_index;
pub mod ids;
pub mod key_map;
pub mod keys;
pub mod layout;
pub mod policy;
pub mod radix;
pub mod read_window;
pub mod slots;
pub mod tenant;
pub mod write_policy;

pub use admission::{Admission, AdmissionKind};
pub use copy_method::CopyMethod;
pub use ids::{Epoch, SessionId};
pub use key_map::{KeyMap, KeySet, KeyTable};
pub use keys::{Namespace, PageHasher, PageKey, TokenIds};
pub use layout::{DType, DevicePool, KvKind, KvPart, Layout, LayoutFingerprint, LayoutSpec};
pub use policy::{EvictionPolicy, PolicyKind};
pub use radix::RadixTree;
pub use read_window::ReadWindow;
pub use tenant::{TenantScope, TenantTag};
pub use write_policy::WritePolicy;

/// Errors of the core crate: every one names the input that was wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// A field of a descriptor or request is out of bounds or contradicts another.
    #[error("invalid {field}: {reason}")]
    InvalidField {
        /// The offending field, as named in config files and on the wire.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// A handle no longer names a live tree node (released twice, or never issued).
    #[error("stale handle: {0}")]
    StaleHandle(String),
}

impl Error {
    /// Whether retrying the same call could succeed. Core errors are about the input, so never.
    pub fn is_retryable(&self) -> bool {
        false
    }
}
