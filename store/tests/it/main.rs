//! The integration tests of the store: its backends (in-process, the store
//! server, Redis, Redis Cluster, Mooncake Store) under one buffer contract,
//! the connector's save and load runs, the scheduler side, KV events and
//! seeded faults. One binary.

mod store_auth;
mod store_buffer;
mod store_inproc;
mod store_kv_events;
mod store_mooncake;
mod store_redis;
mod store_redis_cluster;
mod store_scheduler;
mod store_seeded_faults;
mod store_server;
