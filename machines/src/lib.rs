#![warn(missing_docs)]
//! Pure core of kvferry: per-request state machines and the transfer planner.
//!
//! Nothing in this crate performs IO, reads a clock, spawns a thread or is
//! `async`. Every input carries the current time (`now`) from the caller, and
//! every output is pulled by the caller, in the style of quinn-proto:
//!
//! ```text
//! loop {
//!     // feed whatever happened: a message, a completion, an engine call
//!     machine.handle_event(now, event)?;            // or handle_timeout / abort
//!     while let Some(action) = machine.poll_action() {
//!         execute(action);                          // send, post writes, release
//!     }
//!     arm_timer(machine.poll_timeout());            // earliest deadline, if any
//! }
//! ```
//!
//! The driver that runs this loop for thousands of requests lives in the
//! `kvferry-reactor` crate.

mod backoff;
mod common;
mod duplex;
mod layout;
mod liveness;
mod machine;
mod planner;
mod recv;
mod send;
mod store;
mod wire;

pub use backoff::{Backoff, BackoffState};
pub use common::{
    check_request_id, AbortReason, BlockId, BlockLists, FailReason, InputError, Mode, PeerId,
    Phase, RequestIdError, TransferId, REQUEST_ID_MAX_BYTES,
};
pub use duplex::Duplex;
pub use layout::{
    BatchLimits, LayoutKind, ModelSpec, Pool, PoolKind, PoolRegion, RankLayout, Region, Side,
    Stage, POOLS_MAX,
};
pub use liveness::{DeathCause, Liveness};
pub use machine::Machine;
pub use planner::{plan, PairLayout, Plan, PlanError};
pub use recv::RecvMachine;
pub use send::SendMachine;

/// Each machine's events and actions, the wire codec, the planner's parts
/// and the store's keys and machines, by module: for the crates built on
/// this one, the CLI, the tests and fuzzing.
pub mod internal {
    /// Request ids, leases, messages and the machines' shared config.
    pub mod common {
        pub use crate::common::*;
    }
    /// One request that both sends and receives (`kv_both`).
    pub mod duplex {
        pub use crate::duplex::*;
    }
    /// The transfer planner.
    pub mod planner {
        pub use crate::planner::*;
    }
    /// The receiving side's machine.
    pub mod recv {
        pub use crate::recv::*;
    }
    /// The sending side's machine.
    pub mod send {
        pub use crate::send::*;
    }
    /// Store keys, the save, load and lookup machines, KV events.
    pub mod store {
        pub use crate::store::*;
    }
    /// The control frames and the bounded envelope.
    pub mod wire {
        pub use crate::wire::*;
    }
}
