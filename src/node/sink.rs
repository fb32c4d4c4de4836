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

use kvferry_machines::common::{BlockLists, Msg, PeerId, TICKET_BIT};
use kvferry_machines::planner::Plan;
use kvferry_machines::recv::RecvMachine;
use kvferry_machines::send::SendMachine;
use kvferry_machines::{recv, send, Machine, Phase, TransferId};
use kvferry_reactor::{ActionSink, EventPoster};

use super::bridge::BridgeCmd;
use super::{DataPlaneError, Shared, TransportKind};
use crate::transport::fence::BlockFence;
use crate::transport::local::LocalTransport;
use crate::transport::tcp::{TcpConfig, TcpTransport};
use crate::transport::wire::RejectReason;
use crate::transport::{
    AnySession, AnyTransport, Desc, EndpointAddr, Op, PeerError, Session, Transport, TransportError,
};
use kvferry_machines::wire::{self, Frame};

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
    /// False only when a self-test switched the machines' own protection
    /// off to show what it catches; the block fence would hide that.
    pub fenced: bool,
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
        tcp.set_fence(Some(Rc::new(BlockFence::new(&kv.regions, kv.num_blocks))));
    }
    for &(base, block_len) in &kv.regions {
        // `register_kv_caches` checked that the product fits in 64 bits.
        let len = kv.num_blocks.saturating_mul(block_len);
        let len = usize::try_from(len).map_err(|_| DataPlaneError::RegionTooLong)?;
        // SAFETY: forwarded from `Node::register_kv_caches`, whose caller
        // promised the memory stays valid and shareable with peers.
        unsafe { t.register(base as usize as *mut u8, len) }?;
    }
    Ok(())
}

/// One slot per peer endpoint; its async lock makes concurrent first
/// transfers share one `open` instead of racing thousands of connections.
type SessionSlot = Rc<futures::lock::Mutex<Option<Rc<AnySession>>>>;
/// One chunk to move: P's blocks `src` to D's blocks `dst` of `peer`, in
/// direction `op` as seen from this side.
struct Job<'a> {
    peer: PeerId,
    src: &'a BlockLists,
    dst: &'a BlockLists,
    op: Op,
    /// Push mode: deliver `Status{ok: true}` to the peer once the write
    /// landed (see `send::Action::Write`).
    status_after: bool,
}

type Sessions = Rc<RefCell<HashMap<EndpointAddr, SessionSlot>>>;

/// What the sink needs to know of each machine type.
pub(crate) trait NodeMachine: Machine {
    /// The event that hands `peer`'s message to a live machine of this
    /// executor, as the bridge would.
    fn inbound(shared: &Shared, peer: PeerId, msg: Msg) -> Self::Event;
}

impl NodeMachine for SendMachine {
    fn inbound(shared: &Shared, peer: PeerId, msg: Msg) -> send::Event {
        match msg {
            Msg::LeaseGrant { seq, duration_ms } if seq & TICKET_BIT != 0 => {
                shared.ticket_event(peer.0, seq & !TICKET_BIT, duration_ms)
            }
            msg => send::Event::Msg { peer, msg },
        }
    }
}

impl NodeMachine for RecvMachine {
    fn inbound(_: &Shared, peer: PeerId, msg: Msg) -> recv::Event {
        recv::Event::Msg { peer, msg }
    }
}

/// Whether `msg` may travel over a data-plane session to its peer instead
/// of the side channel. Those are the messages on the critical path of a
/// request: push mode's `Pull` with its lease ticket and `Status`, pull
/// mode's `Pull`, `Ready` and closing `Done`. On loopback each saves about
/// five thread hand-offs (executor, bridge, two ZeroMQ I/O threads, bridge,
/// executor); a small pull-mode request took 0.43 ms at p50 with its `Ready`
/// over ZeroMQ and 0.36 ms without (0.29 and 0.18 ms on one core).
///
/// The others stay on the side channel because of ordering: the bridge
/// answers a `Ready`, `LeaseRequest` or `Pull` for a transfer that already
/// ended with an `Abort` after flushing the machine's own last words from
/// its queue, and that flush cannot see a notification still on its way,
/// so a machine's last words must not be able to trail a message that
/// draws such an answer. A `Status` or `Done` is the sender's last word;
/// after it, its peer sends nothing that draws an `Abort` (push-mode D
/// sends no `LeaseRequest`, pull-mode P sends no `Ready` after D is done).
/// The rule constrains the channel of last words, not of the message that
/// draws the answer: a `Ready` is never a last word, and the `Abort` a late
/// `Ready` draws takes the side channel whichever way the `Ready` came. A
/// `Ready` overtaken by a later `Abort` from P finds D's machine ended and
/// draws an `Abort` that P's ended machine ignores; D reads nothing for it,
/// and a read that raced the abort is refused by P's block fence anyway.
fn over_data_plane(msg: &Msg) -> bool {
    match msg {
        Msg::Status { .. }
        | Msg::Done { .. }
        | Msg::Pull { .. }
        | Msg::LeaseGrant { .. }
        | Msg::Ready { .. } => true,
        Msg::LeaseRequest { .. } | Msg::Abort | Msg::AbortAck => false,
    }
}

