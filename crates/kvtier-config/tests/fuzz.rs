//! Property-based fuzzing of the configuration loader: random values of any type for any key
//! of both processes' schemas, from the file, the environment and `--set`, plus unknown keys and
//! garbage files. Loading never panics; a refusal names the key (a schema path, the
//! environment variable or the `--set` argument that carried it) or the file; what loads
//! validates.
#![allow(missing_docs)]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use kvtier_config::agent::{self, AgentConfig};
use kvtier_config::daemon::{self, DaemonConfig};
use kvtier_config::{ConfigError, Sources};
use proptest::prelude::*;
use toml::{Table, Value};

/// Every key of a default file: (dotted path, its default value).
fn keys(default_toml: &str) -> Vec<(String, Value)> {
    fn walk(prefix: &str, t: &Table, out: &mut Vec<(String, Value)>) {
        for (k, v) in t {
            let path = if prefix.is_empty() {
                k.clone()
            } else {
                format!("{prefix}.{k}")
            };
            match v {
                Value::Table(sub) => walk(&path, sub, out),
                v => out.push((path, v.clone())),
            }
        }
    }
    let mut out = Vec::new();
    walk("", &toml::from_str(default_toml).unwrap(), &mut out);
    out
}

/// Values of every TOML type, biased to edges: bounds, signs, units, odd text.
fn any_value() -> impl Strategy<Value = Value> {
    let text = prop_oneof![
        Just(String::new()),
        Just("0".to_string()),
        Just("-1".to_string()),
        Just("1GiB".to_string()),
        Just("18446744073709551616B".to_string()),
        Just("10ms".to_string()),
        Just("-5s".to_string()),
        Just("0777".to_string()),
        Just("lru".to_string()),
        Just("write_back".to_string()),
        Just("https://[::1]:1".to_string()),
        Just("\u{0}\u{7f}\u{feff}é".to_string()),
        "[ -~]{0,24}",
        ".{0,12}",
    ];
    let leaf = prop_oneof![
        text.prop_map(Value::String),
        prop_oneof![
            Just(0i64),
            Just(-1),
            Just(1),
            Just(i64::MAX),
            Just(i64::MIN),
            Just(u32::MAX as i64 + 1),
            any::<i64>(),
        ]
        .prop_map(Value::Integer),
        any::<bool>().prop_map(Value::Boolean),
        prop_oneof![
            Just(f64::NAN),
            Just(f64::INFINITY),
            Just(-0.0),
            Just(1e300),
            any::<f64>()
        ]
        .prop_map(Value::Float),
    ];
    leaf.prop_recursive(2, 6, 3, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..3).prop_map(Value::Array),
            prop::collection::btree_map("[a-z_]{1,6}", inner, 0..2)
                .prop_map(|m| Value::Table(m.into_iter().collect())),
        ]
    })
}

/// Raw text for an environment variable or a `--set`.
fn any_raw() -> impl Strategy<Value = String> {
    prop_oneof![
        any_value().prop_map(|v| match v {
            Value::String(s) => s,
            other => other.to_string(),
        }),
        Just("1,2,,3".to_string()),
        Just("a,b".to_string()),
    ]
}

/// One fuzzed set of sources for a schema with `keys`, and the names an error may cite.
#[derive(Debug, Clone)]
struct Case {
    src: Sources,
}

