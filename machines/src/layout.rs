//! How a rank's KV cache sits in memory, as the planner sees it.
//!
//! These types are plain data with serde derives so that a layout received
//! from a peer (or read from a `kvferry plan` spec) deserialises straight
//! into them. Nothing here is trusted: [`crate::planner::PairLayout::new`]
//! validates every field before any address is computed.

use serde::{Deserialize, Serialize};

/// Order of the bytes of one block of one region.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LayoutKind {
    /// `(head, token, byte)`: one head of a block is `block_tokens × head_bytes`
    /// contiguous bytes, so a head slice is one copy per block.
    Hnd,
    /// `(token, head, byte)`: a head slice is one short copy per token.
    Nhd,
    /// Multi-head latent attention: one latent per token, identical on every
    /// rank, so one prefill rank sends the whole block to each decode rank.
    Mla,
}

/// The model-wide facts both sides must agree on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    /// Byte order inside a block.
    pub layout: LayoutKind,
    /// Number of KV heads of the whole model (before tensor parallelism).
    pub total_kv_heads: u32,
    /// Tokens per KV block.
    pub block_tokens: u32,
    /// Bytes of one head of one token (`head_dim × element size`).
    pub head_bytes: u64,
}

impl ModelSpec {
    /// Heads held by each rank of a TP group of `tp_size` ranks:
    /// `max(1, H / tp_size)`. Returns 0 only for a zero `tp_size`.
    pub fn heads_per_rank(&self, tp_size: u32) -> u32 {
        if tp_size == 0 {
            return 0;
        }
        (self.total_kv_heads / tp_size).max(1)
    }

    /// First head held by `tp_rank` of a TP group of `tp_size` ranks. When
    /// there are more ranks than heads, heads are replicated and rank `r`
    /// holds head `r / (tp_size / H)`. Meaningless (but never panics) for a
    /// layout that [`crate::planner::TpPair::new`] rejects.
    pub fn first_head(&self, tp_size: u32, tp_rank: u32) -> u32 {
        let heads = self.total_kv_heads;
        if tp_size == 0 || heads == 0 {
            return 0;
        }
        if tp_size <= heads {
            // `tp_rank < tp_size` and `H / tp_size * tp_size <= H` keep this
            // in range for a valid rank; saturate for an invalid one.
            tp_rank.saturating_mul(heads / tp_size)
        } else {
            tp_rank / (tp_size / heads)
        }
    }
}

/// One registered memory region: one layer's K (or V) cache on one rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Region {
    /// Address of block 0.
    pub base: u64,
    /// Stride between consecutive blocks.
    pub block_len: u64,
    /// Bytes at the start of each block that hold this rank's KV.
    pub kv_block_len: u64,
}

/// A rank's place in the pipeline: which of the model's regions it holds.
///
/// The model's regions come in one order (layer by layer; K then V per
/// layer for HND/NHD, one per layer for MLA). A pipeline stage registers
/// the regions of its layers only, a contiguous run starting at
/// `first_region`. Without pipeline parallelism a rank holds them all.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Stage {
    /// Pipeline-parallel size of the engine.
    pub pp_size: u32,
    /// This rank's pipeline stage.
    pub pp_rank: u32,
    /// Index, in the model's region order, of this rank's first region.
    pub first_region: u32,
}

impl Stage {
    /// No pipeline parallelism: one stage holding every region.
    pub const SINGLE: Stage = Stage {
        pp_size: 1,
        pp_rank: 0,
        first_region: 0,
    };
}

impl Default for Stage {
    fn default() -> Self {
        Stage::SINGLE
    }
}

