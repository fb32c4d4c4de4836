//! The transfer planner: which bytes of a prefill rank go where on a decode
//! rank, as `(src, dst, len)` descriptors split into bounded batches.
//!
//! Planning happens in two steps, because the layouts of a P/D pair are
//! known once per peer while block lists arrive once per request:
//!
//! ```
//! use kvferry_machines::{BatchLimits, LayoutKind, ModelSpec, PairLayout, Plan, RankLayout, Region, Stage};
//!
//! let model = ModelSpec { layout: LayoutKind::Hnd, total_kv_heads: 8, block_tokens: 16, head_bytes: 256 };
//! let kv = 8 * 16 * 256;
//! let layout = |base| RankLayout {
//!     tp_size: 1, tp_rank: 0, num_blocks: 64,
//!     regions: vec![Region { base, block_len: kv, kv_block_len: kv }],
//!     stage: Stage::SINGLE,
//!     pools: Vec::new(),
//! };
//! // Validated once per peer: bad metadata is an error here, never a panic later.
//! let pair = PairLayout::new(&model, &layout(0x1000_0000), &layout(0x9000_0000)).unwrap();
//! // Once per request; `plan` keeps its allocations between calls.
//! let mut plan = Plan::default();
//! pair.plan_into(&[vec![3, 4, 5]], &[vec![10, 11, 12]], &BatchLimits::default(), &mut plan).unwrap();
//! assert_eq!(plan.descriptors.len(), 1); // three consecutive blocks, one copy
//! assert_eq!(plan.descriptors[0].len, 3 * kv);
//! ```
//!
//! The rules (heads per rank, which P rank sends which head, region and
//! group pairing, partial prefix hits, coalescing, batching) are those of
//! `kvferry plan`, documented on [`PairLayout`] and [`TpPair`].

use crate::layout::{BatchLimits, LayoutKind, ModelSpec, RankLayout, Region, Side, Stage};

mod batch;
mod error;
mod maps;
mod pools;
mod regions;
mod runs;
mod tp;

pub use batch::{split_batches, Batch, Descriptor};
pub use error::PlanError;
pub use regions::REGIONS_MAX;
pub use runs::Scratch;
pub use tp::{Peers, Share, TpPair};

use batch::{Batcher, Sink};
use maps::{RegionMap, Run};
use regions::region_last_byte;
use runs::{check_disjoint, continues_run, emit_region_by_run, CHUNK};

/// Number of blocks a sliding window of `window_tokens` tokens can touch:
/// `ceil(window / block_tokens) + 1` (one more for a window that straddles
/// a block boundary), or 0 for no window (full attention) or zero-sized blocks.
pub fn sliding_window_blocks(window_tokens: u64, block_tokens: u64) -> usize {
    if window_tokens == 0 || block_tokens == 0 {
        return 0;
    }
    let blocks = window_tokens.div_ceil(block_tokens).saturating_add(1);
    usize::try_from(blocks).unwrap_or(usize::MAX)
}

/// Keeps the last `window_blocks` blocks of a group's block list: a
/// sliding-window layer never reads older blocks, so they need not move.
/// `window_blocks == 0` means no window and returns the list unchanged.
pub fn clip_to_window(blocks: &[u64], window_blocks: usize) -> &[u64] {
    if window_blocks == 0 || blocks.len() <= window_blocks {
        blocks
    } else {
        &blocks[blocks.len() - window_blocks..]
    }
}

/// A plan: descriptors in posting order and the batches covering them.
/// Reuse one across requests with [`PairLayout::plan_into`].
#[derive(Clone, Debug, Default)]
pub struct Plan {
    /// Copies, coalesced, each at most `batch_bytes_max` bytes.
    pub descriptors: Vec<Descriptor>,
    /// Consecutive batches covering `descriptors` in order.
    pub batches: Vec<Batch>,
    scratch: Scratch,
}

impl Plan {
    /// True iff the plan moves any byte.
    pub fn is_transfer(&self) -> bool {
        !self.descriptors.is_empty()
    }

    /// The descriptors of batch `index`, or `None` past the last batch.
    pub fn batch(&self, index: usize) -> Option<&[Descriptor]> {
        let batch = self.batches.get(index)?;
        self.descriptors.get(batch.range())
    }

