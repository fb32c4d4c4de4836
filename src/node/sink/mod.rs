//! The executor side of a node: the [`ActionSink`] that turns machine
//! actions into side-channel frames and planner-built transport batches.
//!
//! Runs on the node's glommio executor. `execute` never waits: a transfer
//! is planned at once (the planner is pure and fast) and then moved by a
//! local task, which reports back through the executor's [`EventPoster`].

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::ops::Range;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use kvferry_machines::duplex::{self, Direction, Duplex};
use kvferry_machines::{
    blocks_fingerprint, BlockLists, Mode, Msg, PeerId, Phase, Plan, PlanError, TransferId,
    TICKET_BIT,
};
use kvferry_machines::{recv, send};
use kvferry_reactor::{ActionSink, EventPoster};

use super::command::BridgeCmd;
use super::tables::Written;
use super::{DataPlaneError, PeerUnfit, Shared, TransportKind};
use crate::transport::internal::wire::RejectReason;
use crate::transport::LocalTransport;
use crate::transport::MooncakeTransport;
use crate::transport::{
    AnySession, AnyTransport, Desc, EndpointAddr, Op, PeerError, RegionInfo, Session, Transport,
    TransportError,
};
use crate::transport::{BlockFence, FenceKey, FencePool};
use crate::transport::{ShmConfig, ShmMode};
use crate::transport::{TcpConfig, TcpTransport};
use kvferry_machines::wire::{self, Frame};

mod coalesce;
mod inbound;
mod messenger;
mod sessions;

use coalesce::*;
use inbound::*;
use messenger::*;
use sessions::*;

