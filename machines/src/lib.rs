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
//!
//! The root exports the machines, the types they share, the layouts and
//! the planner. [`send`], [`recv`] and [`duplex`] hold each machine's
//! events and actions, [`wire`] the control frames and their codec, and
//! [`store`] the store's keys, lookup, save and load machines and KV
//! events.

mod backoff;
mod common;
pub mod duplex;
mod layout;
mod liveness;
mod machine;
mod planner;
pub mod recv;
pub mod send;
pub mod store;
pub mod wire;

pub use backoff::{Backoff, BackoffState};
pub use common::{
    blocks_fingerprint, check_request_id, late_answer, AbortReason, BlockId, BlockLists, Config,
    FailReason, InputError, Mode, Msg, PeerId, Phase, RequestIdError, TransferId,
    REQUEST_ID_MAX_BYTES, TICKET_BIT,
};
pub use duplex::Duplex;
pub use layout::{
    BatchLimits, LayoutKind, ModelSpec, Pool, PoolKind, PoolRegion, RankLayout, Region, Side,
    Stage, POOLS_MAX,
};
pub use liveness::{DeathCause, Liveness};
pub use machine::Machine;
pub use planner::{
    plan, sliding_window_blocks, Batch, Descriptor, PairLayout, Peers, Plan, PlanError, Share,
    TpPair, REGIONS_MAX,
};
pub use recv::RecvMachine;
pub use send::SendMachine;

/// Every module whole, public items and test-only ones alike: for this
/// crate's tests, the fuzz targets, the benches and `kvferry-testkit` only.
/// Production code uses the crate root and the public modules; nothing
/// here is a stable API.
#[doc(hidden)]
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
    /// The control frames and the bounded envelope, and the encoders only
    /// tests use.
    pub mod wire {
        pub use crate::wire::*;

        /// Appends the encoding of `frame` to `out`, reusing its allocation.
        pub fn encode_into(frame: &Frame, out: &mut Vec<u8>) {
            crate::wire::encode_into(frame, out);
        }

        /// The header with `version`, then the body: a peer of another
        /// build, for the tests of version refusal.
        pub fn encode_versioned(frame: &Frame, version: u16, out: &mut Vec<u8>) {
            crate::wire::encode_versioned(frame, version, out);
        }
    }
}
