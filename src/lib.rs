#![warn(missing_docs)]
//! kvferry moves the KV cache of LLM requests from a prefill engine to a
//! decode engine (disaggregated serving).
//!
//! Crates, each depending only on those before it:
//!
//! * `kvferry-machines`: the pure state machines, the planner, the wire
//!   codec and the store's keys and save/load machines (no IO, no clock);
//! * `kvferry-reactor`: the glommio executors that drive them;
//! * `kvferry-transport` ([`transport`]): the data plane (tcp, in-process,
//!   Mooncake), registered regions, the block fence, name resolution;
//! * `kvferry-metrics`: the latency histogram and the `/metrics` endpoint;
//! * `kvferry-store`: store offload, its connector, scheduler side, lookup
//!   server, KV events and backends (beside this crate: a P/D embedder
//!   does not build it);
//! * `kvferry-store-server`: `kvferry store serve`;
//! * this crate: the control plane and the public API, re-exported here:
//!   a [`Node`] per rank with its per-request [`Sender`]/[`Receiver`]
//!   handles, or the vLLM-style step loop of a [`Scheduler`] feeding
//!   [`Node::start_load_kv`]. `examples/embed.rs` shows both.
//!
//! # The threads of one node
//!
//! ```text
//!  engine threads (yours)        executor (glommio, pinned)          peers
//!  Node / Sender / Receiver ──▶  mailbox ─▶ machines (Driver) ─▶ data plane ◀─▶ tcp,
//!  poll, get_finished      ◀──  completion board                   local, mooncake
//!                                  ▲ events    │ control messages
//!                                  │           ▼
//!                               bridge thread: ZeroMQ sockets, peer table,
//!                               liveness ◀──────────────────────▶ peers' bridges
//!  metrics thread (/metrics)     bootstrap service (HTTP, prefill or standalone)
//! ```
//!
//! Engine threads never block on the node: every call queues a command or
//! reads the board. The executor owns the machines and the data plane; the
//! bridge owns every socket of the control plane.
//!
//! # The two engine loops
//!
//! Per request, with handles (an engine of its own):
//!
//! ```text
//!  prefill: tx = node.sender(id)      tx.send(blocks, last) ...  tx.poll() → Success
//!  decode:  rx = node.receiver(id, &target)  rx.request(blocks)  rx.poll() → Success
//! ```
//!
//! Per step, as vLLM's connector does: the scheduler process plans, the
//! worker moves.
//!
//! ```text
//!  scheduler: get_num_new_matched_tokens → update_state_after_alloc
//!             → build_connector_meta → LoadMeta (bytes to the workers)
//!  worker:    node.start_load_kv(meta) → node.get_finished() → (sent, received)
//! ```

pub mod bootstrap;
pub mod node;
pub mod scheduler;
pub mod stats;

pub use kvferry_auth as auth;
pub use kvferry_machines as machines;
pub use kvferry_reactor as reactor;
pub use kvferry_transport as transport;
pub use kvferry_transport::internal::resolve;

pub use kvferry_machines::{
    AbortReason, BlockId, BlockLists, FailReason, LayoutKind, Mode, ModelSpec, Phase, Region,
    TransferId, REQUEST_ID_MAX_BYTES,
};
pub use node::{
    DataPlaneError, Event, EventKind, EventSink, IdCollision, KvLayout, LoadMeta, Misuse, Node,
    NodeConfig, NodeError, NodeStats, PrefillTarget, Receiver, Role, Sender, TransportKind,
};
pub use scheduler::{SchedError, Scheduler, SchedulerConfig};
pub use stats::Latency;

#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
