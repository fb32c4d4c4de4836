//! Why a layout pair or a request's block lists cannot be planned.

use crate::layout::{Side, Stage};

use super::regions::REGIONS_MAX;

/// Why a layout pair or a request's block lists cannot be planned. Every
/// variant that concerns one side names it, so the caller can tell a peer's
/// bad metadata from its own configuration.
#[non_exhaustive]
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// A model-wide parameter is unusable.
    #[error("model: {0}")]
    Model(&'static str),
    /// The TP size neither divides nor is a multiple of the KV head count.
    #[error(
        "{side}: tp_size {tp_size} neither divides nor is a multiple of total_kv_heads {heads}"
    )]
    TpSize {
        /// Side of the bad TP size.
        side: Side,
        /// The TP size given.
        tp_size: u32,
        /// The model's KV head count.
        heads: u32,
    },
    /// The rank is not in its TP group.
    #[error("{side}: tp_rank {tp_rank} is not below tp_size {tp_size}")]
    TpRank {
        /// Side of the bad rank.
        side: Side,
        /// The rank given.
        tp_rank: u32,
        /// The TP size given.
        tp_size: u32,
    },
    /// More regions than [`REGIONS_MAX`].
    #[error("{side}: {regions} regions, more than the {REGIONS_MAX} supported")]
    TooManyRegions {
        /// Side with too many regions.
        side: Side,
        /// Number of regions given.
        regions: usize,
    },
    /// The two sides register different numbers of regions.
    #[error("region count differs: prefill has {prefill}, decode has {decode}")]
    RegionCount {
        /// Prefill's region count.
        prefill: usize,
        /// Decode's region count.
        decode: usize,
    },
    /// The pipeline stages of the two sides do not fit: prefill's regions
    /// run past decode's, a rank claims a stage outside its PP size, or
    /// the PP sizes differ while decode's is not 1.
    #[error("pipeline stages do not fit: prefill {prefill:?}, decode {decode:?}")]
    StageMismatch {
        /// Prefill's stage and region count.
        prefill: (Stage, usize),
        /// Decode's stage and region count.
        decode: (Stage, usize),
    },
    /// `kv_block_len` does not match heads-per-rank × block_tokens × head_bytes.
    #[error("{side} region {region}: kv_block_len {kv_block_len} is not heads-per-rank x block_tokens x head_bytes = {expected}")]
    RegionKvLen {
        /// Side of the region.
        side: Side,
        /// Index of the region.
        region: usize,
        /// The length given.
        kv_block_len: u64,
        /// The length the model and TP size imply.
        expected: u64,
    },
    /// `kv_block_len` is zero or longer than the block stride.
    #[error("{side} region {region}: kv_block_len {kv_block_len} is zero or exceeds block_len {block_len}")]
    RegionBlockLen {
        /// Side of the region.
        side: Side,
        /// Index of the region.
        region: usize,
        /// The KV length given.
        kv_block_len: u64,
        /// The block stride given.
        block_len: u64,
    },
    /// The region's last byte is beyond the 64-bit address space.
    #[error("{side} region {region}: base + num_blocks x block_len overflows a 64-bit address")]
    RegionOverflow {
        /// Side of the region.
        side: Side,
        /// Index of the region.
        region: usize,
    },
    /// Two regions of one side share bytes, so copies could overlap.
    #[error("{side}: regions {first} and {second} overlap")]
    RegionsOverlap {
        /// Side of the regions.
        side: Side,
        /// Index of one region.
        first: usize,
        /// Index of the other region.
        second: usize,
    },
    /// MLA caches are identical on every rank, so their lengths must match.
    #[error("mla region {region}: kv_block_len differs (prefill {prefill}, decode {decode})")]
    MlaKvLen {
        /// Index of the region pair.
        region: usize,
        /// Prefill's length.
        prefill: u64,
        /// Decode's length.
        decode: u64,
    },
    /// The two sides give different numbers of KV-cache groups.
    #[error("KV group count differs: prefill has {prefill}, decode has {decode}")]
    GroupCount {
        /// Prefill's group count.
        prefill: usize,
        /// Decode's group count.
        decode: usize,
    },
    /// Decode asks for more blocks than prefill has in a group.
    #[error("group {group}: prefill has {prefill} blocks, fewer than decode's {decode}")]
    FewerPrefillBlocks {
        /// Index of the group.
        group: usize,
        /// Prefill's block count.
        prefill: usize,
        /// Decode's block count.
        decode: usize,
    },
    /// A block id is not below `num_blocks`.
    #[error("{side} group {group}: block id {block} is not below num_blocks {num_blocks}")]
    BlockOutOfRange {
        /// Side of the block list.
        side: Side,
        /// Index of the group.
        group: usize,
        /// The block id.
        block: u64,
        /// The side's block count.
        num_blocks: u64,
    },
    /// A block id appears twice among the blocks to transfer, so two copies
    /// would read (prefill) or write (decode) the same bytes.
    #[error("{side}: block id {block} appears more than once")]
    DuplicateBlock {
        /// Side of the block list.
        side: Side,
        /// The repeated block id.
        block: u64,
    },
    /// A batch limit is zero, so no descriptor fits in a batch.
    #[error("batch_descriptors_max and batch_bytes_max must be at least 1")]
    ZeroBatchLimit,
    /// The plan would exceed [`BatchLimits::descriptors_max`](crate::layout::BatchLimits::descriptors_max).
    #[error("the plan needs more than descriptors_max = {max} descriptors")]
    TooManyDescriptors {
        /// The bound that was hit.
        max: usize,
    },
    /// A pool of one side is unusable: more than
    /// [`POOLS_MAX`](crate::layout::POOLS_MAX) pools, no
    /// items, a buffer with a zero `item_len`, past the 64-bit address
    /// space, or sharing bytes with another buffer or a KV region.
    #[error("{side} pool {pool}: {why}")]
    BadPool {
        /// Side of the pool.
        side: Side,
        /// Index of the pool.
        pool: usize,
        /// What is wrong with it.
        why: &'static str,
    },
    /// The two sides declare pools that do not pair: another count, kind
    /// or number of buffers.
    #[error("pool {pool}: {why} differs between prefill and decode")]
    PoolMismatch {
        /// Index of the pool (the count when the pool counts differ).
        pool: usize,
        /// What differs.
        why: &'static str,
    },
    /// A buffer's `item_len` differs between the sides, so an item of one
    /// would not fill (or would overflow) the other's.
    #[error("pool {pool} buffer {region}: item_len differs (prefill {prefill}, decode {decode})")]
    PoolItemLen {
        /// Index of the pool.
        pool: usize,
        /// Index of the buffer in the pool.
        region: usize,
        /// Prefill's item length.
        prefill: u64,
        /// Decode's item length.
        decode: u64,
    },
    /// A request's block lists lack the index lists of the layout's pools
    /// (one per pool after the KV groups).
    #[error("{lists} block lists cannot hold the index lists of {pools} pools")]
    MissingPoolLists {
        /// Lists given.
        lists: usize,
        /// Pools declared.
        pools: usize,
    },
    /// A pool index is not below the pool's `items`.
    #[error("{side} pool {pool}: index {index} is not below items {items}")]
    PoolIndexOutOfRange {
        /// Side of the index list.
        side: Side,
        /// Index of the pool.
        pool: usize,
        /// The index.
        index: u64,
        /// The pool's item count.
        items: u64,
    },
    /// A pool index appears twice in one request's list for that pool.
    #[error("{side} pool {pool}: index {index} appears more than once")]
    DuplicatePoolIndex {
        /// Side of the index list.
        side: Side,
        /// Index of the pool.
        pool: usize,
        /// The repeated index.
        index: u64,
    },
    /// The pair needs a rule kvferry does not implement: a state pool
    /// under different TP sizes (SGLang slices Mamba state by TP and
    /// refuses SWA/DSA state), or a state pool under pipeline parallelism. Never
    /// planned approximately: the pair moves nothing.
    #[error("pool {pool}: unsupported: {why}")]
    Unsupported {
        /// Index of the pool.
        pool: usize,
        /// What is not implemented.
        why: &'static str,
    },
}

