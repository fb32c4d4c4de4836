//! What executors and engine threads ask of the bridge thread, and the
//! bootstrap answers it hands itself: the queue's message type, apart from
//! the bridge, so the tables and the sink that send on the queue do not
//! depend on the bridge that reads it.

use kvferry_machines::{Msg, TransferId};

use super::config::PrefillTarget;
use crate::bootstrap::ClientError;

/// What executors and engine threads ask of the bridge.
pub(crate) enum BridgeCmd {
    /// Send an encoded frame to a peer; `tid` ties the peer to a transfer
    /// for peer-death notification.
    Send {
        peer: u32,
        tid: Option<TransferId>,
        bytes: Vec<u8>,
    },
    /// A machine message that came over the data plane (see the sink's
    /// notification handler) and needs the bridge's handling: one for a
    /// transfer the executor does not hold live, or of a kind only the
    /// bridge routes.
    Inbound {
        peer: u32,
        tid: TransferId,
        msg: Msg,
    },
    /// Find and contact the prefill ranks of a new decode request;
    /// `aborted`: the engine aborted it before it asked for the KV, so the
    /// ranks are only told (the machine's abort may not have landed yet
    /// when the bridge finds them).
    Resolve {
        tid: TransferId,
        target: PrefillTarget,
        aborted: bool,
    },
    /// A data-plane connection to the peer failed (refused, reset): mark
    /// it dead now, so new requests to it fail fast until it answers a
    /// probe, instead of each waiting for its own timeout.
    PeerUnreachable { peer: u32 },
    /// Result of a bootstrap query started by the bridge.
    Directory {
        target: PrefillTarget,
        result: Result<EngineRanks, LookupError>,
    },
    /// Stop the thread.
    Stop,
}

/// The side channels of a prefill engine's ranks, as the bootstrap service
/// or a direct target names them.
#[derive(Clone, Debug)]
pub(crate) struct EngineRanks {
    /// TP size.
    pub(crate) tp: u32,
    /// PP size.
    pub(crate) pp: u32,
    /// By rank: stage `s`, TP rank `t` at `s · tp + t`.
    pub(crate) addrs: Vec<String>,
}

/// Why the bootstrap service did not name a prefill engine's ranks; the
/// bridge retries after a tick.
#[derive(Debug, thiserror::Error)]
pub(crate) enum LookupError {
    /// The service could not be asked.
    #[error(transparent)]
    Client(#[from] ClientError),
    /// The engine has no ranks registered at this data-parallel rank
    /// (`None`: at one rank only).
    #[error("engine is not registered at dp rank {0:?}")]
    NotRegistered(Option<u32>),
    /// A rank of the engine has not registered yet.
    #[error("tp rank {rank} of stage {stage} not registered yet")]
    RankMissing {
        /// Its TP rank.
        rank: u32,
        /// Its pipeline stage.
        stage: u32,
    },
}
