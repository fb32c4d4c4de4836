//! kvferry moves the KV cache of LLM requests from a prefill engine to a
//! decode engine (disaggregated serving).
//!
//! Crates: `kvferry-machines` holds the pure state machines and the planner,
//! `kvferry-reactor` the glommio executors that drive them, and this crate the
//! transports, the control plane, the public API and the CLI.

pub mod bootstrap;
pub mod node;
pub mod plan;
pub mod scheduler;
pub mod transport;
pub mod wire;

pub use kvferry_machines as machines;
pub use kvferry_reactor as reactor;
