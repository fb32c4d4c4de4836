//! Why node calls fail, with the blame kept apart: the caller
//! ([`Misuse`]), back-pressure, the data plane, the side channel, the
//! bootstrap service, time. Failures of a request are phases, not errors.

use kvferry_machines::{InputError, Phase, PlanError, RequestIdError, TransferId};
use kvferry_reactor::{ReactorError, SubmitError};

use super::Role;
use crate::bootstrap::{ClientError, ServerError};
use crate::transport::TransportError;

/// Why a node call failed.
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// The caller used the API wrongly.
    #[error("misuse: {0}")]
    Misuse(#[from] Misuse),
    /// The request id's transfer id is held by another request id on this
    /// node (their hashes are equal): this request cannot be opened here.
    #[error(transparent)]
    IdCollision(#[from] IdCollision),
    /// Back-pressure: the node holds its maximum of requests or its queues
    /// are full; retry after collecting finished requests.
    #[error("busy: {0}")]
    Busy(SubmitError),
    /// The node is shutting down.
    #[error("node is shutting down")]
    ShuttingDown,
    /// The executors could not start.
    #[error("reactor: {0}")]
    Reactor(#[from] ReactorError),
    /// The data plane refused (endpoint, memory registration).
    #[error("data plane: {0}")]
    DataPlane(#[from] DataPlaneError),
    /// The side channel could not start.
    #[error("side channel: {during}: {source}")]
    SideChannel {
        /// The step that failed.
        during: &'static str,
        /// What ZeroMQ or the OS said.
        #[source]
        source: std::io::Error,
    },
    /// The embedded bootstrap service or the metrics endpoint could not
    /// start.
    #[error("http server: {0}")]
    Http(#[from] ServerError),
    /// The bootstrap service could not be reached or refused us.
    #[error("bootstrap: {0}")]
    Bootstrap(#[from] ClientError),
    /// A startup step did not finish in time.
    #[error("timed out: {0}")]
    Timeout(&'static str),
    /// The cluster key's file could not be used.
    #[error(transparent)]
    Key(#[from] kvferry_auth::KeyError),
}

impl NodeError {
    /// A side-channel failure during `during`.
    pub(crate) fn side_channel(during: &'static str, source: impl Into<std::io::Error>) -> Self {
        NodeError::SideChannel {
            during,
            source: source.into(),
        }
    }
}

impl From<SubmitError> for NodeError {
    fn from(e: SubmitError) -> Self {
        match e {
            SubmitError::ShuttingDown => NodeError::ShuttingDown,
            SubmitError::MailboxFull { .. } | SubmitError::AtCapacity { .. } => NodeError::Busy(e),
            other => NodeError::Misuse(Misuse::Submit(other)),
        }
    }
}

/// How the caller used the node wrongly.
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum Misuse {
    /// The machines' timeouts or bounds are inconsistent.
    #[error("timeouts: {0}")]
    Timeouts(#[source] InputError),
    /// A node runs exactly one executor (one rank is one device).
    #[error("a node runs exactly one executor (one rank is one device), not {0}")]
    Executors(usize),
    /// `tp_rank` is not below `tp_size`.
    #[error("tp_rank {tp_rank} outside tp_size {tp_size}")]
    TpRank {
        /// The configured rank.
        tp_rank: u32,
        /// The configured size.
        tp_size: u32,
    },
    /// `pp_rank` is not below `pp_size`.
    #[error("pp_rank {pp_rank} outside pp_size {pp_size}")]
    PpRank {
        /// The configured stage.
        pp_rank: u32,
        /// The configured size.
        pp_size: u32,
    },
    /// A bound of [`super::NodeConfig`] that must be positive is 0.
    #[error("{0} must be positive")]
    ZeroBound(&'static str),
    /// A duration of [`super::NodeConfig`] outside the range the node
    /// accepts.
    #[error("{setting} of {value:?} outside {min:?}..={max:?}")]
    OutOfRange {
        /// The field.
        setting: &'static str,
        /// Its value.
        value: std::time::Duration,
        /// The least accepted.
        min: std::time::Duration,
        /// The most accepted.
        max: std::time::Duration,
    },
    /// The node would advertise an address peers reach on other hosts
    /// while listening on loopback only: nobody could connect.
    #[error(
        "host {host:?} is advertised but the node listens on {listen} (loopback): \
         set `listen` (e.g. 0.0.0.0) or a loopback `host`"
    )]
    UnreachableHost {
        /// The advertised host.
        host: String,
        /// The loopback address it would listen on.
        listen: std::net::IpAddr,
    },
    /// The node would listen beyond loopback without a cluster key:
    /// anyone who reached its ports could register, talk to it and write
    /// into its KV memory.
    #[error(
        "{what} would listen on {addr} without a cluster key: set \
         `cluster_key_file` (KVFERRY_CLUSTER_KEY_FILE) on every node, or \
         `allow_unauthenticated_remote` to trust anyone who reaches the port"
    )]
    UnauthenticatedRemote {
        /// What would listen (`side channel and data plane`, `bootstrap service`).
        what: &'static str,
        /// Where.
        addr: String,
    },
    /// `register_kv_caches` was called a second time.
    #[error("register_kv_caches called twice")]
    RegisteredTwice,
    /// A call that needs registered memory came before `register_kv_caches`.
    #[error("register_kv_caches first")]
    NotRegistered,
    /// The registered layout is not one the planner accepts.
    #[error("layout rejected: {0}")]
    Layout(#[source] PlanError),
    /// A region's `num_blocks × block_len` does not fit in 64 bits.
    #[error("region length overflows")]
    RegionOverflow,
    /// The call belongs to the other role: `Prefill` for the calls of a
    /// sending role, `Decode` for those of a receiving one ([`Role::Both`]
    /// has both).
    #[error("this call needs a {0:?} (or Both) node")]
    WrongRole(Role),
    /// The request's input was refused by its machine.
    #[error("request refused: {0}")]
    Request(#[source] InputError),
    /// The executor refused the command (unknown or duplicate transfer).
    #[error(transparent)]
    Submit(SubmitError),
    /// The transfer already ended in this phase.
    #[error("the transfer already ended: {0:?}")]
    Ended(Phase),
    /// The string is not a request id (empty or too long).
    #[error(transparent)]
    RequestId(RequestIdError),
}

/// Two different request ids with one transfer id
/// ([`TransferId::of_request_id`]): the one asked for and the one this
/// node holds (live, or among its finished records).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("request id {request_id:?} has transfer id {transfer_id}, held by request id {held:?}")]
pub struct IdCollision {
    /// The transfer id both hash to.
    pub transfer_id: TransferId,
    /// The request id asked for.
    pub request_id: String,
    /// The request id that holds the transfer id.
    pub held: String,
}

/// Why the data plane could not start or take the registered memory.
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum DataPlaneError {
    /// `NodeConfig::host` is neither an IP address nor a name that
    /// resolves within `resolve_timeout`.
    #[error("bad host {host:?}: {source}")]
    BadHost {
        /// The configured host.
        host: String,
        /// Why it does not parse or resolve.
        #[source]
        source: crate::resolve::ResolveError,
    },
    /// The node's executor has no transport endpoint (it failed to start).
    #[error("the node has no transport endpoint")]
    NoEndpoint,
    /// A region is longer than this machine's address space.
    #[error("region longer than the address space")]
    RegionTooLong,
    /// Device memory registered with a transport that cannot move it.
    #[error(
        "the KV cache is device memory ({device}), which the {transport} transport cannot move: \
         use tcp, auto or mooncake"
    )]
    DeviceUnsupported {
        /// The device.
        device: String,
        /// The configured transport.
        transport: &'static str,
    },
    /// The transport refused.
    #[error(transparent)]
    Transport(#[from] TransportError),
}

/// Why a peer cannot pair with this rank; its transfers fail with
/// `BadMetadata`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PeerUnfit {
    /// The peer runs the other transfer mode.
    #[error("peer runs {theirs:?} mode, we run {ours:?}")]
    Mode {
        /// The peer's mode.
        theirs: kvferry_machines::Mode,
        /// Ours.
        ours: kvferry_machines::Mode,
    },
    /// The peer's model facts differ from ours.
    #[error("peer's model spec differs from ours")]
    Model,
    /// The planner rejected the pair of layouts.
    #[error("layouts do not fit: {0}")]
    Layout(#[source] PlanError),
}

impl PeerUnfit {
    /// True when the layouts pair only by a rule kvferry does not
    /// implement ([`PlanError::Unsupported`]): the peer's transfers fail
    /// `FailReason::Unsupported` on both sides.
    pub fn is_unsupported(&self) -> bool {
        matches!(self, PeerUnfit::Layout(e) if e.is_unsupported())
    }
}

#[cfg(test)]
mod tests {
    use std::error::Error as _;

    use super::*;

    /// A chain of causes names each cause once: a variant that shows its
    /// cause's text is that cause (`transparent`), not its parent.
    #[test]
    fn a_wrapped_error_is_not_its_own_cause() {
        let collision = IdCollision {
            transfer_id: TransferId(7),
            request_id: "a".into(),
            held: "b".into(),
        };
        let e = NodeError::from(collision.clone());
        assert_eq!(e.to_string(), collision.to_string());
        assert!(e.source().is_none(), "{:?}", e.source());
    }
}
