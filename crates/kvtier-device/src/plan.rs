//! The copy plan: which bytes of the engine's memory go to which bytes of the host pool for a
//! list of pages, as (device address, host address, length) runs that every copy method
//! executes. Pure arithmetic: no device, no unsafe; unit- and property-tested against a
//! byte-by-byte reference.
//!
//! The engine's memory is described by a [`DeviceMap`]: regions (buffers or whole
//! allocations) and, for each run of a page (one (layer, part), in the host slot's page-first
//! order), the region it lives in, its offset there and the distance between consecutive
//! pages. SGLang's layer-first buffers are one region per run with the run length as stride
//! ([`DeviceMap::layer_first`]); vLLM's layouts (K and V in one tensor per layer, blocks
//! first, or all layers of a block together) are other offsets and strides over the same
//! regions ([`DeviceMap::new`]).
//!
//! [`Plan::build`] walks pages in request order and runs in slot order, and merges a run into
//! the one before whenever both sides continue where it ended: all runs of a page when the
//! engine keeps a block's layers together, and consecutive pages into consecutive slots.

use kvtier_core::DevicePool;

use crate::{DeviceError, PageCopy};

/// Where one run of every page lives: `region` base + `offset` + page × `page_stride`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RunPlace {
    /// Index of the region (buffer or allocation).
    pub region: usize,
    /// Byte offset of page 0's run in the region.
    pub offset: u64,
    /// Bytes from one page's run to the next page's.
    pub page_stride: u64,
}

/// The engine's memory: its regions' lengths and where each run of a page lives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceMap {
    pool: DevicePool,
    region_bytes: Vec<u64>,
    places: Vec<RunPlace>,
}

fn invalid(field: String, reason: String) -> DeviceError {
    DeviceError::Invalid { field, reason }
}

impl DeviceMap {
    /// One buffer per run, pages back to back (`[token_slot][...]`): the cpu device's pool
    /// file and the per-buffer IPC handles.
    pub fn layer_first(pool: &DevicePool) -> Self {
        let run = pool.layout().run_bytes() as u64;
        Self {
            region_bytes: vec![pool.buffer_bytes() as u64; pool.num_buffers()],
            places: (0..pool.num_buffers())
                .map(|region| RunPlace {
                    region,
                    offset: 0,
                    page_stride: run,
                })
                .collect(),
            pool: pool.clone(),
        }
    }

    /// Validates an explicit map: one place per run of the layout (page-first order: every
    /// layer's K, then every layer's V), each page of each run inside its region, and no two
    /// runs of any pages overlapping. Errors name the run (`runs[i]`) and what is wrong.
    pub fn new(
        pool: DevicePool,
        region_bytes: Vec<u64>,
        places: Vec<RunPlace>,
    ) -> Result<Self, DeviceError> {
        let runs = pool.layout().runs_per_page();
        if places.len() != runs {
            return Err(invalid(
                "runs".into(),
                format!(
                    "{} places for a layout of {runs} runs per page",
                    places.len()
                ),
            ));
        }
        let len = pool.layout().run_bytes() as u64;
        let pages = pool.num_pages() as u64;
        for (i, p) in places.iter().enumerate() {
            let Some(&region) = region_bytes.get(p.region) else {
                return Err(invalid(
                    format!("runs[{i}].region"),
                    format!(
                        "{} is not one of the {} regions",
                        p.region,
                        region_bytes.len()
                    ),
                ));
            };
            if pages > 1 && p.page_stride < len {
                return Err(invalid(
                    format!("runs[{i}].page_stride"),
                    format!(
                        "{} is below the run length {len}: pages would overlap",
                        p.page_stride
                    ),
                ));
            }
            let end = (pages - 1)
                .checked_mul(p.page_stride)
                .and_then(|b| b.checked_add(p.offset))
                .and_then(|b| b.checked_add(len));
            if end.is_none_or(|e| e > region) {
                return Err(invalid(
                    format!("runs[{i}]"),
                    format!(
                        "page {} at offset {} + {} × {} runs past region {} of {region} bytes",
                        pages - 1,
                        p.offset,
                        pages - 1,
                        p.page_stride,
                        p.region
                    ),
                ));
            }
        }
        for a in 0..places.len() {
            for b in a + 1..places.len() {
                if overlap(&places[a], &places[b], len, pages) {
                    return Err(invalid(
                        format!("runs[{b}]"),
                        format!(
                            "overlaps runs[{a}] for some pages in region {}",
                            places[a].region
                        ),
                    ));
                }
            }
        }
        Ok(Self {
            pool,
            region_bytes,
            places,
        })
    }

