//! Prefix lookups (docs/design.md, "Store: the lookup server"): what a
//! lookup asks ([`LookupQuery`]), how it fails ([`LookupFailure`]), who
//! answers ([`PrefixLookup`]: a [`StoreConnector`] asked directly, a
//! closure, or a [`LookupClient`]), and the lookup server across processes.
//! vLLM's scheduler runs in its own process, the store clients in the
//! workers', so the rank-0 worker answers the scheduler's lookups.
//!
//! * [`LookupServer`]: a ZeroMQ REP socket on a thread of its own, bound on
//!   an `ipc://` or `tcp://127.0.0.1` endpoint, answering each request with
//!   a [`PrefixLookup`] it owns. [`LookupServer::spawn_for_store`] gives it
//!   a connector of its own over a second handle of the worker's store
//!   ([`ExistsOnly`]), so it never needs the engine's connector and the
//!   engine's thread never waits on it.
//! * [`LookupClient`]: a REQ socket with a receive timeout, one round trip
//!   per lookup; a socket that timed out is dropped and made again (a REQ
//!   socket waits for its reply forever otherwise).
//! * [`wire`]: the messages between them.
//!
//! The scheduler ([`super::scheduler`]) depends on this module and on no
//! socket: a lookup's failure carries the socket's error as an
//! [`std::io::Error`].

mod board;
mod client;
mod server;
pub mod wire;

pub use board::{Answer as BoardAnswer, BoardError, LookupBoard};
pub use client::{LookupClient, LookupClientStats};
pub use server::{ExistsOnly, LookupServer, LookupServerError, LookupServerStats};
pub use wire::{LookupWireError, ServerFault};

use kvferry_machines::store::lookup::LookupHit;
use kvferry_machines::store::BlockHash;

use crate::config::ConnectorError;
use crate::connector::StoreConnector;

/// What a prefix lookup is asked: the first `token_len` tokens of a
/// request. Also the lookup server's request body.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LookupQuery {
    /// Tokens to look up (the prompt less one token).
    pub token_len: u32,
    /// Per group, the request's block hashes.
    pub block_hashes: Vec<Vec<BlockHash>>,
    /// The LoRA adapter, if any.
    pub lora: Option<String>,
    /// The engine's extra hash inputs.
    pub extra_keys: Vec<String>,
}

/// Why a lookup gave no answer; the scheduler counts it and takes a miss.
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum LookupFailure {
    /// The connector could not look up (bad inputs, store call failed).
    #[error(transparent)]
    Connector(#[from] ConnectorError),
    /// No answer within the client's timeout.
    #[error("no lookup answer within {0:?}")]
    Timeout(std::time::Duration),
    /// The socket failed (ZeroMQ's error as the OS error it stands for).
    #[error("lookup socket: {0}")]
    Transport(#[source] std::io::Error),
    /// An answer that does not decode, or answers another question.
    #[error(transparent)]
    Wire(#[from] LookupWireError),
    /// The lookup server could not answer.
    #[error("the lookup server failed: {0:?}")]
    Server(ServerFault),
}

/// Answers prefix lookups: how many leading tokens are stored, with the
/// load masks.
pub trait PrefixLookup {
    /// Looks `query` up.
    fn lookup(&mut self, query: &LookupQuery) -> Result<LookupHit, LookupFailure>;
}

impl<F> PrefixLookup for F
where
    F: FnMut(&LookupQuery) -> Result<LookupHit, LookupFailure>,
{
    fn lookup(&mut self, query: &LookupQuery) -> Result<LookupHit, LookupFailure> {
        self(query)
    }
}

/// Directly against the store, in one batched existence call (blocks the
/// caller up to the connector's `op_bound`).
impl PrefixLookup for StoreConnector {
    fn lookup(&mut self, q: &LookupQuery) -> Result<LookupHit, LookupFailure> {
        let extra: Vec<&str> = q.extra_keys.iter().map(String::as_str).collect();
        let scope =
            (self.keyspace().scope(q.lora.as_deref(), &extra)).map_err(ConnectorError::from)?;
        Ok(self.lookup_hit(&scope, q.token_len, &q.block_hashes)?)
    }
}

#[cfg(test)]
mod tests;
