//! What a request reports: its phase, why it failed or was aborted, and
//! the error for input a machine refuses.

use serde::{Deserialize, Serialize};

/// What `poll()` reports for a request.
///
/// A machine turns terminal in the same call that queues its release
/// (`ReleaseBlocks` on P, `Received`/`LoadFailed` on D), never earlier: an
/// engine that frees a request's blocks when it sees a terminal phase is
/// safe. A request whose outcome is decided but whose blocks may still be
/// touched (in-flight transfers, a lease not yet returned or fenced) keeps
/// reporting `Transferring`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Phase {
    /// Peer not known yet.
    Bootstrapping,
    /// Peer known, waiting for the KV (P) or for the data (D).
    WaitingForInput,
    /// Transfers in flight, or the end of a failed request being fenced.
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
    /// The peer reported a failure (`Status{ok: false}` or `Done{ok: false}`).
    PeerReported,
    /// The driver declared the peer dead (missed heartbeats, connection dropped).
    PeerDead,
    /// The peer aborted the transfer.
    PeerAborted,
    /// The request was aborted locally.
    Aborted(AbortReason),
    /// Layouts or block lists do not fit together (the planner rejected
    /// them, or P has more blocks than D's destination list can take).
    BadMetadata,
    /// The layouts pair only by a rule kvferry does not implement (a state
    /// pool between different TP sizes, `PlanError::Unsupported`): both
    /// sides refuse the transfer rather than move bytes sliced wrongly.
    Unsupported,
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
    /// The request's string id and another request's string id have the
    /// same transfer id ([`TransferId::of_request_id`]), and the prefill
    /// rank holds the other one: it refused this request's `Pull`.
    ///
    /// [`TransferId::of_request_id`]: super::TransferId::of_request_id
    IdCollision,
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
