//! The contract every request state machine implements.

use std::time::Instant;

use crate::common::{AbortReason, InputError, Phase};

/// The contract every request state machine implements (docs/design.md §2).
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