/// Why a batch was not moved. Logged with its transfer; the machine hears
/// of it as a failed write or read.
#[derive(Clone, Debug, thiserror::Error)]
enum MoveError {
    /// The peer never said hello.
    #[error("peer unknown (no hello)")]
    UnknownPeer,
    /// The peer cannot pair with this rank.
    #[error(transparent)]
    Unfit(PeerUnfit),
    /// The peer's hello named no usable data-plane endpoint.
    #[error("peer endpoint unusable")]
    NoEndpoint,
    /// The planner refused the block lists.
    #[error("plan: {0}")]
    Plan(#[from] PlanError),
    /// `max_data_sessions` sessions are open and busy.
    #[error("{busy} data-plane sessions are busy: max_data_sessions reached")]
    SessionsFull {
        /// Sessions open.
        busy: usize,
    },
    /// The shared batch carrying this transfer went away unfinished.
    #[error("the shared batch was dropped")]
    BatchDropped,
    /// The transfer waited in its lane past its deadline; nothing moved.
    #[error("waited past the transfer bound for a batch")]
    WaitedPastBound,
    /// The transport failed the batch (shared by the transfers of a
    /// shared batch, hence the `Arc`).
    #[error(transparent)]
    Transport(Arc<TransportError>),
}

impl MoveError {
    /// The data-plane connection to the peer failed (refused, reset,
    /// closed): the peer is likely gone, unlike a timeout, a fenced block
    /// or a refused frame, which say nothing about the peer's health.
    fn is_connection_loss(&self) -> bool {
        match self {
            MoveError::Transport(e) => matches!(
                **e,
                TransportError::Disconnected { .. } | TransportError::Io { .. }
            ),
            MoveError::UnknownPeer
            | MoveError::Unfit(_)
            | MoveError::NoEndpoint
            | MoveError::Plan(_)
            | MoveError::SessionsFull { .. }
            | MoveError::BatchDropped
            | MoveError::WaitedPastBound => false,
        }
    }
}

impl From<TransportError> for MoveError {
    fn from(e: TransportError) -> Self {
        MoveError::Transport(Arc::new(e))
    }
}

/// The node's tcp data plane, bound to its host and data-plane port.
fn tcp_transport(shared: &Shared, shm: ShmMode) -> Result<AnyTransport, DataPlaneError> {
    let (config, bind_ip) = (&shared.config, shared.bind_ip);
    let defaults = TcpConfig::default();
    let streams = match config.tcp_streams {
        0 => defaults.streams,
        n => n,
    };
    let tcp = TcpConfig {
        batch_timeout: config
            .timeouts
            .transfer_bound
            .max(std::time::Duration::from_millis(1)),
        poll: config.tcp_poll,
        streams,
        // Room for every stream's frame in flight at once.
        inflight_max_bytes: defaults
            .inflight_max_bytes
            .max(streams as u64 * defaults.frame_max_bytes),
        shm: ShmConfig {
            mode: shm,
            ..ShmConfig::default()
        },
        device: config.device.clone(),
        key: shared.key.clone(),
        rejects: shared.counters.auth.clone(),
        payload_mac: config.payload_mac,
        ..defaults
    };
    // `Node::start` resolved the host: no lookup on the executor.
    let addr = std::net::SocketAddr::new(bind_ip, config.data_plane_port);
    Ok(AnyTransport::Tcp(TcpTransport::bind(addr, tcp)?))
}

/// The node's Mooncake engine, reachable at its host.
fn mooncake_transport(
    config: &super::NodeConfig,
    bind_ip: std::net::IpAddr,
) -> Result<AnyTransport, DataPlaneError> {
    let mc = config.mooncake.clone();
    if mc.linger >= config.timeouts.transfer_bound {
        let why = "mooncake.linger must be shorter than the transfer bound".to_string();
        return Err(DataPlaneError::Transport(
            crate::transport::MisuseError::BadConfig(why).into(),
        ));
    }
    Ok(AnyTransport::Mooncake(MooncakeTransport::new(bind_ip, mc)?))
}

/// Counts a finished move and returns whether it succeeded; first tells
/// the machine `uncarried` when the bytes landed without their `Status`.
async fn count_move(
    shared: &Shared,
    poster: &EventPoster<Duplex>,
    tid: TransferId,
    result: Result<bool, MoveError>,
    uncarried: Option<duplex::Event>,
    bytes: u64,
    count: u64,
) -> bool {
    match result {
        Ok(delivered) => {
            if delivered {
                let c = &shared.counters;
                c.data_plane_messages.fetch_add(1, Ordering::Relaxed);
                c.statuses_behind_writes.fetch_add(1, Ordering::Relaxed);
            } else if let Some(event) = uncarried {
                // The write could not carry it (several streams,
                // no data-plane messages, refused): the machine
                // sends it now that the KV landed.
                let _ = poster.post(tid, event).await;
            }
            shared.counters.bytes.fetch_add(bytes, Ordering::Relaxed);
            shared
                .counters
                .descriptors
                .fetch_add(count, Ordering::Relaxed);

            true
        }
        Err(e) => {
            tracing::warn!(?tid, %e, "transfer failed");
            shared
                .counters
                .transport_errors
                .fetch_add(1, Ordering::Relaxed);
            false
        }
    }
}

/// A transfer planned and admitted: where its bytes go, in which batches.
struct Planned {
    transport: Rc<AnyTransport>,
    endpoint: EndpointAddr,
    descs: Vec<Desc>,
    batches: Vec<Range<usize>>,
}

/// Why a transfer's bytes do not move; its machine hears a failed move.
enum NotStarted {
    /// The planner (or the peer's hello) gave no plan.
    Unplanned,
    /// No endpoint here, or no room for a data-plane session.
    Refused,
}

/// The bytes of one transfer on their way, run by a local task.
struct Move {
    transport: Rc<AnyTransport>,
    sessions: Sessions,
    lanes: Lanes,
    msgr: Messenger,
    endpoint: EndpointAddr,
    op: Op,
    descs: Vec<Desc>,
    batches: Vec<Range<usize>>,
    /// The encoded `Status` frame to ride the write, if any.
    note: Option<Vec<u8>>,
    /// Small enough to share a batch with others to the same peer.
    coalesce: bool,
    deadline: Instant,
}

impl Move {
    /// Moves the bytes; `Ok(true)` if the `note` was delivered with them.
    async fn run(self) -> Result<bool, MoveError> {
        if self.descs.is_empty() {
            Ok(false)
        } else if self.coalesce {
            let io = Io {
                transport: self.transport,
                sessions: self.sessions,
                lanes: self.lanes,
                sender: self.msgr.sender(),
            };
            io.queue(self.endpoint, self.op, self.descs, self.note, self.deadline)
                .await
        } else {
            let msgr = &self.msgr;
            let trailer = self
                .note
                .map(|f| wire::encode_notify(&msgr.sender(), [&f[..]]));
            let route = Route {
                transport: &self.transport,
                sessions: &self.sessions,
                endpoint: self.endpoint,
            };
            route
                .move_bytes(
                    self.op,
                    &self.descs,
                    &self.batches,
                    trailer.as_deref(),
                    self.deadline,
                )
                .await
        }
    }
}

thread_local! {
    /// The transport endpoint of each node whose executor runs on this
    /// thread, so that tasks spawned by `register_kv_caches` reach it.
    static TRANSPORTS: RefCell<HashMap<u64, Rc<AnyTransport>>> = RefCell::new(HashMap::new());
}

/// The KV memory of a node as `register_kv_caches` hands it to the executor.
pub(crate) struct KvMemory {
    /// `(base, block_len)` per region.
    pub regions: Vec<(u64, u64)>,
    pub num_blocks: u64,
    /// The aux and state pools' buffers, fenced per item.
    pub pools: Vec<FencePool>,
    /// False only when a self-test switched the machines' own protection
    /// off to show what it catches; the block fence would hide that.
    pub fenced: bool,
    /// The device of [`super::NodeConfig::device`].
    pub device: Option<Arc<dyn crate::transport::Device>>,
}

/// The memory a rank with `layout` registers with its endpoint (what
/// [`register_regions`] registers): each KV region's blocks, each pool
/// buffer's items.
fn registered_ranges(layout: &kvferry_machines::RankLayout) -> Vec<RegionInfo> {
    let blocks = (layout.regions.iter()).map(|r| (r.base, r.block_len, layout.num_blocks));
    let items =
        (layout.pools.iter()).flat_map(|p| p.regions.iter().map(|r| (r.base, r.item_len, p.items)));
    let ranges = blocks
        .chain(items)
        .map(|(addr, stride, count)| (addr, count.saturating_mul(stride)))
        .collect();
    merge_ranges(ranges)
        .into_iter()
        .map(|(addr, len_bytes)| RegionInfo { addr, len_bytes })
        .collect()
}

/// `(addr, len)` ranges, those that share bytes merged into one: the KV
/// regions of a block-outermost layout (vLLM's BLHNC and BLNHC) interleave,
/// every layer's page of a block inside one block stride, so the ranges
/// their blocks span overlap although their pages never do.
fn merge_ranges(mut ranges: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    ranges.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(ranges.len());
    for (addr, len) in ranges {
        let end = addr.saturating_add(len);
        match out.last_mut() {
            Some((a, l)) if addr < a.saturating_add(*l) => *l = (*l).max(end - *a),
            _ => out.push((addr, len)),
        }
    }
    out
}

/// Registers the regions of `kv` with the node's endpoint and puts them
/// under a block fence; runs on the executor.
pub(crate) fn register_regions(node_id: u64, kv: &KvMemory) -> Result<(), DataPlaneError> {
    let t = TRANSPORTS
        .with(|m| m.borrow().get(&node_id).cloned())
        .ok_or(DataPlaneError::NoEndpoint)?;
    // The local transport copies on the initiator's thread, outside any
    // fence of ours; only tcp endpoints get one.
    if let (true, AnyTransport::Tcp(tcp)) = (kv.fenced, &*t) {
        let fence = BlockFence::with_pools(&kv.regions, kv.num_blocks, &kv.pools);
        tcp.set_fence(Some(Rc::new(fence)));
    }
    let blocks = kv
        .regions
        .iter()
        .map(|&(base, len)| (base, len, kv.num_blocks));
    let items =
        (kv.pools.iter()).flat_map(|p| p.buffers.iter().map(|&(base, len)| (base, len, p.items)));
    // `register_kv_caches` checked that the products fit in 64 bits.
    let ranges = (blocks.chain(items))
        .map(|(base, stride, count)| (base, count.saturating_mul(stride)))
        .collect();
    let mut all = Vec::new();
    for (base, len) in merge_ranges(ranges) {
        let len = usize::try_from(len).map_err(|_| DataPlaneError::RegionTooLong)?;
        all.push((base as usize as *mut u8, len));
    }
    // With a device, the ranges it recognises are device memory, the rest
    // (aux buffers an engine keeps on the host) host memory.
    let on_device = |&(addr, len): &(*mut u8, usize)| {
        kv.device
            .as_ref()
            .is_some_and(|d| d.check_range(addr as u64, len as u64).is_ok())
    };
    let (device, host): (Vec<_>, Vec<_>) = all.into_iter().partition(on_device);
    if let (Some(d), false, AnyTransport::Local(_)) = (&kv.device, device.is_empty(), &*t) {
        let (device, transport) = (d.name(), "local");
        return Err(DataPlaneError::DeviceUnsupported { device, transport });
    }
    // SAFETY: forwarded from `Node::register_kv_caches`, whose caller
    // promised the memory stays valid and shareable with peers.
    unsafe {
        match &*t {
            // One call per kind of memory: Mooncake registers them in
            // parallel (`registerLocalMemoryBatch`), which matters when
            // RDMA pins and maps a large KV.
            AnyTransport::Mooncake(mc) => {
                if !host.is_empty() {
                    drop(mc.register_batch(&host)?);
                }
                if let Some(d) = kv.device.as_ref().filter(|_| !device.is_empty()) {
                    drop(mc.register_batch_at(&device, &d.name())?);
                }
            }
            AnyTransport::Tcp(tcp) => {
                for &(addr, len) in &host {
                    tcp.register(addr, len)?;
                }
                for &(addr, len) in &device {
                    tcp.register_device(addr as u64, len)?;
                }
            }
            _ => {
                for &(addr, len) in &host {
                    t.register(addr, len)?;
                }
            }
        }
    }
    Ok(())
}

/// Makes the device copies of the node's endpoint wait for `event`; runs
/// on the executor.
pub(crate) fn wait_engine(
    node_id: u64,
    event: &crate::transport::EngineEvent,
) -> Result<(), DataPlaneError> {
    let t = TRANSPORTS
        .with(|m| m.borrow().get(&node_id).cloned())
        .ok_or(DataPlaneError::NoEndpoint)?;
    if let AnyTransport::Tcp(tcp) = &*t {
        tcp.wait_engine(event)?;
    }
    Ok(())
}

/// One chunk to move: P's blocks `src` to D's blocks `dst` of `peer`, in
/// direction `op` as seen from this side.
struct Job<'a> {
    peer: PeerId,
    src: &'a BlockLists,
    dst: &'a BlockLists,
    op: Op,
}