    /// Total bytes moved.
    pub fn total_bytes(&self) -> u64 {
        self.descriptors
            .iter()
            .fold(0u64, |sum, d| sum.saturating_add(d.len))
    }
}

/// A validated P/D layout pair: the part of planning that depends only on
/// the two ranks' layouts, computed once per peer.
///
/// Region `i` of prefill pairs with region `i` of decode. Block `b` of a
/// region starts at `base + b·block_len`; its first `kv_block_len` bytes are
/// the rank's KV, laid out per [`LayoutKind`]. Validation rejects: TP sizes
/// that do not fit the head count, ranks outside their group, region counts
/// that differ, `kv_block_len` not equal to heads-per-rank × block_tokens ×
/// head_bytes (HND/NHD) or not equal on both sides (MLA), a zero
/// `kv_block_len` or one longer than `block_len`, regions whose last byte
/// overflows 64 bits, and regions of one side that share bytes (interleaved
/// regions, such as K and V halves of one block, are fine).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PairLayout {
    prefill_num_blocks: u64,
    decode_num_blocks: u64,
    share: Option<Share>,
    /// Empty when this pair transfers nothing.
    regions: Vec<RegionMap>,
    /// One per pool of the layouts; a request's last `pools.len()` block
    /// lists are their indices.
    pools: Vec<pools::PoolMap>,
}

impl PairLayout {
    /// Validates the two layouts and precomputes each region's copy shape.
    pub fn new(
        model: &ModelSpec,
        prefill: &RankLayout,
        decode: &RankLayout,
    ) -> Result<PairLayout, PlanError> {
        let tp = TpPair::new(model, prefill.tp_size, decode.tp_size)?;
        validate_side(model, prefill, Side::Prefill)?;
        validate_side(model, decode, Side::Decode)?;
        let share = tp.share(prefill.tp_rank, decode.tp_rank);
        let pools = pools::pair(&tp, prefill, decode, share)?;
        // Decode's regions that pair with prefill's, region for region;
        // `None`: another stage's layers, nothing to move between the two.
        let Some(offset) = stage_offset(prefill, decode)? else {
            return Ok(PairLayout {
                prefill_num_blocks: prefill.num_blocks,
                decode_num_blocks: decode.num_blocks,
                share: None,
                regions: Vec::new(),
                pools,
            });
        };
        let decode_regions = &decode.regions[offset..offset + prefill.regions.len()];
        if model.layout == LayoutKind::Mla {
            for (i, (p, d)) in prefill.regions.iter().zip(decode_regions).enumerate() {
                if p.kv_block_len != d.kv_block_len {
                    return Err(PlanError::MlaKvLen {
                        region: i,
                        prefill: p.kv_block_len,
                        decode: d.kv_block_len,
                    });
                }
            }
        }
        let regions = match share {
            None => Vec::new(),
            Some(share) => prefill
                .regions
                .iter()
                .zip(decode_regions)
                .map(|(p, d)| region_map(model, &tp, prefill, decode, share, p, d))
                .collect(),
        };
        Ok(PairLayout {
            prefill_num_blocks: prefill.num_blocks,
            decode_num_blocks: decode.num_blocks,
            share,
            regions,
            pools,
        })
    }

    /// What this pair transfers, or `None` if the decode rank gets nothing
    /// from this prefill rank.
    pub fn share(&self) -> Option<Share> {
        self.share
    }

    /// Plans one request into `out`, reusing its allocations. Groups pair by
    /// index; in each, when prefill has more blocks than decode only its last
    /// `len(decode)` blocks are sent (decode already holds the prefix). On
    /// error `out` is left empty.
    pub fn plan_into<P: AsRef<[u64]>, D: AsRef<[u64]>>(
        &self,
        prefill_blocks: &[P],
        decode_blocks: &[D],
        limits: &BatchLimits,
        out: &mut Plan,
    ) -> Result<(), PlanError> {
        out.descriptors.clear();
        out.batches.clear();
        let result = self.fill(
            prefill_blocks,
            decode_blocks,
            limits,
            &mut out.scratch,
            &mut out.descriptors,
            Some(&mut out.batches),
        );
        if result.is_err() {
            out.descriptors.clear();
            out.batches.clear();
        }
        result
    }

