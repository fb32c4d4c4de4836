//! Types shared by the send and receive machines.

use serde::{Deserialize, Serialize};
use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Identifies one request's transfer across P and D (vLLM's `transfer_id`,
/// SGLang's bootstrap room).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct TransferId(pub u64);

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

/// Which side touches the other side's blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Mode {
    /// P writes into D's destination blocks (vLLM, SGLang). D grants the lease.
    Push,
    /// D reads from P's source blocks, then sends `Done` (vLLM-Ascend). P grants the lease.
    Pull,
}

/// A remote rank as the driver names it for this transfer (an index into
/// the driver's session table). Machines only compare peer ids; they never
/// interpret them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct PeerId(pub u32);

/// An engine KV block id (index into the registered regions of one side).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct BlockId(pub u32);

/// Block ids per KV-cache group: `lists[g]` are the blocks of group `g`.
pub type BlockLists = Vec<Vec<BlockId>>;

/// Timeouts (DESIGN.md §2 table) and bounds of one machine.
///
/// Both sides of a transfer should run with the same `lease`; a granter
/// may grant less (P caps grants at its hold limit), never more than the
/// toucher accepts (the toucher clips a grant to its own `lease`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Config {
    /// Peer info not received (P: D's `Pull`; D: the P ranks from the bootstrap service).
    pub bootstrap_timeout: Duration,
    /// D: no progress (data or status) since the request was sent or since the last progress.
    pub waiting_timeout: Duration,
    /// P: KV ready but D silent this long: give the blocks back. Renewed by any message of D.
    pub claim_timeout: Duration,
    /// Length of one lease grant. Renewed every `heartbeat_interval`, so it must exceed it.
    pub lease: Duration,
    /// P: hard cap on holding blocks for one transfer, counted from the machine's creation.
    pub hold_limit: Duration,
    /// The transport contract: a write or read posted at `t` touches no memory after
    /// `t + transfer_bound` (the driver reports it failed by then at the latest).
    pub transfer_bound: Duration,
    /// Extra margin of the fence for clock-rate drift between nodes.
    pub fence_margin: Duration,
    /// How often a toucher renews its lease (the per-transfer heartbeat).
    pub heartbeat_interval: Duration,
    /// Heartbeats a peer may miss before the driver declares it dead (used by the driver).
    pub heartbeat_misses: u32,
    /// Most peers one machine deals with (fan-out / fan-in).
    pub max_peers: usize,
    /// Most chunks in one transfer.
    pub max_chunks: usize,
    /// Most writes (P, push) or reads (D, pull) in flight per machine.
    pub max_in_flight: usize,
    /// Most KV-cache groups in a block list.
    pub max_groups: usize,
    /// Most blocks per group in one block list.
    pub max_blocks_per_group: usize,
    /// Most lease requests remembered per peer (older ones are forgotten).
    pub max_lease_requests: usize,
    /// UNSAFE, for the simulator's self-test only (`tests/sim.rs`): a
    /// granter that ends a transfer reuses its blocks at once, without
    /// waiting for the toucher to return its lease or for the lease plus the
    /// fence to run out. Always `false` outside that test.
    #[doc(hidden)]
    pub unsafe_disable_fence: bool,
    /// UNSAFE, for the simulator's self-test only (`tests/sim.rs`): a
    /// toucher that ends a transfer forgets the writes or reads it still has
    /// in flight. Always `false` outside that test.
    #[doc(hidden)]
    pub unsafe_ignore_in_flight: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            bootstrap_timeout: Duration::from_secs(300),
            waiting_timeout: Duration::from_secs(300),
            claim_timeout: Duration::from_secs(30),
            lease: Duration::from_secs(10),
            hold_limit: Duration::from_secs(480),
            transfer_bound: Duration::from_secs(10),
            fence_margin: Duration::from_secs(2),
            heartbeat_interval: Duration::from_secs(5),
            heartbeat_misses: 2,
            max_peers: 64,
            max_chunks: 4096,
            max_in_flight: 256,
            max_groups: 16,
            max_blocks_per_group: 1 << 20,
            max_lease_requests: 4,
            unsafe_disable_fence: false,
            unsafe_ignore_in_flight: false,
        }
    }
}

