//! `[l3]` of `kvtierd.toml`: the storage tier. Keys every backend shares (write policy,
//! writer, deadlines, retries, breaker, chaos drills) sit in `[l3]`; each backend's own keys
//! in its own section (`[l3.file]`, `[l3.rocksdb]`, `[l3.s3]`, `[l3.remote]`,
//! `[l3.memory]`), which checks itself. `l3.backend` names one of them; a word that names
//! none fails at parse, with the choices.
//!
//! Adding a backend: a variant of [`L3Backend`], a section type here (with its `validate`),
//! its block in the commented default file, and one arm in kvtierd's backend factory
//! (`crates/kvtier-daemon/src/l3/factory.rs`, an exhaustive match, so a missing arm does not
//! compile).

use std::time::Duration;

use kvtier_core::{AdmissionKind, WritePolicy};
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::{ByteSize, Capacity, ConfigError, Dur, Secret};

/// Which storage tier backs L2.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum L3Backend {
    /// One file per page (`[l3.file]`): the embedded default.
    #[default]
    File,
    /// Pages in a RocksDB database with blob files (`[l3.rocksdb]`).
    Rocksdb,
    /// An S3-compatible object store (`[l3.s3]`).
    S3,
    /// Another kvtierd's storage tier (`[l3.remote]`).
    Remote,
    /// A bounded in-process map, for trials (`[l3.memory]`).
    Memory,
    /// No storage tier.
    None,
}

impl L3Backend {
    /// Whether a storage tier is attached at all.
    pub fn stores(self) -> bool {
        self != Self::None
    }

    /// Whether it keeps an index of its objects by tenant, which `tenants.<name>.l3_bytes`
    /// quotas need.
    pub fn keeps_quotas(self) -> bool {
        matches!(self, Self::File | Self::Rocksdb)
    }

    /// The key of its directory on this host, for a backend that has one.
    pub fn directory_key(self) -> Option<&'static str> {
        match self {
            Self::File => Some("file.path"),
            Self::Rocksdb => Some("rocksdb.path"),
            Self::S3 | Self::Remote | Self::Memory | Self::None => None,
        }
    }

    /// The configured word.
    pub fn name(self) -> &'static str {
        match self {
            Self::File => "file",
            Self::Rocksdb => "rocksdb",
            Self::S3 => "s3",
            Self::Remote => "remote",
            Self::Memory => "memory",
            Self::None => "none",
        }
    }
}

impl std::fmt::Display for L3Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// `[l3]`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct L3Config {
    /// The backend.
    pub backend: L3Backend,
    /// When pages are written to L3 (the threshold is applied by
    /// [`L3Config::write_policy`]).
    pub write_policy: WritePolicy,
    /// Hits at which `write_through_selective` writes a page.
    pub write_threshold: u64,
    /// Which pages may go to L3 at all (the admission filter).
    pub admission: AdmissionKind,
    /// Sightings the admission filter remembers per window (about the pages L3 holds).
    pub admission_window: u64,
    /// Writer queue length in pages.
    pub queue_pages: u32,
    /// Pages per writer batch.
    pub batch_pages: u32,
    /// Concurrent backend writes.
    pub concurrency: u32,
    /// Per-call deadline.
    pub timeout: Dur,
    /// Retries of a failed backend call.
    pub retries: u32,
    /// First retry backoff.
    pub retry_backoff: Dur,
    /// Failure rate that opens the breaker.
    pub breaker_failure_rate: f64,
    /// Calls before the rate is judged.
    pub breaker_min_calls: u32,
    /// The rate's window.
    pub breaker_window: Dur,
    /// Breaker cooldown.
    pub breaker_cooldown: Dur,
    /// Chaos drill: delay before every L3 read (0: off).
    pub fault_get_delay: Dur,
    /// Chaos drill: delay before every L3 write (0: off).
    pub fault_set_delay: Dur,
    /// Chaos drill: probability that an L3 call fails (0: off).
    pub fault_error_rate: f64,
    /// `[l3.file]`.
    pub file: FileSection,
    /// `[l3.rocksdb]`.
    pub rocksdb: RocksdbSection,
    /// `[l3.s3]`.
    pub s3: S3Section,
    /// `[l3.remote]`.
    pub remote: RemoteSection,
    /// `[l3.memory]`.
    pub memory: MemorySection,
}

/// `[l3.file]`: one file per page.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct FileSection {
    /// Directory of the pages (unset: `<data_dir>/l3`).
    #[serde(
        deserialize_with = "crate::units::empty_is_none",
        skip_serializing_if = "Option::is_none"
    )]
    pub path: Option<PathBuf>,
    /// Most bytes kept: a size, a share of the space the store may use, or none.
    pub capacity_bytes: Capacity,
    /// Free-space guard.
    pub min_free_bytes: ByteSize,
    /// Pages older than this are misses (0: never).
    pub ttl: Dur,
    /// fsync each page before it becomes visible.
    pub sync: bool,
    /// How pages are read and written: through the page cache, or straight to the device.
    pub io: FileIo,
}