/// `peer`'s message as the event of the machine it is for, which goes
/// `direction` (the way this rank moves KV with that peer).
pub(crate) fn inbound(
    shared: &Shared,
    direction: Direction,
    peer: PeerId,
    msg: Msg,
) -> duplex::Event {
    match direction {
        Direction::Send => duplex::Event::Send(to_send_event(shared, peer, msg)),
        Direction::Recv => duplex::Event::Recv(recv::Event::Msg { peer, msg }),
    }
}

/// A decode peer's message to a send machine: a lease ticket's grant, and a
/// `Pull` or failing `Done` from a peer this rank refuses (see
/// `Shared::refusal`), have events of their own.
fn to_send_event(shared: &Shared, peer: PeerId, msg: Msg) -> send::Event {
    match msg {
        Msg::LeaseGrant { seq, duration_ms } if seq & TICKET_BIT != 0 => {
            shared.ticket_event(peer.0, seq & !TICKET_BIT, duration_ms)
        }
        Msg::Pull { .. } => match shared.refusal(peer.0) {
            Some(reason) => send::Event::UnpairedPull { peer, reason },
            None => send::Event::Msg { peer, msg },
        },
        Msg::Done { ok: false } => match shared.refusal(peer.0) {
            Some(reason) => send::Event::UnpairedDone { peer, reason },
            None => send::Event::Msg { peer, msg },
        },
        msg => send::Event::Msg { peer, msg },
    }
}