impl Config {
    /// Checks the settings once, when the node starts (machines trust a
    /// config they are given). A lease no longer than the heartbeat interval
    /// would lapse between renewals and stall every transfer; a zero bound
    /// would refuse every request.
    pub fn validate(&self) -> Result<(), InputError> {
        if self.lease <= self.heartbeat_interval {
            return Err(InputError::Misuse(
                "lease must be longer than heartbeat_interval",
            ));
        }
        if self.max_peers == 0
            || self.max_chunks == 0
            || self.max_in_flight == 0
            || self.max_groups == 0
            || self.max_blocks_per_group == 0
            || self.max_lease_requests == 0
        {
            return Err(InputError::Misuse("every max_* bound must be at least 1"));
        }
        if self.max_chunks > u32::MAX as usize || self.max_blocks_per_group > u32::MAX as usize {
            return Err(InputError::Misuse("chunk and block bounds must fit in u32"));
        }
        Ok(())
    }

    /// How long a granter waits after a lease ran out before it reuses its
    /// blocks: every transfer started under the lease has ended by then.
    pub fn fence(&self) -> Duration {
        self.fence_margin + self.transfer_bound
    }
}

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
        /// sent right behind this `Pull` (see [`TICKET_BIT`]), so P need not
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
    LeaseRequest { seq: u64 },
    /// Granter → toucher: lease for request `seq`, valid for `duration_ms`.
    LeaseGrant { seq: u64, duration_ms: u64 },
    /// P → D (push mode): this P rank's writes are over (`ok`: all landed). Returns the lease.
    Status { ok: bool },
    /// D → P (pull mode): this D rank's reads are over (`ok`: all succeeded). Returns the lease.
    Done { ok: bool },
    /// Either side: the transfer is aborted. From the toucher it also returns the lease.
    Abort,
    /// Answer to `Abort`. From the toucher it returns the lease.
    AbortAck,
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
        }
    }
}

/// Earliest of two optional deadlines.
pub(crate) fn earliest(a: Option<Instant>, b: Option<Instant>) -> Option<Instant> {
    match (a, b) {
        (Some(x), Some(y)) => Some(x.min(y)),
        (x, None) => x,
        (None, y) => y,
    }
}

/// `now + d`, saturating far in the future instead of panicking.
pub(crate) fn after(now: Instant, d: Duration) -> Instant {
    now.checked_add(d)
        .unwrap_or_else(|| now + Duration::from_secs(u32::MAX as u64))
}

/// Set in the `seq` of a `LeaseGrant` that answers a lease *ticket* rather
/// than a `LeaseRequest`. A ticket is a message the toucher's node sent to
/// the granter's node earlier (the node uses its heartbeat replies): the
/// granter names it when it grants, and the toucher counts the lease from
/// when it sent that message, which precedes the grant. This is the
/// `LeaseRequest` rule (count from when you asked) without the round trip,
/// so a push-mode P can write as soon as D's `Pull` arrives. The node's
/// driver turns such a grant into [`crate::send::Event::TicketGrant`].
pub const TICKET_BIT: u64 = 1 << 63;

/// Toucher side of one lease (one per peer whose blocks we touch).
#[derive(Clone, Debug)]
pub(crate) struct TouchLease {
    next_seq: u64,
    /// `(seq, asked_at)` of the latest requests, oldest first.
    asked: VecDeque<(u64, Instant)>,
    valid_until: Option<Instant>,
    renew_at: Option<Instant>,
}

impl TouchLease {
    pub(crate) fn new() -> Self {
        TouchLease {
            next_seq: 0,
            asked: VecDeque::new(),
            valid_until: None,
            renew_at: None,
        }
    }

