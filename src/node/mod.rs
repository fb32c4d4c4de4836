//! The node: one prefill or decode rank, with its reactor (the machines),
//! its data-plane endpoint and its side channel.
//!
//! ```text
//!  engine threads ──Sender/Receiver/start_load_kv──▶ ReactorHandle ──▶ executor
//!                                                                    (machines,
//!  peers ◀──zmq── bridge thread ◀──frames (flume)── ActionSink ◀──── transport)
//!        ──zmq──▶ bridge thread ──events──▶ ReactorHandle
//! ```
//!
//! * The machines run on one glommio executor (one rank is one device). The
//!   [`ActionSink`](kvferry_reactor::ActionSink) of that executor turns their
//!   actions into side-channel frames and planner-built transport batches.
//! * One bridge thread owns every ZeroMQ socket (a ROUTER on prefill ranks, a
//!   DEALER per prefill peer on decode ranks), decodes frames, routes them to
//!   the machines, answers hellos and heartbeats, resolves prefill ranks for
//!   decode requests and marks silent peers dead.
//! * The messages on a request's critical path skip the bridges once a tcp
//!   data-plane session to the peer is open: the sink packs them into a
//!   NOTIFY frame of that session and the peer's executor hands them to its
//!   machines directly (ZeroMQ stays the fallback; see
//!   [`NodeConfig::data_plane_messages`]). Decode engine threads resolve a
//!   request's prefill ranks from routes the bridge cached.
//! * Engine threads call the node from any thread; nothing they call blocks
//!   on the network, except [`Node::start`] and [`Node::register_kv_caches`].
//!
//! ```no_run
//! use kvferry::node::*;
//! # fn demo(layout: KvLayout, d_layout: KvLayout) -> Result<(), NodeError> {
//! let p = Node::start(NodeConfig::new(Role::Prefill, "p"))?;
//! unsafe { p.register_kv_caches(layout)? };
//! let d = Node::start(NodeConfig::new(Role::Decode, "d"))?;
//! unsafe { d.register_kv_caches(d_layout)? };
//! let target = PrefillTarget::Direct { tp_size: 1, side_channels: vec![p.side_channel_addr()] };
//! let rx = d.receiver(42, &target)?;
//! rx.request(vec![vec![BlockId(0), BlockId(1)]])?;
//! let tx = p.sender(42)?;
//! tx.send(vec![vec![BlockId(5), BlockId(6)]], true)?;
//! let phase = rx.wait(std::time::Duration::from_secs(5));
//! # Ok(()) }
//! ```

mod bridge;
mod error;
mod sink;
mod waker;

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

pub use kvferry_machines::common::{
    AbortReason, BlockId, BlockLists, Config as Timeouts, FailReason, Mode, Phase, TransferId,
};
pub use kvferry_machines::layout::{BatchLimits, LayoutKind, ModelSpec, RankLayout, Region};
use kvferry_machines::planner::PairLayout;
use kvferry_machines::recv::{RecvMachine, ResolvedPeer};
use kvferry_machines::send;
use kvferry_machines::send::SendMachine;
use kvferry_reactor::{
    Completion, Outcome, Reactor, ReactorConfig, ReactorHandle, ShutdownPolicy, SubmitError,
};

use crate::stats::Counters;
pub use crate::stats::NodeStats;
use crate::transport::EndpointAddr;
use bridge::BridgeCmd;
pub use error::{DataPlaneError, Misuse, NodeError, PeerUnfit};
use kvferry_machines::wire;

/// Which side of disaggregated serving this node is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// Runs prefill and sends KV.
    Prefill,
    /// Runs decode and receives KV.
    Decode,
}

/// Which data plane moves the bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TransportKind {
    /// Same process, memcpy.
    Local,
    /// TCP sockets (glommio), works across processes and hosts.
    Tcp,
}

/// Where a decode rank finds the prefill ranks of a request.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum PrefillTarget {
    /// Ask a bootstrap service for engine `engine_id`.
    Bootstrap {
        /// `host:port` of the bootstrap service.
        addr: String,
        /// The prefill engine.
        engine_id: String,
    },
    /// The side-channel addresses of every prefill rank, by TP rank.
    Direct {
        /// Prefill TP size.
        tp_size: u32,
        /// `tcp://host:port` per prefill TP rank.
        side_channels: Vec<String>,
    },
}