/// Which way the machine that `msg` is for moves KV, in `mode`: a data-plane
/// notification names the peer's endpoint only, and a rank of
/// [`Role::Both`](super::Role) may be both a sender and a receiver of the
/// same peer. Leases go from the granter (push: decode; pull: prefill) to
/// the rank that touches the other's memory. `None` for the messages
/// either side sends (`Abort`, `AbortAck`), which never travel that way.
pub(crate) fn toward(msg: &Msg, mode: Mode) -> Option<Direction> {
    let to_toucher = match mode {
        Mode::Push => Direction::Send,
        Mode::Pull => Direction::Recv,
    };
    match msg {
        Msg::Pull { .. } | Msg::Done { .. } | Msg::Unneeded => Some(Direction::Send),
        Msg::Status { .. } | Msg::Ready { .. } | Msg::NotPaired => Some(Direction::Recv),
        Msg::LeaseGrant { .. } => Some(to_toucher),
        Msg::LeaseRequest { .. } => Some(match to_toucher {
            Direction::Send => Direction::Recv,
            Direction::Recv => Direction::Send,
        }),
        Msg::Abort | Msg::AbortAck => None,
    }
}

/// The node's action sink.
pub(crate) struct Sink {
    shared: Arc<Shared>,
    poster: EventPoster<Duplex>,
    plan: Plan,
    /// Scratch block lists for the planner (u64 ids), kept between calls.
    src: Vec<Vec<u64>>,
    dst: Vec<Vec<u64>>,
    /// When each live transfer was created, for the latency histogram;
    /// also which transfers the executor holds live.
    started: Live,
    /// Sends the machines' messages; also holds the node's transport
    /// endpoint and its data-plane sessions, which transfers use too.
    msgr: Messenger,
    /// Small transfers waiting to share a batch, per peer endpoint.
    lanes: Lanes,
    /// Mooncake: the peer data whose registered memory the transport was
    /// taught, per endpoint, so it learns each hello once, not per
    /// transfer; at most `max_data_sessions` (cleared when full, with what
    /// the transport learnt).
    taught: HashMap<EndpointAddr, Arc<super::tables::PeerData>>,
    /// Local blocks each live transfer opened in the block fence; closed in
    /// the turn that reports the transfer terminal.
    opened: HashMap<TransferId, Vec<FenceKey>>,
    /// Push-mode prefill: per live transfer, each peer and the fingerprint
    /// of the blocks written to it so far (`blocks_fingerprint`), kept with
    /// the record of a success so a late `Pull` can be told apart from a
    /// new request that reuses the id.
    written: HashMap<TransferId, Written>,
}

