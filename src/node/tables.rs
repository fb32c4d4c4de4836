//! The tables the engine threads, the executor and the bridge share, and
//! [`Shared`], which holds them.
//!
//! Each table has one writer; the others read. The locks stay where a
//! message to the writer would put a thread hand-off on the critical path
//! of a request: each hand-off waits for a cross-CPU wake-up of an idle
//! vCPU, about 35 µs on the 2-vCPU VM of `docs/performance.md`, against
//! well under a microsecond for these uncontended locks.
//!
//! | table | writer | readers |
//! |---|---|---|
//! | `peers` (hellos by slot and by endpoint) | bridge | executor (planning), bridge |
//! | `tickets` (heartbeat acks sent, prefill) | bridge | executor (grants over the data plane) |
//! | `routes` (resolved prefill ranks, decode) | bridge | engine threads (new requests) |
//! | `records` (final phases) | executor | engine threads (`poll`, `get_finished`) |
//! | `records.names` (string request ids) | engine threads, bridge | executor (`Pull`s), bridge |
//!
//! `records.names` keeps two writers: a string id is claimed where the
//! transfer is opened (an engine thread's `start_*`, or the bridge for a
//! decode rank's `Pull`), so a collision is refused to that caller at once,
//! before any machine exists; a single writer would put the hand-off above
//! on every open by string id. Both claim (and give back a claim whose
//! transfer did not start) through `Shared::claim_name` and
//! `Shared::release_name` under the `records` lock; the executor drops a
//! name only with the record it evicts.
//!
//! `tracked` (transfers to tie to their peers) is not a table but a
//! bounded queue: the executor and engine threads send, the bridge drains.

use kvferry_reactor::lock;
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use kvferry_machines::duplex::{Direction, Duplex};
use kvferry_machines::recv::{self, ResolvedPeer};
use kvferry_machines::send::{self, SendMachine};
use kvferry_machines::wire;
use kvferry_machines::{
    blocks_fingerprint, BlockId, BlockLists, FailReason, Mode, ModelSpec, Msg, PairLayout, PeerId,
    Phase, RankLayout, TransferId,
};
use kvferry_reactor::{ReactorHandle, SubmitError};

use super::command::BridgeCmd;
use super::error::IdCollision;
use super::{waker, Event, EventKind, NodeConfig, PeerUnfit, PrefillTarget, Role};
use crate::stats::Counters;
use crate::transport::EndpointAddr;

/// See [`Shared::track`].
const TRACK_WAKE_EVERY: usize = 1024;

/// What the engine threads and the bridge reach the executor through.
pub(crate) type EngineHandle = ReactorHandle<kvferry_machines::duplex::Duplex>;

/// A remote rank as the node knows it after its hello.
#[derive(Debug)]
pub(crate) struct PeerData {
    /// The peer's hello, kept for diagnostics (`Debug`).
    #[allow(dead_code)]
    pub hello: wire::Hello,
    /// The validated pair (P layout, D layout), or why it does not fit.
    pub pair: Result<PairLayout, PeerUnfit>,
    pub endpoint: Option<EndpointAddr>,
    /// Which way this rank moves KV with the peer: `Send` for a decode
    /// peer behind the ROUTER, `Recv` for a prefill peer behind one of our
    /// DEALERs (a node of [`Role::Both`] has both kinds).
    pub direction: Direction,
}

/// This rank's registered KV cache.
#[derive(Clone, Debug)]
pub(crate) struct LocalKv {
    pub model: ModelSpec,
    pub layout: RankLayout,
}

#[derive(Default)]
pub(crate) struct Records {
    /// Final phase by transfer, for handles polled after collection.
    pub(crate) done: HashMap<TransferId, Phase>,
    pub(crate) order: VecDeque<TransferId>,
    /// Ended since the engine last asked (`get_finished`), which way, and
    /// whether it succeeded.
    pub(crate) finished: VecDeque<(TransferId, Direction, bool)>,
    pub(crate) load_errors: Vec<BlockId>,
    /// The string request id of each transfer opened by one (here or by a
    /// decode rank's `Pull`), live or among the records in `order`, so a
    /// second string with the same hash is refused whichever comes when.
    pub(crate) names: HashMap<TransferId, Arc<str>>,
    /// Push-mode prefill: per successful transfer among the records, each
    /// peer and the fingerprint of the blocks written to it
    /// (`blocks_fingerprint`), which a late `Pull` must match to be
    /// answered with a success.
    pub(crate) written: HashMap<TransferId, Written>,
}

