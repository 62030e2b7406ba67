//! kvtier-config: configuration files of the kvtier processes, their layering and validation.
//!
//! Layering, lowest to highest: built-in defaults < the TOML file < `KVTIER_*` environment
//! variables < `--set section.key=value` flags. Every key has a documented default (the
//! commented default file, [`daemon::DEFAULT_TOML`], is the reference and is checked against
//! the `Default` impls by test) and bounds; every error names the key.
//!
//! Environment variables: `KVTIER_<SECTION>_<KEY>` in upper case, e.g. `KVTIER_L2_POOL_BYTES`
//! for `l2.pool_bytes`, and `KVTIER_<KEY>` for top-level keys (`KVTIER_DATA_DIR`). Section names
//! contain no underscore, so the split is unambiguous. This crate and the binaries' `main` are
//! the only places that read the environment; [`load`] takes it as an argument.

pub mod agent;
pub mod connections;
pub mod daemon;
pub mod l3;
pub mod roles;
pub mod tenants;
pub mod tls;
mod units;
pub mod unix;

pub use units::{ByteSize, Capacity, Dur, Secret};

use serde::de::DeserializeOwned;
use toml::{Table, Value};

/// A configuration error. The message always names the key or the file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// A key has a bad value.
    #[error("config key `{key}`: {reason}")]
    Invalid {
        /// Dotted key, e.g. `l2.pool_bytes`.
        key: String,
        /// What is wrong.
        reason: String,
    },
    /// The file could not be read or is not valid TOML for this schema.
    #[error("config file {file}: {reason}")]
    File {
        /// The file.
        file: String,
        /// The parser's message (names the key and line).
        reason: String,
    },
}

impl ConfigError {
    /// An invalid-value error for `key`.
    pub fn invalid(key: impl Into<String>, reason: impl Into<String>) -> Self {
        Self::Invalid {
            key: key.into(),
            reason: reason.into(),
        }
    }

    /// Configuration errors are never retryable: the input must change.
    pub fn is_retryable(&self) -> bool {
        false
    }
}

/// Where a value came from: applied in this order, each overriding the previous.
#[derive(Debug, Clone, Default)]
pub struct Sources {
    /// Contents and name of the config file, if one was given.
    pub file: Option<(String, String)>,
    /// Environment variables (all of them; only `KVTIER_*` are looked at).
    pub env: Vec<(String, String)>,
    /// `section.key=value` overrides from the command line.
    pub sets: Vec<String>,
}

/// Parses a value for `key` with the type the default file gives that key.
fn typed(key: &str, default: &Value, raw: &str) -> Result<Value, ConfigError> {
    Ok(match default {
        Value::String(_) => Value::String(raw.to_string()),
        Value::Integer(_) => Value::Integer(
            raw.trim()
                .parse()
                .map_err(|_| ConfigError::invalid(key, format!("{raw:?} is not an integer")))?,
        ),
        Value::Boolean(_) => Value::Boolean(match raw.trim().to_ascii_lowercase().as_str() {
            "true" | "1" | "yes" | "on" => true,
            "false" | "0" | "no" | "off" => false,
            _ => {
                return Err(ConfigError::invalid(
                    key,
                    format!("{raw:?} is not a boolean"),
                ));
            }
        }),
        Value::Float(_) => Value::Float(
            raw.trim()
                .parse()
                .map_err(|_| ConfigError::invalid(key, format!("{raw:?} is not a number")))?,
        ),
        // Lists: comma-separated items, integers where they parse (`1000,1001`).
        Value::Array(_) => Value::Array(
            raw.split(',')
                .map(str::trim)
                .filter(|item| !item.is_empty())
                .map(|item| {
                    item.parse()
                        .map_or_else(|_| Value::String(item.to_string()), Value::Integer)
                })
                .collect(),
        ),
        _ => return Err(ConfigError::invalid(key, "cannot be set from a string")),
    })
}

/// Sets `section.key`, `section.sub.key` (or top-level `key`) in `table`, typed by `schema`.
fn set_path(table: &mut Table, schema: &Table, path: &str, raw: &str) -> Result<(), ConfigError> {
    let parts: Vec<&str> = path.split('.').collect();
    let unknown = || removed(path).unwrap_or_else(|| ConfigError::invalid(path, "no such key"));
    let (key, sections) = parts.split_last().ok_or_else(unknown)?;
    let (mut table, mut schema) = (table, schema);
    for (i, section) in sections.iter().enumerate() {
        schema = schema
            .get(*section)
            .and_then(Value::as_table)
            .ok_or_else(unknown)?;
        let t = table
            .entry((*section).to_string())
            .or_insert_with(|| Value::Table(Table::new()));
        table = match t {
            Value::Table(t) => t,
            _ => {
                return Err(ConfigError::invalid(
                    parts[..=i].join("."),
                    "must be a table",
                ));
            }
        };
    }
    let def = schema.get(*key).ok_or_else(unknown)?;
    if def.is_table() {
        return Err(ConfigError::invalid(path, "is a section, not a key"));
    }
    table.insert((*key).to_string(), typed(path, def, raw)?);
    Ok(())
}

