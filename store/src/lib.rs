#![warn(missing_docs)]
//! Store offload, the IO half (its design below, from `DESIGN.md`): the
//! [`StoreBackend`] trait, the in-process store, and the vLLM-shaped
//! [`StoreConnector`] that drives the pure save and load machines of
//! [`kvferry_machines::store`] against a backend.
//!
//! * [`StoreBackend`]: the trait every store implements, scatter lists and
//!   typed per-key and per-call errors.
//! * [`internal::worker`]: the thread each backend runs on, so neither the
//!   engine's thread nor a glommio executor waits on a store.
//! * [`RegisteredMemory`]: the registered engine memory; every scatter list
//!   is checked against it.
//! * [`internal::space`]: the RAM of a store, IO-free: extents of one
//!   arena, LRU eviction, the removed log; the store server's and the
//!   in-process store's.
//! * [`internal::arena`]: the bytes a space indexes, one allocation of
//!   the store's capacity, or a typed error; the store server's and the
//!   in-process store's.
//! * [`InprocStore`]: a bounded RAM store in the engine's process, a
//!   `Space` over an arena of its own.
//! * [`StoreConnector`]: `register_kv_caches`, `lookup`, `start_save`,
//!   `start_load_kv`, `wait_for_save`, `get_finished`,
//!   `block_ids_with_load_errors`, `get_kv_events`, `stats`.
#![doc = ""]
#![doc = include_str!("../DESIGN.md")]

mod any;
mod arena;
mod backend;
mod config;
mod connector;
mod engine_worker;
mod inproc;
mod lookup;
mod memory;
mod mooncake;
mod proto;
mod publish;
mod redis;
mod remote;
mod scheduler;
mod settings;
mod space;
mod worker;

pub use self::redis::{
    ClusterConfig, ClusterStats, RedisClusterStore, RedisConfig, RedisError, RedisStats, RedisStore,
};
pub use any::{AnyStore, OpenError, STORE_URLS};
pub use arena::AllocError;
pub use backend::{
    Answers, CallError, GetItem, ItemError, PutItem, PutOutcome, Scatter, Segment, StoreBackend,
};
pub use config::{
    ConnectorConfig, ConnectorError, ConnectorLimits, ConnectorStats, StoreLoadMeta, StoreRequest,
    StoreSaveMeta,
};
pub use connector::StoreConnector;
pub use engine_worker::{EngineWorker, Registration, Started, WorkerError};
pub use inproc::{InprocConfig, InprocStats, InprocStore};
pub use lookup::{
    BoardError, LookupBoard, LookupClient, LookupFailure, LookupQuery, LookupServer, PrefixLookup,
};
pub use memory::{MemoryError, RegisteredMemory};
pub use mooncake::{MooncakeStore, MooncakeStoreConfig, MooncakeStoreError};
pub use publish::{
    EncodeError, HashEncoding, KvEventBatch, KvEventPublisher, PublishError, PublisherConfig,
};
pub use remote::{RemoteConfig, RemoteError, RemoteStore};
pub use scheduler::{
    Scheduled, StoreMeta, StoreReq, StoreSchedError, StoreScheduler, StoreSchedulerConfig,
};
pub use settings::{GroupSetting, StoreSettings};

/// The parts below the API: the store server's protocol and RAM, the
/// lookup wire, backend threads and limits, for `kvferry-store-server`,
/// the CLI and the tests.
pub mod internal {
    /// The bytes of a RAM store: one allocation its space hands out.
    pub mod arena {
        pub use crate::arena::*;
    }
    /// The in-process store's named registry and stats.
    pub mod inproc {
        pub use crate::inproc::*;
    }
    /// The lookup query, its wire and server.
    pub mod lookup {
        pub use crate::lookup::*;
    }
    /// The store server's protocol, shared by `RemoteStore` and the server.
    pub mod proto {
        pub use crate::proto::*;
    }
    /// The KV event publisher's wire constants.
    pub mod publish {
        pub use crate::publish::*;
    }
    /// The Redis value layout.
    pub mod redis {
        pub use crate::redis::*;
    }
    /// The pure scheduler side's parts.
    pub mod scheduler {
        pub use crate::scheduler::*;
    }
    /// The RAM of a store: extents, LRU eviction, the removed log.
    pub mod space {
        pub use crate::space::*;
    }
    /// The thread each backend runs on.
    pub mod worker {
        pub use crate::worker::*;
    }
}

use std::time::{Duration, Instant};

/// `now + d`, or a time too far to matter when that overflows.
pub(crate) fn after(now: Instant, d: Duration) -> Instant {
    now.checked_add(d)
        .unwrap_or_else(|| now + Duration::from_secs(86_400 * 365))
}