/// Side-channel frames waiting for a data-plane notification, per peer
/// endpoint: (peer slot, transfer, encoded frame).
#[derive(Default)]
struct NoteLane {
    queue: Vec<(PeerId, TransferId, Vec<u8>)>,
    pumping: bool,
}

type NoteLanes = Rc<RefCell<HashMap<EndpointAddr, NoteLane>>>;
/// Peer endpoints that refused a data-plane notification (their node has
/// `data_plane_messages` off, or does not know us by that endpoint): their
/// messages take the side channel from then on.
type Refusing = Rc<RefCell<std::collections::HashSet<EndpointAddr>>>;

/// Sends the machines' side-channel messages, over the data plane where
/// they may. Cheap to clone into the task that delivers a write's closing
/// `Status` when the write could not carry it.
#[derive(Clone)]
struct Messenger {
    shared: Arc<Shared>,
    transport: Option<Rc<AnyTransport>>,
    sessions: Sessions,
    /// Frames waiting to go over the data plane, per peer endpoint.
    notes: NoteLanes,
    refusing: Refusing,
}

impl Messenger {
    /// This node's data-plane endpoint, as notifications name their sender.
    fn sender(&self) -> String {
        self.shared.endpoint.get().cloned().unwrap_or_default()
    }

    fn send_frame(&self, tid: TransferId, peer: PeerId, msg: Msg) {
        let bytes = wire::encode(&Frame::Transfer {
            transfer_id: tid,
            msg,
        });
        self.shared.to_bridge(BridgeCmd::Send {
            peer: peer.0,
            tid: Some(tid),
            bytes,
        });
    }

    /// Sends `msg` over the data-plane session of `peer` when it may
    /// ([`over_data_plane`]) and one is open, else over the side channel
    /// (and then opens a session in the background for the next ones).
    fn send_msg(&self, tid: TransferId, peer: PeerId, msg: Msg) {
        let Some(endpoint) = self.data_plane_endpoint(peer, &msg) else {
            return self.send_frame(tid, peer, msg);
        };
        let open = self
            .sessions
            .borrow()
            .get(&endpoint)
            .and_then(|slot| slot.try_lock().map(|g| g.is_some()));
        match open {
            Some(true) => {}
            Some(false) => return self.send_frame(tid, peer, msg),
            None => {
                self.open_session(endpoint);
                return self.send_frame(tid, peer, msg);
            }
        }
        self.shared.track(peer.0, tid);
        let bytes = wire::encode(&Frame::Transfer {
            transfer_id: tid,
            msg,
        });
        let start = {
            let mut notes = self.notes.borrow_mut();
            let lane = notes.entry(endpoint).or_default();
            lane.queue.push((peer, tid, bytes));
            !std::mem::replace(&mut lane.pumping, true)
        };
        if start {
            glommio::spawn_local(pump_notes(endpoint, self.clone())).detach();
        }
    }

    /// The endpoint of `peer`'s node when `msg` may go to it over the data
    /// plane (see [`Messenger::may_carry`]).
    fn data_plane_endpoint(&self, peer: PeerId, msg: &Msg) -> Option<EndpointAddr> {
        if !self.carries(msg) {
            return None;
        }
        self.shared
            .peer(peer.0)
            .and_then(|d| d.endpoint)
            .filter(|e| !self.refusing.borrow().contains(e))
    }

    /// Whether `msg` may go over the data plane to the node at `endpoint`:
    /// [`Messenger::carries`] it, and that node did not refuse.
    fn may_carry(&self, endpoint: &EndpointAddr, msg: &Msg) -> bool {
        self.carries(msg) && !self.refusing.borrow().contains(endpoint)
    }

    /// Whether this node sends `msg` over the data plane at all: tcp,
    /// data-plane messages on, and [`over_data_plane`].
    fn carries(&self, msg: &Msg) -> bool {
        self.shared.config.data_plane_messages
            && over_data_plane(msg)
            && matches!(self.transport.as_deref(), Some(AnyTransport::Tcp(_)))
    }