    /// Like [`PairLayout::plan_into`], but only the descriptors, into a
    /// caller-owned vector (cleared first). Every descriptor is at most
    /// `limits.batch_bytes_max` bytes; batch them with [`split_batches`].
    pub fn descriptors_into<P: AsRef<[u64]>, D: AsRef<[u64]>>(
        &self,
        prefill_blocks: &[P],
        decode_blocks: &[D],
        limits: &BatchLimits,
        scratch: &mut Scratch,
        out: &mut Vec<Descriptor>,
    ) -> Result<(), PlanError> {
        out.clear();
        let result = self.fill(prefill_blocks, decode_blocks, limits, scratch, out, None);
        if result.is_err() {
            out.clear();
        }
        result
    }

    fn fill<P: AsRef<[u64]>, D: AsRef<[u64]>>(
        &self,
        prefill_blocks: &[P],
        decode_blocks: &[D],
        limits: &BatchLimits,
        scratch: &mut Scratch,
        out: &mut Vec<Descriptor>,
        batches: Option<&mut Vec<Batch>>,
    ) -> Result<(), PlanError> {
        if limits.batch_descriptors_max == 0 || limits.batch_bytes_max == 0 {
            return Err(PlanError::ZeroBatchLimit);
        }
        let kv = self.kv_lists(prefill_blocks.len(), decode_blocks.len())?;
        let (prefill_blocks, prefill_pools) = prefill_blocks.split_at(kv);
        let (decode_blocks, decode_pools) = decode_blocks.split_at(kv);
        self.build_runs(prefill_blocks, decode_blocks, &mut scratch.runs)?;
        for side in [Side::Prefill, Side::Decode] {
            let num_blocks = match side {
                Side::Prefill => self.prefill_num_blocks,
                Side::Decode => self.decode_num_blocks,
            };
            check_disjoint(side, num_blocks, scratch)?;
        }
        // Cleared even without pools: one scratch serves every pair.
        scratch.pool_runs.clear();
        if !self.pools.is_empty() {
            pools::build_runs(&self.pools, prefill_pools, decode_pools, kv, scratch)?;
        }
        let kv_moves = !self.regions.is_empty() && !scratch.runs.is_empty();
        if !kv_moves && scratch.pool_runs.is_empty() {
            return Ok(());
        }
        self.reserve(&scratch.runs, &scratch.pool_runs, limits, out)?;
        self.emit_regions(&scratch.runs, &scratch.pool_runs, limits, out, batches)
    }

    /// How many of a request's block lists are KV groups: all but the
    /// last one per pool.
    fn kv_lists(&self, prefill: usize, decode: usize) -> Result<usize, PlanError> {
        if prefill != decode {
            return Err(PlanError::GroupCount { prefill, decode });
        }
        let pools = self.pools.len();
        prefill
            .checked_sub(pools)
            .ok_or(PlanError::MissingPoolLists {
                lists: prefill,
                pools,
            })
    }

    /// Counts what the plan needs before byte splitting: a lower bound, so
    /// a plan over the limit fails before anything is allocated, and a
    /// large plan grows its vector once instead of copying it log(n) times.
    fn reserve(
        &self,
        runs: &[Run],
        pool_runs: &[(usize, Run)],
        limits: &BatchLimits,
        out: &mut Vec<Descriptor>,
    ) -> Result<(), PlanError> {
        let blocks: u64 = runs.iter().map(|r| r.len).sum();
        let mut estimate = pools::estimate(&self.pools, pool_runs);
        for map in &self.regions {
            let per_region = if map.whole_blocks {
                runs.len() as u64
            } else {
                blocks.saturating_mul(map.slices)
            };
            estimate = estimate.saturating_add(usize::try_from(per_region).unwrap_or(usize::MAX));
        }
        if estimate > limits.descriptors_max {
            return Err(PlanError::TooManyDescriptors {
                max: limits.descriptors_max,
            });
        }
        out.reserve(estimate);
        Ok(())
    }