    /// The pool's geometry.
    pub fn pool(&self) -> &DevicePool {
        &self.pool
    }

    /// The regions' lengths in bytes.
    pub fn region_bytes(&self) -> &[u64] {
        &self.region_bytes
    }

    /// Where each run lives, in page-first order.
    pub fn places(&self) -> &[RunPlace] {
        &self.places
    }
}

/// Whether some page of run `a` overlaps some page of run `b` (both `len` long, `pages`
/// pages each). Runs of one stride are checked exactly; runs of different strides must keep
/// to disjoint spans.
fn overlap(a: &RunPlace, b: &RunPlace, len: u64, pages: u64) -> bool {
    if a.region != b.region {
        return false;
    }
    let (len, n) = (i128::from(len), i128::from(pages));
    let (oa, ob) = (i128::from(a.offset), i128::from(b.offset));
    if a.page_stride == b.page_stride || pages == 1 {
        // Page p of a and page q of b start `d + k·s` apart, k = q − p in (−n, n).
        let s = i128::from(a.page_stride);
        let d = ob - oa;
        if s == 0 || pages == 1 {
            return d.abs() < len;
        }
        let k0 = (-d).div_euclid(s);
        return [k0, k0 + 1]
            .into_iter()
            .map(|k| k.clamp(-(n - 1), n - 1))
            .any(|k| (d + k * s).abs() < len);
    }
    let end = |o: i128, s: u64| o + (n - 1) * i128::from(s) + len;
    oa < end(ob, b.page_stride) && ob < end(oa, a.page_stride)
}

/// One contiguous run to move: addresses on both sides, and its length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Run {
    /// Address in the engine's memory.
    pub device: u64,
    /// Address in the host pool.
    pub host: u64,
    /// Bytes.
    pub len: u64,
}

/// The host side of a plan: the pool's first slot's address and the distance between slots.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostSlots {
    /// Address of slot 0.
    pub base: u64,
    /// Bytes from one slot to the next.
    pub stride: u64,
}

/// The runs of one copy list, merged where both sides are contiguous.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    runs: Vec<Run>,
    bytes: u64,
}

impl Plan {
    /// Plans `copies` (already checked against the pool and host pool: see
    /// [`crate::check_copies`]) with `bases[r]` the address of region `r`.
    pub fn build(map: &DeviceMap, bases: &[u64], host: HostSlots, copies: &[PageCopy]) -> Self {
        let len = map.pool.layout().run_bytes() as u64;
        let mut runs: Vec<Run> = Vec::with_capacity(copies.len());
        let mut bytes = 0;
        for c in copies {
            let slot = host.base + u64::from(c.host_slot) * host.stride;
            let page = u64::from(c.device_page);
            for (i, p) in map.places.iter().enumerate() {
                let run = Run {
                    device: bases[p.region] + p.offset + page * p.page_stride,
                    host: slot + i as u64 * len,
                    len,
                };
                bytes += len;
                match runs.last_mut() {
                    Some(last)
                        if last.device + last.len == run.device
                            && last.host + last.len == run.host =>
                    {
                        last.len += len;
                    }
                    _ => runs.push(run),
                }
            }
        }
        Self { runs, bytes }
    }