/// Everything a node needs to start.
#[derive(Clone, Debug)]
pub struct NodeConfig {
    /// Prefill or decode.
    pub role: Role,
    /// This engine's id (what the bootstrap service lists).
    pub engine_id: String,
    /// Data-parallel rank of the engine.
    pub dp_rank: u32,
    /// Tensor-parallel size of the engine.
    pub tp_size: u32,
    /// This node's TP rank.
    pub tp_rank: u32,
    /// Push (P writes) or pull (D reads); both sides must agree.
    pub mode: Mode,
    /// Data plane.
    pub transport: TransportKind,
    /// Host to bind the side channel and the TCP transport on.
    pub host: String,
    /// Side-channel port of a prefill rank; 0 picks a free one.
    pub side_channel_port: u16,
    /// Prefill: the bootstrap service to register at (`host:port`).
    pub bootstrap: Option<String>,
    /// Prefill: serve the bootstrap service embedded on this address
    /// (vLLM serves it from rank 0 on port 8998). It also serves this
    /// node's `/metrics`.
    pub serve_bootstrap: Option<String>,
    /// Serve this node's `/metrics` and `/health` on this address
    /// (`host:port`, port 0 picks a free one; see [`Node::metrics_addr`]).
    pub metrics_listen: Option<String>,
    /// Timeouts and bounds of the machines; `heartbeat_interval` and
    /// `heartbeat_misses` also drive peer liveness.
    pub timeouts: Timeouts,
    /// The reactor (exactly one executor: one rank is one device).
    pub reactor: ReactorConfig,
    /// Side-channel frame bounds.
    pub frame_limits: wire::Limits,
    /// Planner batch bounds.
    pub batch_limits: BatchLimits,
    /// Most peers the side channel tracks (ROUTER identities on prefill,
    /// DEALER connections on decode). When full, the slot of a dead peer
    /// that no transfer refers to is reused; otherwise a newcomer's hello is
    /// rejected (`bad_frames`) and a decode request that needs a new prefill
    /// connection fails at once.
    pub max_peers: usize,
    /// Most finished transfers remembered for [`Node::phase`] and
    /// [`Node::get_finished`]; past it the oldest records are forgotten
    /// (every machine already ended). An engine that does not call
    /// `get_finished` for that long loses the oldest notifications; each
    /// loss is logged and counted in `NodeStats::limit_hits`.
    pub max_finished_records: usize,
    /// Most block ids kept for [`Node::block_ids_with_load_errors`]; past it
    /// further ids are dropped and counted in `NodeStats::limit_hits`.
    pub max_load_error_blocks: usize,
    /// Commands queued from the executor and engine threads to the bridge
    /// thread. When full a frame is dropped and counted in `dropped_frames`
    /// (the machines' timeouts cover a lost message) and a decode request is
    /// refused with [`NodeError::Busy`].
    pub bridge_queue_capacity: usize,
    /// Decode: most bootstrap targets (service, engine id) whose directory
    /// is cached. When full, an entry that is not being queried is evicted;
    /// if every entry is being queried the request fails at once.
    pub max_bootstrap_targets: usize,
    /// Most data-plane sessions (one per peer endpoint) kept open. When full,
    /// an idle session is closed; if none is idle the transfer fails with
    /// a transport error naming the limit.
    pub max_data_sessions: usize,
    /// How the TCP data plane waits for its sockets. Parking (the default)
    /// leaves the cores to the side-channel threads and the engine: with
    /// spinning, a small request over loopback took 1.75 ms at p50 on
    /// 2 cores against 1.0 ms parked, because the spinning executors starved
    /// the ZeroMQ threads on the same cores. Spin only with cores to spare.
    pub tcp_poll: crate::transport::PollPolicy,
    /// Send the messages on a request's critical path (push: decode's
    /// `Pull` and lease ticket, prefill's `Status`; pull: decode's `Pull`
    /// and `Done`, prefill's `Ready`)
    /// over the tcp data-plane session to that peer instead of ZeroMQ once
    /// a session is open, and take such messages from peers. On loopback
    /// this cuts a small request's latency by about a third (five thread
    /// hand-offs per message: executor, bridge, two libzmq I/O threads,
    /// bridge, executor). Off: everything goes over ZeroMQ, and peers that
    /// try are refused and fall back to it.
    pub data_plane_messages: bool,
    /// Optional notification of every terminal phase, sent from the
    /// executor when it happens (no need to poll). Full channels drop.
    pub notify: Option<flume::Sender<(TransferId, Phase)>>,
    /// The same, with `tag` (a rank, say) in every notification, so that
    /// several nodes can share one channel without a forwarding thread
    /// (which would add a thread hand-off to every notification).
    pub notify_tagged: Option<(u32, TaggedNotify)>,
    /// Prefill: told about every transfer a decode rank asked for before the
    /// engine called [`Node::sender`] (a synthetic server answers these).
    /// Full channels drop.
    pub on_remote_request: Option<flume::Sender<RemoteRequest>>,
}

/// Where [`NodeConfig::notify_tagged`] sends `(tag, transfer, phase)`.
pub type TaggedNotify = flume::Sender<(u32, TransferId, Phase)>;

/// A decode rank asked this prefill rank for a transfer it did not know yet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteRequest {
    /// The transfer.
    pub transfer_id: u64,
    /// Per group, how many blocks the request has on the prefill side
    /// (the decode rank's prefix hit plus its destination blocks).
    pub blocks_per_group: Vec<u32>,
}

/// A decode node's [`ReactorConfig::yield_after_ends_below`]: the engine
/// hears first of requests that end while few are in flight (measured with
/// the demo: one at a time 0.12 → 0.095 ms at p50 on one core; 256 in flight
/// unchanged, where a yield per turn cost 12 % of the throughput).
pub const DECODE_YIELD_BELOW: usize = 8;

impl NodeConfig {
    /// Defaults for one rank (TP 1, push mode, TCP on loopback, ephemeral ports).
    pub fn new(role: Role, engine_id: impl Into<String>) -> NodeConfig {
        let reactor = ReactorConfig {
            mailbox_capacity: 65_536,
            max_machines_per_executor: 65_536,
            // A decode engine waits for its requests to end (the KV is
            // there); a prefill engine only gets its blocks back.
            yield_after_ends_below: match role {
                Role::Decode => DECODE_YIELD_BELOW,
                Role::Prefill => 0,
            },
            ..ReactorConfig::default()
        };
        NodeConfig {
            role,
            engine_id: engine_id.into(),
            dp_rank: 0,
            tp_size: 1,
            tp_rank: 0,
            mode: Mode::Push,
            transport: TransportKind::Tcp,
            host: "127.0.0.1".into(),
            side_channel_port: 0,
            bootstrap: None,
            serve_bootstrap: None,
            metrics_listen: None,
            timeouts: Timeouts::default(),
            reactor,
            frame_limits: wire::Limits::default(),
            batch_limits: BatchLimits::default(),
            max_peers: 4096,
            // As many as the executor holds live: enough for handles polled
            // soon after the end, and small (the soak saw 1 << 20 records
            // cost about 100 MiB of growth before it levelled off).
            max_finished_records: 65_536,
            max_load_error_blocks: 1 << 22,
            bridge_queue_capacity: 65_536,
            max_bootstrap_targets: 256,
            max_data_sessions: 4096,
            tcp_poll: crate::transport::PollPolicy::Park,
            data_plane_messages: true,
            notify: None,
            notify_tagged: None,
            on_remote_request: None,
        }
    }
}

/// The engine's KV cache as registered with the node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvLayout {
    /// Model facts (layout kind, total KV heads, block tokens, head bytes).
    pub model: ModelSpec,
    /// Blocks per region.
    pub num_blocks: u64,
    /// One region per layer and K/V (per layer for MLA), same order on P and D.
    pub regions: Vec<Region>,
}

/// A remote rank as the node knows it after its hello.
#[derive(Debug)]
pub(crate) struct PeerData {
    /// The peer's hello, kept for diagnostics (`Debug`).
    #[allow(dead_code)]
    pub hello: wire::Hello,
    /// The validated pair (P layout, D layout), or why it does not fit.
    pub pair: Result<PairLayout, PeerUnfit>,
    pub endpoint: Option<EndpointAddr>,
}

/// This rank's registered KV cache.
#[derive(Clone, Debug)]
pub(crate) struct LocalKv {
    pub model: ModelSpec,
    pub layout: RankLayout,
}

#[derive(Default)]
struct Records {
    /// Final phase by transfer, for handles polled after collection.
    done: HashMap<TransferId, Phase>,
    order: VecDeque<TransferId>,
    finished: VecDeque<TransferId>,
    load_errors: Vec<BlockId>,
}

