//! Aux and state pools: per-request items that move beside the KV
//! (`docs/design.md` §4, "Aux and state pools").
//!
//! A request's block lists end with one index list per pool, in the order
//! the layouts declare their pools. Item `i` of a buffer is `item_len`
//! bytes at `base + i·item_len`; the same indices are copied in every
//! buffer of the pool, as SGLang copies `item_len` bytes at
//! `ptr + item_len·index` per aux or state buffer.

use super::batch::Sink;
use super::error::PlanError;
use super::maps::Run;
use super::regions::{region_last_byte, REGIONS_MAX};
use super::runs::Scratch;
use super::tp::{Share, TpPair};
use crate::layout::{BatchLimits, Pool, PoolKind, RankLayout, Side, POOLS_MAX};

/// How one pool of prefill maps onto the same pool of decode for one pair.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct PoolMap {
    prefill_items: u64,
    decode_items: u64,
    /// `(src_base, dst_base, item_len)` per buffer; empty when this pair
    /// moves nothing of the pool (aux that another prefill rank sends).
    buffers: Vec<(u64, u64, u64)>,
}

/// Address of the last byte of `items` items of `item_len` bytes from
/// `base`, or `None` when it overflows (or there is no byte).
fn last_byte(base: u64, item_len: u64, items: u64) -> Option<u64> {
    items
        .checked_mul(item_len)?
        .checked_sub(1)?
        .checked_add(base)
}

/// Checks one side's pools alone: bounds, lengths, and that no buffer
/// shares a byte with another buffer or with a KV region.
pub(super) fn validate(layout: &RankLayout, side: Side) -> Result<(), PlanError> {
    let bad = |pool, why| PlanError::BadPool { side, pool, why };
    if layout.pools.len() > POOLS_MAX {
        return Err(bad(POOLS_MAX, "more pools than POOLS_MAX"));
    }
    let mut spans = Vec::new();
    for (p, pool) in layout.pools.iter().enumerate() {
        if pool.items == 0 {
            return Err(bad(p, "no items"));
        }
        if pool.regions.is_empty() || pool.regions.len() > REGIONS_MAX {
            return Err(bad(p, "no buffer, or more than REGIONS_MAX"));
        }
        for r in &pool.regions {
            if r.item_len == 0 {
                return Err(bad(p, "a buffer's item_len is zero"));
            }
            let last = last_byte(r.base, r.item_len, pool.items)
                .ok_or(bad(p, "a buffer overflows a 64-bit address"))?;
            spans.push((r.base, last, p));
        }
    }
    if spans.is_empty() {
        return Ok(());
    }
    spans.sort_unstable();
    for w in spans.windows(2) {
        if w[0].1 >= w[1].0 {
            return Err(bad(w[1].2, "buffers share bytes"));
        }
    }
    check_apart_from_kv(layout, &spans)
        .map_err(|p| bad(p, "a buffer shares bytes with a KV region"))
}

/// Fails with the pool of a buffer in `spans` (sorted) that meets a KV
/// region's span.
fn check_apart_from_kv(layout: &RankLayout, spans: &[(u64, u64, usize)]) -> Result<(), usize> {
    let mut kv: Vec<(u64, u64)> = layout
        .regions
        .iter()
        .filter_map(|r| Some((r.base, region_last_byte(r, layout.num_blocks)?)))
        .collect();
    kv.sort_unstable();
    // KV regions may interleave, so the furthest end so far decides.
    let mut furthest = Vec::with_capacity(kv.len());
    let mut end = 0u64;
    for &(_, last) in &kv {
        end = end.max(last);
        furthest.push(end);
    }
    for &(first, last, pool) in spans {
        let below = kv.partition_point(|&(base, _)| base <= last);
        if below > 0 && furthest[below - 1] >= first {
            return Err(pool);
        }
    }
    Ok(())
}

/// Pairs the pools of two validated layouts for the pair's `share`:
/// counts, kinds, buffers and item lengths must match; state pools need
/// equal TP sizes and no pipeline parallelism; aux moves from one prefill
/// stage.
pub(super) fn pair(
    tp: &TpPair,
    prefill: &RankLayout,
    decode: &RankLayout,
    share: Option<Share>,
) -> Result<Vec<PoolMap>, PlanError> {
    let (pp, dp) = (&prefill.pools, &decode.pools);
    if pp.len() != dp.len() {
        return Err(PlanError::PoolMismatch {
            pool: pp.len().min(dp.len()),
            why: "the pool count",
        });
    }
    if pp.is_empty() {
        return Ok(Vec::new());
    }
    let pipelined = prefill.stage.pp_size > 1 || decode.stage.pp_size > 1;
    if let (true, Some(i)) = (pipelined, state_pool(pp)) {
        return Err(PlanError::Unsupported {
            pool: i,
            why: "a state pool under pipeline parallelism (state is per layer, not split by stage)",
        });
    }
    // Aux is the same on every TP rank and every stage (SGLang hands each
    // stage the batch's outputs): a decode rank takes it from its first
    // prefill source, and from one stage, the last, which computed it.
    // Equal pipelines pair stage to stage, so each decode stage takes its
    // own stage's.
    let first_source = tp.sources_of(decode.tp_rank).next().map(|(r, _)| r);
    let (ps, ds) = (prefill.stage, decode.stage);
    let aux_stage = if ps.pp_size == ds.pp_size {
        ps.pp_rank == ds.pp_rank
    } else {
        ps.pp_rank + 1 == ps.pp_size
    };
    let mut maps = Vec::with_capacity(pp.len());
    for (i, (p, d)) in pp.iter().zip(dp).enumerate() {
        check_pool_pair(i, p, d)?;
        let moves = match p.kind {
            PoolKind::Aux => share.is_some() && first_source == Some(prefill.tp_rank) && aux_stage,
            PoolKind::State if prefill.tp_size != decode.tp_size => {
                return Err(PlanError::Unsupported {
                    pool: i,
                    why: "a state pool between different TP sizes (TP slicing of state is not implemented)",
                });
            }
            // Equal TP sizes: decode rank r has one source, prefill rank r.
            PoolKind::State => share.is_some(),
        };
        let buffers = if moves {
            (p.regions.iter().zip(&d.regions))
                .map(|(a, b)| (a.base, b.base, a.item_len))
                .collect()
        } else {
            Vec::new()
        };
        maps.push(PoolMap {
            prefill_items: p.items,
            decode_items: d.items,
            buffers,
        });
    }
    Ok(maps)
}