/// Push-mode prefill: each peer of a transfer and the fingerprint of the
/// blocks written to it (`blocks_fingerprint`), summed over its writes.
/// Most transfers have one peer: it is kept inline.
#[derive(Clone, Debug, Default)]
pub(crate) struct Written {
    first: Option<(PeerId, u64)>,
    more: Vec<(PeerId, u64)>,
}

impl Written {
    /// Adds the fingerprint `fp` of blocks written to `peer`.
    pub(crate) fn add(&mut self, peer: PeerId, fp: u64) {
        let Some(first) = &mut self.first else {
            self.first = Some((peer, fp));
            return;
        };
        let slot = std::iter::once(first)
            .chain(self.more.iter_mut())
            .find(|(p, _)| *p == peer);
        match slot {
            Some((_, sum)) => *sum = sum.wrapping_add(fp),
            None => self.more.push((peer, fp)),
        }
    }

    fn has(&self, peer: PeerId, fp: u64) -> bool {
        self.first == Some((peer, fp)) || self.more.contains(&(peer, fp))
    }
}

/// State shared by the engine-facing handle, the executor and the bridge.
pub(crate) struct Shared {
    pub role: Role,
    pub node_id: u64,
    pub config: NodeConfig,
    /// `config.host` resolved: what the side channel and the data plane
    /// bind (the host itself is what the node advertises).
    pub bind_ip: std::net::IpAddr,
    /// The cluster key (`config.cluster_key_file`, loaded at start):
    /// every surface authenticates its peers with it when set.
    pub key: Option<kvferry_auth::ClusterKey>,
    pub local: OnceLock<LocalKv>,
    pub endpoint: OnceLock<String>,
    /// Peers by side-channel slot, and the slot of each data-plane
    /// endpoint (the latest hello that named it), for messages that arrive
    /// over the data plane.
    pub(crate) peers: Mutex<Peers>,
    /// Prefill side: per decode peer, the heartbeat acks the bridge sent it
    /// (`seq`, sent at), newest last: a grant naming one as a lease ticket
    /// counts from when it was sent. Read by the bridge and by the executor
    /// (for grants that come over the data plane).
    pub(crate) tickets: Mutex<HashMap<u32, VecDeque<(u64, Instant)>>>,
    /// Transfers whose messages went over the data plane, by peer slot, for
    /// the bridge to tie to that peer (so the peer's death fails them fast)
    /// on its next turn: a queue bounded by `bridge_queue_capacity`, which
    /// the executor and engine threads send to and the bridge drains.
    pub(crate) tracked_tx: flume::Sender<(u32, TransferId)>,
    pub(crate) tracked_rx: flume::Receiver<(u32, TransferId)>,
    /// Decode side: the prefill ranks of each target the bridge resolved,
    /// while all of them are connected and alive, so an engine thread can
    /// hand a new request its peers without a trip through the bridge.
    pub(crate) routes: Mutex<Routes>,
    /// Prometheus counters; the embedded bootstrap service serves them.
    pub counters: Arc<Counters>,
    pub(crate) records: Mutex<Records>,
    pub bridge_tx: flume::Sender<BridgeCmd>,
    pub waker: Arc<waker::Waker>,
    /// State of the fault-injection dice (`NodeConfig::drop_control_ppm`).
    pub(crate) fault_dice: AtomicU64,
    /// Bumped on every terminal phase, and signalled when a `wait` is
    /// waiting (a wake-up with nobody to wake is a system call per request).
    pub(crate) terminal_seq: Mutex<TerminalSeq>,
    pub(crate) terminal_cv: Condvar,
    /// True once any transfer was opened by string request id: until then
    /// no path looks `records.names` up, so numeric ids never take its lock.
    pub(crate) any_named: AtomicBool,
    /// The hash from request ids to transfer ids; unset means
    /// [`TransferId::of_request_id`]. Tests set another to force collisions.
    pub(crate) id_hash: OnceLock<fn(&str) -> TransferId>,
    /// [`Role::Both`] only: the transfers live here as receives (see
    /// [`Shared::is_receiving`]); bounded by the executor's machines.
    pub(crate) receiving: Mutex<HashSet<TransferId>>,
}

