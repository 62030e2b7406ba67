//! Workloads: Mooncake-format trace replay and a built-in multi-turn chat generator. Both
//! yield requests with concrete token ids, so page keys (and so the deterministic KV) follow.

use std::collections::HashSet;
use std::path::Path;

use anyhow::{Context, Result, bail};
use kvtier_core::{Namespace, PageHasher};
use serde::Deserialize;

/// Tokens per trace block (Mooncake `hash_ids` are ids of 512-token blocks).
pub const BLOCK_TOKENS: usize = 512;

/// Token ids are drawn below this (a typical vocabulary size).
const VOCAB: u64 = 128_000;

/// One request of a workload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    /// Position in the workload.
    pub index: usize,
    /// Arrival time in milliseconds from the start.
    pub at_ms: u64,
    /// Prompt tokens.
    pub input: Vec<u32>,
    /// Tokens the request generates (decode), appended before its pages are inserted.
    pub output: Vec<u32>,
}

fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The tokens of trace block `block`: a pure function of its id, so equal ids are equal text.
pub fn block_tokens(block: u64) -> impl Iterator<Item = u32> {
    (0..BLOCK_TOKENS as u64).map(move |j| (mix(block.wrapping_mul(1 << 20) ^ j) % VOCAB) as u32 + 1)
}

/// Output tokens of request `index`: unique to it.
fn output_tokens(index: usize, n: usize) -> Vec<u32> {
    (0..n as u64)
        .map(|j| (mix((index as u64) << 32 ^ j ^ 0xDEC0DE) % VOCAB) as u32 + 1)
        .collect()
}

#[derive(Deserialize)]
struct TraceLine {
    timestamp: u64,
    input_length: usize,
    output_length: usize,
    hash_ids: Vec<u64>,
}

/// Reads a Mooncake-format trace (JSONL: `timestamp`, `input_length`, `output_length`,
/// `hash_ids`), the first `limit` requests (0: all). Each block id becomes 512 tokens; the
/// input is cut at `input_length`. Outputs are capped at `max_output` tokens.
pub fn mooncake(path: &Path, limit: usize, max_output: usize) -> Result<Vec<Request>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if limit > 0 && out.len() >= limit {
            break;
        }
        if line.trim().is_empty() {
            continue;
        }
        let t: TraceLine = serde_json::from_str(line)
            .with_context(|| format!("{} line {}: not a trace record", path.display(), i + 1))?;
        if t.hash_ids.len() * BLOCK_TOKENS < t.input_length {
            bail!(
                "{} line {}: {} blocks cannot hold {} input tokens",
                path.display(),
                i + 1,
                t.hash_ids.len(),
                t.input_length
            );
        }
        let mut input: Vec<u32> = t.hash_ids.iter().flat_map(|&b| block_tokens(b)).collect();
        input.truncate(t.input_length);
        let index = out.len();
        out.push(Request {
            index,
            at_ms: t.timestamp,
            input,
            output: output_tokens(index, t.output_length.min(max_output)),
        });
    }
    Ok(out)
}

/// A multi-turn chat workload: `sessions` conversations of `turns` turns, each starting
/// with one of `system_prompts` shared system prompts; every turn sends the whole history
/// plus a new user message. Turns of different sessions interleave.
#[derive(Clone, Debug)]
pub struct ChatSpec {
    /// Conversations.
    pub sessions: usize,
    /// Turns per conversation.
    pub turns: usize,
    /// Distinct system prompts.
    pub system_prompts: usize,
    /// Tokens of a system prompt.
    pub system_tokens: usize,
    /// Tokens of a user message.
    pub user_tokens: usize,
    /// Tokens of an answer.
    pub output_tokens: usize,
    /// Milliseconds between requests.
    pub interval_ms: u64,
}