impl PlanError {
    /// The side whose metadata or block list is at fault, if the error
    /// concerns one side only.
    pub fn side(&self) -> Option<Side> {
        match self {
            PlanError::TpSize { side, .. }
            | PlanError::TpRank { side, .. }
            | PlanError::TooManyRegions { side, .. }
            | PlanError::RegionKvLen { side, .. }
            | PlanError::RegionBlockLen { side, .. }
            | PlanError::RegionOverflow { side, .. }
            | PlanError::RegionsOverlap { side, .. }
            | PlanError::BlockOutOfRange { side, .. }
            | PlanError::DuplicateBlock { side, .. }
            | PlanError::BadPool { side, .. }
            | PlanError::PoolIndexOutOfRange { side, .. }
            | PlanError::DuplicatePoolIndex { side, .. } => Some(*side),
            PlanError::Model(_)
            | PlanError::RegionCount { .. }
            | PlanError::StageMismatch { .. }
            | PlanError::MlaKvLen { .. }
            | PlanError::GroupCount { .. }
            | PlanError::FewerPrefillBlocks { .. }
            | PlanError::ZeroBatchLimit
            | PlanError::TooManyDescriptors { .. }
            | PlanError::PoolMismatch { .. }
            | PlanError::PoolItemLen { .. }
            | PlanError::MissingPoolLists { .. }
            | PlanError::Unsupported { .. } => None,
        }
    }

    /// True for a pair kvferry refuses because it does not implement the
    /// rule it needs ([`PlanError::Unsupported`]), as opposed to metadata
    /// that is wrong.
    pub fn is_unsupported(&self) -> bool {
        matches!(self, PlanError::Unsupported { .. })
    }
}