/// State shared by the engine-facing handle, the executor and the bridge.
pub(crate) struct Shared {
    pub role: Role,
    pub node_id: u64,
    pub config: NodeConfig,
    pub local: OnceLock<LocalKv>,
    pub endpoint: OnceLock<String>,
    /// Peers by side-channel slot, and the slot of each data-plane
    /// endpoint (the latest hello that named it), for messages that arrive
    /// over the data plane.
    peers: Mutex<Peers>,
    /// Prefill side: per decode peer, the heartbeat acks the bridge sent it
    /// (`seq`, sent at), newest last: a grant naming one as a lease ticket
    /// counts from when it was sent. Read by the bridge and by the executor
    /// (for grants that come over the data plane).
    tickets: Mutex<HashMap<u32, VecDeque<(u64, Instant)>>>,
    /// Transfers whose messages went over the data plane, by peer slot, for
    /// the bridge to tie to that peer (so the peer's death fails them fast)
    /// on its next turn.
    tracked: Mutex<Vec<(u32, TransferId)>>,
    /// Decode side: the prefill ranks of each target the bridge resolved,
    /// while all of them are connected and alive, so an engine thread can
    /// hand a new request its peers without a trip through the bridge.
    routes: Mutex<Routes>,
    pub counters: Arc<Counters>,
    records: Mutex<Records>,
    pub bridge_tx: flume::Sender<BridgeCmd>,
    pub waker: Arc<waker::Waker>,
    /// Prometheus counters; the embedded bootstrap service serves them.
    /// Held while a prefill machine is created and while the bridge hands
    /// a message to a prefill machine. The reactor makes a transfer visible
    /// (board) before its `Create` is in the mailbox; without this lock the
    /// bridge could queue a `Pull` ahead of the engine's `Create`, and the
    /// executor would drop it as a message for an unknown transfer.
    pub create_lock: Mutex<()>,
    /// Bumped on every terminal phase, and signalled when a `wait` is
    /// waiting (a wake-up with nobody to wake is a system call per request).
    terminal_seq: Mutex<TerminalSeq>,
    terminal_cv: Condvar,
}

/// See `Shared::terminal_seq`.
#[derive(Default)]
struct TerminalSeq {
    seq: u64,
    waiters: usize,
}

/// See `Shared::routes`.
#[derive(Default)]
pub(crate) struct Routes {
    /// Per target: (peer slot, receivers expected) per prefill rank the
    /// request contacts, as the bridge last resolved them.
    by_target: HashMap<PrefillTarget, Vec<(u32, u16)>>,
    /// Per prefill slot: the latest heartbeat ack it sent us (`seq`, when
    /// it arrived), a lease ticket for push-mode `Pull`s.
    tickets: HashMap<u32, (u64, Instant)>,
}

#[derive(Default)]
struct Peers {
    by_slot: HashMap<u32, Arc<PeerData>>,
    by_endpoint: HashMap<EndpointAddr, u32>,
}

impl Shared {
    pub(crate) fn peer(&self, id: u32) -> Option<Arc<PeerData>> {
        self.peers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .by_slot
            .get(&id)
            .cloned()
    }

    /// The side-channel slot of the peer whose hello named data-plane
    /// endpoint `endpoint`.
    pub(crate) fn peer_at(&self, endpoint: &EndpointAddr) -> Option<u32> {
        self.peers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .by_endpoint
            .get(endpoint)
            .copied()
    }

    /// Records the hello of the peer in slot `id`.
    pub(crate) fn set_peer(&self, id: u32, data: Arc<PeerData>) {
        let mut p = self.peers.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(e) = data.endpoint {
            p.by_endpoint.insert(e, id);
        }
        if let Some(old) = p.by_slot.insert(id, data) {
            forget_endpoint(&mut p, id, old.endpoint);
        }
    }