    /// Writes the copies of every region over `runs` into `out`, cutting
    /// batches into `batches` as it goes.
    // Inline, so that the hot path compiles into the caller's instance of
    // the generic `fill`: out of line it is compiled once in this crate, and
    // the random-id case of `benches/planner.rs` runs measurably slower.
    #[inline]
    fn emit_regions(
        &self,
        runs: &[Run],
        pool_runs: &[(usize, Run)],
        limits: &BatchLimits,
        out: &mut Vec<Descriptor>,
        batches: Option<&mut Vec<Batch>>,
    ) -> Result<(), PlanError> {
        // Descriptors never need merging after the fact: two copies abut on
        // both sides only when they are whole blocks consecutive on both
        // sides, which is exactly a run, and a run is emitted as one copy.
        // (Token slices of NHD abut only when they are whole rows on both
        // sides, and `region_map` then copies the whole block instead.)
        // Copies of different regions never merge either: each region is its
        // own memory registration, and a descriptor must stay inside one.
        let longest_run = runs.iter().map(|r| r.len).max().unwrap_or(0);
        // Batches are cut while the descriptors just written are still in
        // cache: a separate pass would read the whole plan back from memory.
        let mut sink = Sink {
            out,
            bytes_max: limits.batch_bytes_max,
            descriptors_max: limits.descriptors_max,
            batches,
            batcher: Batcher::default(),
            limits,
        };
        for map in &self.regions {
            if map.whole_blocks && map.len.saturating_mul(longest_run) <= limits.batch_bytes_max {
                // The hot path: one copy per run, none over the byte limit.
                sink.extend_runs(map, runs)?;
                sink.cut_batches(map.len * longest_run);
            } else {
                emit_region_by_run(&mut sink, map, runs, limits)?;
            }
        }
        if !pool_runs.is_empty() {
            pools::emit(&self.pools, pool_runs, &mut sink, limits)?;
        }
        sink.finish_batches();
        Ok(())
    }

    /// Trims each group to decode's length, checks block ids, and groups the
    /// pairs into runs consecutive on both sides (vLLM's
    /// `group_concurrent_contiguous`, over the flattened groups).
    fn build_runs<P: AsRef<[u64]>, D: AsRef<[u64]>>(
        &self,
        prefill_blocks: &[P],
        decode_blocks: &[D],
        runs: &mut Vec<Run>,
    ) -> Result<(), PlanError> {
        runs.clear();
        if prefill_blocks.len() != decode_blocks.len() {
            return Err(PlanError::GroupCount {
                prefill: prefill_blocks.len(),
                decode: decode_blocks.len(),
            });
        }
        for (group, (p, d)) in prefill_blocks.iter().zip(decode_blocks).enumerate() {
            let (p, d) = (p.as_ref(), d.as_ref());
            if p.len() < d.len() {
                return Err(PlanError::FewerPrefillBlocks {
                    group,
                    prefill: p.len(),
                    decode: d.len(),
                });
            }
            self.push_group_runs(group, &p[p.len() - d.len()..], d, runs)?;
        }
        Ok(())
    }

    /// Appends the pairs `(p[i], d[i])` of group `group` (equal lengths) to
    /// `runs`, extending the last run while the pairs continue it.
    #[inline]
    fn push_group_runs(
        &self,
        group: usize,
        p: &[u64],
        d: &[u64],
        runs: &mut Vec<Run>,
    ) -> Result<(), PlanError> {
        // Whether the last pair extended the current run: only then is
        // the next chunk worth testing as a whole.
        let mut streak = false;
        let mut i = 0;
        while i < p.len() {
            if streak && p.len() - i >= CHUNK {
                if let Some(run) = runs.last_mut() {
                    if continues_run(run, &p[i..i + CHUNK], &d[i..i + CHUNK])
                        && p[i + CHUNK - 1] < self.prefill_num_blocks
                        && d[i + CHUNK - 1] < self.decode_num_blocks
                    {
                        // The chunk ascends by one on both sides, so its
                        // last ids are its largest: all are in range.
                        run.len += CHUNK as u64;
                        i += CHUNK;
                        continue;
                    }
                }
            }
            let (pb, db) = (p[i], d[i]);
            self.check_pair(group, pb, db)?;
            match runs.last_mut() {
                Some(run) if run.src + run.len == pb && run.dst + run.len == db => {
                    run.len += 1;
                    streak = true;
                }
                _ => {
                    runs.push(Run {
                        src: pb,
                        dst: db,
                        len: 1,
                    });
                    streak = false;
                }
            }
            i += 1;
        }
        Ok(())
    }

