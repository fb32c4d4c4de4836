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
pub mod layout;
pub mod liveness;
pub mod planner;
pub mod recv;
pub mod send;
pub mod wire;

pub use common::{AbortReason, FailReason, InputError, Phase, TransferId};
pub use recv::RecvMachine;
pub use send::SendMachine;

use std::time::Instant;

/// The contract every request state machine implements (DESIGN.md §2).
///
/// `now` never goes backwards between calls. After every `handle_*` or
/// `abort` call, the driver drains [`Machine::poll_action`] until it returns
/// `None` before feeding the next input.
pub trait Machine {
    /// Inputs from the peer, the transport and the engine.
    type Event;
    /// Outputs the driver executes.
    type Action;

    /// Feeds one input. Bad peer input is an `Err` and leaves the machine
    /// unchanged; failures of the request itself become phases, not errors.
    fn handle_event(&mut self, now: Instant, event: Self::Event) -> Result<(), InputError>;
    /// Tells the machine that time passed. Spurious calls are no-ops.
    fn handle_timeout(&mut self, now: Instant);
    /// Aborts the request locally. Terminal machines ignore it.
    fn abort(&mut self, now: Instant, reason: AbortReason);
    /// Next action to execute, if any.
    #[must_use]
    fn poll_action(&mut self) -> Option<Self::Action>;
    /// Earliest deadline at which `handle_timeout` must be called.
    #[must_use]
    fn poll_timeout(&self) -> Option<Instant>;
    /// What `poll()` reports to the engine.
    fn phase(&self) -> Phase;
}
