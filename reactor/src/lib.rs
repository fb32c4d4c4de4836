#![warn(missing_docs)]
//! Thread-per-core glommio executors that drive kvferry's state machines.
//!
//! A [`Reactor`] runs one glommio `LocalExecutor` per device, pinned to a
//! core with `Placement::Fixed` when the config names one. Each executor
//! owns a [`Driver`]: the machines of its device in a `slab::Slab`, an index
//! `TransferId -> key`, and one deadline heap behind **one** timer. Engine
//! threads reach executors through a [`ReactorHandle`] whose calls go into
//! bounded `flume` mailboxes (a full mailbox is [`SubmitError::MailboxFull`],
//! never an unbounded queue) and collect [`Completion`]s the same way with
//! [`ReactorHandle::get_finished`]. The latest phase of every transfer is
//! readable from any thread on the [`CompletionBoard`] via
//! [`ReactorHandle::poll`].
//!
//! # The run loop of one executor
//!
//! ```text
//! loop {
//!     arm the one timer at round_up(driver.poll_timeout(), tick)
//!         (or the shutdown stage's deadline, if earlier);
//!     wait for the first of: shutdown policy | local event (async action
//!         finished) | timer | mailbox command;
//!     handle it, then up to `max_inputs_per_turn` more queued inputs:
//!         Create  -> driver.insert(now, id, machine, sink)
//!         Event   -> driver.handle_event(now, id, event, sink)
//!         Abort   -> driver.abort(now, id, reason, sink)
//!         Spawn   -> glommio::spawn_local(task)
//!       after each input the driver drains poll_action() into the
//!       ActionSink (capped per input), reports phase changes (board +
//!       tracing), re-arms that machine's deadline and removes the machine
//!       once it is terminal, drained and has no deadline left;
//!     driver.drive_pending(now, sink);     // capped drains left over
//!     driver.handle_timers(now, sink);     // every deadline <= now, in order
//!     move driver completions to the completion channel;
//!     if shutting down: abort / drop by policy; stop when the driver is empty;
//! }
//! ```
//!
//! # Using it from engine threads
//!
//! ```no_run
//! # use std::time::{Duration, Instant};
//! # use kvferry_machines::{AbortReason, InputError, Machine, Phase, TransferId};
//! # struct M;
//! # impl Machine for M {
//! #     type Event = ();
//! #     type Action = ();
//! #     fn handle_event(&mut self, _: Instant, _: ()) -> Result<(), InputError> { Ok(()) }
//! #     fn handle_timeout(&mut self, _: Instant) {}
//! #     fn abort(&mut self, _: Instant, _: AbortReason) {}
//! #     fn poll_action(&mut self) -> Option<()> { None }
//! #     fn poll_timeout(&self) -> Option<Instant> { None }
//! #     fn phase(&self) -> Phase { Phase::WaitingForInput }
//! # }
//! use kvferry_reactor::{ActionSink, Reactor, ReactorConfig, ShutdownPolicy};
//!
//! struct Sink; // the node's: sends messages, posts transfers, releases blocks
//! impl ActionSink<M> for Sink {
//!     fn execute(&mut self, _transfer_id: TransferId, _action: ()) {}
//! }
//!
//! let reactor = Reactor::start(ReactorConfig::for_devices(2), |_ctx| Sink)?;
//! let handle = reactor.handle(); // Clone + Send + Sync
//! handle.create(0, TransferId(1), M).map_err(|refused| refused.error)?;
//! handle.send_event(TransferId(1), ()).map_err(|refused| refused.error)?;
//! let _phase = handle.poll(TransferId(1)); // from the board, no round trip
//! for done in handle.get_finished(64) {
//!     println!("{:?}: {:?}", done.transfer_id, done.outcome);
//! }
//! let report = reactor.shutdown(ShutdownPolicy::Abort { grace: Duration::from_secs(2) })?;
//! assert!(report.completions.len() <= 1);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Threads and shared state
//!
//! Everything shared between threads outside the channels (the
//! [`CompletionBoard`], the [`Stats`] counters and the [`ShutdownLatch`]) is
//! written against [`internal::sync`], which switches to `loom` under
//! `--cfg kvferry_loom`; `reactor/tests/loom.rs` model-checks each of them.
//!
//! Every request runs inside a `tracing` span `transfer{transfer_id, executor}`;
//! phase changes are logged at debug level.

mod board;
mod config;
mod doorbell;
mod driver;
mod error;
mod executor;
mod latch;
mod mailbox;
mod stats;
mod sync;

pub use board::{BoardError, CompletionBoard};
pub use config::{ExecutorConfig, PollPolicy, ReactorConfig, ShutdownPolicy};
pub use doorbell::{batch, release_held, Doorbell};
pub use driver::{
    round_up_to_tick, ActionSink, Completion, Driver, DriverConfig, DriverError, Outcome,
    RejectReason,
};
pub use error::ReactorError;
pub use executor::{ExecutorReport, Reactor, ReactorHandle, ShutdownReport, MIN_MEMLOCK_BYTES};
pub use latch::{LatchGuard, ShutdownLatch};
pub use mailbox::{
    Command, EventPoster, ExecutorContext, PostError, Refused, SpawnFn, SubmitError,
};
pub use stats::{Stats, StatsSnapshot};
pub use sync::lock;

/// Parts for this workspace's own tests, not an embedder's API.
pub mod internal {
    /// The std/loom switch: `--cfg kvferry_loom` swaps every lock, atomic
    /// and thread here for loom's, so the model checks run the real code.
    pub mod sync {
        pub use crate::sync::*;
    }
}
