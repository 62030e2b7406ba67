//! The SGLang HiCache RPC protocol's metrics: objects moved by operation and outcome, bytes,
//! batch timings, where hits were served from, registered host pools, and the objects kept
//! in memory.

use kvtier_server::metrics::{IO_BUCKETS, MetricRegistry, Result};
use prometheus::{HistogramVec, IntCounterVec, IntGauge};

use super::objects::MemoryGauges;

/// Series of the SGLang protocol.
#[derive(Clone, Debug)]
pub struct SglangMetrics {
    /// Objects by operation (exist, put, get) and outcome.
    pub transfers: IntCounterVec,
    /// Bytes moved by puts and gets.
    pub bytes: IntCounterVec,
    /// Time of one batch, by operation.
    pub seconds: HistogramVec,
    /// Gets served and exists found, by operation and tier (memory, l3).
    pub hits: IntCounterVec,
    /// Host pools registered now.
    pub pools: IntGauge,
    /// The objects kept in kvtierd's memory (its own L2 pages).
    pub memory: MemoryGauges,
}

impl SglangMetrics {
    /// Declares the series in `r`, with known label values at zero.
    pub fn new(r: &MetricRegistry) -> Result<Self> {
        let m = Self {
            transfers: r.counter_vec(
                "kvtier_sglang_transfers_total",
                "SGLang HiCache RPC objects by operation and outcome",
                &["op", "outcome"],
            )?,
            bytes: r.counter_vec(
                "kvtier_sglang_bytes_total",
                "Bytes moved by SGLang HiCache RPC puts and gets",
                &["op"],
            )?,
            seconds: r.histogram_vec(
                "kvtier_sglang_batch_duration_seconds",
                "Time to serve one SGLang HiCache RPC batch",
                &["op"],
                IO_BUCKETS,
            )?,
            pools: r.gauge("kvtier_sglang_pools", "SGLang host pools registered now")?,
            hits: r.counter_vec(
                "kvtier_sglang_hits_total",
                "SGLang gets served and exists found, by the tier that had the object",
                &["op", "tier"],
            )?,
            memory: MemoryGauges {
                bytes: r.gauge(
                    "kvtier_sglang_memory_bytes",
                    "Bytes of SGLang objects kept in kvtierd's memory (its own L2 pages)",
                )?,
                objects: r.gauge(
                    "kvtier_sglang_memory_objects",
                    "SGLang objects kept in kvtierd's memory (its own L2 pages)",
                )?,
                evictions: r.counter(
                    "kvtier_sglang_memory_evictions_total",
                    "SGLang objects pushed out of kvtierd's memory to make room",
                )?,
            },
        };
        for op in ["exist", "put", "get"] {
            m.transfers.with_label_values(&[op, "ok"]);
            m.seconds.with_label_values(&[op]);
        }
        for op in ["put", "get"] {
            m.bytes.with_label_values(&[op]);
        }
        for op in ["exist", "get"] {
            for tier in ["memory", "l3"] {
                m.hits.with_label_values(&[op, tier]);
            }
        }
        Ok(m)
    }
}