    /// Records a request made at `now` (before it is sent) and returns its sequence number.
    pub(crate) fn request(&mut self, now: Instant, cfg: &Config) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        // A grant for a request older than the longest lease would already
        // be over when it arrives: nothing is lost by forgetting it.
        while self
            .asked
            .front()
            .is_some_and(|&(_, at)| after(at, cfg.lease) <= now)
        {
            self.asked.pop_front();
        }
        // Full: replace the newest request, not the oldest. When the round
        // trip is longer than several renewals, forgetting the oldest one
        // each time would forget every request just before its grant comes
        // back, and the lease would never go live. The oldest ones answer
        // first; the newest slot keeps one fresh request out in case the
        // old ones were lost.
        if self.asked.len() >= cfg.max_lease_requests.max(1) {
            self.asked.pop_back();
        }
        self.asked.push_back((seq, now));
        self.renew_at = Some(after(now, cfg.heartbeat_interval));
        seq
    }

    /// Plans the first request for one heartbeat interval from now (a
    /// ticket grant is expected first); an earlier plan stays.
    pub(crate) fn defer_request(&mut self, now: Instant, cfg: &Config) {
        if self.renew_at.is_none() && self.asked.is_empty() {
            self.renew_at = Some(after(now, cfg.heartbeat_interval));
        }
    }

    /// Checks a grant without applying it.
    pub(crate) fn check_grant(&self, seq: u64) -> Result<(), InputError> {
        if seq >= self.next_seq {
            return Err(InputError::Peer("lease grant for a request never made"));
        }
        Ok(())
    }

    /// Applies a grant that passed `check_grant`. A grant for a forgotten
    /// request is ignored: we no longer know when we asked.
    pub(crate) fn handle_grant(&mut self, seq: u64, duration_ms: u64, cfg: &Config) {
        let Some(&(_, asked_at)) = self.asked.iter().find(|(s, _)| *s == seq) else {
            return;
        };
        let granted = Duration::from_millis(duration_ms).min(cfg.lease);
        let end = after(asked_at, granted);
        self.valid_until = Some(self.valid_until.map_or(end, |u| u.max(end)));
        // A grant for an older request would end earlier than this one.
        self.asked.retain(|&(s, _)| s > seq);
    }

    /// Applies a grant that answers a ticket sent at `sent_at` (see
    /// [`TICKET_BIT`]).
    pub(crate) fn handle_ticket(&mut self, sent_at: Instant, duration_ms: u64, cfg: &Config) {
        let granted = Duration::from_millis(duration_ms).min(cfg.lease);
        let end = after(sent_at, granted);
        self.valid_until = Some(self.valid_until.map_or(end, |u| u.max(end)));
        // No request of ours was out, so nothing would renew this lease:
        // ask one heartbeat interval before it ends (an earlier plan stays),
        // which leaves the round trip time to come back in.
        let renew = end
            .checked_sub(cfg.heartbeat_interval)
            .unwrap_or(sent_at)
            .max(sent_at);
        self.renew_at = Some(self.renew_at.map_or(renew, |r| r.min(renew)));
    }

    pub(crate) fn is_live(&self, now: Instant) -> bool {
        self.valid_until.is_some_and(|u| now < u)
    }

    pub(crate) fn renew_at(&self) -> Option<Instant> {
        self.renew_at
    }

    /// End of the lease as the toucher counts it (for tests and debugging).
    pub(crate) fn valid_until(&self) -> Option<Instant> {
        self.valid_until
    }
}

/// Granter side of one lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct GrantLease {
    /// End of the latest grant as the granter counts it; `None`: never granted.
    pub(crate) until: Option<Instant>,
}

impl GrantLease {
    pub(crate) fn new() -> Self {
        GrantLease { until: None }
    }

