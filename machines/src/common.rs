//! Types shared by the send and receive machines.

use serde::{Deserialize, Serialize};

/// Identifies one request's transfer across P and D (vLLM's `transfer_id`,
/// SGLang's bootstrap room).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct TransferId(pub u64);

/// What `poll()` reports for a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Peer not known yet.
    Bootstrapping,
    /// Peer known, waiting for the KV (P) or for the data (D).
    WaitingForInput,
    /// Descriptors in flight.
    Transferring,
    /// All paired peers confirmed.
    Success,
    /// Transport error, peer failure, bad metadata or abort.
    Failed(FailReason),
    /// A deadline passed.
    Expired,
}

impl Phase {
    /// True for `Success`, `Failed` and `Expired`: no later input changes it.
    pub fn is_terminal(&self) -> bool {
        match self {
            Phase::Bootstrapping | Phase::WaitingForInput | Phase::Transferring => false,
            Phase::Success | Phase::Failed(_) | Phase::Expired => true,
        }
    }
}

/// Why a request failed. Separates blame: the peer, the transport, us.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum FailReason {
    /// The data plane reported an error for one of our batches.
    Transport,
    /// The peer reported a failure in its `Status`.
    PeerReported,
    /// The peer missed its heartbeats or its connection dropped.
    PeerDead,
    /// The peer aborted the transfer.
    PeerAborted,
    /// The request was aborted locally.
    Aborted(AbortReason),
    /// Layouts or block lists do not fit together (planner rejected them).
    BadMetadata,
}

/// Why the local side aborted a request.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum AbortReason {
    /// The engine aborted the request (preemption, scheduler decision).
    Engine,
    /// The client went away.
    ClientDisconnect,
    /// The node is shutting down.
    Shutdown,
}

/// Input a machine refused. The machine is unchanged after such an error.
#[non_exhaustive]
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum InputError {
    /// The peer sent something that does not fit this request.
    #[error("peer misbehaved: {0}")]
    Peer(&'static str),
    /// The local caller used the API wrongly (e.g. sent blocks twice).
    #[error("misuse: {0}")]
    Misuse(&'static str),
}
