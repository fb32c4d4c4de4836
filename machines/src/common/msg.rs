//! The per-transfer control messages between P and D.

use serde::{Deserialize, Serialize};

use super::BlockLists;
#[cfg(doc)]
use super::{PeerId, TransferId};

/// Per-transfer control messages between the machines of P and D.
///
/// The driver wraps each in an envelope carrying the [`TransferId`] and the
/// sender's identity (which becomes the [`PeerId`] on the receiving side);
/// the wire encoding maps these variants one to one.
///
/// Lease protocol: the *toucher* (P in push mode, D in pull mode) sends
/// `LeaseRequest{seq}` and remembers when it asked; the *granter* answers
/// `LeaseGrant{seq, duration_ms}` and counts the lease from when it granted.
/// The toucher's lease ends at `asked_at + duration`, the granter's at
/// `granted_at + duration >= asked_at + duration`, whatever the message
/// delays, so the toucher's lease always ends first. `Status`, `Done`,
/// `Abort` (from the toucher) and `AbortAck` return the lease: the toucher
/// sends them only once none of its transfers on that peer is in flight.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Msg {
    /// D → P, once per D rank: "I take part in this transfer".
    Pull {
        /// How many D ranks will send `Pull` to this P rank for this transfer.
        receivers_expected: u16,
        /// D's destination blocks (push mode; P ignores them in pull mode).
        #[serde(deserialize_with = "crate::wire::bounded::groups")]
        dst_blocks: BlockLists,
        /// Per group, how many of P's leading blocks D already holds (prefix
        /// hit): P's block at position `i >= prefix` lands in `dst[i - prefix]`.
        #[serde(deserialize_with = "crate::wire::bounded::per_group")]
        prefix_blocks: Vec<u32>,
        /// Pull mode: the first lease request rides on the `Pull`. Push
        /// mode: `Some(ticket)` announces a grant on lease ticket `ticket`
        /// sent right behind this `Pull` (see [`TICKET_BIT`](crate::TICKET_BIT)), so P need not
        /// ask for a lease.
        lease_seq: Option<u64>,
    },
    /// P → D (pull mode): one chunk of KV is ready to be read.
    Ready {
        /// Chunk index, 0-based and dense.
        chunk: u32,
        /// Position in P's full block list of this chunk's first block, per group.
        #[serde(deserialize_with = "crate::wire::bounded::per_group")]
        start_blocks: Vec<u32>,
        /// The chunk's source blocks, per group.
        #[serde(deserialize_with = "crate::wire::bounded::groups")]
        src_blocks: BlockLists,
        /// True on the last chunk of the request.
        is_last: bool,
    },
    /// Toucher → granter: please (re)grant the lease.
    LeaseRequest {
        /// The lease request it answers or makes.
        seq: u64,
    },
    /// Granter → toucher: lease for request `seq`, valid for `duration_ms`.
    LeaseGrant {
        /// The lease request it answers or makes.
        seq: u64,
        /// Length of the lease in milliseconds, on each side's own clock.
        duration_ms: u64,
    },
    /// P → D (push mode): this P rank's writes are over (`ok`: all landed). Returns the lease.
    Status {
        /// True when it succeeded.
        ok: bool,
    },
    /// D → P (pull mode): this D rank's reads are over (`ok`: all succeeded). Returns the lease.
    Done {
        /// True when it succeeded.
        ok: bool,
    },
    /// Either side: the transfer is aborted. From the toucher it also returns the lease.
    Abort,
    /// Answer to `Abort`. From the toucher it returns the lease.
    AbortAck,
    /// D → P: no D rank reads this P rank's KV for this transfer (its KV
    /// heads are replicas another P rank sends); P releases the blocks at
    /// once. Each such P rank is told by exactly one D rank (see
    /// `docs/design.md` §3, "Unpaired prefill ranks").
    Unneeded,
    /// P → D: refuses D's `Pull`: by the layouts P knows, D's rank reads
    /// nothing from this P rank. Both sides fail the transfer with
    /// `BadMetadata`. P sends it before touching anything or granting a
    /// lease, so it settles the peer like a lease return.
    NotPaired,
}

impl Msg {
    /// Short name for logs and metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Msg::Pull { .. } => "pull",
            Msg::Ready { .. } => "ready",
            Msg::LeaseRequest { .. } => "lease_request",
            Msg::LeaseGrant { .. } => "lease_grant",
            Msg::Status { .. } => "status",
            Msg::Done { .. } => "done",
            Msg::Abort => "abort",
            Msg::AbortAck => "abort_ack",
            Msg::Unneeded => "unneeded",
            Msg::NotPaired => "not_paired",
        }
    }
}