fn case(keys: Vec<(String, Value)>, env_prefix: &'static str) -> impl Strategy<Value = Case> {
    let n = keys.len();
    let pick = move || 0..n + 1; // n: an unknown key
    let file = prop::collection::vec((pick(), any_value()), 0..6);
    let env = prop::collection::vec((pick(), any_raw()), 0..3);
    let sets = prop::collection::vec((pick(), any_raw()), 0..3);
    (file, env, sets, any::<bool>(), ".{0,40}").prop_map(move |(file, env, sets, garbage, junk)| {
        let path = |i: usize| keys.get(i).map_or("server.colour", |(p, _)| p.as_str());
        let mut table = Table::new();
        for (i, v) in file {
            insert(&mut table, path(i), v);
        }
        let text = if garbage {
            format!("{}\n{junk}", toml::to_string(&table).unwrap_or_default())
        } else {
            toml::to_string(&table).unwrap_or_default()
        };
        let var = |p: &str| format!("{env_prefix}{}", p.replace('.', "_").to_uppercase());
        Case {
            src: Sources {
                file: Some(("fuzz.toml".into(), text)),
                env: env
                    .into_iter()
                    .map(|(i, raw)| (var(path(i)), raw))
                    .collect(),
                sets: sets
                    .into_iter()
                    .map(|(i, raw)| format!("{}={raw}", path(i)))
                    .collect(),
            },
        }
    })
}

fn insert(t: &mut Table, path: &str, v: Value) {
    let mut parts: Vec<&str> = path.split('.').collect();
    let last = parts.pop().unwrap();
    let mut t = t;
    for p in parts {
        let e = t
            .entry(p.to_string())
            .or_insert_with(|| Value::Table(Table::new()));
        if !e.is_table() {
            *e = Value::Table(Table::new());
        }
        t = e.as_table_mut().unwrap();
    }
    t.insert(last.to_string(), v);
}

/// The refusal names something the user wrote: a schema key, one of the case's environment
/// variables or `--set` arguments, or the file.
fn names_its_cause(e: &ConfigError, c: &Case, schema: &[(String, Value)]) -> bool {
    match e {
        ConfigError::File { file, .. } => file == "fuzz.toml" || file == "<overrides>",
        ConfigError::Invalid { key, .. } => {
            let bare = key.split('[').next().unwrap_or(key);
            schema
                .iter()
                .any(|(p, _)| p == bare || bare.starts_with(&format!("{p}.")))
                || c.src.env.iter().any(|(v, _)| v == key)
                || c.src.sets.iter().any(|s| s == key)
                || bare == "server.colour"
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 600, ..ProptestConfig::default() })]

    #[test]
    fn the_daemon_config_loader_names_every_refusal(c in case(keys(daemon::DEFAULT_TOML), "KVTIER_")) {
        let schema = keys(daemon::DEFAULT_TOML);
        match DaemonConfig::load(&c.src) {
            Ok(cfg) => prop_assert!(cfg.validate().is_ok()),
            Err(e) => prop_assert!(names_its_cause(&e, &c, &schema), "{e} for {c:?}"),
        }
    }

    #[test]
    fn the_agent_config_loader_names_every_refusal(c in case(keys(agent::DEFAULT_TOML), "KVTIER_AGENT_")) {
        let schema = keys(agent::DEFAULT_TOML);
        match AgentConfig::load(&c.src) {
            Ok(cfg) => prop_assert!(cfg.validate().is_ok()),
            Err(e) => prop_assert!(names_its_cause(&e, &c, &schema), "{e} for {c:?}"),
        }
    }
}

#[test]
fn a_wrongly_typed_key_is_named() {
    // Every key, given a value of another type in the file, is refused naming that key.
    for (default_toml, is_daemon) in [(daemon::DEFAULT_TOML, true), (agent::DEFAULT_TOML, false)] {
        for (path, def) in keys(default_toml) {
            let wrong = match def {
                Value::Boolean(_) => Value::Array(vec![]),
                _ => Value::Boolean(true),
            };
            let mut t = Table::new();
            insert(&mut t, &path, wrong);
            let src = Sources {
                file: Some(("fuzz.toml".into(), toml::to_string(&t).unwrap())),
                ..Sources::default()
            };
            let e = if is_daemon {
                DaemonConfig::load(&src).map(|_| ()).unwrap_err()
            } else {
                AgentConfig::load(&src).map(|_| ()).unwrap_err()
            };
            assert!(e.to_string().contains(&path), "{path}: {e}");
        }
    }
}
