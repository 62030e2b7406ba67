//! The copy plan: which bytes of the engine's memory go to which bytes of the host pool for a
//! list of pages, as (device address, host address, length) runs that every copy method
//! executes. Pure arithmetic: no device, no unsafe; unit- and property-tested against a
//! byte-by-byte reference.
//!
//! The engine's memory is described by a [`DeviceMap`]: regions (buffers or whole
//! allocations) and a page's pieces, in the order of its bytes in the host slot: for each, the
//! region it lives in, its offset there, its length and the distance between consecutive
//! pages. SGLang's layer-first buffers are one region per run with the run length as stride
//! ([`DeviceMap::layer_first`]); vLLM's layouts (K and V in one tensor per layer, blocks
//! first, or all layers of a block together) are other offsets and strides over the same
//! regions ([`DeviceMap::new`]).
//!
//! [`Plan::build`] walks pages in request order and pieces in slot order, and merges a run into
//! the one before whenever both sides continue where it ended: all runs of a page when the
//! engine keeps a block's layers together, and consecutive pages into consecutive slots.

use kvtier_core::DevicePool;

use crate::{DeviceError, PageCopy};

/// One piece of every page: `len` bytes at `region` base + `offset` + page × `page_stride`.
/// A page's pieces, in order, are its bytes in the host slot, back to back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    /// Index of the region (buffer or allocation).
    pub region: usize,
    /// Byte offset of page 0's piece in the region.
    pub offset: u64,
    /// Bytes from one page's piece to the next page's.
    pub page_stride: u64,
    /// Bytes of the piece.
    pub len: u64,
}

/// The engine's memory: its regions' lengths and where each piece of a page lives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceMap {
    pool: DevicePool,
    region_bytes: Vec<u64>,
    pieces: Vec<Piece>,
}

/// Most pieces a page may have. vLLM's layouts have at most one or two per layer and block
/// (the K/V axis before the block axis splits a block in two), so a few hundred; the bound
/// keeps the overlap check (pairs whose spans overlap) small whatever a client sends: 1,024
/// pieces whose spans all overlap took 11 ms to check (the worst case; 32,768 took 8 to 24
/// s before the bound).
pub const MAX_PIECES: usize = 1024;

/// Most regions (buffers or allocations) a map may have: each is a mapping or an IPC import
/// the agent holds.
pub const MAX_REGIONS: usize = 1024;

fn invalid(field: String, reason: String) -> DeviceError {
    DeviceError::Invalid { field, reason }
}

impl DeviceMap {
    /// One buffer per run, pages back to back (`[token_slot][...]`): the cpu device's pool
    /// file and the per-buffer IPC handles. A piece is a run.
    pub fn layer_first(pool: &DevicePool) -> Self {
        let run = pool.layout().run_bytes() as u64;
        Self {
            region_bytes: vec![pool.buffer_bytes() as u64; pool.num_buffers()],
            pieces: (0..pool.num_buffers())
                .map(|region| Piece {
                    region,
                    offset: 0,
                    page_stride: run,
                    len: run,
                })
                .collect(),
            pool: pool.clone(),
        }
    }