    /// Grants `d` from `now` and returns the message to send.
    pub(crate) fn grant(&mut self, now: Instant, seq: u64, d: Duration) -> Msg {
        let end = after(now, d);
        self.until = Some(self.until.map_or(end, |u| u.max(end)));
        Msg::LeaseGrant {
            seq,
            duration_ms: d.as_millis().min(u64::MAX as u128) as u64,
        }
    }
}

/// A write (push) or read (pull) the toucher posted and has not seen complete.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Op {
    pub(crate) peer: PeerId,
    pub(crate) chunk: u32,
    /// Posted time plus the transfer bound: after this the op can no longer touch memory.
    pub(crate) deadline: Instant,
}

/// Maps the part of a chunk that the receiver needs onto its destination
/// blocks. Returns `(src, dst)` with equal lengths per group, or `None` when
/// the lists do not fit together (group count, or blocks past the end of
/// the destination list).
pub(crate) fn align_chunk(
    start: &[u32],
    src: &[Vec<BlockId>],
    dst: &[Vec<BlockId>],
    prefix: &[u32],
) -> Option<(BlockLists, BlockLists)> {
    if start.len() != src.len() || src.len() != dst.len() || dst.len() != prefix.len() {
        return None;
    }
    let mut out_src = Vec::with_capacity(src.len());
    let mut out_dst = Vec::with_capacity(src.len());
    for g in 0..src.len() {
        let first = start[g] as usize;
        let skip = prefix[g] as usize;
        let mut s = Vec::new();
        let mut d = Vec::new();
        for (i, b) in src[g].iter().enumerate() {
            let pos = first + i;
            if pos < skip {
                continue;
            }
            let target = *dst[g].get(pos - skip)?;
            s.push(*b);
            d.push(target);
        }
        out_src.push(s);
        out_dst.push(d);
    }
    Some((out_src, out_dst))
}

/// True when P's full block list, ending at `end[g]` per group, fills the
/// destination exactly: D's list takes P's blocks from `prefix[g]` on, so
/// P having fewer blocks would leave destination blocks without KV, and
/// more would overflow it.
pub(crate) fn covers_exactly(end: &[u32], dst: &[Vec<BlockId>], prefix: &[u32]) -> bool {
    end.len() == dst.len()
        && dst.len() == prefix.len()
        && end
            .iter()
            .zip(dst)
            .zip(prefix)
            .all(|((e, d), p)| e.checked_sub(*p).is_some_and(|n| n as usize == d.len()))
}

/// Per group, the position just past a chunk's last block.
pub(crate) fn chunk_end(start: &[u32], src: &[Vec<BlockId>]) -> Vec<u32> {
    start
        .iter()
        .zip(src)
        .map(|(s, g)| s.saturating_add(g.len() as u32))
        .collect()
}

/// True when an aligned chunk moves no block at all.
pub(crate) fn is_empty_lists(lists: &[Vec<BlockId>]) -> bool {
    lists.iter().all(|g| g.is_empty())
}

/// Checks a block list against the configured bounds.
pub(crate) fn check_lists(lists: &[Vec<BlockId>], cfg: &Config) -> bool {
    lists.len() <= cfg.max_groups && lists.iter().all(|g| g.len() <= cfg.max_blocks_per_group)
}

/// The end of a request after its outcome was decided: wait until no
/// transfer can touch the blocks anymore, then release.
///
/// Toucher: its own ops must complete or pass their bound; the
/// lease-returning message to a peer is sent once no op on that peer is left.
/// Granter: every peer must return its lease, or the lease must have run
/// out plus the fence.
#[derive(Clone, Debug)]
pub(crate) struct Drain {
    /// The terminal phase reported once the drain completes.
    pub(crate) outcome: Phase,
    pub(crate) ops: Vec<Op>,
    /// Messages to send once the peer has no op in flight.
    pub(crate) returns: Vec<(PeerId, Msg)>,
    /// Leases we granted and that were not returned yet.
    pub(crate) leases: Vec<(PeerId, GrantLease)>,
}