    /// The runs, in order.
    pub fn runs(&self) -> &[Run] {
        &self.runs
    }

    /// Bytes moved in all.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The runs in batches of at most `max` (a driver's limit per call); none when empty.
    pub fn batches(&self, max: usize) -> std::slice::Chunks<'_, Run> {
        self.runs.chunks(max.max(1))
    }

    /// Splits the runs into at most `parts` consecutive pieces of about equal bytes, for
    /// copies spread over threads. Never returns an empty piece.
    pub fn split(&self, parts: usize) -> Vec<&[Run]> {
        let parts = parts.max(1);
        if self.runs.is_empty() {
            return Vec::new();
        }
        let share = self.bytes.div_ceil(parts as u64).max(1);
        let mut out = Vec::with_capacity(parts);
        let (mut start, mut acc) = (0, 0);
        for (i, r) in self.runs.iter().enumerate() {
            acc += r.len;
            if acc >= share && out.len() + 1 < parts {
                out.push(&self.runs[start..=i]);
                start = i + 1;
                acc = 0;
            }
        }
        if start < self.runs.len() {
            out.push(&self.runs[start..]);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvtier_core::{DType, KvKind, Layout, LayoutSpec};
    use proptest::prelude::*;

    fn pool(kind: KvKind, layers: u32, page_size: u32, pages: u64) -> DevicePool {
        let layout = Layout::new(LayoutSpec {
            model_id: "plan".into(),
            model_version: String::new(),
            dtype: DType::Bf16,
            num_layers: layers,
            kind,
            page_size,
            tp_rank: 0,
            tp_size: 1,
        })
        .unwrap();
        DevicePool::new(layout, pages * u64::from(page_size)).unwrap()
    }

    fn mha(layers: u32, pages: u64) -> DevicePool {
        pool(
            KvKind::Mha {
                kv_heads: 1,
                head_dim: 4,
            },
            layers,
            2,
            pages,
        )
    }

    /// vLLM's FlashAttention layout: per layer one tensor `[2, blocks, ...]`, K then V.
    fn k_then_v_per_layer(p: &DevicePool) -> DeviceMap {
        let (run, n, layers) = (
            p.layout().run_bytes() as u64,
            p.num_pages() as u64,
            p.layout().num_layers(),
        );
        let places = (0..2)
            .flat_map(|part| {
                (0..layers).map(move |l| RunPlace {
                    region: l,
                    offset: part * n * run,
                    page_stride: run,
                })
            })
            .collect();
        DeviceMap::new(p.clone(), vec![2 * n * run; layers], places).unwrap()
    }

    /// All layers of a block together in one allocation: `[blocks, 2, layers, ...]`.
    fn block_first(p: &DevicePool) -> DeviceMap {
        let (run, n, runs) = (
            p.layout().run_bytes() as u64,
            p.num_pages() as u64,
            p.layout().runs_per_page() as u64,
        );
        let places = (0..runs)
            .map(|i| RunPlace {
                region: 0,
                offset: i * run,
                page_stride: runs * run,
            })
            .collect();
        DeviceMap::new(p.clone(), vec![n * runs * run], places).unwrap()
    }

    fn copies(pairs: &[(u32, u32)]) -> Vec<PageCopy> {
        pairs
            .iter()
            .map(|&(device_page, host_slot)| PageCopy {
                device_page,
                host_slot,
            })
            .collect()
    }

    const HOST: HostSlots = HostSlots {
        base: 1 << 40,
        stride: 4096,
    };

    #[test]
    fn layer_first_pages_move_one_run_per_layer_and_part() {
        let p = mha(3, 8);
        let map = DeviceMap::layer_first(&p);
        let bases: Vec<u64> = (0..6).map(|b| b << 32).collect();
        let plan = Plan::build(&map, &bases, HOST, &copies(&[(5, 2)]));
        let run = p.layout().run_bytes() as u64;
        assert_eq!(plan.runs().len(), 6);
        assert_eq!(plan.bytes(), 6 * run);
        assert_eq!(
            plan.runs()[4],
            Run {
                device: (4 << 32) + 5 * run,
                host: HOST.base + 2 * HOST.stride + 4 * run,
                len: run
            }
        );
    }

    #[test]
    fn a_block_first_page_is_one_run_and_consecutive_pages_into_packed_slots_merge() {
        let p = mha(4, 8);
        let map = block_first(&p);
        let page = p.layout().page_bytes() as u64;
        let one = Plan::build(&map, &[0], HOST, &copies(&[(3, 1)]));
        assert_eq!(
            one.runs(),
            &[Run {
                device: 3 * page,
                host: HOST.base + HOST.stride,
                len: page
            }]
        );
        let packed = HostSlots {
            base: HOST.base,
            stride: page,
        };
        let many = Plan::build(
            &map,
            &[0],
            packed,
            &copies(&[(2, 0), (3, 1), (4, 2), (0, 3)]),
        );
        assert_eq!(many.runs().len(), 2, "{:?}", many.runs());
        assert_eq!(many.runs()[0].len, 3 * page);
    }

    #[test]
    fn an_empty_list_plans_nothing_and_batches_split_at_the_limit() {
        let p = mha(2, 8);
        let map = DeviceMap::layer_first(&p);
        let plan = Plan::build(&map, &[0, 1 << 20, 2 << 20, 3 << 20], HOST, &[]);
        assert_eq!(plan.batches(8).count(), 0);
        assert!(plan.split(4).is_empty());
        let plan = Plan::build(
            &map,
            &[0, 1 << 20, 2 << 20, 3 << 20],
            HOST,
            &copies(&[(0, 0), (1, 5), (2, 7)]),
        );
        let sizes: Vec<usize> = plan.batches(5).map(<[Run]>::len).collect();
        assert_eq!(sizes, vec![5, 5, 2]);
        let parts = plan.split(4);
        assert_eq!(parts.len(), 4);
        assert_eq!(parts.iter().map(|s| s.len()).sum::<usize>(), 12);
    }

    #[test]
    fn bad_maps_are_refused_by_run() {
        let p = mha(2, 8);
        let run = p.layout().run_bytes() as u64;
        let ok = k_then_v_per_layer(&p);
        let mut places = ok.places().to_vec();
        let err = |places: Vec<RunPlace>, regions: Vec<u64>| {
            DeviceMap::new(p.clone(), regions, places)
                .unwrap_err()
                .to_string()
        };
        let regions = ok.region_bytes().to_vec();
        assert!(err(places[..3].to_vec(), regions.clone()).contains("4 runs per page"));
        places[2].region = 9;
        assert!(err(places.clone(), regions.clone()).contains("runs[2].region"));
        places[2] = ok.places()[2];
        places[3].offset += 1;
        assert!(err(places.clone(), regions.clone()).contains("runs[3]"));
        places[3] = ok.places()[3];
        places[1].page_stride = run - 2;
        assert!(err(places.clone(), regions.clone()).contains("runs[1].page_stride"));
        places[1] = ok.places()[1];
        // Layer 0's V placed one page into its K: K's page 1 is V's page 0.
        places[2].offset = run;
        places[2].region = 0;
        assert!(err(places, regions).contains("overlaps runs[0]"));
    }

    /// A layout from proptest: one of the map shapes, pages in a small pool.
    fn any_map() -> impl Strategy<Value = DeviceMap> {
        (1u32..4, 1u64..7, 0u8..3, any::<bool>()).prop_map(|(layers, pages, shape, mla)| {
            let p = if mla {
                pool(
                    KvKind::Mla {
                        kv_lora_rank: 3,
                        rope_dim: 1,
                    },
                    layers,
                    2,
                    pages,
                )
            } else {
                mha(layers, pages)
            };
            match shape {
                0 => DeviceMap::layer_first(&p),
                1 if !mla => k_then_v_per_layer(&p),
                _ => block_first(&p),
            }
        })
    }

    proptest! {
        /// Executing the plan moves exactly the bytes a byte-by-byte walk of the map says, in
        /// both directions, and touches nothing else.
        #[test]
        fn the_plan_moves_what_the_map_says(
            map in any_map(),
            picks in proptest::collection::vec((0u32..64, 0u32..64), 0..10),
            gap in 0u64..3,
        ) {
            let pool = map.pool().clone();
            let n = pool.num_pages() as u32;
            let run = pool.layout().run_bytes() as u64;
            let page = pool.layout().page_bytes() as u64;
            let slots = 12u32;
            // Distinct pages and slots, as the agent sends them.
            let mut seen_p = std::collections::HashSet::new();
            let mut seen_s = std::collections::HashSet::new();
            let list: Vec<PageCopy> = picks
                .iter()
                .map(|&(d, h)| (d % n, h % slots))
                .filter(|&(d, h)| seen_p.insert(d) && seen_s.insert(h))
                .map(|(device_page, host_slot)| PageCopy { device_page, host_slot })
                .collect();
            // Regions laid out in one address space with a gap between them.
            let mut bases = Vec::new();
            let mut end = 0u64;
            for &r in map.region_bytes() {
                bases.push(end);
                end += r + gap * 7;
            }
            let host = HostSlots { base: end + 64, stride: page + gap * 16 };
            let total = (host.base + u64::from(slots) * host.stride) as usize;
            let plan = Plan::build(&map, &bases, host, &list);
            prop_assert_eq!(plan.bytes(), list.len() as u64 * page);
            let mem: Vec<u8> = (0..total).map(|i| (i * 31 % 251) as u8).collect();
            for to_host in [true, false] {
                let mut got = mem.clone();
                for r in plan.runs() {
                    let (s, d) = if to_host { (r.device, r.host) } else { (r.host, r.device) };
                    got.copy_within(s as usize..(s + r.len) as usize, d as usize);
                }
                let mut want = mem.clone();
                for c in &list {
                    for (i, p) in map.places().iter().enumerate() {
                        for b in 0..run {
                            let dev = bases[p.region] + p.offset
                                + u64::from(c.device_page) * p.page_stride + b;
                            let hst = host.base + u64::from(c.host_slot) * host.stride
                                + i as u64 * run + b;
                            let (s, d) = if to_host { (dev, hst) } else { (hst, dev) };
                            want[d as usize] = mem[s as usize];
                        }
                    }
                }
                prop_assert!(got == want, "to_host={} runs={:?}", to_host, plan.runs());
            }
        }

        /// A map is accepted exactly when no two of its runs share a byte on any pair of pages.
        #[test]
        fn accepted_maps_never_overlap(
            offs in proptest::collection::vec(0u64..64, 2..5),
            stride in 4u64..24,
            pages in 1u64..6,
        ) {
            let p = pool(KvKind::Mla { kv_lora_rank: 1, rope_dim: 0 }, offs.len() as u32, 2, pages);
            let run = p.layout().run_bytes() as u64;
            let places: Vec<RunPlace> = offs
                .iter()
                .map(|&o| RunPlace { region: 0, offset: o, page_stride: stride })
                .collect();
            let mut owner = vec![usize::MAX; 1 << 12];
            let mut clash = false;
            for (i, pl) in places.iter().enumerate() {
                for page in 0..pages {
                    for b in 0..run {
                        let at = (pl.offset + page * pl.page_stride + b) as usize;
                        clash |= owner[at] != usize::MAX;
                        owner[at] = i;
                    }
                }
            }
            let accepted = DeviceMap::new(p, vec![1 << 12], places).is_ok();
            prop_assert_eq!(accepted, !clash);
        }
    }
}
