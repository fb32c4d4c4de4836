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
use std::ops::Range;

mod pools;

/// Most regions one side may register. Real models register one region per
/// layer and K/V (a few hundred); the bound keeps the pairwise overlap check
/// cheap even for hostile metadata.
pub const REGIONS_MAX: usize = 4096;

/// One copy: `len` bytes from `src` (prefill memory) to `dst` (decode memory).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Descriptor {
    /// Source address on the prefill rank.
    pub src: u64,
    /// Destination address on the decode rank.
    pub dst: u64,
    /// Bytes to copy; never zero in a plan.
    pub len: u64,
}

/// A batch: `count` descriptors starting at index `first`, posted together.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Batch {
    /// Index of the batch's first descriptor.
    pub first: usize,
    /// Number of descriptors in the batch (at least one).
    pub count: usize,
}

impl Batch {
    /// The batch's descriptor indices.
    pub fn range(&self) -> Range<usize> {
        self.first..self.first + self.count
    }
}

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
    /// The plan would exceed [`BatchLimits::descriptors_max`].
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

/// What one prefill rank sends to one decode rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Share {
    /// Heads `first .. first + count` (model-wide head indices).
    Heads {
        /// First head sent.
        first: u32,
        /// Number of consecutive heads sent.
        count: u32,
    },
    /// The whole MLA latent cache.
    Latent,
}

/// The tensor-parallel geometry of a P/D pair: who holds which heads, and
/// which P rank sends each head to each D rank.
///
/// A rank of a TP group of size `tp` holds `max(1, H / tp)` heads; for
/// `tp <= H` rank `r` holds heads `r·H/tp ..`, for `tp > H` heads are
/// replicated and rank `r` holds head `r / (tp/H)`. Head `h` of decode rank
/// `rd` comes from its only holder when `Tp <= H`, and from replica
/// `h·(Tp/H) + rd % (Tp/H)` when `Tp > H`. For MLA, decode rank `rd` is fed
/// by prefill rank `rd % Tp` alone. Every head of every decode rank thus
/// comes from exactly one prefill rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TpPair {
    kind: LayoutKind,
    heads: u32,
    prefill_tp: u32,
    decode_tp: u32,
}

impl TpPair {
    /// Checks that both TP sizes fit the model.
    pub fn new(model: &ModelSpec, prefill_tp: u32, decode_tp: u32) -> Result<TpPair, PlanError> {
        validate_model(model)?;
        check_tp(model, Side::Prefill, prefill_tp)?;
        check_tp(model, Side::Decode, decode_tp)?;
        Ok(TpPair {
            kind: model.layout,
            heads: model.total_kv_heads,
            prefill_tp,
            decode_tp,
        })
    }

    /// Heads `(first, count)` held by `rank` of a group of `tp` ranks.
    fn heads_of(&self, tp: u32, rank: u32) -> (u32, u32) {
        let h = self.heads;
        if tp <= h {
            (rank * (h / tp), h / tp)
        } else {
            (rank / (tp / h), 1)
        }
    }

    /// What `prefill_rank` sends to `decode_rank`, or `None` if the pair
    /// transfers nothing (or a rank is out of range).
    pub fn share(&self, prefill_rank: u32, decode_rank: u32) -> Option<Share> {
        if prefill_rank >= self.prefill_tp || decode_rank >= self.decode_tp {
            return None;
        }
        match self.kind {
            LayoutKind::Mla => {
                (prefill_rank == decode_rank % self.prefill_tp).then_some(Share::Latent)
            }
            LayoutKind::Hnd | LayoutKind::Nhd => {
                let (pf, pn) = self.heads_of(self.prefill_tp, prefill_rank);
                let (df, dn) = self.heads_of(self.decode_tp, decode_rank);
                let first = pf.max(df);
                let end = (pf + pn).min(df + dn);
                if first >= end {
                    return None;
                }
                if self.prefill_tp > self.heads {
                    // Several P ranks hold this head; the replica index picks
                    // one per decode rank so the load spreads over replicas.
                    let replicas = self.prefill_tp / self.heads;
                    if prefill_rank % replicas != decode_rank % replicas {
                        return None;
                    }
                }
                Some(Share::Heads {
                    first,
                    count: end - first,
                })
            }
        }
    }