impl Drain {
    /// Drops expired ops, sends the returns that are due and tells whether
    /// the blocks are free.
    pub(crate) fn advance(
        &mut self,
        now: Instant,
        fence: Duration,
        out: &mut VecDeque<(PeerId, Msg)>,
    ) -> bool {
        self.ops.retain(|op| now < op.deadline);
        let ops = &self.ops;
        let mut i = 0;
        while i < self.returns.len() {
            let peer = self.returns[i].0;
            if ops.iter().any(|op| op.peer == peer) {
                i += 1;
            } else {
                out.push_back(self.returns.remove(i));
            }
        }
        self.leases
            .retain(|(_, l)| l.until.is_some_and(|u| now < after(u, fence)));
        self.ops.is_empty() && self.returns.is_empty() && self.leases.is_empty()
    }

    /// A completion for an op; unknown ones are late and absorbed.
    pub(crate) fn handle_completion(&mut self, peer: PeerId, chunk: u32) {
        if let Some(i) = self
            .ops
            .iter()
            .position(|op| op.peer == peer && op.chunk == chunk)
        {
            self.ops.swap_remove(i);
        }
    }

    /// A message from `peer` after the outcome was decided: only the
    /// lease-returning ones (`Status`, `Done`, `Abort`, `AbortAck`) matter.
    pub(crate) fn handle_msg(&mut self, peer: PeerId, msg: &Msg) {
        match msg {
            Msg::Status { .. } | Msg::Done { .. } | Msg::Abort | Msg::AbortAck => {
                self.handle_return(peer)
            }
            Msg::Pull { .. }
            | Msg::Ready { .. }
            | Msg::LeaseRequest { .. }
            | Msg::LeaseGrant { .. } => {}
        }
    }

    /// A lease-returning message from `peer`.
    pub(crate) fn handle_return(&mut self, peer: PeerId) {
        self.leases.retain(|(p, _)| *p != peer);
    }

    pub(crate) fn poll_timeout(&self, fence: Duration) -> Option<Instant> {
        let ops = self.ops.iter().map(|op| op.deadline).min();
        let leases = self
            .leases
            .iter()
            .filter_map(|(_, l)| l.until.map(|u| after(u, fence)))
            .min();
        earliest(ops, leases)
    }
}

/// How a live request ends; decides the outcome and what each peer is owed.
#[derive(Clone, Copy, Debug)]
pub(crate) enum End {
    Fail(FailReason),
    Expire,
    /// The peer aborted: it gets an `AbortAck`, the others an abort.
    PeerAbort(PeerId),
    /// The peer returned its lease while failing (`Status`/`Done` with `ok: false`).
    PeerFailed(PeerId),
}

impl End {
    /// The terminal phase reported once the drain completes.
    pub(crate) fn outcome(self) -> Phase {
        match self {
            End::Fail(r) => Phase::Failed(r),
            End::Expire => Phase::Expired,
            End::PeerAbort(_) => Phase::Failed(FailReason::PeerAborted),
            End::PeerFailed(_) => Phase::Failed(FailReason::PeerReported),
        }
    }

    /// Starts the drain of a request that had `ops` in flight.
    pub(crate) fn drain(self, mut ops: Vec<Op>, cfg: &Config) -> Drain {
        if cfg.unsafe_ignore_in_flight {
            ops.clear();
        }
        Drain {
            outcome: self.outcome(),
            ops,
            returns: Vec::new(),
            leases: Vec::new(),
        }
    }

