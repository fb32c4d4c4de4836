//! Invariants every plan must satisfy, shared by the `plan_spec` and
//! `planner` targets. The central one is memory safety of the plan itself:
//! every descriptor must read only bytes of a requested prefill block and
//! write only bytes of a requested decode block, inside the `kv_block_len`
//! bytes of one region's block, because the transport copies exactly what
//! the plan says. A copy of a pool item (aux or state, whose indices are
//! the last block lists, one per pool) must stay inside requested items of
//! one buffer of that pool.

use kvferry_machines::internal::planner::Plan;
use kvferry_machines::{BatchLimits, RankLayout};

/// Panics unless `[addr, addr + len)` lies inside one region of `rank` and
/// every block it touches is below `num_blocks`, is in `blocks` (any group),
/// and is touched only in its first `kv_block_len` bytes. A descriptor may
/// span several blocks: the planner coalesces consecutive blocks when their
/// KV bytes are contiguous.
fn assert_inside(side: &str, rank: &RankLayout, lists: &[Vec<u64>], addr: u64, len: u64) {
    let end = addr
        .checked_add(len)
        .unwrap_or_else(|| panic!("{side}: {addr:#x}+{len} overflows"));
    let (blocks, items) = lists.split_at(lists.len().saturating_sub(rank.pools.len()));
    if inside_items(rank, items, addr, end) {
        return;
    }
    let requested = |b: u64| blocks.iter().flatten().any(|&x| x == b);
    let hit = rank.regions.iter().any(|r| {
        if addr < r.base || r.block_len == 0 {
            return false;
        }
        let mut block = (addr - r.base) / r.block_len;
        let mut at = addr;
        while at < end {
            if block >= rank.num_blocks || !requested(block) {
                return false;
            }
            // The planner rejects regions whose last byte overflows, so
            // these cannot overflow for a region of a layout it accepted.
            let start = block
                .checked_mul(r.block_len)
                .and_then(|off| r.base.checked_add(off))
                .expect("accepted a region whose block address overflows");
            let kv_end = start
                .checked_add(r.kv_block_len)
                .expect("accepted a region whose KV bytes overflow");
            let piece_end = end.min(start.saturating_add(r.block_len));
            if at < start || piece_end > kv_end {
                return false;
            }
            at = piece_end;
            block += 1;
        }
        true
    });
    assert!(
        hit,
        "{side}: descriptor [{addr:#x}, {end:#x}) is outside every requested block's KV bytes"
    );
}

/// True if `[addr, end)` lies inside one buffer of a pool of `rank` and
/// covers only items its list in `items` (one per pool) requests.
fn inside_items(rank: &RankLayout, items: &[Vec<u64>], addr: u64, end: u64) -> bool {
    rank.pools.iter().zip(items).any(|(pool, wanted)| {
        pool.regions.iter().any(|r| {
            if addr < r.base || r.item_len == 0 {
                return false;
            }
            let first = (addr - r.base) / r.item_len;
            let last = (end - 1 - r.base) / r.item_len;
            last < pool.items && (first..=last).all(|i| wanted.contains(&i))
        })
    })
}

/// Checks `plan` against the inputs it was planned from.
pub(super) fn check_plan(
    plan: &Plan,
    prefill: &RankLayout,
    decode: &RankLayout,
    prefill_blocks: &[Vec<u64>],
    decode_blocks: &[Vec<u64>],
    limits: &BatchLimits,
) {
    assert!(
        plan.descriptors.len() <= limits.descriptors_max,
        "{} descriptors, limit {}",
        plan.descriptors.len(),
        limits.descriptors_max
    );
    for d in &plan.descriptors {
        assert!(d.len > 0, "empty descriptor {d:?}");
        assert!(
            d.len <= limits.batch_bytes_max.max(1),
            "descriptor {d:?} over batch_bytes_max"
        );
        assert_inside("prefill (src)", prefill, prefill_blocks, d.src, d.len);
        assert_inside("decode (dst)", decode, decode_blocks, d.dst, d.len);
    }
    // Batches cut the descriptor list into consecutive non-empty pieces.
    let mut next = 0usize;
    for b in &plan.batches {
        assert_eq!(
            b.first, next,
            "batches are not consecutive: {:?}",
            plan.batches
        );
        assert!(b.count >= 1);
        assert!(b.count <= limits.batch_descriptors_max.max(1));
        let bytes: u64 = plan.descriptors[b.range()].iter().map(|d| d.len).sum();
        assert!(
            b.count == 1 || bytes <= limits.batch_bytes_max,
            "batch {b:?} has {bytes} bytes"
        );
        next += b.count;
    }
    assert_eq!(
        next,
        plan.descriptors.len(),
        "batches do not cover the plan"
    );
    assert_eq!(plan.is_transfer(), !plan.descriptors.is_empty());
}
