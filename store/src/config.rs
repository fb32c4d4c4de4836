//! What a [`super::StoreConnector`] is given and what it answers: its
//! configuration and bounds, the requests, its errors and its stats.

use kvferry_machines::store::events::Medium;
use kvferry_machines::store::lookup::LookupHit;
use kvferry_machines::store::{
    BlockHash, KeyError, KeyspaceSpec, PressureStats, StoreConfig, StoreFault, StorePlanError,
};
use kvferry_machines::{BlockLists, InputError, TransferId};

use super::memory::MemoryError;
use super::worker::PostError;

/// How a connector runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConnectorConfig {
    /// Bounds and timeouts of the save and load machines.
    pub store: StoreConfig,
    /// What the engine's keys have in common.
    pub keyspace: KeyspaceSpec,
    /// Where the store holds blocks, as KV events name it.
    pub medium: Medium,
    /// Bounds of the connector's own maps and queues.
    pub limits: ConnectorLimits,
}

/// The named bounds of every map and queue of a connector.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnectorLimits {
    /// Saves running or finished and not yet collected by `get_finished`;
    /// past it `start_save` is [`ConnectorError::TooManySaves`].
    pub max_saves: usize,
    /// Loads running or finished and not yet collected; past it
    /// `start_load_kv` is [`ConnectorError::TooManyLoads`].
    pub max_loads: usize,
    /// Block ids with load errors held until collected; past it they are
    /// dropped and counted (`ConnectorStats::load_errors_dropped`).
    pub max_load_error_blocks: usize,
    /// KV events held until collected; past it dropped and counted.
    pub max_events: usize,
    /// Requests the pressure path remembers.
    pub max_pressure_requests: usize,
    /// Longest wait for the backend to take the engine's KV layout, once,
    /// at `register_kv_caches` ([`super::StoreBackend::register`]): longer
    /// than one op's bound, as a backend may pin and map the whole KV
    /// then (Mooncake's `register_buffer`), and the backend's thread may
    /// still be starting.
    pub max_register_wait: std::time::Duration,
}

impl Default for ConnectorLimits {
    fn default() -> Self {
        ConnectorLimits {
            max_saves: 4096,
            max_loads: 4096,
            max_load_error_blocks: 1 << 20,
            max_events: 1 << 16,
            max_pressure_requests: 4096,
            max_register_wait: std::time::Duration::from_secs(60),
        }
    }
}

impl ConnectorLimits {
    /// The backend queue's bound: every call the machines may have out at
    /// once (an existence check and `max_batches_in_flight` batches per
    /// request), one lookup, and as many calls again given up on but not
    /// yet answered by a slow backend. A full queue fails the call.
    pub fn backend_queue(&self, store: &StoreConfig) -> usize {
        let per_request = store.max_batches_in_flight.saturating_add(1);
        let requests = self.max_saves.saturating_add(self.max_loads);
        requests
            .saturating_mul(per_request)
            .saturating_add(1)
            .saturating_mul(2)
    }
}

/// The request-wide inputs of a save or a load.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoreRequest {
    /// The request.
    pub id: TransferId,
    /// Per group, the engine's block hashes, block 0 first.
    pub block_hashes: Vec<Vec<BlockHash>>,
    /// Per group, the engine's blocks for the same positions.
    pub block_ids: BlockLists,
    /// The LoRA adapter, if any.
    pub lora: Option<String>,
    /// The engine's extra hash inputs (vLLM's `extra_keys`).
    pub extra_keys: Vec<String>,
}

/// What `start_save` saves: the first `token_len` tokens of a request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoreSaveMeta {
    /// The request.
    pub request: StoreRequest,
    /// Tokens to save (aligned down to the groups' common block multiple).
    pub token_len: u32,
    /// The request's tokens, for `BlockStored` events; `None`: events
    /// carry none.
    pub token_ids: Option<Vec<u32>>,
}