/// `l3.file.io`: how the file backend moves page bytes to and from its disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FileIo {
    /// Through the kernel's page cache: a page read again soon comes from memory, and the
    /// cache holds a second copy of what L2 already keeps.
    #[default]
    Buffered,
    /// `O_DIRECT`, through aligned buffers: every read goes to the device, nothing is cached
    /// twice, and the page cache stays with the engine. Refused at start on a filesystem that
    /// does not take `O_DIRECT` (some FUSE and network filesystems, tmpfs before
    /// Linux 6.6).
    Direct,
}

/// `[l3.rocksdb]`: pages in a RocksDB database.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RocksdbSection {
    /// Database directory (unset: `<data_dir>/rocksdb`).
    #[serde(
        deserialize_with = "crate::units::empty_is_none",
        skip_serializing_if = "Option::is_none"
    )]
    pub path: Option<PathBuf>,
    /// Most bytes kept (0: unbounded).
    pub capacity_bytes: ByteSize,
    /// Sync the write-ahead log on every write.
    pub sync: bool,
}

/// `[l3.s3]`: an S3-compatible object store.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct S3Section {
    /// Endpoint URL (unset: AWS).
    #[serde(
        deserialize_with = "crate::units::empty_is_none",
        skip_serializing_if = "Option::is_none"
    )]
    pub endpoint: Option<String>,
    /// Region (unset: us-east-1).
    #[serde(
        deserialize_with = "crate::units::empty_is_none",
        skip_serializing_if = "Option::is_none"
    )]
    pub region: Option<String>,
    /// The bucket.
    pub bucket: String,
    /// Key prefix inside the bucket.
    pub prefix: String,
    /// Access key id (unset: environment).
    #[serde(
        deserialize_with = "crate::units::empty_is_none",
        skip_serializing_if = "Option::is_none"
    )]
    pub access_key: Option<String>,
    /// Secret key (empty: environment). Never printed.
    pub secret_key: Secret,
    /// Virtual-hosted-style requests.
    pub virtual_hosted: bool,
}

/// `[l3.remote]`: another kvtierd's storage tier.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RemoteSection {
    /// `https://host:port` / `http://host:port` (its `server.tcp`) or a Unix socket path.
    pub address: String,
    /// PEM CA bundle the peer's certificate chains to (https only).
    #[serde(
        deserialize_with = "crate::units::empty_is_none",
        skip_serializing_if = "Option::is_none"
    )]
    pub tls_ca: Option<PathBuf>,
    /// PEM client certificate, for a peer that requires one.
    #[serde(
        deserialize_with = "crate::units::empty_is_none",
        skip_serializing_if = "Option::is_none"
    )]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of `tls_cert`.
    #[serde(
        deserialize_with = "crate::units::empty_is_none",
        skip_serializing_if = "Option::is_none"
    )]
    pub tls_key: Option<PathBuf>,
    /// The peer's `server.token`. Never printed.
    pub token: crate::Secret,
    /// File holding the token.
    #[serde(
        deserialize_with = "crate::units::empty_is_none",
        skip_serializing_if = "Option::is_none"
    )]
    pub token_file: Option<PathBuf>,
}

impl RemoteSection {
    /// The bearer token to present: `token` or the contents of `token_file`.
    pub fn bearer_token(&self) -> Result<Option<String>, ConfigError> {
        crate::tls::resolve_token(&self.token, self.token_file.as_deref(), "l3.remote.token")
    }
}

/// `[l3.memory]`: a bounded in-process map.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct MemorySection {
    /// Most bytes kept (oldest pages evicted first).
    pub capacity_bytes: ByteSize,
}

impl FileSection {
    /// No bound, no free-space guard, no expiry, no fsync: for tests and benchmarks.
    pub fn unbounded() -> Self {
        Self {
            capacity_bytes: Capacity::Unbounded,
            min_free_bytes: ByteSize(0),
            ..Self::default()
        }
    }
}

fn within(key: &str, d: Dur, lo: Duration, hi: Duration, range: &str) -> Result<(), ConfigError> {
    if d.0 < lo || d.0 > hi {
        return Err(ConfigError::invalid(key, format!("{d} is outside {range}")));
    }
    Ok(())
}

impl L3Config {
    /// The L2 → L3 write policy, with its threshold.
    pub fn write_policy(&self) -> WritePolicy {
        self.write_policy.with_threshold(self.write_threshold)
    }