type Live = Rc<RefCell<HashMap<TransferId, Instant>>>;

impl Drop for Sink {
    fn drop(&mut self) {
        let id = self.shared.node_id;
        TRANSPORTS.with(|m| m.borrow_mut().remove(&id));
    }
}

impl Sink {
    /// Builds the sink and the node's transport endpoint on the executor;
    /// reports the endpoint address (or why it failed) on `ready`.
    pub(crate) fn new(
        shared: Arc<Shared>,
        poster: EventPoster<Duplex>,
        ready: flume::Sender<Result<String, DataPlaneError>>,
    ) -> Self {
        let made = match shared.config.transport {
            TransportKind::Local => Ok(AnyTransport::Local(LocalTransport::default())),
            TransportKind::Tcp => tcp_transport(&shared, ShmMode::Off),
            TransportKind::Auto => tcp_transport(&shared, ShmMode::Auto),
            TransportKind::Shm => tcp_transport(&shared, ShmMode::Require),
            TransportKind::Mooncake => mooncake_transport(&shared.config, shared.bind_ip),
        };
        let started: Live = Rc::new(RefCell::new(HashMap::new()));
        let transport = match made {
            Ok(t) => {
                if let (AnyTransport::Tcp(tcp), true) = (&t, shared.config.data_plane_messages) {
                    tcp.set_notify_handler(Some(notify_handler(
                        shared.clone(),
                        poster.clone(),
                        started.clone(),
                    )));
                }
                let t = Rc::new(t);
                let _ = ready.try_send(Ok(t.endpoint_addr().to_string()));
                TRANSPORTS.with(|m| m.borrow_mut().insert(shared.node_id, t.clone()));
                Some(t)
            }
            Err(e) => {
                let _ = ready.try_send(Err(e));
                None
            }
        };
        Sink {
            shared: shared.clone(),
            poster,
            plan: Plan::default(),
            src: Vec::new(),
            dst: Vec::new(),
            taught: HashMap::new(),
            started,
            msgr: Messenger {
                shared,
                transport,
                sessions: Rc::new(RefCell::new(HashMap::new())),
                notes: Rc::new(RefCell::new(HashMap::new())),
                refusing: Rc::default(),
            },
            lanes: Rc::new(RefCell::new(HashMap::new())),
            opened: HashMap::new(),
            written: HashMap::new(),
        }
    }

    /// The endpoint's block fence, once `register_kv_caches` made one.
    fn fence(&self) -> Option<Rc<BlockFence>> {
        match self.msgr.transport.as_deref() {
            Some(AnyTransport::Tcp(tcp)) => tcp.fence(),
            // Their targets' bytes move without this node's CPU seeing them
            // (local: the initiator's memcpy; Mooncake: one-sided RDMA).
            Some(AnyTransport::Local(_) | AnyTransport::Mooncake(_)) | None => None,
        }
    }

    /// Opens this node's `blocks` of `tid` in the block fence: the data
    /// plane may touch them until the transfer is reported terminal.
    fn open_blocks(&mut self, tid: TransferId, blocks: &BlockLists) {
        let Some(fence) = self.fence() else {
            return;
        };
        let pools = self.shared.local.get().map_or(0, |l| l.layout.pools.len());
        let keys = fence_keys(blocks, pools);
        fence.open(keys.clone());
        self.opened.entry(tid).or_default().extend(keys);
    }

    /// Posts `events` to the machine from a local task (`execute` cannot wait).
    fn post_later(&self, tid: TransferId, events: Vec<duplex::Event>) {
        let poster = self.poster.clone();
        glommio::spawn_local(async move {
            for e in events {
                let _ = poster.post(tid, e).await;
            }
        })
        .detach();
    }

