//! Helpers on block lists: aligning a chunk onto the destination,
//! coverage and bounds checks.

use super::{BlockId, BlockLists, Config};

/// Maps the part of a chunk that the receiver needs onto its destination
/// blocks. Returns `(src, dst)` with equal lengths per group, or `None` when
/// the lists do not fit together (group count, or blocks past the end of
/// the destination list).
pub(crate) fn align_chunk(
    start: &[u32],
    src: &[Vec<BlockId>],
    dst: &[Vec<BlockId>],
    prefix: &[u32],
) -> Option<(BlockLists, BlockLists)> {
    if start.len() != src.len() || src.len() != dst.len() || dst.len() != prefix.len() {
        return None;
    }
    let mut out_src = Vec::with_capacity(src.len());
    let mut out_dst = Vec::with_capacity(src.len());
    for g in 0..src.len() {
        let first = start[g] as usize;
        let skip = prefix[g] as usize;
        let mut s = Vec::new();
        let mut d = Vec::new();
        for (i, b) in src[g].iter().enumerate() {
            let pos = first + i;
            if pos < skip {
                continue;
            }
            let target = *dst[g].get(pos - skip)?;
            s.push(*b);
            d.push(target);
        }
        out_src.push(s);
        out_dst.push(d);
    }
    Some((out_src, out_dst))
}

/// True when P's full block list, ending at `end[g]` per group, fills the
/// destination exactly: D's list takes P's blocks from `prefix[g]` on, so
/// P having fewer blocks would leave destination blocks without KV, and
/// more would overflow it.
pub(crate) fn covers_exactly(end: &[u32], dst: &[Vec<BlockId>], prefix: &[u32]) -> bool {
    end.len() == dst.len()
        && dst.len() == prefix.len()
        && end
            .iter()
            .zip(dst)
            .zip(prefix)
            .all(|((e, d), p)| e.checked_sub(*p).is_some_and(|n| n as usize == d.len()))
}

/// Per group, the position just past a chunk's last block.
pub(crate) fn chunk_end(start: &[u32], src: &[Vec<BlockId>]) -> Vec<u32> {
    start
        .iter()
        .zip(src)
        .map(|(s, g)| s.saturating_add(g.len() as u32))
        .collect()
}

/// True when an aligned chunk moves no block at all.
pub(crate) fn is_empty_lists(lists: &[Vec<BlockId>]) -> bool {
    lists.iter().all(|g| g.is_empty())
}

/// Checks a block list against the configured bounds.
pub(crate) fn check_lists(lists: &[Vec<BlockId>], cfg: &Config) -> bool {
    lists.len() <= cfg.max_groups && lists.iter().all(|g| g.len() <= cfg.max_blocks_per_group)
}