/// Maps `KVTIER_L2_POOL_BYTES` to `l2.pool_bytes` (and `KVTIER_L3_S3_SECRET_KEY` to
/// `l3.s3.secret_key`) using the schema's sections: the longest section name that prefixes
/// what is left, then the key.
fn env_path(schema: &Table, var: &str, prefix: &str) -> Option<String> {
    let rest = var.strip_prefix(prefix)?.to_ascii_lowercase();
    key_path(schema, &rest)
}

fn key_path(schema: &Table, rest: &str) -> Option<String> {
    if schema.get(rest).is_some_and(|v| !v.is_table()) {
        return Some(rest.to_string());
    }
    schema.iter().find_map(|(name, v)| {
        let sub = v.as_table()?;
        let tail = rest.strip_prefix(name.as_str())?.strip_prefix('_')?;
        Some(format!("{name}.{}", key_path(sub, tail)?))
    })
}

/// Checks `(key, value, low, high)` bounds (inclusive); the error names the first key out
/// of range.
pub fn check_ranges(ranges: &[(&str, u64, u64, u64)]) -> Result<(), ConfigError> {
    for &(key, v, lo, hi) in ranges {
        if v < lo || v > hi {
            return Err(ConfigError::invalid(
                key,
                format!("{v} is outside {lo}..={hi}"),
            ));
        }
    }
    Ok(())
}

impl Sources {
    /// What a process's command line gives: the config file at `path` (read here; a missing
    /// file is an error naming it), this process's environment, and `--set` overrides.
    pub fn from_process(
        path: Option<&std::path::Path>,
        sets: Vec<String>,
    ) -> Result<Self, ConfigError> {
        let file = match path {
            Some(p) => Some((
                p.display().to_string(),
                std::fs::read_to_string(p).map_err(|e| ConfigError::File {
                    file: p.display().to_string(),
                    reason: e.to_string(),
                })?,
            )),
            None => None,
        };
        Ok(Self {
            file,
            env: std::env::vars().collect(),
            sets,
        })
    }
}

/// Keys that were settings once, each with what replaced it: a file (or `--set`) that still
/// names one is refused with that, rather than with serde's list of the keys there are.
const REMOVED: &[(&str, &str)] = &[(
    "l3.s3.retries",
    "removed: S3 calls are retried once, by l3.retries (the S3 client's own retries under \
     them multiplied a call's attempts up to 9); set l3.retries instead",
)];

/// The error for `key` where it is a removed setting.
fn removed(key: &str) -> Option<ConfigError> {
    REMOVED
        .iter()
        .find(|(k, _)| *k == key)
        .map(|(k, why)| ConfigError::invalid(*k, *why))
}

/// The error for environment variable `var` where it names a removed setting.
fn removed_env(var: &str, prefix: &str) -> Option<ConfigError> {
    let rest = var.strip_prefix(prefix)?.to_ascii_lowercase();
    REMOVED
        .iter()
        .find(|(k, _)| k.replace('.', "_") == rest)
        .map(|(k, why)| ConfigError::invalid(format!("{var} ({k})"), *why))
}

fn refuse_removed(table: &Table) -> Result<(), ConfigError> {
    for (key, why) in REMOVED {
        let mut at = Some(table);
        let mut parts = key.split('.').peekable();
        while let (Some(t), Some(part)) = (at, parts.next()) {
            match (t.get(part), parts.peek()) {
                (Some(_), None) => return Err(ConfigError::invalid(*key, *why)),
                (Some(Value::Table(inner)), Some(_)) => at = Some(inner),
                _ => at = None,
            }
        }
    }
    Ok(())
}

/// Every default is written once, in a process's commented default file: its configuration
/// type's `Default` is that file, parsed once (`defaults_from_file!(name, Type, FILE)` makes
/// `name() -> &'static Type`), and a section's `Default` is the file's section
/// (`default_from_parent!`). No type has serde defaults: [`load`] lays what the sources give
/// over the whole file, so a key the file lacked would fail every load (and the tests).
macro_rules! defaults_from_file {
    ($name:ident, $t:ty, $file:expr) => {
        fn $name() -> &'static $t {
            static PARSED: std::sync::OnceLock<$t> = std::sync::OnceLock::new();
            PARSED.get_or_init(|| match toml::from_str($file) {
                Ok(d) => d,
                Err(e) => panic!(
                    "the default file of {} does not make one: {e}",
                    stringify!($t)
                ),
            })
        }
    };
}
pub(crate) use defaults_from_file;