    /// Plans `src` (P's blocks) → `dst` (D's blocks) against `peer` and
    /// moves the bytes in direction `op`; `done(ok)` is the completion event
    /// and `plan_failed` the verdict when the planner refuses. `uncarried`
    /// is set for a write whose `Status` is to ride it (`status_after` of
    /// `send::Action::Write`): it tells the machine, before `done(true)`,
    /// that the write landed without its `Status`, so the machine sends it
    /// itself.
    fn start_transfer(
        &mut self,
        tid: TransferId,
        job: Job<'_>,
        done: impl FnOnce(bool) -> duplex::Event + 'static,
        plan_failed: duplex::Event,
        uncarried: Option<duplex::Event>,
    ) {
        let Job { peer, src, dst, op } = job;
        let planned = match self.admit(tid, peer, src, dst, op) {
            Ok(p) => p,
            Err(NotStarted::Unplanned) => {
                self.post_later(tid, vec![plan_failed, done(false)]);
                return;
            }
            Err(NotStarted::Refused) => {
                self.post_later(tid, vec![done(false)]);
                return;
            }
        };
        let bytes: u64 = planned.descs.iter().map(|d| d.len_bytes).sum();
        let count = planned.descs.len() as u64;
        let poster = self.poster.clone();
        let shared = self.shared.clone();
        let (note, uncarried) = self.status_rider(tid, &planned.endpoint, uncarried);
        let mv = self.move_of(planned, op, note, bytes);
        let (sessions, to) = (mv.sessions.clone(), mv.endpoint);
        glommio::spawn_local(async move {
            let result = mv.run().await;
            if result.as_ref().is_err_and(MoveError::is_connection_loss) {
                shared.to_bridge(BridgeCmd::PeerUnreachable { peer: peer.0 });
            }
            if result.is_ok() && uses_shm(&sessions, &to) {
                let c = &shared.counters;
                c.shm_bytes.fetch_add(bytes, Ordering::Relaxed);
            }
            let ok = count_move(&shared, &poster, tid, result, uncarried, bytes, count).await;
            let _ = poster.post(tid, done(ok)).await;
        })
        .detach();
    }

    /// The `Status` frame to ride the write of `tid` when one is to
    /// (`uncarried` is set; see `status_note`), and `uncarried` for the
    /// move to post if the bytes land without it.
    fn status_rider(
        &self,
        tid: TransferId,
        endpoint: &EndpointAddr,
        uncarried: Option<duplex::Event>,
    ) -> (Option<Vec<u8>>, Option<duplex::Event>) {
        let note = self.status_note(tid, endpoint, uncarried.is_some());
        // Fault injection: the `Status` rides nowhere, and the machine,
        // told it was carried, does not send it either: it is lost.
        if note.is_some() && self.shared.drops_control() {
            let c = &self.shared.counters;
            c.dropped_trailer.fetch_add(1, Ordering::Relaxed);
            return (None, None);
        }
        (note, uncarried)
    }

    /// The `Move` of `planned` (`bytes` in all), `note` riding its write;
    /// its deadline counts from now, when the machine's op was posted,
    /// not from when its task first runs.
    fn move_of(&self, planned: Planned, op: Op, note: Option<Vec<u8>>, bytes: u64) -> Move {
        let Planned {
            transport,
            endpoint,
            descs,
            batches,
        } = planned;
        let coalesce = transport.coalesce_small_batches()
            && batches.len() == 1
            && descs.len() <= COALESCE_MAX_DESCS
            && bytes <= COALESCE_MAX_BYTES;
        Move {
            transport,
            sessions: self.msgr.sessions.clone(),
            lanes: self.lanes.clone(),
            msgr: self.msgr.clone(),
            endpoint,
            op,
            descs,
            batches,
            note,
            coalesce,
            deadline: Instant::now() + self.shared.config.timeouts.transfer_bound,
        }
    }

    /// The closing `Status` of `tid` as the frame to ride its write, when
    /// the write is to carry it (`status_after`) and the peer takes
    /// data-plane messages; the D node learns the KV landed without
    /// waiting for this node to hear the write's acknowledgement.
    fn status_note(
        &self,
        tid: TransferId,
        endpoint: &EndpointAddr,
        status_after: bool,
    ) -> Option<Vec<u8>> {
        let status = Msg::Status { ok: true };
        (status_after && self.msgr.may_carry(endpoint, &status)).then(|| {
            wire::encode(&Frame::Transfer {
                transfer_id: tid,
                msg: status,
            })
        })
    }