    /// Forgets the peer in slot `id` (its slot goes to a newcomer).
    pub(crate) fn remove_peer(&self, id: u32) {
        let mut p = self.peers.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(old) = p.by_slot.remove(&id) {
            forget_endpoint(&mut p, id, old.endpoint);
        }
        drop(p);
        self.tickets
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&id);
    }

    /// Remembers that heartbeat ack `seq` went to `peer` at `at`; the
    /// oldest beyond `kept` are forgotten.
    pub(crate) fn ack_sent(&self, peer: u32, seq: u64, at: Instant, kept: usize) {
        let mut t = self.tickets.lock().unwrap_or_else(|e| e.into_inner());
        let acks = t.entry(peer).or_default();
        if acks.len() >= kept {
            acks.pop_front();
        }
        acks.push_back((seq, at));
    }

    /// When the heartbeat ack `ticket` went to `peer` (the first time, if
    /// twice), if it is still remembered.
    pub(crate) fn ticket_sent_at(&self, peer: u32, ticket: u64) -> Option<Instant> {
        let t = self.tickets.lock().unwrap_or_else(|e| e.into_inner());
        t.get(&peer)?
            .iter()
            .filter(|(q, _)| *q == ticket)
            .map(|(_, at)| *at)
            .min()
    }

    /// What a grant naming heartbeat ack `ticket` from decode `peer` means
    /// to a prefill machine: a lease counted from when that ack went out
    /// (the oldest, if sent twice), or, for an unknown or forgotten one,
    /// that P must ask for a lease at once.
    pub(crate) fn ticket_event(&self, peer: u32, ticket: u64, duration_ms: u64) -> send::Event {
        let peer = kvferry_machines::common::PeerId(peer);
        match self.ticket_sent_at(peer.0, ticket) {
            Some(sent_at) => send::Event::TicketGrant {
                peer,
                sent_at,
                duration_ms,
            },
            None => {
                tracing::debug!(?peer, ticket, "lease ticket not ours; refused");
                send::Event::TicketRefused { peer }
            }
        }
    }

    /// Ties `tid` to `peer` for the bridge (see `tracked`); bounded like the
    /// bridge's queue, past which the peer's death is left to the
    /// machines' own timeouts.
    pub(crate) fn track(&self, peer: u32, tid: TransferId) {
        let mut t = self.tracked.lock().unwrap_or_else(|e| e.into_inner());
        if t.len() < self.config.bridge_queue_capacity {
            t.push((peer, tid));
            // An otherwise idle bridge only turns once per heartbeat
            // interval; under load, wake it to take the queue now and then
            // (one eventfd write per `TRACK_WAKE_EVERY` entries).
            if t.len() % TRACK_WAKE_EVERY == 0 {
                drop(t);
                self.waker.wake();
            }
        } else {
            self.counters.limit_hits.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(
                limit = self.config.bridge_queue_capacity,
                "transfer not tied to its peer: bridge_queue_capacity reached"
            );
        }
    }

    /// Takes what [`Shared::track`] queued.
    pub(crate) fn take_tracked(&self) -> Vec<(u32, TransferId)> {
        std::mem::take(&mut *self.tracked.lock().unwrap_or_else(|e| e.into_inner()))
    }

    pub(crate) fn routes(&self) -> std::sync::MutexGuard<'_, Routes> {
        self.routes.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The peers of a new decode request for `target`, from the routes the
    /// bridge cached, each tied to `tid` for peer-death notification under
    /// the same lock the bridge takes before it fails a dead peer's
    /// transfers (so none is missed). `None`: ask the bridge.
    pub(crate) fn cached_route(
        &self,
        tid: TransferId,
        target: &PrefillTarget,
    ) -> Option<Vec<ResolvedPeer>> {
        let routes = self.routes();
        let route = routes.by_target.get(target)?;
        let peers = route
            .iter()
            .map(|&(slot, receivers_expected)| ResolvedPeer {
                peer: kvferry_machines::common::PeerId(slot),
                receivers_expected,
                lease_ticket: routes.fresh_ticket(slot, &self.config),
            })
            .collect();
        for &(slot, _) in route {
            self.track(slot, tid);
        }
        Some(peers)
    }

    /// Queues a command for the bridge; a full queue drops it (the
    /// machines' timeouts cover a lost message) and counts the drop.
    pub(crate) fn to_bridge(&self, cmd: BridgeCmd) -> bool {
        match self.bridge_tx.try_send(cmd) {
            Ok(()) => {
                self.waker.wake();
                true
            }
            Err(_) => {
                self.counters.dropped_frames.fetch_add(1, Ordering::Relaxed);
                self.counters.limit_hits.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(
                    limit = self.config.bridge_queue_capacity,
                    "bridge command dropped: bridge_queue_capacity reached"
                );
                false
            }
        }
    }

    /// The recorded final phase of a transfer that ended here.
    pub(crate) fn finished_phase(&self, tid: TransferId) -> Option<Phase> {
        self.records
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .done
            .get(&tid)
            .copied()
    }

    pub(crate) fn add_load_errors(&self, blocks: &[BlockId]) {
        let mut r = self.records.lock().unwrap_or_else(|e| e.into_inner());
        let room = self
            .config
            .max_load_error_blocks
            .saturating_sub(r.load_errors.len());
        if blocks.len() > room {
            tracing::warn!(
                dropped = blocks.len() - room,
                limit = self.config.max_load_error_blocks,
                "load-error block ids dropped: max_load_error_blocks reached"
            );
            self.counters.limit_hits.fetch_add(1, Ordering::Relaxed);
        }
        r.load_errors.extend(blocks.iter().take(room));
    }

    /// Remembers a final phase for handles and `get_finished`, bounded:
    /// the oldest records go first.
    fn record(&self, tid: TransferId, phase: Phase) {
        let mut r = self.records.lock().unwrap_or_else(|e| e.into_inner());
        let max = self.config.max_finished_records.max(1);
        if r.order.len() >= max {
            if let Some(old) = r.order.pop_front() {
                r.done.remove(&old);
            }
        }
        if r.finished.len() >= max {
            // The engine is not collecting (`get_finished`): the oldest
            // uncollected notification goes. Its phase stays queryable
            // until it ages out of `done` too.
            if let Some(lost) = r.finished.pop_front() {
                self.counters.limit_hits.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    ?lost,
                    limit = max,
                    "finished notification dropped uncollected: max_finished_records reached"
                );
            }
        }
        if r.done.insert(tid, phase).is_none() {
            r.order.push_back(tid);
        }
        r.finished.push_back(tid);
    }

    /// A request of this node reached `phase`, `latency` after its first
    /// report.
    pub(crate) fn on_terminal(&self, tid: TransferId, phase: Phase, latency: Duration) {
        if !phase.is_terminal() {
            return;
        }
        self.counters.record_terminal(phase, latency);
        if let (Role::Prefill, Phase::Expired) = (self.role, phase) {
            // The claim or lease ran out: the hold ended without decode's word.
            Counters::inc(&self.counters.expired_holds);
        }
        self.record(tid, phase);
        if let Some(n) = &self.config.notify {
            let _ = n.try_send((tid, phase));
        }
        if let Some((tag, n)) = &self.config.notify_tagged {
            let _ = n.try_send((*tag, tid, phase));
        }
        let waiters = {
            let mut t = self.terminal_seq.lock().unwrap_or_else(|e| e.into_inner());
            t.seq += 1;
            t.waiters
        };
        if waiters > 0 {
            self.terminal_cv.notify_all();
        }
    }
}

impl Routes {
    /// The ticket of prefill `slot` if recent enough to be worth a grant
    /// (push mode only).
    pub(crate) fn fresh_ticket(&self, slot: u32, config: &NodeConfig) -> Option<u64> {
        let fresh = config.timeouts.lease / 2;
        match config.mode {
            Mode::Push => self
                .tickets
                .get(&slot)
                .filter(|(_, at)| at.elapsed() < fresh)
                .map(|&(seq, _)| seq),
            Mode::Pull => None,
        }
    }

    pub(crate) fn set_ticket(&mut self, slot: u32, seq: u64, at: Instant) {
        self.tickets.insert(slot, (seq, at));
    }

    /// Caches the resolution of `target` (bounded: a full cache starts over).
    pub(crate) fn insert(&mut self, target: PrefillTarget, route: Vec<(u32, u16)>, max: usize) {
        if self.by_target.len() >= max.max(1) && !self.by_target.contains_key(&target) {
            self.by_target.clear();
        }
        self.by_target.insert(target, route);
    }

    /// Forgets every cached resolution and the tickets of `slot` (reused).
    pub(crate) fn clear(&mut self, reused: Option<u32>) {
        self.by_target.clear();
        if let Some(slot) = reused {
            self.tickets.remove(&slot);
        }
    }
}

/// Drops the index entry of `endpoint` if it still names slot `id`.
fn forget_endpoint(p: &mut Peers, id: u32, endpoint: Option<EndpointAddr>) {
    if let Some(e) = endpoint {
        if p.by_endpoint.get(&e) == Some(&id)
            && p.by_slot.get(&id).and_then(|d| d.endpoint) != Some(e)
        {
            p.by_endpoint.remove(&e);
        }
    }
}