/// See `Shared::terminal_seq`.
#[derive(Default)]
pub(crate) struct TerminalSeq {
    pub(crate) seq: u64,
    pub(crate) waiters: usize,
}

/// See `Shared::routes`.
#[derive(Default)]
pub(crate) struct Routes {
    /// Per target: (peer slot, receivers expected) per prefill rank the
    /// request contacts, as the bridge last resolved them; 0 receivers
    /// marks an unpaired rank this rank tells it is not needed.
    pub(crate) by_target: HashMap<PrefillTarget, Vec<(u32, u16)>>,
    /// Per prefill slot: the latest heartbeat ack it sent us (`seq`, when
    /// it arrived), a lease ticket for push-mode `Pull`s.
    pub(crate) tickets: HashMap<u32, (u64, Instant)>,
}

/// See [`Shared::peers_at`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct PeersAt {
    send: Option<u32>,
    recv: Option<u32>,
}

impl PeersAt {
    /// The slot of the peer this rank moves KV with in `direction`.
    pub(crate) fn get(&self, direction: Direction) -> Option<u32> {
        match direction {
            Direction::Send => self.send,
            Direction::Recv => self.recv,
        }
    }

    /// True when no peer named that endpoint.
    pub(crate) fn is_empty(&self) -> bool {
        self.send.is_none() && self.recv.is_none()
    }
}

#[derive(Default)]
pub(crate) struct Peers {
    pub(crate) by_slot: HashMap<u32, Arc<PeerData>>,
    /// By (endpoint, direction): a node of [`Role::Both`] can be both a
    /// decode and a prefill peer of this one, in two slots.
    pub(crate) by_endpoint: HashMap<(EndpointAddr, Direction), u32>,
}

impl Shared {
    /// A configured limit refused or dropped something: counted in
    /// `limit_hits` and logged with the limit's name and value.
    pub(crate) fn limit_reached(
        &self,
        limit: &'static str,
        value: usize,
        what: std::fmt::Arguments<'_>,
    ) {
        self.counters.limit_hits.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(limit, value, "{what}: {limit} reached");
    }
}

impl Shared {
    pub(crate) fn peer(&self, id: u32) -> Option<Arc<PeerData>> {
        lock(&self.peers).by_slot.get(&id).cloned()
    }

    /// Prefill: why a `Pull` from decode peer `id` is refused at once, if
    /// it is: its rank reads nothing from ours (`BadMetadata`), or the
    /// layouts pair only by a rule kvferry does not implement
    /// (`Unsupported`). Other layouts that do not fit fail when the
    /// transfer is planned.
    pub(crate) fn refusal(&self, id: u32) -> Option<FailReason> {
        let d = self.peer(id)?;
        match &d.pair {
            Ok(p) if p.share().is_none() => Some(FailReason::BadMetadata),
            Err(unfit) if unfit.is_unsupported() => Some(FailReason::Unsupported),
            Ok(_) | Err(_) => None,
        }
    }

    /// Prefill: creates the send machine of `tid`, unless there is one
    /// already (the engine's `sender` and decode's first message may come
    /// in either order).
    pub(crate) fn create_sender(
        &self,
        h: &ReactorHandle<Duplex>,
        tid: TransferId,
    ) -> Result<(), SubmitError> {
        if self.is_receiving(tid) {
            // Found, but it is this rank's receive of the same id.
            return Err(SubmitError::DuplicateTransfer(tid));
        }
        let m = SendMachine::new(Instant::now(), &self.config.timeouts, tid, self.config.mode);
        // The bridge may see the transfer and queue decode's `Pull` before
        // this `Create` reaches the mailbox: the executor holds such events
        // until the machine exists (kvferry_reactor, "Early").
        match h.create(0, tid, Duplex::Send(m)) {
            Ok(()) => Ok(()),
            Err(r) if r.error == SubmitError::DuplicateTransfer(tid) => Ok(()),
            Err(r) => Err(r.error),
        }
    }