    /// The prefill ranks `decode_rank` receives from, with what each sends,
    /// in increasing head order.
    pub fn sources_of(&self, decode_rank: u32) -> Peers {
        let empty = Peers::empty(*self, decode_rank, Side::Decode);
        if decode_rank >= self.decode_tp {
            return empty;
        }
        let (next, step, remaining) = match self.kind {
            LayoutKind::Mla => (u64::from(decode_rank % self.prefill_tp), 1, 1),
            LayoutKind::Hnd | LayoutKind::Nhd => {
                let (df, dn) = self.heads_of(self.decode_tp, decode_rank);
                if self.prefill_tp <= self.heads {
                    let per = self.heads / self.prefill_tp;
                    let lo = df / per;
                    let hi = (df + dn - 1) / per;
                    (u64::from(lo), 1, u64::from(hi - lo) + 1)
                } else {
                    let replicas = self.prefill_tp / self.heads;
                    let start =
                        u64::from(df) * u64::from(replicas) + u64::from(decode_rank % replicas);
                    (start, u64::from(replicas), u64::from(dn))
                }
            }
        };
        Peers {
            next,
            step,
            remaining,
            ..empty
        }
    }

    /// The prefill ranks no decode rank receives from (their KV heads are
    /// replicas another prefill rank sends) that `decode_rank` tells so:
    /// rank `u` is told by decode rank `u % decode TP`. Every decode rank
    /// computes the same rule, so each unpaired prefill rank is told
    /// exactly once, by a decode rank that exists.
    pub fn unpaired_told_by(&self, decode_rank: u32) -> impl Iterator<Item = u32> + '_ {
        let d_tp = self.decode_tp;
        (0..self.prefill_tp)
            .filter(move |&u| u % d_tp == decode_rank && self.targets_of(u).count() == 0)
    }

    /// The decode ranks `prefill_rank` sends to, with what each receives.
    pub fn targets_of(&self, prefill_rank: u32) -> Peers {
        let empty = Peers::empty(*self, prefill_rank, Side::Prefill);
        if prefill_rank >= self.prefill_tp {
            return empty;
        }
        let (next, step, remaining) = match self.kind {
            LayoutKind::Mla => {
                let count = if prefill_rank < self.decode_tp {
                    u64::from((self.decode_tp - 1 - prefill_rank) / self.prefill_tp) + 1
                } else {
                    0
                };
                (u64::from(prefill_rank), u64::from(self.prefill_tp), count)
            }
            LayoutKind::Hnd | LayoutKind::Nhd => {
                let (pf, pn) = self.heads_of(self.prefill_tp, prefill_rank);
                if self.decode_tp <= self.heads {
                    let per = self.heads / self.decode_tp;
                    let lo = pf / per;
                    let hi = (pf + pn - 1) / per;
                    (u64::from(lo), 1, u64::from(hi - lo) + 1)
                } else {
                    let replicas = u64::from(self.decode_tp / self.heads);
                    (u64::from(pf) * replicas, 1, u64::from(pn) * replicas)
                }
            }
        };
        Peers {
            next,
            step,
            remaining,
            ..empty
        }
    }
}

/// Iterator over the peers of one rank: `(peer rank, what is transferred)`.
/// It visits at most one candidate per peer rank, so it is bounded by the
/// peer's TP size.
#[derive(Clone, Debug)]
pub struct Peers {
    pair: TpPair,
    rank: u32,
    side: Side,
    next: u64,
    step: u64,
    remaining: u64,
}

