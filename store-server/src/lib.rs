#![warn(missing_docs)]
//! `kvferry store serve`: a RAM store several engines share
//! (store/DESIGN.md, "The store server").
//!
//! One glommio executor serves everything: the control connections
//! ([`kvferry_store::internal::proto`], the protocol client and server share), and a tcp data-plane endpoint through which the
//! server itself moves the bytes: for a put it reads the engine's blocks
//! into its arena ([`Op::Read`](kvferry_transport::Op::Read)), for a get
//! it writes the arena into the engine's blocks
//! ([`Op::Write`](kvferry_transport::Op::Write)). Each descriptor is checked by the
//! server against the regions the engine's endpoint announced, by the
//! server's transport against its own arena, and by the engine's
//! endpoint against its registered regions and its fence. A put is
//! committed (visible) only once the whole batch landed.
//!
//! The modules, each one concept:
//!
//! * `config`: [`ServeConfig`], the check of its settings, [`ServeError`].
//! * `lifecycle`: [`StoreServer`]: allocates, binds and starts the
//!   executor thread; stops it when dropped.
//! * `server`: what the executor's tasks share: the arena (a
//!   [`kvferry_store::internal::arena::Arena`], registered with the data
//!   plane), the [`Space`] that indexes it, the connections per address.
//! * `accept`: the listener: admission within the connection bounds, one
//!   task per connection, shutdown.
//! * `framing`: the handshake that opens a control connection and the
//!   reading of each request.
//! * `conn`: one engine's connection: hello, exists, remove, and puts and
//!   gets, whose bytes move over a data-plane session to the engine.
//! * `descs`: an item's segments as descriptors against the arena.
//! * `metrics`: [`ServerCounters`] and their OpenMetrics text.
//!
//! Each uses only modules before it in this order, so none uses another
//! back: `config`, `metrics`, `descs`, `server`, `framing`, `conn`,
//! `accept`, `lifecycle`.

mod accept;
mod config;
mod conn;
mod descs;
mod framing;
mod lifecycle;
mod metrics;
mod server;

pub use config::{ServeConfig, ServeError};
pub use kvferry_store::internal::space::{Space, SpaceStats, REMOVED_LOG_MAX};
pub use lifecycle::StoreServer;
pub use metrics::{metrics_text, ServerCounters, ServerStats};