    /// [`Role::Both`]: true while `tid` is live here as a receive. A
    /// sender for it, or a decode peer's `Pull` naming it, is refused
    /// rather than handed to the receive machine.
    pub(crate) fn is_receiving(&self, tid: TransferId) -> bool {
        self.role == Role::Both && self.lock_receiving().contains(&tid)
    }

    /// [`Role::Both`]: `tid` is live here as a receive from now
    /// (`live`) or no longer.
    pub(crate) fn set_receiving(&self, tid: TransferId, live: bool) {
        if self.role != Role::Both {
            return;
        }
        let mut r = self.lock_receiving();
        if live {
            r.insert(tid);
        } else {
            r.remove(&tid);
        }
    }

    /// Which way `tid` goes here, for a transfer that ended without
    /// reporting it (refused at creation, dropped at shutdown).
    pub(crate) fn direction_of(&self, tid: TransferId) -> Direction {
        match self.role {
            Role::Prefill => Direction::Send,
            Role::Decode => Direction::Recv,
            Role::Both if self.is_receiving(tid) => Direction::Recv,
            Role::Both => Direction::Send,
        }
    }

    fn lock_receiving(&self) -> std::sync::MutexGuard<'_, HashSet<TransferId>> {
        lock(&self.receiving)
    }

    /// The transfer id of string request id `id` (see [`Shared::id_hash`]).
    pub(crate) fn transfer_id_of(&self, id: &str) -> TransferId {
        self.id_hash
            .get()
            .map_or_else(|| TransferId::of_request_id(id), |h| h(id))
    }

    /// Ties request id `id` to `tid`, unless another request id holds it.
    /// `Ok(true)` when `id` was not tied yet (the caller undoes it with
    /// [`Shared::release_name`] if the transfer does not start). A
    /// transfer opened by number holds no string and takes any.
    pub(crate) fn claim_name(&self, tid: TransferId, id: &str) -> Result<bool, IdCollision> {
        let mut r = lock(&self.records);
        match r.names.get(&tid) {
            Some(held) if &**held == id => Ok(false),
            Some(held) => {
                Counters::inc(&self.counters.id_collisions);
                Err(IdCollision {
                    transfer_id: tid,
                    request_id: id.to_owned(),
                    held: held.to_string(),
                })
            }
            None => {
                self.any_named.store(true, Ordering::Relaxed);
                r.names.insert(tid, Arc::from(id));
                Ok(true)
            }
        }
    }

    /// Like [`Shared::claim_name`] without tying anything.
    pub(crate) fn check_name(&self, tid: TransferId, id: &str) -> Result<(), IdCollision> {
        match self.name_of(tid) {
            Some(held) if &*held != id => {
                Counters::inc(&self.counters.id_collisions);
                Err(IdCollision {
                    transfer_id: tid,
                    request_id: id.to_owned(),
                    held: held.to_string(),
                })
            }
            _ => Ok(()),
        }
    }

    /// Unties a request id whose transfer did not start.
    pub(crate) fn release_name(&self, tid: TransferId) {
        let mut r = lock(&self.records);
        if !r.done.contains_key(&tid) {
            r.names.remove(&tid);
        }
    }

    /// The string request id of `tid`, if it was opened by one.
    pub(crate) fn name_of(&self, tid: TransferId) -> Option<Arc<str>> {
        if !self.any_named.load(Ordering::Relaxed) {
            return None;
        }
        let r = lock(&self.records);
        r.names.get(&tid).cloned()
    }

    /// The frame that carries `msg` for `tid`: a `Pull` of a transfer
    /// opened by string request id names it.
    pub(crate) fn transfer_frame(&self, tid: TransferId, msg: Msg) -> wire::Frame {
        if let Msg::Pull { .. } = msg {
            if let Some(name) = self.name_of(tid) {
                return wire::Frame::NamedTransfer {
                    transfer_id: tid,
                    request_id: name.to_string(),
                    msg,
                };
            }
        }
        wire::Frame::Transfer {
            transfer_id: tid,
            msg,
        }
    }

    /// The side-channel slots of the peers whose hello named data-plane
    /// endpoint `endpoint`: the one this rank sends to and the one it
    /// receives from (a node of [`Role::Both`] can be both), under one lock.
    pub(crate) fn peers_at(&self, endpoint: &EndpointAddr) -> PeersAt {
        let p = lock(&self.peers);
        let slot = |d| p.by_endpoint.get(&(*endpoint, d)).copied();
        PeersAt {
            send: slot(Direction::Send),
            recv: slot(Direction::Recv),
        }
    }

    /// Records the hello of the peer in slot `id`.
    pub(crate) fn set_peer(&self, id: u32, data: Arc<PeerData>) {
        let mut p = lock(&self.peers);
        if let Some(e) = data.endpoint {
            p.by_endpoint.insert((e, data.direction), id);
        }
        if let Some(old) = p.by_slot.insert(id, data) {
            forget_endpoint(&mut p, id, &old);
        }
    }

    /// Forgets the peer in slot `id` (its slot goes to a newcomer).
    pub(crate) fn remove_peer(&self, id: u32) {
        let mut p = lock(&self.peers);
        if let Some(old) = p.by_slot.remove(&id) {
            forget_endpoint(&mut p, id, &old);
        }
        drop(p);
        lock(&self.tickets).remove(&id);
    }

    /// Remembers that heartbeat ack `seq` went to `peer` at `at`; the
    /// oldest beyond `kept` are forgotten.
    pub(crate) fn ack_sent(&self, peer: u32, seq: u64, at: Instant, kept: usize) {
        let mut t = lock(&self.tickets);
        let acks = t.entry(peer).or_default();
        if acks.len() >= kept {
            acks.pop_front();
        }
        acks.push_back((seq, at));
    }

    /// When the heartbeat ack `ticket` went to `peer` (the first time, if
    /// twice), if it is still remembered.
    pub(crate) fn ticket_sent_at(&self, peer: u32, ticket: u64) -> Option<Instant> {
        let t = lock(&self.tickets);
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
        let peer = kvferry_machines::PeerId(peer);
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
        match self.tracked_tx.try_send((peer, tid)) {
            // An otherwise idle bridge only turns once per heartbeat
            // interval; under load, wake it to take the queue now and then
            // (one eventfd write per `TRACK_WAKE_EVERY` entries).
            Ok(()) if self.tracked_tx.len().is_multiple_of(TRACK_WAKE_EVERY) => self.waker.wake(),
            Ok(()) => {}
            // Full (the receiver lives in `Shared` as long as the senders).
            Err(_) => {
                self.counters.limit_hits.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(
                    limit = self.config.bridge_queue_capacity,
                    "transfer not tied to its peer: bridge_queue_capacity reached"
                );
            }
        }
    }

    /// Takes what [`Shared::track`] queued.
    pub(crate) fn take_tracked(&self) -> Vec<(u32, TransferId)> {
        self.tracked_rx.drain().collect()
    }

    pub(crate) fn routes(&self) -> std::sync::MutexGuard<'_, Routes> {
        lock(&self.routes)
    }

    /// The `PeersResolved` of a new decode request for `target`, from the routes the
    /// bridge cached, each tied to `tid` for peer-death notification under
    /// the same lock the bridge takes before it fails a dead peer's
    /// transfers (so none is missed). `None`: ask the bridge.
    pub(crate) fn cached_route(
        &self,
        tid: TransferId,
        target: &PrefillTarget,
    ) -> Option<recv::Event> {
        let routes = self.routes();
        let route = routes.by_target.get(target)?;
        let mut peers = Vec::with_capacity(route.len());
        let mut unneeded = Vec::new();
        // A slot with no receivers is an unpaired P rank this rank tells.
        for &(slot, receivers_expected) in route {
            let peer = kvferry_machines::PeerId(slot);
            if receivers_expected == 0 {
                unneeded.push(peer);
                continue;
            }
            peers.push(ResolvedPeer {
                peer,
                receivers_expected,
                lease_ticket: routes.fresh_ticket(slot, &self.config),
            });
            self.track(slot, tid);
        }
        Some(recv::Event::PeersResolved { peers, unneeded })
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

    /// Fault injection: true for the share `drop_control_ppm` of calls,
    /// from a per-node xorshift sequence (never true when it is 0).
    pub(crate) fn drops_control(&self) -> bool {
        let ppm = self.config.drop_control_ppm;
        if ppm == 0 {
            return false;
        }
        let step = |mut x: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let prev = self
            .fault_dice
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |x| Some(step(x)))
            .unwrap_or_else(|x| x);
        step(prev) % 1_000_000 < u64::from(ppm)
    }

    /// The recorded final phase of a transfer that ended here.
    pub(crate) fn finished_phase(&self, tid: TransferId) -> Option<Phase> {
        lock(&self.records).done.get(&tid).copied()
    }

    pub(crate) fn add_load_errors(&self, blocks: &[BlockId]) {
        let mut r = lock(&self.records);
        let room = self
            .config
            .max_load_error_blocks
            .saturating_sub(r.load_errors.len());
        if blocks.len() > room {
            let what = format_args!("{} load-error block ids dropped", blocks.len() - room);
            let limit = self.config.max_load_error_blocks;
            self.limit_reached("max_load_error_blocks", limit, what);
        }
        r.load_errors.extend(blocks.iter().take(room));
    }

    /// True when `peer`'s blocks `dst_blocks` are what the ended transfer
    /// `tid` wrote to it (see [`Records::written`]).
    pub(crate) fn wrote(&self, tid: TransferId, peer: PeerId, dst_blocks: &BlockLists) -> bool {
        let r = lock(&self.records);
        let fp = blocks_fingerprint(peer, dst_blocks);
        (r.written.get(&tid)).is_some_and(|w| w.has(peer, fp))
    }

    /// Remembers a final phase for handles and `get_finished`, bounded:
    /// the oldest records go first; with a success, what it wrote.
    pub(crate) fn record(
        &self,
        tid: TransferId,
        direction: Direction,
        phase: Phase,
        written: Option<Written>,
    ) {
        let mut r = lock(&self.records);
        if let (Some(w), Phase::Success) = (written, phase) {
            r.written.insert(tid, w);
        }
        let max = self.config.max_finished_records.max(1);
        if r.order.len() >= max {
            if let Some(old) = r.order.pop_front() {
                r.done.remove(&old);
                r.names.remove(&old);
                r.written.remove(&old);
            }
        }
        if r.finished.len() >= max {
            // The engine is not collecting (`get_finished`): the oldest
            // uncollected notification goes. Its phase stays queryable
            // until it ages out of `done` too.
            if let Some(lost) = r.finished.pop_front() {
                let what =
                    format_args!("the finished notification of {lost:?} dropped uncollected");
                self.limit_reached("max_finished_records", max, what);
            }
        }
        if r.done.insert(tid, phase).is_none() {
            r.order.push_back(tid);
        }
        r.finished
            .push_back((tid, direction, phase == Phase::Success));
    }

    /// A request of this node reached `phase`, `latency` after its first
    /// report.
    /// `written`: push-mode prefill, what the transfer wrote to its peers.
    pub(crate) fn on_terminal(
        &self,
        tid: TransferId,
        direction: Direction,
        phase: Phase,
        latency: Duration,
        written: Option<Written>,
    ) {
        if !phase.is_terminal() {
            return;
        }
        self.counters.record_terminal(phase, latency);
        match (direction, phase) {
            // The claim or lease ran out: the hold ended without decode's word.
            (Direction::Send, Phase::Expired) => Counters::inc(&self.counters.expired_holds),
            (Direction::Recv, _) => self.set_receiving(tid, false),
            (Direction::Send, _) => {}
        }
        self.record(tid, direction, phase, written);
    }

    /// Wakes whoever waits for a terminal phase, once the phase of `tid`
    /// shows on the completion board (after `on_terminal`).
    pub(crate) fn on_published(&self, tid: TransferId, phase: Phase) {
        if let Some(sink) = &self.config.events {
            let _ = sink.tx.try_send(Event {
                tag: sink.tag,
                transfer_id: tid,
                kind: EventKind::Finished(phase),
            });
        }
        let waiters = {
            let mut t = lock(&self.terminal_seq);
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

/// Drops the index entry of `old`'s endpoint if it still names slot `id`
/// and the slot's current hello names another.
fn forget_endpoint(p: &mut Peers, id: u32, old: &PeerData) {
    let Some(e) = old.endpoint else { return };
    let key = (e, old.direction);
    let current = p.by_slot.get(&id).map(|d| (d.endpoint, d.direction));
    if p.by_endpoint.get(&key) == Some(&id) && current != Some((Some(e), old.direction)) {
        p.by_endpoint.remove(&key);
    }
}
