//! Store offload, the IO half (docs/design.md, "Store"): the
//! [`StoreBackend`] trait, the in-process store, and the vLLM-shaped
//! [`StoreConnector`] that drives the pure save and load machines of
//! [`kvferry_machines::store`] against a backend.
//!
//! * [`backend`]: the trait every store implements, scatter lists and
//!   typed per-key and per-call errors.
//! * [`worker`]: the thread each backend runs on, so neither the engine's
//!   thread nor a glommio executor waits on a store.
//! * [`memory`]: the registered engine memory; every scatter list is
//!   checked against it.
//! * [`space`]: the RAM of a store, IO-free: extents of one arena, LRU
//!   eviction, the removed log; the store server's and the in-process
//!   store's.
//! * [`inproc`]: a bounded RAM store in the engine's process, a
//!   [`space::Space`] over an arena of its own.
//! * [`StoreConnector`]: `register_kv_caches`, `lookup`, `start_save`,
//!   `start_load_kv`, `wait_for_save`, `get_finished`,
//!   `block_ids_with_load_errors`, `get_kv_events`, `stats`.

pub mod any;
pub mod backend;
mod config;
mod connector;
pub mod inproc;
pub mod lookup;
pub mod memory;
pub mod mooncake;
pub mod proto;
pub mod publish;
pub mod redis;
pub mod remote;
pub mod scheduler;
pub mod space;
pub mod worker;

pub use self::redis::{
    ClusterConfig, ClusterStats, RedisClusterStore, RedisConfig, RedisError, RedisStats, RedisStore,
};
pub use any::{AnyStore, OpenError, STORE_URLS};
pub use backend::{
    Answers, CallError, GetItem, ItemError, PutItem, PutOutcome, Scatter, Segment, StoreBackend,
};
pub use config::{
    ConnectorConfig, ConnectorError, ConnectorLimits, ConnectorStats, StoreLoadMeta, StoreRequest,
    StoreSaveMeta,
};
pub use connector::StoreConnector;
pub use inproc::{InprocConfig, InprocStats, InprocStore};
pub use lookup::{LookupClient, LookupFailure, LookupQuery, LookupServer, PrefixLookup};
pub use memory::{MemoryError, RegisteredMemory};
pub use mooncake::{MooncakeStore, MooncakeStoreConfig, MooncakeStoreError};
pub use publish::{
    EncodeError, HashEncoding, KvEventBatch, KvEventPublisher, PublishError, PublisherConfig,
};
pub use remote::{RemoteConfig, RemoteError, RemoteStore};
pub use scheduler::{StoreMeta, StoreScheduler, StoreSchedulerConfig};

use std::time::{Duration, Instant};

/// `now + d`, or a time too far to matter when that overflows.
pub(crate) fn after(now: Instant, d: Duration) -> Instant {
    now.checked_add(d)
        .unwrap_or_else(|| now + Duration::from_secs(86_400 * 365))
}