/// The reactor of either role.
enum Engine {
    Prefill(Reactor<SendMachine>),
    Decode(Reactor<RecvMachine>),
}

#[derive(Clone)]
pub(crate) enum EngineHandle {
    Prefill(ReactorHandle<SendMachine>),
    Decode(ReactorHandle<RecvMachine>),
}

impl EngineHandle {
    pub(crate) fn poll(&self, tid: TransferId) -> Option<Phase> {
        match self {
            EngineHandle::Prefill(h) => h.poll(tid),
            EngineHandle::Decode(h) => h.poll(tid),
        }
    }

    fn get_finished(&self, max: usize) -> Vec<Completion> {
        match self {
            EngineHandle::Prefill(h) => h.get_finished(max),
            EngineHandle::Decode(h) => h.get_finished(max),
        }
    }

    fn abort(&self, tid: TransferId, reason: AbortReason) -> Result<(), SubmitError> {
        match self {
            EngineHandle::Prefill(h) => h.abort(tid, reason),
            EngineHandle::Decode(h) => h.abort(tid, reason),
        }
    }

    fn spawn_on<F, Fut>(&self, make: F) -> Result<(), SubmitError>
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()> + 'static,
    {
        match self {
            EngineHandle::Prefill(h) => h.spawn_on(0, make),
            EngineHandle::Decode(h) => h.spawn_on(0, make),
        }
    }
}

struct Inner {
    shared: Arc<Shared>,
    handle: EngineHandle,
    engine: Mutex<Option<Engine>>,
    bridge: Mutex<Option<bridge::BridgeThread>>,
    side_channel: String,
    bootstrap_server: Mutex<Option<crate::node::bridge::EmbeddedBootstrap>>,
    metrics_server: Mutex<Option<crate::stats::MetricsServer>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.stop(Duration::from_millis(200));
    }
}

impl Inner {
    fn stop(&self, grace: Duration) {
        let engine = self.engine.lock().unwrap_or_else(|e| e.into_inner()).take();
        let policy = ShutdownPolicy::Abort { grace };
        match engine {
            Some(Engine::Prefill(r)) => drop(r.shutdown(policy)),
            Some(Engine::Decode(r)) => drop(r.shutdown(policy)),
            None => {}
        }
        if let Some(b) = self.bridge.lock().unwrap_or_else(|e| e.into_inner()).take() {
            b.stop(&self.shared);
        }
        if let Some(s) = self
            .bootstrap_server
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            s.stop();
        }
        drop(
            self.metrics_server
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take(),
        );
    }
}

static NEXT_NODE_ID: AtomicU64 = AtomicU64::new(1);

/// See [`Shared::track`].
const TRACK_WAKE_EVERY: usize = 1024;

/// One prefill or decode rank. Cheap to clone; every clone is the same node.
/// The node stops when the last clone (and handle) is dropped, or at
/// [`Node::shutdown`].
#[derive(Clone)]
pub struct Node {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node")
            .field("role", &self.inner.shared.role)
            .field("engine_id", &self.inner.shared.config.engine_id)
            .field("tp_rank", &self.inner.shared.config.tp_rank)
            .finish()
    }
}

impl Node {
    /// Starts the executor (with its transport endpoint), the side channel
    /// and, on a prefill rank, the embedded bootstrap service and the
    /// registration at the bootstrap service.
    pub fn start(config: NodeConfig) -> Result<Node, NodeError> {
        config.timeouts.validate().map_err(Misuse::Timeouts)?;
        if config.reactor.executors.len() != 1 {
            return Err(Misuse::Executors(config.reactor.executors.len()).into());
        }
        if config.tp_size == 0 || config.tp_rank >= config.tp_size {
            return Err(Misuse::TpRank {
                tp_rank: config.tp_rank,
                tp_size: config.tp_size,
            }
            .into());
        }
        if config.max_peers == 0
            || config.max_finished_records == 0
            || config.bridge_queue_capacity == 0
            || config.max_bootstrap_targets == 0
            || config.max_data_sessions == 0
        {
            return Err(Misuse::ZeroBound(
                "max_peers, max_finished_records, bridge_queue_capacity, \
                 max_bootstrap_targets and max_data_sessions",
            )
            .into());
        }
        let (bridge_tx, bridge_rx) = flume::bounded(config.bridge_queue_capacity);
        let waker = Arc::new(waker::Waker::new().map_err(|e| NodeError::side_channel("waker", e))?);
        let shared = Arc::new(Shared {
            role: config.role,
            node_id: NEXT_NODE_ID.fetch_add(1, Ordering::Relaxed),
            config: config.clone(),
            local: OnceLock::new(),
            endpoint: OnceLock::new(),
            peers: Mutex::new(Peers::default()),
            tickets: Mutex::new(HashMap::new()),
            tracked: Mutex::new(Vec::new()),
            routes: Mutex::new(Routes::default()),
            counters: Arc::new(Counters::default()),
            records: Mutex::new(Records::default()),
            bridge_tx,
            waker,
            create_lock: Mutex::new(()),
            terminal_seq: Mutex::new(TerminalSeq::default()),
            terminal_cv: Condvar::new(),
        });
        let (ready_tx, ready_rx) = flume::bounded::<Result<String, DataPlaneError>>(1);
        let engine = match config.role {
            Role::Prefill => {
                let s = shared.clone();
                let r = Reactor::<SendMachine>::start(config.reactor.clone(), move |ctx| {
                    sink::Sink::new(s.clone(), ctx.poster, ready_tx.clone())
                })?;
                Engine::Prefill(r)
            }
            Role::Decode => {
                let s = shared.clone();
                let r = Reactor::<RecvMachine>::start(config.reactor.clone(), move |ctx| {
                    sink::Sink::new(s.clone(), ctx.poster, ready_tx.clone())
                })?;
                Engine::Decode(r)
            }
        };
        let handle = match &engine {
            Engine::Prefill(r) => EngineHandle::Prefill(r.handle()),
            Engine::Decode(r) => EngineHandle::Decode(r.handle()),
        };
        let endpoint = ready_rx
            .recv_timeout(Duration::from_secs(10))
            .map_err(|_| NodeError::Timeout("transport endpoint"))??;
        let _ = shared.endpoint.set(endpoint);
        let counters = shared.counters.clone();
        let source: crate::bootstrap::MetricsSource =
            Arc::new(move || crate::stats::render(&counters));
        let bootstrap_server = match (&config.role, &config.serve_bootstrap) {
            (Role::Prefill, Some(addr)) => {
                Some(bridge::EmbeddedBootstrap::start(addr, source.clone())?)
            }
            _ => None,
        };
        let metrics_server = match &config.metrics_listen {
            Some(addr) => Some(crate::stats::MetricsServer::start(addr, source)?),
            None => None,
        };
        let (bridge, side_channel) =
            bridge::BridgeThread::start(shared.clone(), handle.clone(), bridge_rx)?;
        let node = Node {
            inner: Arc::new(Inner {
                shared,
                handle,
                engine: Mutex::new(Some(engine)),
                bridge: Mutex::new(Some(bridge)),
                side_channel,
                bootstrap_server: Mutex::new(bootstrap_server),
                metrics_server: Mutex::new(metrics_server),
            }),
        };
        if config.role == Role::Prefill {
            if let Some(addr) = node.bootstrap_addr() {
                bridge::register_in_background(addr, &config, node.side_channel_addr());
            }
        }
        Ok(node)
    }