/// One rank's KV cache: its place in the TP group and its regions.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RankLayout {
    /// Size of this engine's tensor-parallel group.
    pub tp_size: u32,
    /// This rank's index in the group.
    pub tp_rank: u32,
    /// Blocks per region; block ids must be below this.
    pub num_blocks: u64,
    /// Regions, in the model's order (see [`Stage`]): without pipeline
    /// parallelism region i pairs with region i.
    #[serde(deserialize_with = "crate::wire::bounded::regions")]
    pub regions: Vec<Region>,
    /// The pipeline stage, and which of the model's regions it holds.
    #[serde(default)]
    pub stage: Stage,
    /// Buffers that move beside the KV, indexed per request rather than
    /// per block (SGLang's aux data and state buffers), in the order both
    /// sides declare them. A request's block lists end with one index list
    /// per pool, in this order (`docs/design.md` §4, "Aux and state
    /// pools"). At most [`POOLS_MAX`].
    #[serde(default, deserialize_with = "crate::wire::bounded::pools")]
    pub pools: Vec<Pool>,
}

/// Most pools one rank declares: SGLang has one aux pool and a few state
/// types (Mamba, SWA, DSA, ...). Each pool's index list also counts among
/// a request's groups (`Config::max_groups`, `wire::Limits::max_groups`).
pub const POOLS_MAX: usize = 16;

/// What a pool holds, which decides how it moves under tensor parallelism.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PoolKind {
    /// Per-request data identical on every TP rank (SGLang's aux buffers:
    /// the first output token, metadata): each decode rank copies it whole
    /// from its first prefill source.
    Aux,
    /// Per-request state (SGLang's Mamba conv/temporal state, SWA or DSA
    /// pages): each rank holds its TP slice, so it moves rank to rank and
    /// needs equal TP sizes (slicing across TP sizes is not implemented).
    State,
}

/// One buffer of a pool: `items` items of `item_len` bytes from `base`
/// (item `i` at `base + i·item_len`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolRegion {
    /// Address of item 0.
    pub base: u64,
    /// Bytes of one item; also the stride between items.
    pub item_len: u64,
}

/// A pool of per-request items: one or more buffers indexed alike (SGLang
/// passes one list of `(ptr, item_len)` per aux pool or state type).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Pool {
    /// How it moves under tensor parallelism.
    pub kind: PoolKind,
    /// Items per buffer; indices must be below this.
    pub items: u64,
    /// The buffers, each copied at the same indices; at most
    /// `wire::Limits::max_regions` (the planner's `REGIONS_MAX`).
    #[serde(deserialize_with = "crate::wire::bounded::pool_regions")]
    pub regions: Vec<PoolRegion>,
}

/// Which side of a transfer a layout or block list belongs to. Errors carry
/// it so the caller can tell a peer's bad metadata from its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Side {
    /// The prefill engine (source of the bytes).
    Prefill,
    /// The decode engine (destination of the bytes).
    Decode,
}

impl std::fmt::Display for Side {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Side::Prefill => f.write_str("prefill"),
            Side::Decode => f.write_str("decode"),
        }
    }
}

/// Bounds on the planner's output.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BatchLimits {
    /// Most descriptors in one batch (vLLM posts 128 at a time).
    pub batch_descriptors_max: usize,
    /// Most bytes in one batch; a larger descriptor is split.
    pub batch_bytes_max: u64,
    /// Most descriptors in a whole plan. A hostile layout can ask for billions
    /// of tiny copies; this turns that into an error instead of an OOM.
    #[serde(default = "BatchLimits::default_descriptors_max")]
    pub descriptors_max: usize,
}

impl BatchLimits {
    /// Default bound on a whole plan: 16 Mi descriptors (384 MiB of output),
    /// enough for a 128k-token request under NHD heterogeneous TP with 128
    /// regions.
    pub const DEFAULT_DESCRIPTORS_MAX: usize = 1 << 24;

    fn default_descriptors_max() -> usize {
        Self::DEFAULT_DESCRIPTORS_MAX
    }
}

impl Default for BatchLimits {
    /// 128 descriptors and 128 MiB per batch, as vLLM batches its transfers.
    fn default() -> Self {
        BatchLimits {
            batch_descriptors_max: 128,
            batch_bytes_max: 128 << 20,
            descriptors_max: Self::DEFAULT_DESCRIPTORS_MAX,
        }
    }
}
