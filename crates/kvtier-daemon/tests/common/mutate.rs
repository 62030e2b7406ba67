//! Byte-level mutations of valid protobuf messages, for the RPC fuzzers: a valid request of
//! each method is the seed, so most mutants still decode and reach the handler's checks.
#![allow(dead_code, unreachable_pub)]

use proptest::prelude::*;

/// One edit of a message's bytes.
#[derive(Debug, Clone)]
pub enum Edit {
    /// Flip bits of the byte at (index mod len).
    Flip(usize, u8),
    /// Cut the message at (index mod len + 1).
    Truncate(usize),
    /// Insert bytes at (index mod len + 1).
    Insert(usize, Vec<u8>),
    /// Append a field: tag varint then a payload (a varint, or length-delimited bytes).
    Field(u32, u8, Vec<u8>),
    /// Repeat the bytes from (index mod len) to the end.
    Repeat(usize),
}

/// Edits, weighted towards ones that keep the message decodable.
pub fn edits() -> impl Strategy<Value = Vec<Edit>> {
    let edit = prop_oneof![
        1 => (any::<usize>(), 1u8..).prop_map(|(i, b)| Edit::Flip(i, b)),
        1 => any::<usize>().prop_map(Edit::Truncate),
        1 => (any::<usize>(), prop::collection::vec(any::<u8>(), 1..12))
            .prop_map(|(i, b)| Edit::Insert(i, b)),
        4 => (1u32..12, 0u8..3, prop::collection::vec(any::<u8>(), 0..80))
            .prop_map(|(f, w, b)| Edit::Field(f, w, b)),
        2 => any::<usize>().prop_map(Edit::Repeat),
    ];
    prop::collection::vec(edit, 0..4)
}

fn varint(mut v: u64, out: &mut Vec<u8>) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// `seed` with `edits` applied in order.
pub fn apply(seed: &[u8], edits: &[Edit]) -> Vec<u8> {
    let mut m = seed.to_vec();
    for e in edits {
        let len = m.len();
        match e {
            Edit::Flip(i, b) if len > 0 => m[i % len] ^= b,
            Edit::Truncate(i) => m.truncate(i % (len + 1)),
            Edit::Insert(i, b) => {
                let at = i % (len + 1);
                m.splice(at..at, b.iter().copied());
            }
            Edit::Field(field, wire, payload) => {
                let wire = u64::from(*wire % 3);
                varint((u64::from(*field) << 3) | wire, &mut m);
                match wire {
                    0 => varint(
                        payload
                            .iter()
                            .fold(0u64, |a, b| a.rotate_left(8) ^ u64::from(*b)),
                        &mut m,
                    ),
                    1 => m.extend(payload.iter().copied().chain([0; 8]).take(8)),
                    _ => {
                        varint(payload.len() as u64, &mut m);
                        m.extend_from_slice(payload);
                    }
                }
            }
            Edit::Repeat(i) if len > 0 => {
                let tail = m[i % len..].to_vec();
                m.extend(tail);
            }
            _ => {}
        }
    }
    m
}

/// Whether a refusal is one a client can act on: never `Internal`, `Unknown` (a panic) or
/// `DataLoss`. Bytes that are not the method's message are `InvalidArgument` naming the
/// message and field (kvtier_server::malformed).
pub fn clean_refusal(s: &tonic::Status) -> bool {
    !matches!(
        s.code(),
        tonic::Code::Internal | tonic::Code::Unknown | tonic::Code::DataLoss
    )
}

/// A method to fuzz: its path, its shape, and a valid request (several messages for a
/// client stream).
pub type Method = (&'static str, kvtier_client::raw::Shape, Vec<Vec<u8>>);

/// Runs `PROPTEST_CASES` (default `default_cases`) batches of `batch` mutated calls of
/// `table`'s methods, each batch sent at once on one connection to `target`. Fails a case
/// when a call hangs past 20 s or is refused uncleanly. Returns the calls served and the
/// refusals by code.
pub fn run_batches(
    rt: &tokio::runtime::Runtime,
    target: &str,
    table: &[Method],
    batch: usize,
    default_cases: u32,
) -> (usize, std::collections::BTreeMap<String, usize>) {
    use proptest::test_runner::{Config, TestCaseError, TestRunner};
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default_cases);
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        max_shrink_iters: 64,
        ..Config::default()
    });
    let calls = prop::collection::vec((0..table.len(), edits()), batch);
    let served = std::cell::Cell::new(0usize);
    let refused = std::cell::RefCell::new(std::collections::BTreeMap::<String, usize>::new());
    runner
        .run(&calls, |batch| {
            let results = rt.block_on(async {
                let ch = kvtier_client::connect(target).await.unwrap();
                let tasks: Vec<_> = batch
                    .iter()
                    .map(|(m, edits)| {
                        let (path, shape, seed) = &table[*m];
                        let msgs: Vec<bytes::Bytes> =
                            seed.iter().map(|s| apply(s, edits).into()).collect();
                        let (ch, path, shape) = (ch.clone(), *path, *shape);
                        tokio::spawn(async move {
                            let r = tokio::time::timeout(
                                std::time::Duration::from_secs(20),
                                // One reply of a stream: WatchMetrics' next may be a minute away.
                                kvtier_client::raw::call(ch, path, shape, msgs, 1),
                            )
                            .await;
                            (path, r)
                        })
                    })
                    .collect();
                let mut out = Vec::new();
                for t in tasks {
                    out.push(t.await.unwrap());
                }
                out
            });
            for (path, r) in results {
                let r = r.map_err(|_| TestCaseError::fail(format!("{path} hung")))?;
                match r {
                    Ok(_) => served.set(served.get() + 1),
                    Err(s) => {
                        prop_assert!(clean_refusal(&s), "{path}: {:?} {}", s.code(), s.message());
                        *refused
                            .borrow_mut()
                            .entry(format!("{:?}", s.code()))
                            .or_default() += 1;
                    }
                }
            }
            Ok(())
        })
        .unwrap();
    let (served, refused) = (served.get(), refused.into_inner());
    eprintln!("fuzz: {served} served, refused by code: {refused:?}");
    assert!(
        served > 0 && !refused.is_empty(),
        "the fuzzer reached both outcomes"
    );
    (served, refused)
}
