//! Runs of blocks consecutive on both sides, and the copies they become:
//! the planner's inner loop and its reusable memory.

use crate::layout::{BatchLimits, Side};

use super::batch::{Descriptor, Sink};
use super::error::PlanError;
use super::maps::{RegionMap, Run};

/// Reusable working memory of the planner, so that planning a request
/// allocates nothing once the buffers have grown.
#[derive(Clone, Debug, Default)]
pub struct Scratch {
    pub(super) runs: Vec<Run>,
    pub(super) spans: Vec<(u64, u64)>,
    /// One bit per block id, all zero between calls.
    pub(super) seen: Vec<u64>,
    /// Runs of pool indices, tagged with their pool.
    pub(super) pool_runs: Vec<(usize, Run)>,
    /// Pool indices, sorted to find duplicates.
    pub(super) pool_ids: Vec<u64>,
}

/// Writes the copies of region `map` run by run: for regions that copy
/// slices of blocks, or whose runs may be longer than the byte limit.
pub(super) fn emit_region_by_run(
    sink: &mut Sink<'_>,
    map: &RegionMap,
    runs: &[Run],
    limits: &BatchLimits,
) -> Result<(), PlanError> {
    for run in runs {
        // Validation bounds every address below: a block id is below
        // num_blocks and the region's last byte fits in u64.
        let src = map.src_base + run.src * map.src_block_len + map.src_off;
        let dst = map.dst_base + run.dst * map.dst_block_len + map.dst_off;
        if map.whole_blocks {
            sink.emit(src, dst, map.len * run.len)?;
        } else {
            emit_blocks(sink, map, src, dst, run.len)?;
        }
        // Every copy is at most the byte limit, and at most one
        // block's slice otherwise.
        let len_max = if map.whole_blocks {
            limits.batch_bytes_max
        } else {
            map.len.min(limits.batch_bytes_max)
        };
        sink.cut_batches(len_max);
    }
    Ok(())
}

/// Pairs tested at once when a run is growing: long runs of consecutive
/// blocks are the common case, and a fixed-size chunk compiles to vector
/// compares instead of one branch per pair.
pub(super) const CHUNK: usize = 16;

/// True if `p` and `d` (each `CHUNK` long) continue `run` on both sides.
#[inline]
pub(super) fn continues_run(run: &Run, p: &[u64], d: &[u64]) -> bool {
    // `run` lies below num_blocks, so its end plus a chunk overflows only for
    // hostile sizes; those take the pair-by-pair path.
    let (Some(p0), Some(d0)) = (
        (run.src + run.len).checked_add(CHUNK as u64),
        (run.dst + run.len).checked_add(CHUNK as u64),
    ) else {
        return false;
    };
    let (p0, d0) = (p0 - CHUNK as u64, d0 - CHUNK as u64);
    let mut all = true;
    for k in 0..CHUNK {
        // `&` rather than `&&`: no early exit, so the loop vectorises.
        all &= (p[k] == p0 + k as u64) & (d[k] == d0 + k as u64);
    }
    all
}

/// Largest block pool checked with a bitmap (2 MiB of bits); larger pools
/// sort the runs instead.
pub(super) const BITMAP_BLOCKS_MAX: u64 = 1 << 24;