    /// Opens a session to `endpoint` in the background, unless one is open
    /// or opening; a failure is only logged (the side channel still works).
    fn open_session(&self, endpoint: EndpointAddr) {
        let (Some(transport), Ok(())) = (
            self.transport.clone(),
            make_room(
                &self.sessions,
                &endpoint,
                self.shared.config.max_data_sessions,
            ),
        ) else {
            return;
        };
        let slot = self
            .sessions
            .borrow_mut()
            .entry(endpoint)
            .or_default()
            .clone();
        glommio::spawn_local(async move {
            let mut guard = slot.lock().await;
            if guard.is_none() {
                match transport.open(&endpoint).await {
                    Ok(s) => *guard = Some(Rc::new(s)),
                    Err(e) => tracing::debug!(%endpoint, %e, "no data-plane session for messages"),
                }
            }
        })
        .detach();
    }
}

/// The node's action sink, for either machine type.
pub(crate) struct Sink<M: Machine> {
    shared: Arc<Shared>,
    poster: EventPoster<M>,
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
    /// Local blocks each live transfer opened in the block fence; closed in
    /// the turn that reports the transfer terminal.
    opened: HashMap<TransferId, Vec<u32>>,
}

type Live = Rc<RefCell<HashMap<TransferId, Instant>>>;

impl<M: Machine> Drop for Sink<M> {
    fn drop(&mut self) {
        let id = self.shared.node_id;
        TRANSPORTS.with(|m| m.borrow_mut().remove(&id));
    }
}

