//! Invariants every plan must satisfy, shared by the `plan_spec` and
//! `planner` targets. The central one is memory safety of the plan itself:
//! every descriptor must read only bytes of a requested prefill block and
//! write only bytes of a requested decode block, inside the `kv_block_len`
//! bytes of one region's block, because the transport copies exactly what
//! the plan says.

use kvferry_machines::layout::{BatchLimits, RankLayout};
use kvferry_machines::planner::Plan;

/// Panics unless `[addr, addr + len)` lies inside the KV bytes of one block
/// of one region of `rank`, and that block is in `blocks` (any group).
fn assert_inside(side: &str, rank: &RankLayout, blocks: &[Vec<u64>], addr: u64, len: u64) {
    let end = addr.checked_add(len).unwrap_or_else(|| panic!("{side}: {addr:#x}+{len} overflows"));
    let hit = rank.regions.iter().any(|r| {
        if addr < r.base || r.block_len == 0 {
            return false;
        }
        let block = (addr - r.base) / r.block_len;
        if block >= rank.num_blocks || !blocks.iter().flatten().any(|&b| b == block) {
            return false;
        }
        let start = r.base + block * r.block_len;
        end <= start + r.kv_block_len
    });
    assert!(
        hit,
        "{side}: descriptor [{addr:#x}, {end:#x}) is outside every requested block's KV bytes"
    );
}

/// Checks `plan` against the inputs it was planned from.
pub fn check_plan(
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
        assert!(d.len <= limits.batch_bytes_max.max(1), "descriptor {d:?} over batch_bytes_max");
        assert_inside("prefill (src)", prefill, prefill_blocks, d.src, d.len);
        assert_inside("decode (dst)", decode, decode_blocks, d.dst, d.len);
    }
    // Batches cut the descriptor list into consecutive non-empty pieces.
    let mut next = 0usize;
    for b in &plan.batches {
        assert_eq!(b.first, next, "batches are not consecutive: {:?}", plan.batches);
        assert!(b.count >= 1);
        assert!(b.count <= limits.batch_descriptors_max.max(1));
        let bytes: u64 = plan.descriptors[b.range()].iter().map(|d| d.len).sum();
        assert!(b.count == 1 || bytes <= limits.batch_bytes_max, "batch {b:?} has {bytes} bytes");
        next += b.count;
    }
    assert_eq!(next, plan.descriptors.len(), "batches do not cover the plan");
    assert_eq!(plan.is_transfer(), !plan.descriptors.is_empty());
}