    /// Plans `src` → `dst` against `peer` and takes a data-plane session
    /// slot for it; logs why when it cannot.
    fn admit(
        &mut self,
        tid: TransferId,
        peer: PeerId,
        src: &BlockLists,
        dst: &BlockLists,
        op: Op,
    ) -> Result<Planned, NotStarted> {
        let (endpoint, descs, batches) = match self.plan_descs(peer, src, dst, op) {
            Ok(p) => p,
            Err(why) => {
                tracing::warn!(?tid, ?peer, %why, "transfer not planned");
                return Err(NotStarted::Unplanned);
            }
        };
        let Some(transport) = self.msgr.transport.clone() else {
            return Err(NotStarted::Refused);
        };
        let max = self.shared.config.max_data_sessions;
        if let Err(why) = make_room(&self.msgr.sessions, &endpoint, max) {
            tracing::warn!(?tid, %why, "transfer not started");
            let c = &self.shared.counters;
            c.limit_hits.fetch_add(1, Ordering::Relaxed);
            return Err(NotStarted::Refused);
        }
        Ok(Planned {
            transport,
            endpoint,
            descs,
            batches,
        })
    }

    /// Mooncake: hands the transport the memory `data`'s hello announced
    /// for `endpoint`, once per hello.
    fn teach_peer(&mut self, endpoint: EndpointAddr, data: &Arc<super::tables::PeerData>) {
        let Some(AnyTransport::Mooncake(mc)) = self.msgr.transport.as_deref() else {
            return;
        };
        if self
            .taught
            .get(&endpoint)
            .is_some_and(|t| Arc::ptr_eq(t, data))
        {
            return;
        }
        if self.taught.len() >= self.shared.config.max_data_sessions {
            self.taught.clear();
            mc.forget_peers();
        }
        mc.learn_peer(&endpoint, registered_ranges(&data.hello.layout));
        self.taught.insert(endpoint, data.clone());
    }

    #[allow(clippy::type_complexity)]
    fn plan_descs(
        &mut self,
        peer: PeerId,
        src: &BlockLists,
        dst: &BlockLists,
        op: Op,
    ) -> Result<(EndpointAddr, Vec<Desc>, Vec<Range<usize>>), MoveError> {
        let data = self.shared.peer(peer.0).ok_or(MoveError::UnknownPeer)?;
        let pair = data
            .pair
            .as_ref()
            .map_err(|e| MoveError::Unfit(e.clone()))?;
        let endpoint = data.endpoint.ok_or(MoveError::NoEndpoint)?;
        self.teach_peer(endpoint, &data);
        fill_u64(&mut self.src, src);
        fill_u64(&mut self.dst, dst);
        pair.plan_into(
            &self.src,
            &self.dst,
            &self.shared.config.batch_limits,
            &mut self.plan,
        )?;
        let descs = self
            .plan
            .descriptors
            .iter()
            .map(|d| match op {
                Op::Write => Desc {
                    local_addr: d.src,
                    remote_addr: d.dst,
                    len_bytes: d.len,
                },
                Op::Read => Desc {
                    local_addr: d.dst,
                    remote_addr: d.src,
                    len_bytes: d.len,
                },
            })
            .collect();
        let batches = self.plan.batches.iter().map(|b| b.range()).collect();
        Ok((endpoint, descs, batches))
    }

    fn report(&mut self, tid: TransferId, direction: Direction, phase: Phase, now: Instant) {
        if !phase.is_terminal() {
            // The first report comes when the machine is inserted.
            self.started.borrow_mut().entry(tid).or_insert(now);
            return;
        }
        // The blocks go back to the engine now: close them before anything
        // else runs on this executor, so no byte moves in or out of them
        // from here on, whatever is still in flight.
        if let Some(ids) = self.opened.remove(&tid) {
            if let Some(f) = self.fence() {
                f.close(ids);
            }
        }
        let since = self.started.borrow_mut().remove(&tid).unwrap_or(now);
        let latency = now.saturating_duration_since(since);
        let written = self.written.remove(&tid);
        self.shared
            .on_terminal(tid, direction, phase, latency, written);
    }
}

/// The fence keys of a request's block lists: the KV groups' block ids,
/// then one list of item indices per pool of the layout (the last `pools`
/// lists, in the layout's order).
fn fence_keys(lists: &BlockLists, pools: usize) -> impl Iterator<Item = FenceKey> + Clone + '_ {
    let kv = lists.len().saturating_sub(pools);
    lists.iter().enumerate().flat_map(move |(i, list)| {
        list.iter().map(move |b| match i.checked_sub(kv) {
            None => FenceKey::Block(b.0),
            Some(pool) => FenceKey::Item {
                pool: pool as u32,
                index: b.0,
            },
        })
    })
}

fn fill_u64(out: &mut Vec<Vec<u64>>, lists: &BlockLists) {
    out.resize_with(lists.len(), Vec::new);
    for (o, l) in out.iter_mut().zip(lists) {
        o.clear();
        o.extend(l.iter().map(|b| u64::from(b.0)));
    }
}