    /// The bootstrap service this node registers at (or serves).
    pub fn bootstrap_addr(&self) -> Option<String> {
        let c = &self.inner.shared.config;
        if let Some(b) = &c.bootstrap {
            return Some(b.clone());
        }
        self.inner
            .bootstrap_server
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(|s| s.addr())
    }

    /// This node's role.
    pub fn role(&self) -> Role {
        self.inner.shared.role
    }

    /// The side-channel address peers connect to (`tcp://host:port`;
    /// decode ranks have none and return an empty string).
    pub fn side_channel_addr(&self) -> String {
        self.inner.side_channel.clone()
    }

    /// The data-plane endpoint (`tcp://..` or `local://..`).
    pub fn endpoint(&self) -> String {
        self.inner
            .shared
            .endpoint
            .get()
            .cloned()
            .unwrap_or_default()
    }

    /// Registers the engine's KV cache with the data plane and makes it the
    /// layout this rank announces to peers. Call once, before requests.
    ///
    /// # Safety
    ///
    /// Every region must point at `num_blocks × block_len` bytes that stay
    /// allocated until the node is shut down (or dropped), and that peers
    /// may write (decode, push mode) or read (prefill) whenever the protocol
    /// lets them: the engine must not hold Rust references into them while a
    /// transfer on the blocks may be in flight.
    pub unsafe fn register_kv_caches(&self, layout: KvLayout) -> Result<(), NodeError> {
        let s = &self.inner.shared;
        if s.local.get().is_some() {
            return Err(Misuse::RegisteredTwice.into());
        }
        let rank = RankLayout {
            tp_size: s.config.tp_size,
            tp_rank: s.config.tp_rank,
            num_blocks: layout.num_blocks,
            regions: layout.regions.clone(),
        };
        // Checked now so a bad layout is the caller's error, not every
        // peer's: a pair with itself exercises the same validation.
        PairLayout::new(
            &layout.model,
            &rank,
            &RankLayout {
                tp_size: 1,
                tp_rank: 0,
                ..rank.clone()
            },
        )
        .or_else(|_| PairLayout::new(&layout.model, &rank, &rank))
        .map_err(Misuse::Layout)?;
        for r in &rank.regions {
            layout
                .num_blocks
                .checked_mul(r.block_len)
                .ok_or(Misuse::RegionOverflow)?;
        }
        let kv = sink::KvMemory {
            regions: rank.regions.iter().map(|r| (r.base, r.block_len)).collect(),
            num_blocks: layout.num_blocks,
            fenced: !(s.config.timeouts.unsafe_disable_fence
                || s.config.timeouts.unsafe_ignore_in_flight),
        };
        let (tx, rx) = flume::bounded(1);
        let node_id = s.node_id;
        self.inner
            .handle
            .spawn_on(move || async move {
                let _ = tx.send(sink::register_regions(node_id, &kv));
            })
            .map_err(NodeError::from)?;
        // Waits for the executor: inside a `Node::batch` the ring of the
        // spawn just queued would otherwise wait for the batch's end.
        kvferry_reactor::release_held();
        rx.recv_timeout(Duration::from_secs(10))
            .map_err(|_| NodeError::Timeout("memory registration"))??;
        let _ = s.local.set(LocalKv {
            model: layout.model,
            layout: rank,
        });
        Ok(())
    }

    fn require(&self, role: Role) -> Result<(), NodeError> {
        if self.inner.shared.role != role {
            return Err(Misuse::WrongRole(role).into());
        }
        if self.inner.shared.local.get().is_none() {
            return Err(Misuse::NotRegistered.into());
        }
        Ok(())
    }

    /// Runs `f` and wakes each executor that `f` queued work for once, when
    /// `f` returns, instead of once per call: for an engine step that
    /// starts several requests, or a `sender` and its `send` issued
    /// together. Without it a woken executor on a busy core may run between
    /// two calls, take the first, park, and be woken again for the second.
    /// Work queued inside `f` only starts when `f` returns, so `f` must not
    /// wait for a transfer by other means than the node's own calls: its
    /// waits ([`Sender::wait`]), polls ([`Node::phase`], the handles'
    /// `poll`, [`Node::get_finished`], all reading through the reactor
    /// handle, which wakes what is held first) and `register_kv_caches`.
    /// Batches nest, on any number of nodes.
    pub fn batch<R>(f: impl FnOnce() -> R) -> R {
        kvferry_reactor::batch(f)
    }

    /// Prefill: the handle for `transfer_id` (created now, or found if the
    /// decode side's request arrived first).
    pub fn sender(&self, transfer_id: u64) -> Result<Sender, NodeError> {
        self.require(Role::Prefill)?;
        let tid = TransferId(transfer_id);
        let EngineHandle::Prefill(h) = &self.inner.handle else {
            unreachable!("role checked above");
        };
        let s = &self.inner.shared;
        if s.finished_phase(tid).is_some() {
            // The transfer already ended here: typically decode aborted (or
            // failed) before the engine had its KV. A new machine would wait
            // out its bootstrap timeout for a `Pull` that never comes; the
            // handle reports the recorded outcome at once instead, and the
            // engine frees its blocks. Transfer ids are never reused.
            return Ok(Sender {
                node: self.clone(),
                tid,
            });
        }
        let m = SendMachine::new(Instant::now(), &s.config.timeouts, tid, s.config.mode);
        let created = {
            let _order = s.create_lock.lock().unwrap_or_else(|e| e.into_inner());
            h.create(0, tid, m)
        };
        match created {
            Ok(()) => {}
            // The decode side's `Pull` got here first and created it.
            Err(r) if r.error == SubmitError::DuplicateTransfer(tid) => {}
            Err(r) => return Err(r.error.into()),
        }
        Ok(Sender {
            node: self.clone(),
            tid,
        })
    }

