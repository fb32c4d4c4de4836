//! The pure core of KV offload to a shared store (docs/design.md, "Store
//! (pure core)"): keys, prefix lookup, and the save and load machines.
//!
//! An engine saves the KV blocks of finished prefixes to a store shared by
//! many engines and later loads them back instead of recomputing them.
//! Everything here is pure: the driver asks the store what the machines
//! say (existence checks, puts, gets) and feeds the answers back.
//!
//! * [`key`]: one key per (KV-cache group, block, shard), its textual
//!   format, and which replica rank stores each key.
//! * [`lookup`]: how many leading tokens are stored for every rank and
//!   group, from one batched existence call; load and store masks.
//! * [`save`] and [`load`]: request state machines implementing
//!   [`crate::Machine`], with the same phases, deadlines and abort rules as
//!   the transfer machines.
//! * [`Pressure`]: the per-connector memory of a full store.
//! * [`events`]: KV events of the store tier, collected per step.
//!
//! The driver's contract with a store backend, which bounds when a save
//! may give its blocks back: a call posted at `t` touches no engine memory
//! after `t + StoreConfig::op_bound` (it has completed, or the backend
//! reports it failed by then). The machines rely on it as the transfer
//! machines rely on `Config::transfer_bound`.

use std::time::Duration;

use crate::common::{BlockId, InputError};
use crate::layout::RankLayout;

pub mod events;
pub mod key;
pub mod load;
pub mod lookup;
mod pressure;
mod report;
pub mod save;

mod batch;

pub use key::{
    BlockHash, ChunkKey, GroupSpec, KeyError, Keyspace, KeyspaceSpec, RequestScope, Shard,
};
pub use pressure::{Pressure, PressureStats};

/// Bounds and timeouts of the store machines.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StoreConfig {
    /// Most keys in one put or get call.
    pub max_keys_per_batch: usize,
    /// Most put or get calls one machine has in flight.
    pub max_batches_in_flight: usize,
    /// Most keys one save or load moves.
    pub max_keys_per_request: usize,
    /// Most keys one lookup asks about (a 128k-token request at TP 8 with
    /// two groups needs 2 × 8192 × 8).
    pub max_lookup_keys: usize,
    /// The backend contract: a call posted at `t` touches no engine memory
    /// after `t + op_bound`; a call not answered by then failed.
    pub op_bound: Duration,
    /// A save or load ends by this long after it started (then it stops
    /// posting and ends `Expired` once nothing is in flight).
    pub request_timeout: Duration,
    /// Loads: most bytes of values in flight at once, for a backend that
    /// stages values in a bounded buffer (Mooncake's disk offload). `None`:
    /// values land in the engine's blocks directly, no staging.
    pub staging_budget_bytes: Option<u64>,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            max_keys_per_batch: 128,
            max_batches_in_flight: 4,
            max_keys_per_request: 1 << 16,
            max_lookup_keys: 1 << 18,
            op_bound: Duration::from_secs(10),
            request_timeout: Duration::from_secs(120),
            staging_budget_bytes: None,
        }
    }
}

impl StoreConfig {
    /// Checks the settings once, when the connector starts.
    pub fn validate(&self) -> Result<(), InputError> {
        if self.max_keys_per_batch == 0
            || self.max_batches_in_flight == 0
            || self.max_keys_per_request == 0
            || self.max_lookup_keys == 0
        {
            return Err(InputError::Misuse("every max_* bound must be at least 1"));
        }
        if self.max_keys_per_request > u32::MAX as usize {
            return Err(InputError::Misuse("max_keys_per_request must fit in u32"));
        }
        if self.staging_budget_bytes == Some(0) {
            return Err(InputError::Misuse("a staging budget must be positive"));
        }
        Ok(())
    }
}

/// One block of one group that a save or load moves: its key, where it
/// sits in the request and in the engine, and the size of its value.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct StoreItem {
    /// The block's key for this rank's shard.
    pub key: ChunkKey,
    /// The KV-cache group.
    pub group: u32,
    /// The block's position in the request (block `index` holds tokens
    /// `index × block_tokens ..`).
    pub index: u32,
    /// The engine's block.
    pub block: BlockId,
    /// The engine's hash of the block (what KV events name).
    pub hash: BlockHash,
    /// Bytes of the value: this rank's bytes of the block, all its regions.
    pub value_bytes: u64,
}

/// One group of a request as a save or load sees it: position `i` of each
/// list is block `i` of the request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupBlocks {
    /// The engine's block hashes.
    pub hashes: Vec<BlockHash>,
    /// The engine's blocks.
    pub block_ids: Vec<BlockId>,
    /// Bytes of one block's value on this rank ([`value_bytes`]).
    pub value_bytes: u64,
}

/// Bytes of one block's value on a rank: its bytes of the block in every
/// region it registered (`kv_block_len` summed), saturating.
pub fn value_bytes(layout: &RankLayout) -> u64 {
    (layout.regions.iter()).fold(0u64, |sum, r| sum.saturating_add(r.kv_block_len))
}

/// Why a whole store call failed (no per-key answer came back).
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreFault {
    /// The backend could not reach the store, or the call broke midway.
    Transport,
    /// The call was not answered within `op_bound`.
    Timeout,
    /// The store refused the call (protocol error, bad request).
    Refused,
}

/// Why a lookup, save or load could not be planned from its inputs.
#[non_exhaustive]
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum StorePlanError {
    /// A key could not be built.
    #[error(transparent)]
    Key(#[from] KeyError),
    /// The request names another number of groups than the keyspace.
    #[error("the request has {got} groups, the keyspace {want}")]
    GroupCount {
        /// Groups the request gave.
        got: usize,
        /// Groups of the keyspace.
        want: usize,
    },
    /// A group lacks the hash or block of a position it must move.
    #[error("group {group} has no hash or block at position {index}")]
    MissingBlock {
        /// The group.
        group: u32,
        /// The block position.
        index: u32,
    },
    /// The least common multiple of the groups' block sizes overflows.
    #[error("the groups' block sizes have no common multiple below 2^32")]
    BlockSizes,
    /// More keys than the bound allows.
    #[error("{count} keys exceed the limit of {max}")]
    TooManyKeys {
        /// Keys needed.
        count: usize,
        /// The bound (`max_lookup_keys` or `max_keys_per_request`).
        max: usize,
    },
    /// The store's answer does not match the keys asked about.
    #[error("an answer for {got} keys to a question about {want}")]
    AnswerLength {
        /// Answers given.
        got: usize,
        /// Keys asked about.
        want: usize,
    },
}