impl<M: NodeMachine + 'static> Sink<M>
where
    M::Event: 'static,
{
    /// Builds the sink and the node's transport endpoint on the executor;
    /// reports the endpoint address (or why it failed) on `ready`.
    pub(crate) fn new(
        shared: Arc<Shared>,
        poster: EventPoster<M>,
        ready: flume::Sender<Result<String, DataPlaneError>>,
    ) -> Self {
        let made = match shared.config.transport {
            TransportKind::Local => Ok(AnyTransport::Local(LocalTransport::default())),
            TransportKind::Tcp => {
                let bound = shared.config.timeouts.transfer_bound;
                let config = TcpConfig {
                    batch_timeout: bound.max(std::time::Duration::from_millis(1)),
                    poll: shared.config.tcp_poll,
                    ..TcpConfig::default()
                };
                format!("{}:0", shared.config.host)
                    .parse()
                    .map_err(|source| DataPlaneError::BadHost {
                        host: shared.config.host.clone(),
                        source,
                    })
                    .and_then(|addr| Ok(TcpTransport::bind(addr, config)?))
                    .map(AnyTransport::Tcp)
            }
        };
        let started: Live = Rc::new(RefCell::new(HashMap::new()));
        let transport = match made {
            Ok(t) => {
                if let (AnyTransport::Tcp(tcp), true) = (&t, shared.config.data_plane_messages) {
                    tcp.set_notify_handler(Some(notify_handler::<M>(
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
        }
    }

    /// The endpoint's block fence, once `register_kv_caches` made one.
    fn fence(&self) -> Option<Rc<BlockFence>> {
        match self.msgr.transport.as_deref() {
            Some(AnyTransport::Tcp(tcp)) => tcp.fence(),
            Some(AnyTransport::Local(_)) | None => None,
        }
    }

    /// Opens this node's `blocks` of `tid` in the block fence: the data
    /// plane may touch them until the transfer is reported terminal.
    fn open_blocks(&mut self, tid: TransferId, blocks: &BlockLists) {
        let Some(fence) = self.fence() else {
            return;
        };
        let ids = blocks.iter().flatten().map(|b| b.0);
        fence.open(ids.clone());
        self.opened.entry(tid).or_default().extend(ids);
    }

    /// Posts `events` to the machine from a local task (`execute` cannot wait).
    fn post_later(&self, tid: TransferId, events: Vec<M::Event>) {
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
    /// and `plan_failed` the verdict when the planner refuses. For a write
    /// whose `Status` was to ride it (`status_after`), `uncarried` tells the
    /// machine, before `done(true)`, that it landed without its `Status`, so
    /// the machine sends it itself.
    fn start_transfer(
        &mut self,
        tid: TransferId,
        job: Job<'_>,
        done: impl FnOnce(bool) -> M::Event + 'static,
        plan_failed: M::Event,
        uncarried: Option<M::Event>,
    ) {
        let Job {
            peer,
            src,
            dst,
            op,
            status_after,
        } = job;
        let planned = self.plan_descs(peer, src, dst, op);
        let (endpoint, descs, batches) = match planned {
            Ok(p) => p,
            Err(why) => {
                tracing::warn!(?tid, ?peer, %why, "transfer not planned");
                self.post_later(tid, vec![plan_failed, done(false)]);
                return;
            }
        };
        let Some(transport) = self.msgr.transport.clone() else {
            self.post_later(tid, vec![done(false)]);
            return;
        };
        let bytes: u64 = descs.iter().map(|d| d.len_bytes).sum();
        let count = descs.len() as u64;
        let sessions = self.msgr.sessions.clone();
        let poster = self.poster.clone();
        let shared = self.shared.clone();
        let bound = shared.config.timeouts.transfer_bound;
        if let Err(why) = make_room(&sessions, &endpoint, shared.config.max_data_sessions) {
            tracing::warn!(?tid, %why, "transfer not started");
            shared.counters.limit_hits.fetch_add(1, Ordering::Relaxed);
            self.post_later(tid, vec![done(false)]);
            return;
        }
        let lanes = self.lanes.clone();
        // The closing `Status` rides the write when the peer takes
        // data-plane messages; the D node learns the KV landed without
        // waiting for this node to hear the write's acknowledgement.
        let status = Msg::Status { ok: true };
        let note = (status_after && self.msgr.may_carry(&endpoint, &status)).then(|| {
            wire::encode(&Frame::Transfer {
                transfer_id: tid,
                msg: status,
            })
        });
        let msgr = self.msgr.clone();
        let coalesce = transport.coalesce_small_batches()
            && batches.len() == 1
            && descs.len() <= COALESCE_MAX_DESCS
            && bytes <= COALESCE_MAX_BYTES;
        // Counted from now, when the machine's op was posted, not from when
        // the task first runs.
        let deadline = Instant::now() + bound;
        glommio::spawn_local(async move {
            let result = if descs.is_empty() {
                Ok(false)
            } else if coalesce {
                let io = Io {
                    transport,
                    sessions,
                    lanes,
                    sender: msgr.sender(),
                };
                io.queue(endpoint, op, descs, note, deadline).await
            } else {
                let trailer = note.map(|f| wire::encode_notify(&msgr.sender(), [&f[..]]));
                let route = Route {
                    transport: &transport,
                    sessions: &sessions,
                    endpoint,
                };
                route
                    .move_bytes(op, &descs, &batches, trailer.as_deref(), deadline)
                    .await
            };
            let ok = match result {
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
            };
            let _ = poster.post(tid, done(ok)).await;
        })
        .detach();
    }

    #[allow(clippy::type_complexity)]
    fn plan_descs(
        &mut self,
        peer: PeerId,
        src: &BlockLists,
        dst: &BlockLists,
        op: Op,
    ) -> Result<(EndpointAddr, Vec<Desc>, Vec<Range<usize>>), String> {
        let data = self.shared.peer(peer.0).ok_or("peer unknown (no hello)")?;
        let pair = data.pair.as_ref().map_err(|e| e.to_string())?;
        let endpoint = data.endpoint.ok_or("peer endpoint unusable")?;
        fill_u64(&mut self.src, src);
        fill_u64(&mut self.dst, dst);
        pair.plan_into(
            &self.src,
            &self.dst,
            &self.shared.config.batch_limits,
            &mut self.plan,
        )
        .map_err(|e| e.to_string())?;
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

    fn report(&mut self, tid: TransferId, phase: Phase, now: Instant) {
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
        self.shared
            .on_terminal(tid, phase, now.saturating_duration_since(since));
    }
}

fn fill_u64(out: &mut Vec<Vec<u64>>, lists: &BlockLists) {
    out.resize_with(lists.len(), Vec::new);
    for (o, l) in out.iter_mut().zip(lists) {
        o.clear();
        o.extend(l.iter().map(|b| u64::from(b.0)));
    }
}

/// A transfer at most this many descriptors long (and one planner batch)
/// may share a data-plane batch with others to the same peer.
const COALESCE_MAX_DESCS: usize = 256;
/// ... and at most this many bytes.
const COALESCE_MAX_BYTES: u64 = 256 << 10;
/// Most descriptors in one shared batch.
const SHARED_BATCH_MAX_DESCS: usize = 4096;
/// Most bytes in one shared batch.
const SHARED_BATCH_MAX_BYTES: u64 = 4 << 20;
/// Shared batches in flight per peer: one per TCP stream of the session.
const PUMPS_PER_LANE: usize = 2;

/// Small transfers to one peer, waiting for a shared batch. A TCP stream
/// carries one batch per round trip, so with hundreds of small requests in
/// flight one batch per request capped the rate at a few thousand per
/// second; a pump instead takes everything queued (in arrival order, so no
/// request starves) and moves it as one batch.
#[derive(Default)]
struct Lane {
    queue: VecDeque<Queued>,
    /// Pump tasks running for this lane (at most [`PUMPS_PER_LANE`]).
    pumps: usize,
}

/// One small transfer in a lane.
struct Queued {
    op: Op,
    descs: Vec<Desc>,
    /// When the op was posted plus the transfer bound: no byte of it may
    /// move after this.
    deadline: Instant,
    /// The encoded side-channel frame to deliver behind the batch once it
    /// landed (a write's closing `Status`).
    note: Option<Vec<u8>>,
    /// `Ok(true)` when the note was delivered.
    done: futures::channel::oneshot::Sender<Result<bool, String>>,
}

type Lanes = Rc<RefCell<HashMap<EndpointAddr, Lane>>>;

/// What a shared batch needs to run.
struct Io {
    transport: Rc<AnyTransport>,
    sessions: Sessions,
    lanes: Lanes,
    /// This node's data-plane endpoint (see [`Messenger::sender`]).
    sender: String,
}

impl Io {
    /// Queues a small transfer on the lane of `endpoint` and waits for the
    /// shared batch that carries it.
    async fn queue(
        self,
        endpoint: EndpointAddr,
        op: Op,
        descs: Vec<Desc>,
        note: Option<Vec<u8>>,
        deadline: Instant,
    ) -> Result<bool, String> {
        let (done, answer) = futures::channel::oneshot::channel();
        let start_pump = {
            let mut lanes = self.lanes.borrow_mut();
            let lane = lanes.entry(endpoint).or_default();
            lane.queue.push_back(Queued {
                op,
                descs,
                deadline,
                note,
                done,
            });
            let start = lane.pumps < PUMPS_PER_LANE;
            if start {
                lane.pumps += 1;
            }
            start
        };
        if start_pump {
            let io = Io {
                transport: self.transport.clone(),
                sessions: self.sessions.clone(),
                lanes: self.lanes.clone(),
                sender: self.sender.clone(),
            };
            glommio::spawn_local(io.pump(endpoint)).detach();
        }
        answer
            .await
            .unwrap_or_else(|_| Err("the shared batch was dropped".to_string()))
    }

    /// Moves what the lane holds, batch after batch, until it is empty.
    async fn pump(self, endpoint: EndpointAddr) {
        loop {
            let jobs = self.take(endpoint);
            if jobs.is_empty() {
                return;
            }
            let now = Instant::now();
            let (live, late): (Vec<Queued>, Vec<Queued>) =
                jobs.into_iter().partition(|j| now < j.deadline);
            for j in late {
                // Never started: no byte of it moved.
                let _ = j
                    .done
                    .send(Err("waited past the transfer bound for a batch".to_string()));
            }
            let Some(first) = live.first() else { continue };
            let op = first.op;
            // The whole batch stops at the earliest deadline of its parts,
            // so no part touches memory past its own bound.
            let deadline = live.iter().map(|j| j.deadline).min().unwrap_or(now);
            let descs: Vec<Desc> = live.iter().flat_map(|j| j.descs.iter().copied()).collect();
            let whole = std::iter::once(0..descs.len()).collect::<Vec<_>>();
            let notes: Vec<&[u8]> = live.iter().filter_map(|j| j.note.as_deref()).collect();
            let trailer = (!notes.is_empty()).then(|| wire::encode_notify(&self.sender, notes));
            let route = Route {
                transport: &self.transport,
                sessions: &self.sessions,
                endpoint,
            };
            let result = route
                .move_bytes(op, &descs, &whole, trailer.as_deref(), deadline)
                .await;
            for j in live {
                let answer = result.clone().map(|d| d && j.note.is_some());
                let _ = j.done.send(answer);
            }
        }
    }

    /// Takes the next shared batch off the lane: queued transfers in order,
    /// of one direction, within the batch bounds. An empty result retires
    /// this pump (and the lane, when it was the last one).
    fn take(&self, endpoint: EndpointAddr) -> Vec<Queued> {
        let mut lanes = self.lanes.borrow_mut();
        let Some(lane) = lanes.get_mut(&endpoint) else {
            return Vec::new();
        };
        let mut jobs: Vec<Queued> = Vec::new();
        let (mut n, mut bytes) = (0usize, 0u64);
        // The notes share one notification, within its bounds.
        let (mut notes, mut note_bytes) = (0usize, wire::notify_endpoint_len(&self.sender));
        while let Some(next) = lane.queue.front() {
            let len: u64 = next.descs.iter().map(|d| d.len_bytes).sum();
            let note_len = next.note.as_deref().map_or(0, wire::notify_frame_len);
            let notes_fit = next.note.is_none()
                || (notes < wire::MAX_NOTIFY_FRAMES
                    && note_bytes + note_len <= crate::transport::wire::MAX_NOTIFY_BYTES);
            let fits = jobs.is_empty()
                || (jobs[0].op == next.op
                    && n + next.descs.len() <= SHARED_BATCH_MAX_DESCS
                    && bytes + len <= SHARED_BATCH_MAX_BYTES
                    && notes_fit);
            if !fits {
                break;
            }
            n += next.descs.len();
            bytes += len;
            notes += usize::from(next.note.is_some());
            note_bytes += note_len;
            jobs.extend(lane.queue.pop_front());
        }
        if jobs.is_empty() {
            lane.pumps = lane.pumps.saturating_sub(1);
            if lane.pumps == 0 {
                lanes.remove(&endpoint);
            }
        }
        jobs
    }
}

/// Sends what the note lane of `endpoint` holds, one notification per
/// turn (everything queued meanwhile shares the next), until it is empty.
/// Whatever the peer did not take goes over the side channel instead.
async fn pump_notes(endpoint: EndpointAddr, msgr: Messenger) {
    let Messenger {
        shared,
        sessions,
        notes,
        refusing,
        ..
    } = &msgr;
    let sender = msgr.sender();
    loop {
        // Let the executor finish its turn first: a machine's messages of
        // one step (a `Pull` and its lease ticket) then share a frame.
        futures_lite::future::yield_now().await;
        let batch = {
            let mut map = notes.borrow_mut();
            let Some(lane) = map.get_mut(&endpoint) else {
                return;
            };
            if lane.queue.is_empty() {
                map.remove(&endpoint);
                return;
            }
            let mut bytes = wire::notify_endpoint_len(&sender);
            let n = lane
                .queue
                .iter()
                .take(wire::MAX_NOTIFY_FRAMES)
                .take_while(|(_, _, f)| {
                    bytes += wire::notify_frame_len(f);
                    bytes <= crate::transport::wire::MAX_NOTIFY_BYTES
                })
                .count()
                .max(1);
            lane.queue.drain(..n).collect::<Vec<_>>()
        };
        let slot = sessions.borrow().get(&endpoint).cloned();
        let session = match slot {
            Some(slot) => slot.lock().await.clone(),
            None => None,
        };
        let sent = match session.as_deref() {
            Some(AnySession::Tcp(s)) => {
                let payload = wire::encode_notify(&sender, batch.iter().map(|(_, _, f)| &f[..]));
                match s.notify(&payload).await {
                    Ok(()) => true,
                    Err(e) => {
                        if let TransportError::Peer(PeerError::Rejected {
                            reason: RejectReason::Undeliverable,
                            ..
                        }) = e
                        {
                            tracing::info!(%endpoint, "peer takes no data-plane messages; using the side channel for it");
                            let mut r = refusing.borrow_mut();
                            if r.len() >= shared.config.max_data_sessions {
                                r.clear();
                            }
                            r.insert(endpoint);
                        } else {
                            tracing::debug!(%endpoint, %e, "data-plane notification not taken; using the side channel");
                        }
                        false
                    }
                }
            }
            Some(AnySession::Local(_)) | None => false,
        };
        let counter = if sent {
            &shared.counters.data_plane_messages
        } else {
            &shared.counters.data_plane_fallbacks
        };
        counter.fetch_add(batch.len() as u64, Ordering::Relaxed);
        if !sent {
            for (peer, tid, bytes) in batch {
                shared.to_bridge(BridgeCmd::Send {
                    peer: peer.0,
                    tid: Some(tid),
                    bytes,
                });
            }
        }
    }
}

/// Takes the side-channel frames a peer sends over the data plane (see
/// [`pump_notes`]) on this node's executor. Messages for transfers this
/// executor holds live go straight to their machines; anything else takes
/// the bridge's path, as if it had come over ZeroMQ. Refuses (so the peer
/// resends over the side channel) when the sender is not a peer whose hello
/// named that endpoint.
fn notify_handler<M: NodeMachine + 'static>(
    shared: Arc<Shared>,
    poster: EventPoster<M>,
    live: Live,
) -> crate::transport::tcp::NotifyHandler {
    let router = Rc::new(NoteRouter {
        shared,
        poster,
        live,
        deferred: RefCell::new(Deferred::default()),
    });
    Rc::new(move |bytes: &[u8]| {
        let shared = &router.shared;
        let limits = shared.config.frame_limits;
        let (sender, frames) = match wire::decode_notify(bytes, &limits) {
            Ok(x) => x,
            Err(e) => {
                tracing::debug!(%e, "bad data-plane notification");
                shared.counters.bad_frames.fetch_add(1, Ordering::Relaxed);
                return false;
            }
        };
        let Some(peer) = sender
            .parse::<EndpointAddr>()
            .ok()
            .and_then(|e| shared.peer_at(&e))
        else {
            tracing::debug!(sender, "data-plane notification from an unknown endpoint");
            return false;
        };
        for f in frames {
            match wire::decode(f, &limits) {
                Ok(Frame::Transfer { transfer_id, msg }) => router.route(peer, transfer_id, msg),
                Ok(other) => {
                    tracing::debug!(?other, "only transfer messages travel over the data plane");
                    shared.counters.bad_frames.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) => {
                    tracing::debug!(%e, "bad frame in a data-plane notification");
                    shared.counters.bad_frames.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        true
    })
}

/// Where the data-plane notifications of one executor go.
struct NoteRouter<M: NodeMachine> {
    shared: Arc<Shared>,
    poster: EventPoster<M>,
    live: Live,
    deferred: RefCell<Deferred>,
}

/// Most messages waiting a turn in [`Deferred`] per executor.
const MAX_DEFERRED_NOTES: usize = 1024;

/// Messages waiting for the executor's mailbox to be taken once.
#[derive(Default)]
struct Deferred {
    /// In arrival order; while it is not empty every message joins it, so
    /// none overtakes an earlier one.
    queue: std::collections::VecDeque<(u32, TransferId, Msg)>,
    draining: bool,
}

impl<M: NodeMachine + 'static> NoteRouter<M> {
    /// A message for a transfer that is not live here yet usually names one
    /// whose `Create` already sits in this executor's mailbox: the engine
    /// called `sender` (or `receiver`) and the peer's `Pull` overtook it in
    /// the same wake-up. It waits until the driver has had one turn, so it
    /// goes to the machine from here instead of through the bridge thread
    /// and back (two thread hand-offs; a quarter of small requests in the
    /// demo took that path). One turn only: a transfer this executor does
    /// not hold still takes the bridge's path, which creates machines.
    fn route(self: &Rc<Self>, peer: u32, tid: TransferId, msg: Msg) {
        let mut d = self.deferred.borrow_mut();
        // Goes now unless it is one this executor could take but does not
        // hold yet, or earlier ones wait.
        let waits = over_data_plane(&msg) && !self.is_live(tid);
        if d.queue.is_empty() && !waits {
            drop(d);
            self.deliver(peer, tid, msg);
            return;
        }
        if d.queue.len() >= MAX_DEFERRED_NOTES {
            // A flood (a peer naming transfers nobody holds) waits no turn:
            // what waits goes now, in order, and this one behind it.
            drop(d);
            self.drain();
            self.deliver(peer, tid, msg);
            return;
        }
        d.queue.push_back((peer, tid, msg));
        if !d.draining {
            d.draining = true;
            let me = Rc::clone(self);
            glommio::spawn_local(async move {
                futures_lite::future::yield_now().await;
                me.drain();
            })
            .detach();
        }
    }

    fn drain(&self) {
        loop {
            // Not borrowed across `deliver`: the bridge hand-off never calls
            // back, but the queue stays consistent if anything ever does.
            let next = self.deferred.borrow_mut().queue.pop_front();
            let Some((peer, tid, msg)) = next else { break };
            self.deliver(peer, tid, msg);
        }
        self.deferred.borrow_mut().draining = false;
    }

    fn is_live(&self, tid: TransferId) -> bool {
        self.live.borrow().contains_key(&tid)
    }

    fn deliver(&self, peer: u32, tid: TransferId, msg: Msg) {
        let shared = &self.shared;
        if over_data_plane(&msg) && self.is_live(tid) {
            let event = M::inbound(shared, PeerId(peer), msg.clone());
            // A full queue (or a closing executor) leaves it to the
            // bridge, whose hand-off waits for room.
            if self.poster.try_post(tid, event).is_ok() {
                shared.track(peer, tid);
                return;
            }
        }
        shared.to_bridge(BridgeCmd::Inbound { peer, tid, msg });
    }
}

/// Makes room for a session to `endpoint` under `max` sessions: closes the
/// idle ones (no transfer holds their slot) when full. Peers that restart
/// come back at new endpoints, so without this the map would only grow.
fn make_room(sessions: &Sessions, endpoint: &EndpointAddr, max: usize) -> Result<(), String> {
    let mut map = sessions.borrow_mut();
    if map.contains_key(endpoint) || map.len() < max {
        return Ok(());
    }
    map.retain(|_, slot| Rc::strong_count(slot) > 1);
    if map.len() < max {
        Ok(())
    } else {
        Err(format!(
            "{} data-plane sessions are busy: max_data_sessions reached",
            map.len()
        ))
    }
}

/// Where a data-plane batch goes.
struct Route<'a> {
    transport: &'a AnyTransport,
    sessions: &'a Sessions,
    endpoint: EndpointAddr,
}

impl Route<'_> {
    /// Moves every batch over one session, all batches in flight at once;
    /// at `deadline` (the machines' transfer bound counted from when the op
    /// was posted) the batches are dropped, which stops every socket
    /// operation on their memory at once. A `trailer` (writes only) goes to
    /// the peer's notification handler behind the bytes when the transport
    /// can make its delivery depend on all of them landing; `Ok(true)` says
    /// it was delivered, `Ok(false)` that the caller must deliver it.
    async fn move_bytes(
        &self,
        op: Op,
        descs: &[Desc],
        batches: &[Range<usize>],
        trailer: Option<&[u8]>,
        deadline: Instant,
    ) -> Result<bool, String> {
        let slot = self
            .sessions
            .borrow_mut()
            .entry(self.endpoint)
            .or_default()
            .clone();
        let session = {
            let mut guard = slot.lock().await;
            match guard.as_ref() {
                Some(s) => s.clone(),
                None => {
                    let opened = self.transport.open(&self.endpoint).await;
                    let s = Rc::new(opened.map_err(|e| e.to_string())?);
                    *guard = Some(s.clone());
                    s
                }
            }
        };
        // The transport holds the batches' only timer, set to `deadline`:
        // its own batch bound (the same transfer bound, counted from this
        // call) would start after the op waited in its lane or for the
        // session, and a second timer here would only race it.
        let trailer = trailer.filter(|_| op == Op::Write && batches.len() == 1);
        let moves = batches
            .iter()
            .map(|b| session.transfer_until(op, &descs[b.clone()], trailer, deadline));
        let result = futures::future::try_join_all(moves)
            .await
            .map(|delivered| delivered.contains(&true))
            .map_err(|e| e.to_string());
        if result.is_err() {
            // A broken session is re-opened by the next transfer.
            let mut guard = slot.lock().await;
            if guard.as_ref().is_some_and(|s| Rc::ptr_eq(s, &session)) {
                *guard = None;
            }
        }
        result
    }
}

impl ActionSink<SendMachine> for Sink<SendMachine> {
    fn execute(&mut self, tid: TransferId, action: send::Action) {
        match action {
            send::Action::Send { peer, msg } => {
                // Pull mode: D ranks read these blocks from our endpoint.
                if let Msg::Ready { src_blocks, .. } = &msg {
                    self.open_blocks(tid, src_blocks);
                }
                self.msgr.send_msg(tid, peer, msg)
            }
            send::Action::Write {
                peer,
                chunk,
                src_blocks,
                dst_blocks,
                status_after,
            } => {
                self.open_blocks(tid, &src_blocks);
                self.start_transfer(
                    tid,
                    Job {
                        peer,
                        src: &src_blocks,
                        dst: &dst_blocks,
                        op: Op::Write,
                        status_after,
                    },
                    move |ok| send::Event::WriteDone { peer, chunk, ok },
                    send::Event::PlanFailed { peer },
                    status_after.then_some(send::Event::StatusNotCarried { peer }),
                )
            }
            // The phase turns terminal in the same call; `on_phase` reports it.
            send::Action::ReleaseBlocks { .. } => {}
        }
    }

    fn on_phase(&mut self, tid: TransferId, phase: Phase, now: Instant) {
        self.report(tid, phase, now);
    }
}

impl ActionSink<RecvMachine> for Sink<RecvMachine> {
    fn execute(&mut self, tid: TransferId, action: recv::Action) {
        match action {
            recv::Action::Send { peer, msg } => {
                // Push mode: P ranks write these blocks through our endpoint.
                if let Msg::Pull { dst_blocks, .. } = &msg {
                    if !self.opened.contains_key(&tid) {
                        self.open_blocks(tid, dst_blocks);
                    }
                }
                self.msgr.send_msg(tid, peer, msg)
            }
            recv::Action::Read {
                peer,
                chunk,
                src_blocks,
                dst_blocks,
            } => {
                self.open_blocks(tid, &dst_blocks);
                self.start_transfer(
                    tid,
                    Job {
                        peer,
                        src: &src_blocks,
                        dst: &dst_blocks,
                        op: Op::Read,
                        status_after: false,
                    },
                    move |ok| recv::Event::ReadDone { peer, chunk, ok },
                    recv::Event::PlanFailed { peer },
                    None,
                )
            }
            recv::Action::Received => {}
            recv::Action::LoadFailed { block_ids } => self.shared.add_load_errors(&block_ids),
        }
    }

    fn on_phase(&mut self, tid: TransferId, phase: Phase, now: Instant) {
        self.report(tid, phase, now);
    }
}