/// Prefill side: the actions of send machines.
impl Sink {
    /// Adds `dst_blocks`, about to be written to `peer`, to what `tid`
    /// wrote to it.
    fn note_written(&mut self, tid: TransferId, peer: PeerId, dst_blocks: &BlockLists) {
        let fp = blocks_fingerprint(peer, dst_blocks);
        self.written.entry(tid).or_default().add(peer, fp);
    }

    fn send_from_p(&mut self, tid: TransferId, peer: PeerId, msg: Msg, resent: bool) {
        // Pull mode: D ranks read these blocks from our endpoint (opened
        // once: a resent `Ready` names blocks its first sending opened).
        if let (Msg::Ready { src_blocks, .. }, false) = (&msg, resent) {
            self.open_blocks(tid, src_blocks);
        }
        self.msgr.send_msg(tid, peer, msg, resent)
    }

    fn execute_send(&mut self, tid: TransferId, action: send::Action) {
        match action {
            send::Action::Send { peer, msg } => self.send_from_p(tid, peer, msg, false),
            send::Action::Resend { peer, msg } => self.send_from_p(tid, peer, msg, true),
            send::Action::Write {
                peer,
                chunk,
                src_blocks,
                dst_blocks,
                status_after,
            } => {
                self.open_blocks(tid, &src_blocks);
                self.note_written(tid, peer, &dst_blocks);
                let sent = duplex::Event::Send;
                self.start_transfer(
                    tid,
                    Job {
                        peer,
                        src: &src_blocks,
                        dst: &dst_blocks,
                        op: Op::Write,
                    },
                    move |ok| sent(send::Event::WriteDone { peer, chunk, ok }),
                    sent(send::Event::PlanFailed { peer }),
                    status_after.then(|| sent(send::Event::StatusNotCarried { peer })),
                )
            }
            // The phase turns terminal in the same call; `on_phase` reports it.
            send::Action::ReleaseBlocks { .. } => {}
        }
    }
}

/// Decode side: the actions of receive machines.
impl Sink {
    fn send_from_d(&mut self, tid: TransferId, peer: PeerId, msg: Msg, resent: bool) {
        // Push mode: P ranks write these blocks through our endpoint.
        if let Msg::Pull { dst_blocks, .. } = &msg {
            if !self.opened.contains_key(&tid) {
                self.open_blocks(tid, dst_blocks);
            }
        }
        self.msgr.send_msg(tid, peer, msg, resent)
    }

    fn execute_recv(&mut self, tid: TransferId, action: recv::Action) {
        match action {
            recv::Action::Send { peer, msg } => self.send_from_d(tid, peer, msg, false),
            recv::Action::Resend { peer, msg } => self.send_from_d(tid, peer, msg, true),
            recv::Action::Read {
                peer,
                chunk,
                src_blocks,
                dst_blocks,
            } => {
                self.open_blocks(tid, &dst_blocks);
                let got = duplex::Event::Recv;
                self.start_transfer(
                    tid,
                    Job {
                        peer,
                        src: &src_blocks,
                        dst: &dst_blocks,
                        op: Op::Read,
                    },
                    move |ok| got(recv::Event::ReadDone { peer, chunk, ok }),
                    got(recv::Event::PlanFailed { peer }),
                    None,
                )
            }
            recv::Action::Received => {}
            recv::Action::LoadFailed { block_ids } => self.shared.add_load_errors(&block_ids),
        }
    }
}

impl ActionSink<Duplex> for Sink {
    fn execute(&mut self, tid: TransferId, action: duplex::Action) {
        match action {
            duplex::Action::Send(a) => self.execute_send(tid, a),
            duplex::Action::Recv(a) => self.execute_recv(tid, a),
        }
    }

    fn on_phase(&mut self, tid: TransferId, machine: &Duplex, phase: Phase, now: Instant) {
        self.report(tid, machine.direction(), phase, now);
    }

    fn on_published(&mut self, tid: TransferId, phase: Phase) {
        self.shared.on_published(tid, phase);
    }

    /// A peer's message whose machine ended before it was handed over (an
    /// engine's abort overtook decode's first `Pull`, say): the bridge
    /// answers it as it answers any message for an ended transfer, so the
    /// peer is told now rather than at its deadline.
    fn on_late_event(&mut self, tid: TransferId, event: duplex::Event) {
        let (duplex::Event::Send(send::Event::Msg { peer, msg })
        | duplex::Event::Recv(recv::Event::Msg { peer, msg })) = event
        else {
            return;
        };
        self.shared.to_bridge(BridgeCmd::Inbound {
            peer: peer.0,
            tid,
            msg,
        });
    }
}