impl Peers {
    fn empty(pair: TpPair, rank: u32, side: Side) -> Peers {
        Peers {
            pair,
            rank,
            side,
            next: 0,
            step: 1,
            remaining: 0,
        }
    }
}

impl Iterator for Peers {
    type Item = (u32, Share);

    fn next(&mut self) -> Option<(u32, Share)> {
        while self.remaining > 0 {
            let candidate = self.next;
            self.remaining -= 1;
            self.next = self.next.saturating_add(self.step);
            let Ok(peer) = u32::try_from(candidate) else {
                self.remaining = 0;
                break;
            };
            let share = match self.side {
                Side::Decode => self.pair.share(peer, self.rank),
                Side::Prefill => self.pair.share(self.rank, peer),
            };
            if let Some(share) = share {
                return Some((peer, share));
            }
        }
        None
    }
}

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

/// How one region of prefill maps onto the same region of decode, for the
/// share of this P/D pair: per block, `slices` copies of `len` bytes, the
/// first at `src_off`/`dst_off` into the block and each next one a stride on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct RegionMap {
    src_base: u64,
    src_block_len: u64,
    dst_base: u64,
    dst_block_len: u64,
    src_off: u64,
    dst_off: u64,
    len: u64,
    slices: u64,
    src_stride: u64,
    dst_stride: u64,
    /// The copy of one block is a whole block stride on both sides, so a run
    /// of consecutive blocks is one contiguous copy.
    whole_blocks: bool,
}

/// A run of blocks consecutive on both sides: prefill `src..src+len` goes to
/// decode `dst..dst+len`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Run {
    src: u64,
    dst: u64,
    len: u64,
}