    /// Decode: the handle for `transfer_id`, fed by the prefill engine at
    /// `prefill`. Nothing is sent until [`Receiver::request`].
    pub fn receiver(
        &self,
        transfer_id: u64,
        prefill: &PrefillTarget,
    ) -> Result<Receiver, NodeError> {
        self.require(Role::Decode)?;
        Ok(Receiver {
            node: self.clone(),
            tid: TransferId(transfer_id),
            target: prefill.clone(),
        })
    }

    fn request(
        &self,
        tid: TransferId,
        target: &PrefillTarget,
        dst_blocks: BlockLists,
        prefix_blocks: Vec<u32>,
    ) -> Result<(), NodeError> {
        // The machine and its first event: one wake-up.
        Node::batch(|| self.request_now(tid, target, dst_blocks, prefix_blocks))
    }

    fn request_now(
        &self,
        tid: TransferId,
        target: &PrefillTarget,
        dst_blocks: BlockLists,
        prefix_blocks: Vec<u32>,
    ) -> Result<(), NodeError> {
        self.require(Role::Decode)?;
        let EngineHandle::Decode(h) = &self.inner.handle else {
            unreachable!("role checked above");
        };
        let s = &self.inner.shared;
        let m = RecvMachine::new(
            Instant::now(),
            &s.config.timeouts,
            tid,
            s.config.mode,
            dst_blocks,
            prefix_blocks,
        )
        .map_err(Misuse::Request)?;
        h.create(0, tid, m).map_err(|r| NodeError::from(r.error))?;
        // Prefill ranks this node talks to already: no trip through the
        // bridge (about two thread hand-offs off every request).
        if let Some(peers) = s.cached_route(tid, target) {
            return match h.send_event(tid, kvferry_machines::recv::Event::PeersResolved { peers }) {
                Ok(()) => Ok(()),
                Err(r) => {
                    let _ = h.abort(tid, AbortReason::Engine);
                    Err(NodeError::from(r.error))
                }
            };
        }
        if !s.to_bridge(BridgeCmd::Resolve {
            tid,
            target: target.clone(),
        }) {
            // Without resolution the machine would wait out its bootstrap
            // timeout; fail it now instead.
            let _ = h.abort(tid, AbortReason::Engine);
            return Err(NodeError::Busy(SubmitError::MailboxFull { executor: 0 }));
        }
        Ok(())
    }

    fn send_chunk(
        &self,
        tid: TransferId,
        blocks: BlockLists,
        is_last: bool,
    ) -> Result<(), NodeError> {
        let EngineHandle::Prefill(h) = &self.inner.handle else {
            return Err(Misuse::WrongRole(Role::Prefill).into());
        };
        match h.send_event(
            tid,
            send::Event::ChunkReady {
                src_blocks: blocks,
                is_last,
            },
        ) {
            Ok(()) => Ok(()),
            // Ended already (see `sender`): nothing to send, the handle's
            // phase tells the outcome.
            Err(r)
                if r.error == SubmitError::UnknownTransfer(tid)
                    && self.inner.shared.finished_phase(tid).is_some() =>
            {
                Ok(())
            }
            Err(r) => Err(NodeError::from(r.error)),
        }
    }

    /// Latest phase of a transfer: live from the executor, or the final
    /// phase once it finished (kept for a bounded number of transfers).
    pub fn phase(&self, transfer_id: u64) -> Option<Phase> {
        let tid = TransferId(transfer_id);
        if let Some(p) = self.inner.handle.poll(tid) {
            return Some(p);
        }
        self.collect();
        let done = {
            let r = self
                .inner
                .shared
                .records
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            r.done.get(&tid).copied()
        };
        // A transfer may leave the board between the two looks.
        done.or_else(|| self.inner.handle.poll(tid))
    }

    /// Aborts a transfer (either role). Unknown transfers are a misuse.
    pub fn abort(&self, transfer_id: u64) -> Result<(), NodeError> {
        self.inner
            .handle
            .abort(TransferId(transfer_id), AbortReason::Engine)
            .map_err(NodeError::from)
    }

    /// Collects the executor's completions so its board stays small. Final
    /// phases were recorded when they happened; only transfers that never
    /// reported one (refused at creation, dropped at shutdown) are recorded here.
    fn collect(&self) {
        for c in self.inner.handle.get_finished(4096) {
            match c.outcome {
                Outcome::Finished { .. } => {}
                // `Rejected`, `Dropped` and any later outcome: no terminal
                // phase was reported for it.
                _ => self.inner.shared.record(
                    c.transfer_id,
                    Phase::Failed(FailReason::Aborted(AbortReason::Shutdown)),
                ),
            }
        }
    }

    /// vLLM-style batch call: starts every load (decode) and send (prefill)
    /// of `meta`. Returns the first error; the requests before it started.
    /// Each executor is woken once for the whole batch (see
    /// [`Node::batch`]).
    pub fn start_load_kv(&self, meta: &LoadMeta) -> Result<(), NodeError> {
        Node::batch(|| self.start_load_kv_now(meta))
    }

    fn start_load_kv_now(&self, meta: &LoadMeta) -> Result<(), NodeError> {
        for l in &meta.loads {
            self.request(
                TransferId(l.transfer_id),
                &l.prefill,
                l.dst_blocks.clone(),
                l.prefix_blocks.clone(),
            )?;
        }
        for s in &meta.sends {
            self.sender(s.transfer_id)?
                .send(s.src_blocks.clone(), s.is_last)?;
        }
        Ok(())
    }

    /// vLLM-style: the transfers that finished since the last call, as
    /// `(finished sending, finished receiving)` (one of them is empty,
    /// by role). Every terminal outcome counts; failed loads also appear
    /// in [`Node::block_ids_with_load_errors`].
    pub fn get_finished(&self) -> (Vec<u64>, Vec<u64>) {
        self.collect();
        let ids: Vec<u64> = {
            let mut r = self
                .inner
                .shared
                .records
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            r.finished.drain(..).map(|t| t.0).collect()
        };
        match self.inner.shared.role {
            Role::Prefill => (ids, Vec::new()),
            Role::Decode => (Vec::new(), ids),
        }
    }