    /// Checks every key's bounds; each backend section checks its own, and what it requires
    /// only when it is the one in use. Destructures exhaustively, so a new key cannot be
    /// added without deciding its validation.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let Self {
            backend,
            write_policy: _,
            write_threshold,
            admission: _,
            admission_window,
            queue_pages,
            batch_pages,
            concurrency,
            timeout,
            retries,
            retry_backoff,
            breaker_failure_rate,
            breaker_min_calls,
            breaker_window,
            breaker_cooldown,
            fault_get_delay,
            fault_set_delay,
            fault_error_rate,
            file,
            rocksdb,
            s3,
            remote,
            memory,
        } = self;
        crate::check_ranges(&[
            (
                "l3.breaker_min_calls",
                u64::from(*breaker_min_calls),
                1,
                100_000,
            ),
            ("l3.write_threshold", *write_threshold, 1, 1_000_000),
            ("l3.admission_window", *admission_window, 1024, 1 << 26),
            ("l3.queue_pages", u64::from(*queue_pages), 1, 1 << 20),
            ("l3.batch_pages", u64::from(*batch_pages), 1, 4096),
            ("l3.concurrency", u64::from(*concurrency), 1, 256),
            ("l3.retries", u64::from(*retries), 0, 10),
        ])?;
        let ms = Duration::from_millis;
        let s = Duration::from_secs;
        within("l3.timeout", *timeout, ms(1), s(600), "1ms..=10m")?;
        if !(0.01..=1.0).contains(breaker_failure_rate) {
            return Err(ConfigError::invalid(
                "l3.breaker_failure_rate",
                format!("{breaker_failure_rate} is outside 0.01..=1.0"),
            ));
        }
        within(
            "l3.breaker_window",
            *breaker_window,
            ms(100),
            s(600),
            "100ms..=10m",
        )?;
        within(
            "l3.retry_backoff",
            *retry_backoff,
            Duration::from_micros(100),
            s(10),
            "100us..=10s",
        )?;
        within(
            "l3.breaker_cooldown",
            *breaker_cooldown,
            ms(10),
            s(600),
            "10ms..=10m",
        )?;
        for (key, d) in [
            ("l3.fault_get_delay", fault_get_delay),
            ("l3.fault_set_delay", fault_set_delay),
        ] {
            within(key, *d, Duration::ZERO, s(600), "0s..=10m")?;
        }
        if !(0.0..=1.0).contains(fault_error_rate) {
            return Err(ConfigError::invalid(
                "l3.fault_error_rate",
                format!("{fault_error_rate} is outside 0.0..=1.0"),
            ));
        }
        file.validate(*backend == L3Backend::File)?;
        rocksdb.validate(*backend == L3Backend::Rocksdb)?;
        s3.validate(*backend == L3Backend::S3)?;
        remote.validate(*backend == L3Backend::Remote)?;
        memory.validate(*backend == L3Backend::Memory)?;
        Ok(())
    }
}

impl FileSection {
    fn validate(&self, _active: bool) -> Result<(), ConfigError> {
        let Self {
            path: _,
            capacity_bytes: _,
            min_free_bytes: _,
            ttl,
            sync: _,
            io: _,
        } = self;
        within(
            "l3.file.ttl",
            *ttl,
            Duration::ZERO,
            Duration::from_secs(10 * 365 * 86400),
            "0s..=3650d",
        )
    }
}

impl RocksdbSection {
    fn validate(&self, _active: bool) -> Result<(), ConfigError> {
        let Self {
            path: _,
            capacity_bytes: _,
            sync: _,
        } = self;
        Ok(())
    }
}

impl S3Section {
    fn validate(&self, active: bool) -> Result<(), ConfigError> {
        let Self {
            endpoint,
            region: _,
            bucket,
            prefix: _,
            access_key: _,
            secret_key: _,
            virtual_hosted: _,
        } = self;
        if active && bucket.is_empty() {
            return Err(ConfigError::invalid(
                "l3.s3.bucket",
                "required with l3.backend = \"s3\"",
            ));
        }
        if let Some(endpoint) = endpoint
            && !(endpoint.starts_with("http://") || endpoint.starts_with("https://"))
        {
            return Err(ConfigError::invalid(
                "l3.s3.endpoint",
                format!("{endpoint:?} is not an http:// or https:// URL"),
            ));
        }
        Ok(())
    }
}

impl RemoteSection {
    fn validate(&self, active: bool) -> Result<(), ConfigError> {
        if active && self.address.is_empty() {
            return Err(ConfigError::invalid(
                "l3.remote.address",
                "required with l3.backend = \"remote\" (https://host:port, http://host:port or a \
                 socket path)",
            ));
        }
        if !active {
            return Ok(());
        }
        crate::tls::one_token_source(&self.token, self.token_file.as_deref(), "l3.remote.token")?;
        crate::tls::check_client(
            "l3.remote",
            &self.address,
            self.tls_ca.as_deref(),
            self.tls_cert.as_deref(),
            self.tls_key.as_deref(),
        )
    }
}

impl MemorySection {
    fn validate(&self, active: bool) -> Result<(), ConfigError> {
        if active && self.capacity_bytes.0 == 0 {
            return Err(ConfigError::invalid(
                "l3.memory.capacity_bytes",
                "must be above 0",
            ));
        }
        Ok(())
    }
}
