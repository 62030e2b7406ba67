//! `docs/hash-spec.md` is normative: this test reads its test vectors and checks the code
//! against every one, so the document and the implementation cannot drift apart.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use kvtier_core::{Namespace, PageHasher, PageKey};

const SPEC: &str = include_str!("../docs/hash-spec.md");

struct Vector {
    line: String,
    page_size: usize,
    tokens: Vec<u32>,
    ns: Namespace,
    seed: Option<String>,
    keys: Option<Vec<String>>,
    last_key: Option<String>,
}

fn parse_tokens(s: &str) -> Vec<u32> {
    match s.split_once("..=") {
        Some((a, b)) => (a.parse().unwrap()..=b.parse().unwrap()).collect(),
        None => s.split(',').map(|t| t.parse().unwrap()).collect(),
    }
}

fn vectors() -> Vec<Vector> {
    let block = SPEC
        .split("```vectors\n")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .expect("hash-spec.md has a ```vectors block");
    block
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|line| {
            let mut v = Vector {
                line: line.to_string(),
                page_size: 0,
                tokens: Vec::new(),
                ns: Namespace::default(),
                seed: None,
                keys: None,
                last_key: None,
            };
            for field in line.split_whitespace() {
                let (k, val) = field.split_once('=').expect("field=value");
                match k {
                    "page_size" => v.page_size = val.parse().unwrap(),
                    "tokens" => v.tokens = parse_tokens(val),
                    "tenant" => v.ns.tenant = val.into(),
                    "cache_salt" => v.ns.cache_salt = val.into(),
                    "lora_id" => v.ns.lora_id = val.into(),
                    "extra_key" => v.ns.extra_key = val.into(),
                    "seed" => v.seed = Some(val.into()),
                    "keys" => v.keys = Some(val.split(',').map(String::from).collect()),
                    "last_key" => v.last_key = Some(val.into()),
                    other => panic!("unknown vector field {other:?} in {line:?}"),
                }
            }
            v
        })
        .collect()
}

#[test]
fn every_vector_in_the_spec_holds() {
    let vs = vectors();
    assert!(vs.len() >= 6, "the spec lost vectors: {}", vs.len());
    for v in vs {
        let h = PageHasher::new(v.page_size, &v.ns).unwrap();
        let keys: Vec<String> = h.keys(&v.tokens).iter().map(PageKey::to_hex).collect();
        assert_eq!(keys.len(), v.tokens.len() / v.page_size, "{}", v.line);
        if let Some(want) = &v.keys {
            assert_eq!(&keys, want, "{}", v.line);
        }
        if let Some(want) = &v.last_key {
            assert_eq!(keys.last(), Some(want), "{}", v.line);
        }
        assert_eq!(v.seed, v.ns.seed().map(|s| s.to_hex()), "{}", v.line);
    }
}

#[test]
fn spec_seed_preimage_example_holds() {
    let hex = SPEC
        .split("The seed preimage of `tenant=acme` is")
        .nth(1)
        .and_then(|rest| rest.split('`').nth(3))
        .expect("the preimage example is in the spec");
    let ns = Namespace {
        tenant: "acme".into(),
        ..Namespace::default()
    };
    let got: String = ns
        .seed_preimage()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(got, hex);
}
