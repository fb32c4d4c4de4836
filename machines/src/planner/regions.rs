//! The bounds on a side's registered regions.

use crate::layout::Region;

/// Most regions one side may register. Real models register one region per
/// layer and K/V (a few hundred); the bound keeps the pairwise overlap check
/// cheap even for hostile metadata.
pub const REGIONS_MAX: usize = 4096;

/// Address of the last KV byte of `region` (inclusive, so that a region may
/// end at the top of the address space), or `None` if it overflows. `None`
/// too for no blocks (nothing registered) or a zero `kv_block_len`; the
/// caller tells those apart.
pub(super) fn region_last_byte(region: &Region, num_blocks: u64) -> Option<u64> {
    num_blocks
        .checked_sub(1)?
        .checked_mul(region.block_len)?
        .checked_add(region.kv_block_len.checked_sub(1)?)?
        .checked_add(region.base)
}