/// Rejects a block id used twice on `side`: the copies would overlap.
pub(super) fn check_disjoint(
    side: Side,
    num_blocks: u64,
    scratch: &mut Scratch,
) -> Result<(), PlanError> {
    let runs = &scratch.runs;
    if runs.len() < 2 {
        return Ok(());
    }
    let start_of = |r: &Run| match side {
        Side::Prefill => r.src,
        Side::Decode => r.dst,
    };
    if num_blocks <= BITMAP_BLOCKS_MAX {
        // A bitmap is linear in the blocks and needs no sort.
        let words = num_blocks.div_ceil(64) as usize;
        if scratch.seen.len() < words {
            scratch.seen.resize(words, 0);
        }
        let seen = &mut scratch.seen[..words];
        let mut result = Ok(());
        let mut marked = runs.len();
        for (k, run) in runs.iter().enumerate() {
            if let Some(block) = mark_range(seen, start_of(run), run.len) {
                result = Err(PlanError::DuplicateBlock { side, block });
                marked = k + 1;
                break;
            }
        }
        // Leave the bitmap zeroed for the next call.
        for run in &runs[..marked] {
            clear_range(seen, start_of(run), run.len);
        }
        return result;
    }
    let spans = &mut scratch.spans;
    spans.clear();
    spans.extend(runs.iter().map(|r| (start_of(r), r.len)));
    spans.sort_unstable();
    for pair in spans.windows(2) {
        let (start, len) = pair[0];
        // Runs are below num_blocks, so `start + len` cannot overflow.
        if start + len > pair[1].0 {
            return Err(PlanError::DuplicateBlock {
                side,
                block: pair[1].0,
            });
        }
    }
    Ok(())
}

/// The bits `start .. start + len` of `words`, one word at a time: `(word
/// index, mask)`. The caller keeps the range inside `words`.
pub(super) fn word_masks(start: u64, len: u64) -> impl Iterator<Item = (usize, u64)> {
    let end = start + len;
    let mut at = start;
    std::iter::from_fn(move || {
        if at >= end {
            return None;
        }
        let bit = at % 64;
        let n = (64 - bit).min(end - at);
        let mask = if n == 64 {
            u64::MAX
        } else {
            ((1u64 << n) - 1) << bit
        };
        let word = (at / 64) as usize;
        at += n;
        Some((word, mask))
    })
}

/// Sets the bits of `start .. start + len`; returns the first that was
/// already set, if any (the remaining bits are still set).
pub(super) fn mark_range(words: &mut [u64], start: u64, len: u64) -> Option<u64> {
    let mut first_dup = None;
    for (word, mask) in word_masks(start, len) {
        let dup = words[word] & mask;
        if dup != 0 && first_dup.is_none() {
            first_dup = Some(word as u64 * 64 + u64::from(dup.trailing_zeros()));
        }
        words[word] |= mask;
    }
    first_dup
}

pub(super) fn clear_range(words: &mut [u64], start: u64, len: u64) {
    for (word, mask) in word_masks(start, len) {
        words[word] &= !mask;
    }
}

/// Emits the copies of `count` consecutive blocks whose first copy starts at
/// `src`/`dst`, slice by slice. None of them abut (see `fill`), so each is
/// its own descriptor.
#[inline]
pub(super) fn emit_blocks(
    sink: &mut Sink<'_>,
    map: &RegionMap,
    src: u64,
    dst: u64,
    count: u64,
) -> Result<(), PlanError> {
    let (mut src, mut dst) = (src, dst);
    if map.len <= sink.bytes_max {
        // Each slice is one descriptor: check the bound once for the run,
        // then push without per-slice splitting.
        let needed = count.saturating_mul(map.slices);
        let room = sink.descriptors_max.saturating_sub(sink.out.len());
        if needed > room as u64 {
            return Err(sink.too_many());
        }
        for _ in 0..count {
            let (mut s, mut d) = (src, dst);
            for _ in 0..map.slices {
                sink.out.push(Descriptor {
                    src: s,
                    dst: d,
                    len: map.len,
                });
                // The step past the last slice may leave the address space
                // for a region at its very top; that value is never used.
                s = s.wrapping_add(map.src_stride);
                d = d.wrapping_add(map.dst_stride);
            }
            src = src.wrapping_add(map.src_block_len);
            dst = dst.wrapping_add(map.dst_block_len);
        }
        return Ok(());
    }
    for _ in 0..count {
        let (mut s, mut d) = (src, dst);
        for _ in 0..map.slices {
            sink.emit(s, d, map.len)?;
            s = s.wrapping_add(map.src_stride);
            d = d.wrapping_add(map.dst_stride);
        }
        src = src.wrapping_add(map.src_block_len);
        dst = dst.wrapping_add(map.dst_block_len);
    }
    Ok(())
}