/// The first state pool of `pools`, if any.
fn state_pool(pools: &[Pool]) -> Option<usize> {
    pools.iter().position(|p| p.kind == PoolKind::State)
}

/// Pool `i` of prefill (`p`) and of decode (`d`) must agree on their kind,
/// their buffer count and each buffer's item length.
fn check_pool_pair(i: usize, p: &Pool, d: &Pool) -> Result<(), PlanError> {
    if p.kind != d.kind {
        return Err(PlanError::PoolMismatch {
            pool: i,
            why: "the kind",
        });
    }
    if p.regions.len() != d.regions.len() {
        return Err(PlanError::PoolMismatch {
            pool: i,
            why: "the buffer count",
        });
    }
    for (r, (a, b)) in p.regions.iter().zip(&d.regions).enumerate() {
        if a.item_len != b.item_len {
            return Err(PlanError::PoolItemLen {
                pool: i,
                region: r,
                prefill: a.item_len,
                decode: b.item_len,
            });
        }
    }
    Ok(())
}

/// Checks the index lists of the pools (prefill's and decode's, one per
/// pool; the first is list `first_list` of the request) and appends the
/// runs of the pools this pair moves to `scratch.pool_runs` (empty on
/// entry), tagged with
/// their pool. Prefill's last `len(decode)` indices pair with decode's,
/// as in a KV group.
pub(super) fn build_runs<P: AsRef<[u64]>, D: AsRef<[u64]>>(
    maps: &[PoolMap],
    prefill: &[P],
    decode: &[D],
    first_list: usize,
    scratch: &mut Scratch,
) -> Result<(), PlanError> {
    for (i, ((map, p), d)) in maps.iter().zip(prefill).zip(decode).enumerate() {
        let (p, d) = (p.as_ref(), d.as_ref());
        if p.len() < d.len() {
            return Err(PlanError::FewerPrefillBlocks {
                group: first_list + i,
                prefill: p.len(),
                decode: d.len(),
            });
        }
        let p = &p[p.len() - d.len()..];
        check_indices(
            Side::Prefill,
            i,
            p,
            map.prefill_items,
            &mut scratch.pool_ids,
        )?;
        check_indices(Side::Decode, i, d, map.decode_items, &mut scratch.pool_ids)?;
        if map.buffers.is_empty() {
            continue;
        }
        let runs = &mut scratch.pool_runs;
        for (&src, &dst) in p.iter().zip(d) {
            match runs.last_mut() {
                Some((pool, run))
                    if *pool == i && run.src + run.len == src && run.dst + run.len == dst =>
                {
                    run.len += 1
                }
                _ => runs.push((i, Run { src, dst, len: 1 })),
            }
        }
    }
    Ok(())
}

/// Rejects an index at or past `items`, or one listed twice.
fn check_indices(
    side: Side,
    pool: usize,
    ids: &[u64],
    items: u64,
    sorted: &mut Vec<u64>,
) -> Result<(), PlanError> {
    if let Some(&index) = ids.iter().find(|&&i| i >= items) {
        return Err(PlanError::PoolIndexOutOfRange {
            side,
            pool,
            index,
            items,
        });
    }
    sorted.clear();
    sorted.extend_from_slice(ids);
    sorted.sort_unstable();
    match sorted.windows(2).find(|w| w[0] == w[1]) {
        Some(w) => Err(PlanError::DuplicatePoolIndex {
            side,
            pool,
            index: w[0],
        }),
        None => Ok(()),
    }
}

/// Descriptors the pool runs need before byte splitting.
pub(super) fn estimate(maps: &[PoolMap], runs: &[(usize, Run)]) -> usize {
    runs.iter().map(|(pool, _)| maps[*pool].buffers.len()).sum()
}

/// Writes the copies of every pool run, buffer by buffer, into `sink`.
// Out of line: the KV emission it follows is the planner's hot path, and
// a few copies per request need no inlining into it.
#[inline(never)]
pub(super) fn emit(
    maps: &[PoolMap],
    runs: &[(usize, Run)],
    sink: &mut Sink<'_>,
    limits: &BatchLimits,
) -> Result<(), PlanError> {
    for group in runs.chunk_by(|a, b| a.0 == b.0) {
        let map = &maps[group[0].0];
        for &(src_base, dst_base, len) in &map.buffers {
            for (_, run) in group {
                // Validation bounds these: indices are below `items` and a
                // buffer's last byte fits in u64.
                sink.emit(
                    src_base + run.src * len,
                    dst_base + run.dst * len,
                    run.len * len,
                )?;
            }
            sink.cut_batches(limits.batch_bytes_max);
        }
    }
    Ok(())
}