    /// Checks that prefill block `pb` and decode block `db` of `group`
    /// exist on their sides.
    #[inline]
    fn check_pair(&self, group: usize, pb: u64, db: u64) -> Result<(), PlanError> {
        if pb >= self.prefill_num_blocks {
            return Err(PlanError::BlockOutOfRange {
                side: Side::Prefill,
                group,
                block: pb,
                num_blocks: self.prefill_num_blocks,
            });
        }
        if db >= self.decode_num_blocks {
            return Err(PlanError::BlockOutOfRange {
                side: Side::Decode,
                group,
                block: db,
                num_blocks: self.decode_num_blocks,
            });
        }
        Ok(())
    }
}

/// Convenience: validates both layouts and plans one request.
pub fn plan<P: AsRef<[u64]>, D: AsRef<[u64]>>(
    model: &ModelSpec,
    prefill: &RankLayout,
    decode: &RankLayout,
    prefill_blocks: &[P],
    decode_blocks: &[D],
    limits: &BatchLimits,
) -> Result<Plan, PlanError> {
    let pair = PairLayout::new(model, prefill, decode)?;
    let mut out = Plan::default();
    pair.plan_into(prefill_blocks, decode_blocks, limits, &mut out)?;
    Ok(out)
}

/// Bytes of one block of one region for a rank holding `heads_per_rank`
/// heads, or `None` if that does not fit in u64.
fn kv_len(model: &ModelSpec, heads_per_rank: u32) -> Option<u64> {
    u64::from(heads_per_rank)
        .checked_mul(u64::from(model.block_tokens))?
        .checked_mul(model.head_bytes)
}

fn validate_side(model: &ModelSpec, layout: &RankLayout, side: Side) -> Result<(), PlanError> {
    if layout.tp_rank >= layout.tp_size {
        return Err(PlanError::TpRank {
            side,
            tp_rank: layout.tp_rank,
            tp_size: layout.tp_size,
        });
    }
    if layout.regions.len() > REGIONS_MAX {
        return Err(PlanError::TooManyRegions {
            side,
            regions: layout.regions.len(),
        });
    }
    let expected = match model.layout {
        LayoutKind::Mla => None,
        LayoutKind::Hnd | LayoutKind::Nhd => Some(
            kv_len(model, model.heads_per_rank(layout.tp_size)).ok_or(PlanError::Model(
                "heads per rank x block_tokens x head_bytes overflows 64 bits",
            ))?,
        ),
    };
    for (i, r) in layout.regions.iter().enumerate() {
        if let Some(expected) = expected {
            if r.kv_block_len != expected {
                return Err(PlanError::RegionKvLen {
                    side,
                    region: i,
                    kv_block_len: r.kv_block_len,
                    expected,
                });
            }
        }
        if r.kv_block_len == 0 || r.kv_block_len > r.block_len {
            return Err(PlanError::RegionBlockLen {
                side,
                region: i,
                kv_block_len: r.kv_block_len,
                block_len: r.block_len,
            });
        }
        if layout.num_blocks > 0 && region_last_byte(r, layout.num_blocks).is_none() {
            return Err(PlanError::RegionOverflow { side, region: i });
        }
    }
    check_regions_disjoint(&layout.regions, layout.num_blocks, side)?;
    pools::validate(layout, side)
}

/// Rejects two regions of one side that share a byte. Regions that start
/// inside another must interleave with it: same block stride, and each one's
/// KV bytes in a different part of the block. That accepts K and V stored in
/// one block as two regions, and conservatively rejects stranger overlaps.
fn check_regions_disjoint(
    regions: &[Region],
    num_blocks: u64,
    side: Side,
) -> Result<(), PlanError> {
    if num_blocks == 0 || regions.len() < 2 {
        return Ok(());
    }
    let mut order: Vec<usize> = (0..regions.len()).collect();
    order.sort_unstable_by_key(|&i| regions[i].base);
    for (k, &i) in order.iter().enumerate() {
        let a = &regions[i];
        // Validated above, so the last byte exists.
        let last = region_last_byte(a, num_blocks).unwrap_or(u64::MAX);
        for &j in &order[k + 1..] {
            let b = &regions[j];
            if b.base > last {
                break;
            }
            let offset = (b.base - a.base) % a.block_len.max(1);
            let interleaved = a.block_len == b.block_len
                && offset >= a.kv_block_len
                && b.kv_block_len <= a.block_len - offset;
            if !interleaved {
                return Err(PlanError::RegionsOverlap {
                    side,
                    first: i.min(j),
                    second: i.max(j),
                });
            }
        }
    }
    Ok(())
}