    /// Settles one unfinished peer when the request ends, for both sides.
    ///
    /// `granted` is `Some` when the peer touches our blocks under a lease we
    /// granted, `None` when we touch its blocks. A toucher's lease-returning
    /// message (`failure_return`: `Status` from P, `Done` from D) waits in
    /// the drain until nothing of ours is in flight on that peer; a granter
    /// keeps the lease in the drain until it is returned or has run out plus
    /// the fence. Returns a message to send at once, if any.
    pub(crate) fn settle_peer(
        self,
        drain: &mut Drain,
        peer: PeerId,
        granted: Option<GrantLease>,
        failure_return: Msg,
        cfg: &Config,
    ) -> Option<Msg> {
        let aborter = matches!(self, End::PeerAbort(a) if a == peer);
        let failer = matches!(self, End::PeerFailed(a) if a == peer);
        match granted {
            None => {
                let msg = match self {
                    _ if aborter => Msg::AbortAck,
                    End::Fail(FailReason::Aborted(_)) => Msg::Abort,
                    End::Fail(_) | End::Expire | End::PeerAbort(_) | End::PeerFailed(_) => {
                        failure_return
                    }
                };
                drain.returns.push((peer, msg));
                None
            }
            // The toucher's abort returned its lease.
            Some(_) if aborter => Some(Msg::AbortAck),
            // The toucher's failure report returned its lease.
            Some(_) if failer => None,
            Some(lease) => {
                if !cfg.unsafe_disable_fence {
                    drain.leases.push((peer, lease));
                }
                Some(Msg::Abort)
            }
        }
    }
}

#[cfg(test)]
mod lease_tests {
    use super::*;

    /// Renewals every heartbeat interval, each grant arriving `rtt` after its
    /// request; returns whether the lease ever went live.
    fn goes_live(rtt_intervals: u32, max_lease_requests: usize) -> bool {
        let cfg = Config {
            heartbeat_interval: Duration::from_millis(100),
            lease: Duration::from_secs(10),
            max_lease_requests,
            ..Config::default()
        };
        let t0 = Instant::now();
        let rtt = cfg.heartbeat_interval * rtt_intervals;
        let mut lease = TouchLease::new();
        let mut in_flight: VecDeque<(Instant, u64)> = VecDeque::new();
        for step in 0..(4 * rtt_intervals + 8) {
            let now = t0 + cfg.heartbeat_interval * step;
            while in_flight
                .front()
                .is_some_and(|&(arrives, _)| arrives <= now)
            {
                let (_, seq) = in_flight.pop_front().expect("checked");
                lease.check_grant(seq).expect("a request we made");
                lease.handle_grant(seq, cfg.lease.as_millis() as u64, &cfg);
                if lease.is_live(now) {
                    return true;
                }
            }
            let seq = lease.request(now, &cfg);
            in_flight.push_back((now + rtt, seq));
        }
        false
    }

    #[test]
    fn lease_goes_live_when_the_round_trip_spans_many_renewals() {
        // A round trip of 10 renewal intervals with 4 remembered requests:
        // forgetting the oldest request each time starved this for good.
        for rtt in [1, 3, 4, 5, 10, 40] {
            assert!(goes_live(rtt, 4), "rtt of {rtt} intervals never went live");
        }
    }

    #[test]
    fn remembered_requests_stay_bounded_and_age_out() {
        let cfg = Config {
            max_lease_requests: 3,
            ..Config::default()
        };
        let t0 = Instant::now();
        let mut lease = TouchLease::new();
        for i in 0..50 {
            lease.request(t0 + Duration::from_millis(i), &cfg);
            assert!(lease.asked.len() <= 3);
        }
        // The oldest requests are kept: their grants come back first.
        assert_eq!(lease.asked.front().map(|a| a.0), Some(0));
        // Past the longest lease every old request is forgotten.
        lease.request(t0 + cfg.lease + Duration::from_secs(1), &cfg);
        assert_eq!(lease.asked.len(), 1);
        // A grant forgets the requests it supersedes.
        let seq = lease.request(t0 + cfg.lease + Duration::from_secs(2), &cfg);
        lease.handle_grant(seq, 1_000, &cfg);
        assert!(lease.asked.is_empty());
        assert!(lease.is_live(t0 + cfg.lease + Duration::from_secs(2)));
    }
}