    /// vLLM-style: destination blocks whose load failed since the last call.
    pub fn block_ids_with_load_errors(&self) -> Vec<BlockId> {
        let mut r = self
            .inner
            .shared
            .records
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        std::mem::take(&mut r.load_errors)
    }

    /// Counters.
    pub fn stats(&self) -> NodeStats {
        self.inner.shared.counters.snapshot()
    }

    /// The node's metrics as `/metrics` serves them (OpenMetrics text):
    /// the counters of [`Node::stats`] and the latency histogram.
    pub fn metrics_text(&self) -> String {
        crate::stats::render(&self.inner.shared.counters)
    }

    /// Latency of the requests that succeeded, first report to terminal.
    pub fn latency(&self) -> crate::stats::Latency {
        self.inner.shared.counters.latency()
    }

    /// Where `/metrics` and `/health` are served (`NodeConfig::metrics_listen`).
    pub fn metrics_addr(&self) -> Option<std::net::SocketAddr> {
        let m = self
            .inner
            .metrics_server
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        m.as_ref().map(|m| m.local_addr())
    }

    /// Side-channel peers currently marked dead.
    pub fn dead_peers(&self) -> usize {
        bridge::dead_peers(&self.inner.shared)
    }

    /// Stops the node: aborts live requests, gives them `grace` to tell
    /// their peers, then closes the side channel and the transport.
    pub fn shutdown(&self, grace: Duration) {
        self.inner.stop(grace);
    }
}

/// One load of a [`LoadMeta`] (decode).
#[derive(Clone, Debug)]
pub struct LoadRequest {
    /// The transfer.
    pub transfer_id: u64,
    /// Where its prefill ranks are.
    pub prefill: PrefillTarget,
    /// Destination blocks per group.
    pub dst_blocks: BlockLists,
    /// Per group, leading prefill blocks already held locally.
    pub prefix_blocks: Vec<u32>,
}

/// One send of a [`LoadMeta`] (prefill).
#[derive(Clone, Debug)]
pub struct SendRequest {
    /// The transfer.
    pub transfer_id: u64,
    /// Source blocks per group of this chunk.
    pub src_blocks: BlockLists,
    /// True on the request's last chunk.
    pub is_last: bool,
}

/// What the scheduler hands the worker each step (vLLM's connector metadata).
#[derive(Clone, Debug, Default)]
pub struct LoadMeta {
    /// Loads to start (decode).
    pub loads: Vec<LoadRequest>,
    /// Chunks to send (prefill).
    pub sends: Vec<SendRequest>,
}

/// Waits for a terminal phase of `tid` on `node`, up to `timeout`: sleeps
/// on the node's condition variable, which the executor signals on every
/// terminal phase.
fn wait_terminal(node: &Node, tid: u64, timeout: Duration, before: Phase) -> Phase {
    let deadline = Instant::now() + timeout;
    let s = &node.inner.shared;
    loop {
        let seen = s.terminal_seq.lock().unwrap_or_else(|e| e.into_inner()).seq;
        let p = node.phase(tid).unwrap_or(before);
        let now = Instant::now();
        if p.is_terminal() || now >= deadline {
            return p;
        }
        let mut guard = s.terminal_seq.lock().unwrap_or_else(|e| e.into_inner());
        if guard.seq == seen {
            // Counted under the lock the notifier bumps `seq` under: it
            // either sees us waiting or we see its bump.
            guard.waiters += 1;
            let (mut guard, _) = s
                .terminal_cv
                .wait_timeout(guard, deadline - now)
                .unwrap_or_else(|e| e.into_inner());
            guard.waiters -= 1;
        }
    }
}

/// Prefill-side handle of one transfer (SGLang's `KVSender`).
#[derive(Debug)]
pub struct Sender {
    node: Node,
    tid: TransferId,
}

impl Sender {
    /// The transfer.
    pub fn transfer_id(&self) -> u64 {
        self.tid.0
    }

    /// Hands a chunk of ready KV (source blocks per group) to the transfer;
    /// `is_last` on the final chunk (a whole request is one chunk).
    pub fn send(&self, blocks: BlockLists, is_last: bool) -> Result<(), NodeError> {
        self.node.send_chunk(self.tid, blocks, is_last)
    }

    /// Current phase. Terminal once the source blocks may be reused.
    pub fn poll(&self) -> Phase {
        self.node
            .phase(self.tid.0)
            .unwrap_or(Phase::Failed(FailReason::Aborted(AbortReason::Engine)))
    }

    /// Aborts the transfer; the phase turns terminal once no peer can read
    /// the blocks anymore.
    pub fn abort(&self) -> Result<(), NodeError> {
        self.node.abort(self.tid.0)
    }

    /// Waits (bounded) for a terminal phase.
    pub fn wait(&self, timeout: Duration) -> Phase {
        wait_terminal(
            &self.node,
            self.tid.0,
            timeout,
            Phase::Failed(FailReason::Aborted(AbortReason::Engine)),
        )
    }
}

/// Decode-side handle of one transfer (SGLang's `KVReceiver`).
#[derive(Debug)]
pub struct Receiver {
    node: Node,
    tid: TransferId,
    target: PrefillTarget,
}

impl Receiver {
    /// The transfer.
    pub fn transfer_id(&self) -> u64 {
        self.tid.0
    }

    /// Asks the prefill ranks for the KV, into `dst_blocks` (per group).
    pub fn request(&self, dst_blocks: BlockLists) -> Result<(), NodeError> {
        let prefix = vec![0; dst_blocks.len()];
        self.node
            .request(self.tid, &self.target, dst_blocks, prefix)
    }

    /// Like [`Receiver::request`] with a partial prefix hit: per group, the
    /// number of the prefill side's leading blocks this rank already holds.
    pub fn request_with_prefix(
        &self,
        dst_blocks: BlockLists,
        prefix_blocks: Vec<u32>,
    ) -> Result<(), NodeError> {
        self.node
            .request(self.tid, &self.target, dst_blocks, prefix_blocks)
    }

    /// Current phase; `Bootstrapping` before `request`. Terminal once the
    /// destination blocks are the engine's again.
    pub fn poll(&self) -> Phase {
        self.node.phase(self.tid.0).unwrap_or(Phase::Bootstrapping)
    }

    /// Aborts the transfer.
    pub fn abort(&self) -> Result<(), NodeError> {
        self.node.abort(self.tid.0)
    }

    /// Waits (bounded) for a terminal phase.
    pub fn wait(&self, timeout: Duration) -> Phase {
        wait_terminal(&self.node, self.tid.0, timeout, Phase::Bootstrapping)
    }
}