/// What `start_load_kv` loads: a lookup's hit, less what the engine holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoreLoadMeta {
    /// The request.
    pub request: StoreRequest,
    /// The scheduler's lookup hit (its load masks).
    pub hit: LookupHit,
    /// Leading tokens the engine holds itself (vLLM's local prefix hit).
    pub local_tokens: u32,
}

/// Why a connector call was refused.
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum ConnectorError {
    /// The configuration is unusable.
    #[error("bad configuration: {0}")]
    Config(InputError),
    /// A keyspace, scope or key could not be built.
    #[error(transparent)]
    Key(#[from] KeyError),
    /// A lookup, save or load could not be planned.
    #[error(transparent)]
    Plan(#[from] StorePlanError),
    /// Registered memory refused a layout or a block.
    #[error(transparent)]
    Memory(#[from] MemoryError),
    /// A machine refused its inputs.
    #[error(transparent)]
    Input(#[from] InputError),
    /// `register_kv_caches` was not called yet.
    #[error("no KV cache registered")]
    NotRegistered,
    /// `register_kv_caches` was called before.
    #[error("a KV cache is registered already")]
    RegisteredTwice,
    /// A save (or load) of this request is running or not yet collected.
    #[error("request {0} has a save or load already")]
    DuplicateRequest(TransferId),
    /// `ConnectorLimits::max_saves` reached.
    #[error("{max} saves running or not yet collected")]
    TooManySaves {
        /// The bound.
        max: usize,
    },
    /// `ConnectorLimits::max_loads` reached.
    #[error("{max} loads running or not yet collected")]
    TooManyLoads {
        /// The bound.
        max: usize,
    },
    /// The backend thread could not be started.
    #[error("the backend thread could not start: {0}")]
    Spawn(#[source] std::io::Error),
    /// A call could not be posted to the backend thread.
    #[error(transparent)]
    Post(#[from] PostError),
    /// The backend refused the engine's memory.
    #[error("the backend did not take the KV memory: {0:?}")]
    Register(StoreFault),
    /// A lookup's existence call failed as a whole.
    #[error("the lookup's store call failed: {0:?}")]
    Lookup(StoreFault),
}

/// Counters and gauges of a connector.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ConnectorStats {
    /// Lookups answered.
    pub lookups: u64,
    /// Existence calls made by lookups (one per lookup with keys).
    pub lookup_calls: u64,
    /// Keys lookups asked about.
    pub lookup_keys: u64,
    /// Tokens lookups found stored.
    pub lookup_hit_tokens: u64,
    /// Saves started (skipped ones included).
    pub saves_started: u64,
    /// Saves released.
    pub saves_finished: u64,
    /// Keys saves stored.
    pub saved_keys: u64,
    /// Keys saves found stored already (dedup).
    pub dedup_skipped: u64,
    /// Keys of saves not stored (full, too large, failed, not attempted).
    pub save_failed_keys: u64,
    /// Loads started.
    pub loads_started: u64,
    /// Loads finished.
    pub loads_finished: u64,
    /// Keys loads loaded.
    pub loaded_keys: u64,
    /// Blocks loads reported not loaded.
    pub load_error_blocks: u64,
    /// Load error block ids dropped for want of room.
    pub load_errors_dropped: u64,
    /// Existence calls of saves.
    pub exists_calls: u64,
    /// Put calls.
    pub put_calls: u64,
    /// Get calls.
    pub get_calls: u64,
    /// Calls that could not be posted (failed at once).
    pub post_failures: u64,
    /// Keys the store reported gone (evicted or removed).
    pub removed_keys: u64,
    /// KV events dropped for want of room.
    pub events_dropped: u64,
    /// The pressure path's counters.
    pub pressure: PressureStats,
    /// Calls posted and not answered yet.
    pub calls_in_flight: u64,
    /// Saves running now.
    pub saves_running: u64,
    /// Loads running now.
    pub loads_running: u64,
}
