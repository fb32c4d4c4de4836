//! How a region of prefill maps onto decode's, and a run of blocks: what
//! the descriptor sink and the run builders share.

/// How one region of prefill maps onto the same region of decode, for the
/// share of this P/D pair: per block, `slices` copies of `len` bytes, the
/// first at `src_off`/`dst_off` into the block and each next one a stride on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct RegionMap {
    pub(super) src_base: u64,
    pub(super) src_block_len: u64,
    pub(super) dst_base: u64,
    pub(super) dst_block_len: u64,
    pub(super) src_off: u64,
    pub(super) dst_off: u64,
    pub(super) len: u64,
    pub(super) slices: u64,
    pub(super) src_stride: u64,
    pub(super) dst_stride: u64,
    /// The copy of one block is a whole block stride on both sides, so a run
    /// of consecutive blocks is one contiguous copy.
    pub(super) whole_blocks: bool,
}

/// A run of blocks consecutive on both sides: prefill `src..src+len` goes to
/// decode `dst..dst+len`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Run {
    pub(super) src: u64,
    pub(super) dst: u64,
    pub(super) len: u64,
}