/// Reusable working memory of the planner, so that planning a request
/// allocates nothing once the buffers have grown.
#[derive(Clone, Debug, Default)]
pub struct Scratch {
    runs: Vec<Run>,
    spans: Vec<(u64, u64)>,
    /// One bit per block id, all zero between calls.
    seen: Vec<u64>,
    /// Runs of pool indices, tagged with their pool.
    pool_runs: Vec<(usize, Run)>,
    /// Pool indices, sorted to find duplicates.
    pool_ids: Vec<u64>,
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

/// Writes the copies of region `map` run by run: for regions that copy
/// slices of blocks, or whose runs may be longer than the byte limit.
fn emit_region_by_run(
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
const CHUNK: usize = 16;

/// True if `p` and `d` (each `CHUNK` long) continue `run` on both sides.
#[inline]
fn continues_run(run: &Run, p: &[u64], d: &[u64]) -> bool {
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
const BITMAP_BLOCKS_MAX: u64 = 1 << 24;

/// Rejects a block id used twice on `side`: the copies would overlap.
fn check_disjoint(side: Side, num_blocks: u64, scratch: &mut Scratch) -> Result<(), PlanError> {
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
fn word_masks(start: u64, len: u64) -> impl Iterator<Item = (usize, u64)> {
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
fn mark_range(words: &mut [u64], start: u64, len: u64) -> Option<u64> {
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

fn clear_range(words: &mut [u64], start: u64, len: u64) {
    for (word, mask) in word_masks(start, len) {
        words[word] &= !mask;
    }
}

/// Emits the copies of `count` consecutive blocks whose first copy starts at
/// `src`/`dst`, slice by slice. None of them abut (see `fill`), so each is
/// its own descriptor.
#[inline]
fn emit_blocks(
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

/// Appends descriptors, cutting them at the batch byte limit so every
/// descriptor fits in a batch, and refusing to grow past `descriptors_max`.
struct Sink<'a> {
    out: &'a mut Vec<Descriptor>,
    bytes_max: u64,
    descriptors_max: usize,
    /// Where batches go, if the caller wants them.
    batches: Option<&'a mut Vec<Batch>>,
    batcher: Batcher,
    limits: &'a BatchLimits,
}

impl Sink<'_> {
    /// Cuts batches over the descriptors written since the last call, each
    /// at most `len_max` bytes.
    #[inline]
    fn cut_batches(&mut self, len_max: u64) {
        if let Some(batches) = self.batches.as_deref_mut() {
            self.batcher
                .feed_bounded(self.out, self.limits, batches, len_max);
        }
    }

    fn finish_batches(&mut self) {
        self.cut_batches(self.bytes_max);
        if let Some(batches) = self.batches.as_deref_mut() {
            self.batcher.finish(batches);
        }
    }

    fn too_many(&self) -> PlanError {
        PlanError::TooManyDescriptors {
            max: self.descriptors_max,
        }
    }

    #[inline]
    fn emit(&mut self, mut src: u64, mut dst: u64, mut len: u64) -> Result<(), PlanError> {
        while len > 0 {
            if self.out.len() >= self.descriptors_max {
                return Err(self.too_many());
            }
            let take = len.min(self.bytes_max);
            self.out.push(Descriptor {
                src,
                dst,
                len: take,
            });
            len -= take;
            // The sum may pass the top of the address space only when the
            // loop ends, so it is never used.
            src = src.wrapping_add(take);
            dst = dst.wrapping_add(take);
        }
        Ok(())
    }

    /// One copy per run of whole blocks; the caller checked that none
    /// exceeds the byte limit. A single `extend` over a slice iterator lets
    /// the compiler drop the per-element capacity check.
    fn extend_runs(&mut self, map: &RegionMap, runs: &[Run]) -> Result<(), PlanError> {
        if self.descriptors_max - self.out.len().min(self.descriptors_max) < runs.len() {
            return Err(self.too_many());
        }
        // Validation bounds every address: block ids are below num_blocks
        // and the region's last byte fits in u64.
        self.out.extend(runs.iter().map(|run| Descriptor {
            src: map.src_base + run.src * map.src_block_len + map.src_off,
            dst: map.dst_base + run.dst * map.dst_block_len + map.dst_off,
            len: map.len * run.len,
        }));
        Ok(())
    }
}

/// Cuts `descriptors` into consecutive batches of at most
/// `batch_descriptors_max` descriptors and `batch_bytes_max` bytes, into
/// `batches` (cleared first). A descriptor longer than the byte limit (which
/// the planner never emits) gets a batch of its own.
pub fn split_batches(descriptors: &[Descriptor], limits: &BatchLimits, batches: &mut Vec<Batch>) {
    batches.clear();
    let mut batcher = Batcher::default();
    batcher.feed(descriptors, limits, batches);
    batcher.finish(batches);
}

/// Incremental batch cutting over a growing descriptor vector.
#[derive(Clone, Copy, Debug, Default)]
struct Batcher {
    /// Index of the first descriptor not yet seen.
    next: usize,
    /// The open batch.
    first: usize,
    count: usize,
    bytes: u64,
}

impl Batcher {
    /// Takes in `descriptors[self.next..]`, closing full batches.
    #[inline]
    fn feed(&mut self, descriptors: &[Descriptor], limits: &BatchLimits, batches: &mut Vec<Batch>) {
        let count_max = limits.batch_descriptors_max.max(1);
        let Some(new) = descriptors.get(self.next..) else {
            return;
        };
        for d in new {
            if self.count > 0
                && (self.count == count_max
                    || limits.batch_bytes_max.saturating_sub(self.bytes) < d.len)
            {
                batches.push(Batch {
                    first: self.first,
                    count: self.count,
                });
                self.first += self.count;
                self.count = 0;
                self.bytes = 0;
            }
            self.count += 1;
            self.bytes = self.bytes.saturating_add(d.len);
        }
        self.next = descriptors.len();
    }

    /// Like [`Batcher::feed`] when every new descriptor is at most
    /// `len_max` bytes. If a full batch of such descriptors cannot reach the
    /// byte limit, batches are cut by count alone, in O(batches) instead of
    /// O(descriptors).
    #[inline]
    fn feed_bounded(
        &mut self,
        descriptors: &[Descriptor],
        limits: &BatchLimits,
        batches: &mut Vec<Batch>,
        len_max: u64,
    ) {
        let count_max = limits.batch_descriptors_max.max(1);
        let room = count_max.saturating_sub(self.count) as u64;
        let by_count_alone = len_max
            .checked_mul(count_max as u64)
            .is_some_and(|b| b <= limits.batch_bytes_max)
            && self.bytes.saturating_add(len_max.saturating_mul(room)) <= limits.batch_bytes_max;
        let end = descriptors.len();
        if !by_count_alone || self.next > end {
            self.feed(descriptors, limits, batches);
            return;
        }
        let open_before = self.first;
        let mut i = self.next;
        while i < end {
            if self.count == count_max {
                batches.push(Batch {
                    first: self.first,
                    count: self.count,
                });
                self.first += self.count;
                self.count = 0;
            }
            let take = (count_max - self.count).min(end - i);
            self.count += take;
            i += take;
        }
        // Only the open batch's bytes matter from here on: add the new
        // descriptors to it, or sum it afresh if it was opened in this call
        // (then it holds at most `count_max` descriptors, all new).
        let (from, base) = if self.first == open_before {
            (self.next, self.bytes)
        } else {
            (self.first, 0)
        };
        self.bytes = descriptors[from..end]
            .iter()
            .fold(base, |sum, d| sum.saturating_add(d.len));
        self.next = end;
    }

    /// Closes the open batch, if any.
    fn finish(&mut self, batches: &mut Vec<Batch>) {
        if self.count > 0 {
            batches.push(Batch {
                first: self.first,
                count: self.count,
            });
            self.first += self.count;
            self.count = 0;
            self.bytes = 0;
        }
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

fn validate_model(model: &ModelSpec) -> Result<(), PlanError> {
    match model.layout {
        // The latent cache is opaque: only its length matters.
        LayoutKind::Mla => Ok(()),
        LayoutKind::Hnd | LayoutKind::Nhd => {
            if model.total_kv_heads == 0 {
                return Err(PlanError::Model("total_kv_heads must be at least 1"));
            }
            if model.block_tokens == 0 {
                return Err(PlanError::Model("block_tokens must be at least 1"));
            }
            if model.head_bytes == 0 {
                return Err(PlanError::Model("head_bytes must be at least 1"));
            }
            Ok(())
        }
    }
}

fn check_tp(model: &ModelSpec, side: Side, tp_size: u32) -> Result<(), PlanError> {
    let heads = model.total_kv_heads;
    let fits = match model.layout {
        LayoutKind::Mla => tp_size > 0,
        LayoutKind::Hnd | LayoutKind::Nhd => {
            tp_size > 0
                && if tp_size <= heads {
                    heads.is_multiple_of(tp_size)
                } else {
                    tp_size.is_multiple_of(heads)
                }
        }
    };
    if fits {
        Ok(())
    } else {
        Err(PlanError::TpSize {
            side,
            tp_size,
            heads,
        })
    }
}

/// Bytes of one block of one region for a rank holding `heads_per_rank`
/// heads, or `None` if that does not fit in u64.
fn kv_len(model: &ModelSpec, heads_per_rank: u32) -> Option<u64> {
    u64::from(heads_per_rank)
        .checked_mul(u64::from(model.block_tokens))?
        .checked_mul(model.head_bytes)
}

/// Address of the last KV byte of `region` (inclusive, so that a region may
/// end at the top of the address space), or `None` if it overflows. `None`
/// too for no blocks (nothing registered) or a zero `kv_block_len`; the
/// caller tells those apart.
fn region_last_byte(region: &Region, num_blocks: u64) -> Option<u64> {
    num_blocks
        .checked_sub(1)?
        .checked_mul(region.block_len)?
        .checked_add(region.kv_block_len.checked_sub(1)?)?
        .checked_add(region.base)
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