/// Where prefill's regions start among decode's, by the two stages:
/// `Some(offset)` when decode holds every layer prefill holds, `None` when
/// they hold different layers (equal PP sizes, different stages).
///
/// Supported: equal PP sizes (stage `s` feeds stage `s`, same regions) and
/// a decode engine without pipeline parallelism fed by every stage of a
/// prefill engine that has it (each stage's regions within decode's).
fn stage_offset(prefill: &RankLayout, decode: &RankLayout) -> Result<Option<usize>, PlanError> {
    let (p, d) = (prefill.stage, decode.stage);
    let mismatch = || PlanError::StageMismatch {
        prefill: (p, prefill.regions.len()),
        decode: (d, decode.regions.len()),
    };
    let in_range = |s: Stage| s.pp_size >= 1 && s.pp_rank < s.pp_size;
    if !in_range(p) || !in_range(d) {
        return Err(mismatch());
    }
    if p.pp_size == d.pp_size {
        if p.pp_rank != d.pp_rank {
            return Ok(None);
        }
        if prefill.regions.len() != decode.regions.len() {
            return Err(PlanError::RegionCount {
                prefill: prefill.regions.len(),
                decode: decode.regions.len(),
            });
        }
        if p.first_region != d.first_region {
            return Err(mismatch());
        }
        return Ok(Some(0));
    }
    if d.pp_size != 1 {
        return Err(mismatch());
    }
    let start = p.first_region as usize;
    let end = start + prefill.regions.len();
    // The first stage starts at decode's first region and the last ends at
    // its last, so a prefill engine with fewer layers cannot pass.
    let first_fits = p.pp_rank != 0 || start == 0;
    let last_fits = p.pp_rank + 1 != p.pp_size || end == decode.regions.len();
    if end > decode.regions.len() || !first_fits || !last_fits {
        return Err(mismatch());
    }
    Ok(Some(start))
}

fn region_map(
    model: &ModelSpec,
    tp: &TpPair,
    prefill: &RankLayout,
    decode: &RankLayout,
    share: Share,
    p: &Region,
    d: &Region,
) -> RegionMap {
    let mut map = RegionMap {
        src_base: p.base,
        src_block_len: p.block_len,
        dst_base: d.base,
        dst_block_len: d.block_len,
        src_off: 0,
        dst_off: 0,
        len: p.kv_block_len,
        slices: 1,
        src_stride: 0,
        dst_stride: 0,
        whole_blocks: false,
    };
    match share {
        Share::Latent => {}
        Share::Heads { first, count } => {
            let (p_first, p_heads) = tp.heads_of(prefill.tp_size, prefill.tp_rank);
            let (d_first, d_heads) = tp.heads_of(decode.tp_size, decode.tp_rank);
            // Validation proved heads-per-rank × T × B fits in u64, and every
            // offset below is at most that.
            let b = model.head_bytes;
            let t = u64::from(model.block_tokens);
            match model.layout {
                LayoutKind::Hnd | LayoutKind::Mla => {
                    map.src_off = u64::from(first - p_first) * t * b;
                    map.dst_off = u64::from(first - d_first) * t * b;
                    map.len = u64::from(count) * t * b;
                }
                LayoutKind::Nhd => {
                    map.src_off = u64::from(first - p_first) * b;
                    map.dst_off = u64::from(first - d_first) * b;
                    map.len = u64::from(count) * b;
                    map.src_stride = u64::from(p_heads) * b;
                    map.dst_stride = u64::from(d_heads) * b;
                    if map.len == map.src_stride && map.len == map.dst_stride {
                        // Every head of every token: the token slices abut.
                        map.len *= t;
                    } else {
                        map.slices = t;
                    }
                }
            }
        }
    }
    map.whole_blocks =
        map.slices == 1 && map.len == map.src_block_len && map.len == map.dst_block_len;
    map
}
