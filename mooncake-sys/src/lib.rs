#![warn(missing_docs)]
//! Mooncake's Transfer Engine (`transfer_engine_c.h`) and Store
//! (`store_c.h`) C APIs, loaded at run time, and a safe wrapper.
//!
//! Nothing links against Mooncake: [`TeLib::load`] opens
//! `libtransfer_engine.so` with `libloading` from [`TE_LIB_ENV`] or the
//! system search path, [`StoreLib::load`] opens `libmooncake_store.so`
//! from [`STORE_LIB_ENV`], and every function is looked up by name. So
//! this crate builds and its tests run on machines without Mooncake; a
//! missing library is [`Error::LibraryNotFound`], a library without one
//! of the functions is [`Error::MissingSymbol`].
//!
//! Written for Mooncake at commit `3b5a5941` (2026-08-22, after v0.3.9;
//! `include/UPSTREAM.md`). The engine reads its tuning from the
//! environment; those that matter to kvferry:
//!
//! | variable | what it sets |
//! |---|---|
//! | `MC_TCP_BIND_ADDRESS` | the address the `tcp` transport listens on |
//! | `MC_HANDSHAKE_PORT`, `MC_MIN_RPC_PORT`/`MC_MAX_RPC_PORT` | the handshake (P2PHANDSHAKE) port and its range |
//! | `MC_SLICE_SIZE`, `MC_TCP_SLICE_SIZE` | how a request is cut into slices |
//! | `MC_SLICE_TIMEOUT`, `MC_TCP_STATUS_TIMEOUT_SEC` | when the engine itself fails a slice |
//! | `MC_RETRY_CNT` | RDMA retries before a slice fails |
//! | `MC_FORCE_TCP` | use tcp even where RDMA devices exist |
//! | `MC_LOG_LEVEL` | the engine's log level |
//!
//! The wrapper ([`Engine`], [`Batch`], [`Registration`], [`Segment`]) owns
//! every handle: a batch id is freed when its [`Batch`] drops, also on an
//! error path. The C API has no cancel, and `freeBatchID` refuses a batch
//! whose tasks are not finished; [`Batch::try_free`] says so, and a
//! [`Batch`] dropped unfinished is kept by its [`Engine`] and freed once
//! the library reports every task finished ([`Engine::reap`]).

pub mod engine;
pub mod error;
#[cfg(feature = "fake")]
pub mod fake;
pub mod ffi;
mod lib_te;
pub mod store;

pub use engine::{Batch, Engine, EngineConfig, Registration, Segment, TaskState};
pub use error::Error;
pub use lib_te::{StoreLib, TeLib, STORE_LIB_ENV, STORE_LIB_NAME, TE_LIB_ENV, TE_LIB_NAME};