/// `impl Default for Section { parent().section.clone() }`, for each `Section => field`.
macro_rules! default_from_parent {
    ($parent:ident, $($t:ty => $($f:ident).+),* $(,)?) => {$(
        impl Default for $t {
            fn default() -> Self {
                $parent().$($f).+.clone()
            }
        }
    )*};
}
pub(crate) use default_from_parent;

/// Lays `over` onto `base`, table by table: a key `over` gives replaces `base`'s, a table in
/// both is laid over in turn.
fn lay_over(base: &mut Table, over: Table) {
    for (key, value) in over {
        match (base.get_mut(&key), value) {
            (Some(Value::Table(b)), Value::Table(o)) => lay_over(b, o),
            (_, value) => {
                base.insert(key, value);
            }
        }
    }
}

/// Loads a configuration of type `T` whose commented default file is `default_toml`.
pub fn load<T: DeserializeOwned>(default_toml: &str, src: &Sources) -> Result<T, ConfigError> {
    load_env(default_toml, src, Env::Daemon)
}

/// Which environment variables a process reads: kvtierd takes `KVTIER_<SECTION>_<KEY>`
/// (leaving `KVTIER_AGENT_*` alone), kvtier-agent takes `KVTIER_AGENT_<SECTION>_<KEY>`, so
/// both can run with one environment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Env {
    /// `KVTIER_*` except `KVTIER_AGENT_*`.
    Daemon,
    /// `KVTIER_AGENT_*`.
    Agent,
}

impl Env {
    fn prefix(self) -> &'static str {
        match self {
            Env::Daemon => "KVTIER_",
            Env::Agent => "KVTIER_AGENT_",
        }
    }

    fn takes(self, var: &str) -> bool {
        match self {
            Env::Daemon => var.starts_with("KVTIER_") && !var.starts_with("KVTIER_AGENT_"),
            Env::Agent => var.starts_with("KVTIER_AGENT_"),
        }
    }
}

/// [`load`] for the process whose variables `env` names.
pub fn load_env<T: DeserializeOwned>(
    default_toml: &str,
    src: &Sources,
    which: Env,
) -> Result<T, ConfigError> {
    let schema: Table = toml::from_str(default_toml).map_err(|e| ConfigError::File {
        file: "<built-in defaults>".into(),
        reason: e.to_string(),
    })?;
    // Every key starts at the default file's value; the sources are laid over it.
    let mut table = schema.clone();
    if let Some((name, text)) = &src.file {
        let file = toml::from_str::<Table>(text).map_err(|e| ConfigError::File {
            file: name.clone(),
            reason: e.to_string(),
        })?;
        refuse_removed(&file)?;
        lay_over(&mut table, file);
    }
    let mut env: Vec<&(String, String)> = src.env.iter().filter(|(k, _)| which.takes(k)).collect();
    env.sort();
    for (var, raw) in env {
        let path = env_path(&schema, var, which.prefix()).ok_or_else(|| {
            removed_env(var, which.prefix())
                .unwrap_or_else(|| ConfigError::invalid(var.clone(), "no such configuration key"))
        })?;
        set_path(&mut table, &schema, &path, raw)
            .map_err(|e| ConfigError::invalid(var.clone(), e.to_string()))?;
    }
    for set in &src.sets {
        let (path, raw) = set
            .split_once('=')
            .ok_or_else(|| ConfigError::invalid(set.clone(), "expected section.key=value"))?;
        set_path(&mut table, &schema, path.trim(), raw)?;
    }
    // The path-tracking deserializer names the key of a bad value (`cache.write_policy`),
    // whichever source gave it; enum-valued settings fail here with the allowed words.
    serde_path_to_error::deserialize(Value::Table(table)).map_err(|e| {
        let key = e.path().to_string();
        let file = src.file.as_ref().map(|(n, _)| n.clone());
        let reason = e.into_inner().to_string().trim_end().to_string();
        match (key.is_empty() || key == ".", file) {
            (true, file) => ConfigError::File {
                file: file.unwrap_or_else(|| "<overrides>".into()),
                reason,
            },
            (false, Some(file)) => ConfigError::invalid(key, format!("{reason} (config {file})")),
            (false, None) => ConfigError::invalid(key, reason),
        }
    })
}