/// The requests of a chat workload, in arrival order.
pub fn chat(spec: &ChatSpec) -> Vec<Request> {
    let mut history: Vec<Vec<u32>> = (0..spec.sessions)
        .map(|s| {
            let p = (s % spec.system_prompts.max(1)) as u64;
            (0..spec.system_tokens as u64)
                .map(|j| (mix(0x5157 ^ (p << 24) ^ j) % VOCAB) as u32 + 1)
                .collect()
        })
        .collect();
    let mut out = Vec::new();
    for turn in 0..spec.turns {
        for (s, h) in history.iter_mut().enumerate() {
            let user = (0..spec.user_tokens as u64).map(|j| {
                (mix(0x05E2 ^ ((s as u64) << 40) ^ ((turn as u64) << 20) ^ j) % VOCAB) as u32 + 1
            });
            h.extend(user);
            let index = out.len();
            let output = output_tokens(index, spec.output_tokens);
            out.push(Request {
                index,
                at_ms: index as u64 * spec.interval_ms,
                input: h.clone(),
                output: output.clone(),
            });
            h.extend(output);
        }
    }
    out
}

/// Tokens an unbounded cache would have served: for each request, the longest prefix of full
/// pages that an earlier request's input or output already contained.
pub fn ideal_reusable_tokens(requests: &[Request], page_size: usize) -> u64 {
    let Ok(hasher) = PageHasher::new(page_size, &Namespace::default()) else {
        return 0;
    };
    let mut seen = HashSet::new();
    let mut total = 0u64;
    for r in requests {
        let keys = hasher.keys(&r.input);
        let hit = keys.iter().take_while(|k| seen.contains(*k)).count();
        total += (hit * page_size) as u64;
        let mut all = r.input.clone();
        all.extend_from_slice(&r.output);
        seen.extend(hasher.keys(&all));
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_blocks_are_equal_tokens_and_the_ideal_counts_shared_prefixes() {
        let a: Vec<u32> = block_tokens(5).collect();
        let b: Vec<u32> = block_tokens(5).collect();
        let c: Vec<u32> = block_tokens(6).collect();
        assert_eq!(a, b);
        assert_ne!(a, c);
        let dir = std::env::temp_dir().join(format!("kvtier-sim-trace-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.jsonl");
        std::fs::write(
            &path,
            "{\"timestamp\": 0, \"input_length\": 1000, \"output_length\": 5, \"hash_ids\": [1, 2]}\n\
             {\"timestamp\": 10, \"input_length\": 1500, \"output_length\": 5, \"hash_ids\": [1, 2, 3]}\n\
             {\"timestamp\": 20, \"input_length\": 600, \"output_length\": 5, \"hash_ids\": [9, 2]}\n",
        )
        .unwrap();
        let reqs = mooncake(&path, 0, 16).unwrap();
        assert_eq!(reqs.len(), 3);
        assert_eq!(reqs[0].input.len(), 1000);
        assert_eq!(reqs[1].input[..1000], reqs[0].input[..]);
        // Request 1 reuses request 0's full pages of input (1000 tokens = 15 pages of 64).
        // Request 2 starts with another block: nothing.
        assert_eq!(ideal_reusable_tokens(&reqs, 64), 15 * 64);
        assert!(mooncake(&path, 2, 16).unwrap().len() == 2);
        std::fs::write(&path, "{\"timestamp\": 0}\n").unwrap();
        let e = mooncake(&path, 0, 16).unwrap_err().to_string();
        assert!(e.contains("line 1"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn chat_turns_extend_their_history() {
        let reqs = chat(&ChatSpec {
            sessions: 2,
            turns: 3,
            system_prompts: 1,
            system_tokens: 128,
            user_tokens: 32,
            output_tokens: 16,
            interval_ms: 1,
        });
        assert_eq!(reqs.len(), 6);
        // Session 0's second turn starts with its first turn's input and output.
        let (t0, t1) = (&reqs[0], &reqs[2]);
        assert_eq!(t1.input[..t0.input.len()], t0.input[..]);
        assert_eq!(t1.input[t0.input.len()..t0.input.len() + 16], t0.output[..]);
        // Both sessions share the system prompt.
        assert_eq!(reqs[0].input[..128], reqs[1].input[..128]);
        assert!(ideal_reusable_tokens(&reqs, 16) > 0);
    }
}