    /// Validates an explicit map: pieces that add up to the page, each page of each piece
    /// inside its region, and no two pieces of any pages overlapping. Errors name the piece
    /// (`pieces[i]`) and what is wrong.
    pub fn new(
        pool: DevicePool,
        region_bytes: Vec<u64>,
        pieces: Vec<Piece>,
    ) -> Result<Self, DeviceError> {
        if pieces.len() > MAX_PIECES {
            return Err(invalid(
                "pieces".into(),
                format!("{} pieces; at most {MAX_PIECES}", pieces.len()),
            ));
        }
        if region_bytes.len() > MAX_REGIONS {
            return Err(invalid(
                "regions".into(),
                format!("{} allocations; at most {MAX_REGIONS}", region_bytes.len()),
            ));
        }
        let page = pool.layout().page_bytes() as u64;
        let total = pieces.iter().try_fold(0u64, |a, p| a.checked_add(p.len));
        if total != Some(page) {
            return Err(invalid(
                "pieces".into(),
                format!(
                    "{} pieces of {} bytes in all, for pages of {page} bytes",
                    pieces.len(),
                    total.map_or_else(|| "overflowing".to_string(), |t| t.to_string())
                ),
            ));
        }
        let pages = pool.num_pages() as u64;
        for (i, p) in pieces.iter().enumerate() {
            if p.len == 0 {
                return Err(invalid(
                    format!("pieces[{i}].len"),
                    "must be at least 1".into(),
                ));
            }
            let Some(&region) = region_bytes.get(p.region) else {
                return Err(invalid(
                    format!("pieces[{i}].region"),
                    format!(
                        "{} is not one of the {} regions",
                        p.region,
                        region_bytes.len()
                    ),
                ));
            };
            if pages > 1 && p.page_stride < p.len {
                return Err(invalid(
                    format!("pieces[{i}].page_stride"),
                    format!(
                        "{} is below the piece's {} bytes: pages would overlap",
                        p.page_stride, p.len
                    ),
                ));
            }
            let end = (pages - 1)
                .checked_mul(p.page_stride)
                .and_then(|b| b.checked_add(p.offset))
                .and_then(|b| b.checked_add(p.len));
            if end.is_none_or(|e| e > region) {
                return Err(invalid(
                    format!("pieces[{i}]"),
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
        if let Some((a, b)) = first_overlap(&pieces, pages) {
            return Err(invalid(
                format!("pieces[{b}]"),
                format!(
                    "overlaps pieces[{a}] for some pages in region {}",
                    pieces[a].region
                ),
            ));
        }
        Ok(Self {
            pool,
            region_bytes,
            pieces,
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

    /// The pieces of a page, in host order.
    pub fn pieces(&self) -> &[Piece] {
        &self.pieces
    }
}

/// Two pieces (indices, the lower first) some of whose pages overlap, if any. Only pieces
/// whose spans (first page's start to last page's end) overlap can: pieces are sorted by
/// region and offset, and each is checked against those that start inside its span.
fn first_overlap(pieces: &[Piece], pages: u64) -> Option<(usize, usize)> {
    let span_end = |p: &Piece| {
        u128::from(p.offset) + u128::from(pages - 1) * u128::from(p.page_stride) + u128::from(p.len)
    };
    let mut order: Vec<usize> = (0..pieces.len()).collect();
    order.sort_unstable_by_key(|&i| (pieces[i].region, pieces[i].offset));
    for (n, &i) in order.iter().enumerate() {
        let end = span_end(&pieces[i]);
        for &j in &order[n + 1..] {
            if pieces[j].region != pieces[i].region || u128::from(pieces[j].offset) >= end {
                break;
            }
            if overlap(&pieces[i], &pieces[j], pages) {
                return Some((i.min(j), i.max(j)));
            }
        }
    }
    None
}

/// Whether some page of piece `a` overlaps some page of piece `b` (`pages` pages each).
/// Pieces of one stride are checked exactly; pieces of different strides must keep to
/// disjoint spans.
fn overlap(a: &Piece, b: &Piece, pages: u64) -> bool {
    if a.region != b.region {
        return false;
    }
    let n = i128::from(pages);
    let (la, lb) = (i128::from(a.len), i128::from(b.len));
    let (oa, ob) = (i128::from(a.offset), i128::from(b.offset));
    if a.page_stride == b.page_stride || pages == 1 {
        // Page q of b starts x = d + k·s after page p of a (k = q − p in (−n, n)); they
        // overlap when −lb < x < la. The x nearest 0 from either side decides.
        let s = i128::from(a.page_stride);
        let d = ob - oa;
        let hits = |x: i128| -lb < x && x < la;
        if s == 0 || pages == 1 {
            return hits(d);
        }
        let k0 = (-d).div_euclid(s);
        return [k0, k0 + 1]
            .into_iter()
            .map(|k| k.clamp(-(n - 1), n - 1))
            .any(|k| hits(d + k * s));
    }
    let end = |o: i128, s: u64, l: i128| o + (n - 1) * i128::from(s) + l;
    oa < end(ob, b.page_stride, lb) && ob < end(oa, a.page_stride, la)
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
        let mut runs: Vec<Run> = Vec::with_capacity(copies.len());
        let mut bytes = 0;
        for c in copies {
            let mut host_at = host.base + u64::from(c.host_slot) * host.stride;
            let page = u64::from(c.device_page);
            for p in &map.pieces {
                let run = Run {
                    device: bases[p.region] + p.offset + page * p.page_stride,
                    host: host_at,
                    len: p.len,
                };
                host_at += p.len;
                bytes += p.len;
                match runs.last_mut() {
                    Some(last)
                        if last.device + last.len == run.device
                            && last.host + last.len == run.host =>
                    {
                        last.len += run.len;
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
                (0..layers).map(move |l| Piece {
                    region: l,
                    offset: part * n * run,
                    page_stride: run,
                    len: run,
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
            .map(|i| Piece {
                region: 0,
                offset: i * run,
                page_stride: runs * run,
                len: run,
            })
            .collect();
        DeviceMap::new(p.clone(), vec![n * runs * run], places).unwrap()
    }

    /// Every run in two uneven pieces in two regions: the first 5 bytes of each run's pages
    /// back to back in region 0, the rest in region 1 (a layout whose block is not one
    /// contiguous span per layer).
    fn split_runs(p: &DevicePool) -> DeviceMap {
        let (run, n, runs) = (
            p.layout().run_bytes() as u64,
            p.num_pages() as u64,
            p.layout().runs_per_page() as u64,
        );
        let (a, b) = (5, run - 5);
        let pieces = (0..runs)
            .flat_map(|r| {
                [
                    Piece {
                        region: 0,
                        offset: r * n * a,
                        page_stride: a,
                        len: a,
                    },
                    Piece {
                        region: 1,
                        offset: r * n * b,
                        page_stride: b,
                        len: b,
                    },
                ]
            })
            .collect();
        DeviceMap::new(p.clone(), vec![runs * n * a, runs * n * b], pieces).unwrap()
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
        let mut places = ok.pieces().to_vec();
        let err = |places: Vec<Piece>, regions: Vec<u64>| {
            DeviceMap::new(p.clone(), regions, places)
                .unwrap_err()
                .to_string()
        };
        let regions = ok.region_bytes().to_vec();
        assert!(err(places[..3].to_vec(), regions.clone()).contains("for pages of"));
        places[2].region = 9;
        assert!(err(places.clone(), regions.clone()).contains("pieces[2].region"));
        places[2] = ok.pieces()[2];
        places[3].offset += 1;
        assert!(err(places.clone(), regions.clone()).contains("pieces[3]"));
        places[3] = ok.pieces()[3];
        places[1].page_stride = run - 2;
        assert!(err(places.clone(), regions.clone()).contains("pieces[1].page_stride"));
        places[1] = ok.pieces()[1];
        // Layer 0's V placed one page into its K: K's page 1 is V's page 0.
        places[2].offset = run;
        places[2].region = 0;
        assert!(err(places.clone(), regions.clone()).contains("overlaps pieces[0]"));
        places[2] = ok.pieces()[2];
        places[0].len = 0;
        places[1].len += run;
        assert!(err(places, regions).contains("pieces[0].len"));
    }

    /// A layout from proptest: one of the map shapes, pages in a small pool.
    fn any_map() -> impl Strategy<Value = DeviceMap> {
        (1u32..4, 1u64..7, 0u8..4, any::<bool>()).prop_map(|(layers, pages, shape, mla)| {
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
                3 => split_runs(&p),
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
                    let mut at = 0;
                    for p in map.pieces() {
                        for b in 0..p.len {
                            let dev = bases[p.region] + p.offset
                                + u64::from(c.device_page) * p.page_stride + b;
                            let hst = host.base + u64::from(c.host_slot) * host.stride
                                + at + b;
                            let (s, d) = if to_host { (dev, hst) } else { (hst, dev) };
                            want[d as usize] = mem[s as usize];
                        }
                        at += p.len;
                    }
                }
                prop_assert!(got == want, "to_host={} runs={:?}", to_host, plan.runs());
            }
        }

        /// `overlap` is exact for pieces of one stride (any lengths) and never misses an
        /// overlap of pieces of different strides.
        #[test]
        fn overlap_agrees_with_a_byte_walk(
            oa in 0u64..48, la in 1u64..9, ob in 0u64..48, lb in 1u64..9,
            sa in 1u64..20, sb in 1u64..20, pages in 1u64..6, same in any::<bool>(),
        ) {
            let sb = if same { sa } else { sb };
            let a = Piece { region: 0, offset: oa, page_stride: sa, len: la };
            let b = Piece { region: 0, offset: ob, page_stride: sb, len: lb };
            let bytes = |p: &Piece| -> std::collections::HashSet<u64> {
                (0..pages)
                    .flat_map(|q| (0..p.len).map(move |x| p.offset + q * p.page_stride + x))
                    .collect()
            };
            let clash = !bytes(&a).is_disjoint(&bytes(&b));
            if same || pages == 1 {
                prop_assert_eq!(overlap(&a, &b, pages), clash);
            } else if clash {
                prop_assert!(overlap(&a, &b, pages));
            }
            let elsewhere = Piece { region: 1, ..b };
            prop_assert!(!overlap(&a, &elsewhere, pages));
        }

        /// Checking only pieces whose spans overlap finds an overlapping pair exactly when
        /// checking every pair does.
        #[test]
        fn the_pruned_check_finds_what_every_pair_finds(
            raw in proptest::collection::vec((0usize..2, 0u64..64, 1u64..12, 1u64..6), 1..24),
            pages in 1u64..5,
        ) {
            let pieces: Vec<Piece> = raw
                .iter()
                .map(|&(region, offset, page_stride, len)| Piece {
                    region,
                    offset,
                    page_stride: page_stride.max(len),
                    len,
                })
                .collect();
            let every = (0..pieces.len()).any(|a| {
                (a + 1..pieces.len()).any(|b| overlap(&pieces[a], &pieces[b], pages))
            });
            prop_assert_eq!(first_overlap(&pieces, pages).is_some(), every);
        }
    }

    #[test]
    fn too_many_pieces_or_regions_are_refused_before_any_is_checked() {
        let pool = mha(1, 8);
        let one = Piece {
            region: 0,
            offset: 0,
            page_stride: 1,
            len: 1,
        };
        let e = DeviceMap::new(pool.clone(), vec![1 << 20], vec![one; MAX_PIECES + 1])
            .unwrap_err()
            .to_string();
        assert!(e.contains("pieces; at most 1024"), "{e}");
        let e = DeviceMap::new(pool, vec![1; MAX_REGIONS + 1], vec![one])
            .unwrap_err()
            .to_string();
        assert!(e.contains("allocations; at most 1024"), "{e}");
    }
}
