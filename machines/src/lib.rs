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

pub mod common;
pub mod duplex;
pub mod layout;
pub mod liveness;
mod machine;
pub mod planner;
pub mod recv;
pub mod send;
pub mod store;
pub mod wire;

pub use common::{AbortReason, FailReason, InputError, Phase, TransferId};
pub use machine::Machine;
pub use recv::RecvMachine;
pub use send::SendMachine;
