//! The side-channel bridge: one thread per node that owns every ZeroMQ
//! socket (libzmq is neither thread-safe nor io_uring-aware, so sockets stay
//! off the executors).
//!
//! It decodes every inbound frame (bad ones are counted, logged and
//! dropped), answers hellos and heartbeats, routes machine messages to the
//! reactor, resolves the prefill ranks of new decode requests, and tracks
//! peer liveness: a peer silent for `heartbeat_misses` heartbeat intervals is
//! marked dead, the live transfers that involve it get `PeerDead` at once,
//! requests to it fail fast, and any later frame from it (the periodic
//! probe is answered) clears the mark.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvferry_machines::duplex::{self, Direction};
use kvferry_machines::recv::{self, ResolvedPeer};
use kvferry_machines::send;
use kvferry_machines::{
    late_answer, AbortReason, Mode, Msg, PairLayout, PeerId, Phase, TpPair, TransferId,
};
use kvferry_reactor::SubmitError;

use super::sink::inbound;
use super::{
    Counters, EngineHandle, NodeConfig, NodeError, PeerData, PeerUnfit, PrefillTarget, Shared,
};
use crate::bootstrap::{BootstrapClient, EngineEntry, QueryResponse};
use crate::transport::EndpointAddr;
use kvferry_machines::wire::{self, Frame, Hello};
use kvferry_machines::{DeathCause, Liveness};

/// Most frames read from one socket before looking at the others.
mod auth;
mod names;
mod peers;
mod resolve;

pub(crate) use super::command::{BridgeCmd, EngineRanks, LookupError};

const READ_BUDGET: usize = 512;
/// Heartbeat acks remembered per decode peer as lease tickets.
const TICKETS_KEPT: usize = 8;
/// Most commands handled per loop turn.
const COMMAND_BUDGET: usize = 4096;
/// ZeroMQ high-water marks (messages per peer).
const HWM: i32 = 200_000;

pub(crate) struct BridgeThread {
    join: JoinHandle<()>,
}

/// Binds prefill's ROUTER to the resolved host (`Node::start`); returns
/// it and the address it is advertised at (the configured host).
fn bind_router(ctx: &zmq::Context, shared: &Shared) -> Result<(zmq::Socket, String), NodeError> {
    let zerr = |e: zmq::Error| NodeError::side_channel("socket setup", e);
    let s = ctx.socket(zmq::ROUTER).map_err(zerr)?;
    configure(&s, &shared.config).map_err(zerr)?;
    // A frame for a decode peer that is gone is an error the bridge
    // counts (`dropped_frames`), not a silent drop.
    s.set_router_mandatory(true).map_err(zerr)?;
    let port = match shared.config.side_channel_port {
        0 => "*".to_string(),
        p => p.to_string(),
    };
    let ip = match shared.bind_ip {
        std::net::IpAddr::V4(ip) => ip.to_string(),
        std::net::IpAddr::V6(ip) => format!("[{ip}]"),
    };
    s.bind(&format!("tcp://{ip}:{port}"))
        .map_err(|e| NodeError::side_channel("bind", e))?;
    let bound = s.get_last_endpoint().map_err(zerr)?.map_err(|_| {
        NodeError::side_channel(
            "bound endpoint",
            std::io::Error::new(std::io::ErrorKind::InvalidData, "not UTF-8"),
        )
    })?;
    let advertised = crate::resolve::advertised(&shared.config.host, &bound);
    Ok((s, advertised))
}

impl BridgeThread {
    /// Binds the ROUTER (roles that send) and starts the thread. Returns
    /// the side-channel address peers connect to (empty on decode).
    pub(crate) fn start(
        shared: Arc<Shared>,
        handle: EngineHandle,
        rx: flume::Receiver<BridgeCmd>,
    ) -> Result<(BridgeThread, String), NodeError> {
        let ctx = zmq::Context::new();
        let (router, addr) = if shared.role.sends() {
            let (s, advertised) = bind_router(&ctx, &shared)?;
            (Some(s), advertised)
        } else {
            (None, String::new())
        };
        let heartbeat = shared
            .config
            .timeouts
            .heartbeat_interval
            .max(Duration::from_millis(1));
        let probe = shared.config.probe_every().max(Duration::from_millis(1));
        // Ticks come as often as the more frequent of the two; each goes
        // out when its own interval passed.
        let tick = heartbeat.min(probe);
        let now = Instant::now();
        let t = &shared.config.timeouts;
        let silence_max = t.heartbeat_interval * t.heartbeat_misses.max(1);
        let bridge = Bridge {
            liveness: Liveness::new(silence_max),
            refused_ids: names::RefusedIds::default(),
            resolver: {
                let waker = shared.waker.clone();
                shared.config.resolver().notifying(move || waker.wake())
            },
            resolving: HashSet::new(),
            heartbeat: Every::new(heartbeat, now),
            probe: Every::new(probe, now),
            shared,
            handle,
            rx,
            ctx,
            router,
            slots: Vec::new(),
            by_identity: HashMap::new(),
            by_addr: HashMap::new(),
            pending: Vec::new(),
            directory: HashMap::new(),
            tick,
            next_tick: now + tick,
            hb_seq: 0,
            monitors: 0,
            router_gates: auth::RouterGates::default(),
            stop: false,
        };
        let join = std::thread::Builder::new()
            .name("kvferry-bridge".into())
            .spawn(move || bridge.run())
            .map_err(|e| NodeError::side_channel("bridge thread", e))?;
        Ok((BridgeThread { join }, addr))
    }

    pub(crate) fn stop(self, shared: &Shared) {
        // Blocking send is fine: the bridge drains its queue continuously.
        let _ = shared
            .bridge_tx
            .send_timeout(BridgeCmd::Stop, Duration::from_secs(5));
        shared.waker.force();
        let _ = self.join.join();
    }
}

fn configure(s: &zmq::Socket, config: &NodeConfig) -> Result<(), zmq::Error> {
    s.set_linger(0)?;
    s.set_maxmsgsize(config.frame_limits.max_frame_bytes as i64)?;
    s.set_sndhwm(HWM)?;
    s.set_rcvhwm(HWM)?;
    s.set_reconnect_ivl(50)?;
    s.set_reconnect_ivl_max(500)?;
    Ok(())
}

enum Route {
    /// A decode peer behind our ROUTER.
    Identity(Vec<u8>),
    /// A prefill peer behind our own DEALER.
    Dealer(zmq::Socket),
}

struct Slot {
    route: Route,
    /// Decode side: the PAIR end of libzmq's monitor of our DEALER, which
    /// reports a dropped connection at once (heartbeat silence would take
    /// `heartbeat_interval * heartbeat_misses`).
    monitor: Option<zmq::Socket>,
    /// Prefill side-channel address (decode side only), as given: it may
    /// name its host.
    addr: String,
    /// The resolved `tcp://ip:port` our DEALER is connected to.
    connected: String,
    /// A lookup of `addr`'s name under way (the first connection, or a
    /// probe of a dead or silent peer, started it).
    lookup: Option<crate::resolve::Lookup>,
    /// The latest lookup of `addr`'s name failed before the dealer was
    /// ever connected: requests to it fail at once until a probe's lookup
    /// answers.
    unresolved: bool,
    /// A hello waiting for the lookup of the data-plane endpoint it names.
    hello_lookup: Option<(Hello, crate::resolve::Lookup)>,
    ready: bool,
    /// The protocol version of a peer that refused our frames (decode
    /// side); cleared by its next hello.
    refused: Option<u16>,
    transfers: HashSet<TransferId>,
    /// Authentication of the peer's frames (with a cluster key).
    gate: auth::Gate,
}

impl Slot {
    fn new(route: Route, monitor: Option<zmq::Socket>, addr: String) -> Slot {
        Slot {
            route,
            monitor,
            addr,
            connected: String::new(),
            lookup: None,
            unresolved: false,
            hello_lookup: None,
            ready: false,
            refused: None,
            transfers: HashSet::new(),
            gate: auth::Gate::Plain,
        }
    }
}

enum Dir {
    Querying,
    Known(EngineRanks),
    Failed(Instant),
    /// The service refused this node (HTTP 401: another key or none;
    /// 403: no key there, and this node on another host): requests for
    /// the target fail at once instead of waiting out their bootstrap
    /// timeout; asked again a tick later (the key may have been fixed).
    Refused(Instant),
}

struct Pending {
    tid: TransferId,
    target: PrefillTarget,
    /// Past it, a request that ended before its `Pull` left stops trying
    /// to tell its prefill ranks (they have expired by then anyway).
    give_up: Instant,
    /// Aborted before it asked for the KV (`Receiver::abort`).
    aborted: bool,
}

struct Bridge {
    shared: Arc<Shared>,
    handle: EngineHandle,
    rx: flume::Receiver<BridgeCmd>,
    ctx: zmq::Context,
    router: Option<zmq::Socket>,
    slots: Vec<Slot>,
    by_identity: HashMap<Vec<u8>, u32>,
    by_addr: HashMap<String, u32>,
    pending: Vec<Pending>,
    directory: HashMap<PrefillTarget, Dir>,
    tick: Duration,
    next_tick: Instant,
    hb_seq: u64,
    /// Socket monitors made so far (names their inproc endpoints).
    monitors: u64,
    /// Prefill: ROUTER identities part way through the side channel's
    /// handshake, or authenticated without a slot yet.
    router_gates: auth::RouterGates,
    stop: bool,
    /// Which peers are dead (see `kvferry_machines::Liveness`).
    liveness: Liveness,
    /// Prefill: pulls refused for an id collision (see `names`).
    refused_ids: names::RefusedIds,
    /// Looks up the names in side-channel addresses and peers' hellos, on
    /// threads of its own; an answer wakes the bridge.
    resolver: crate::resolve::Resolver,
    /// Slots with a lookup under way (`Slot::lookup`, `Slot::hello_lookup`).
    resolving: HashSet<u32>,
    /// When decode heartbeats its ready peers.
    heartbeat: Every,
    /// When decode probes (says hello again to) its dead or silent peers.
    probe: Every,
}

/// A period of the bridge's ticks.
struct Every {
    period: Duration,
    next: Instant,
}

impl Every {
    fn new(period: Duration, now: Instant) -> Every {
        Every {
            period,
            next: now + period,
        }
    }

    /// True once per period (at the first tick after it passed).
    fn is_due(&mut self, now: Instant) -> bool {
        let due = now >= self.next;
        if due {
            self.next = now + self.period;
        }
        due
    }
}

/// Where a readable socket is.
#[derive(Clone, Copy)]
enum Source {
    Router,
    Dealer(u32),
    Monitor(u32),
}

/// Who sent a frame: the peer's slot, or the identity of a ROUTER peer
/// that has none yet.
type Sender = Result<u32, Vec<u8>>;

impl Bridge {
    fn run(mut self) {
        while !self.stop {
            let mut sources = Vec::with_capacity(1 + self.slots.len());
            let readable: Vec<Source> = {
                let mut items = Vec::with_capacity(2 + self.slots.len());
                items.push(zmq::PollItem::from_fd(
                    self.shared.waker.raw_fd(),
                    zmq::POLLIN,
                ));
                if let Some(r) = &self.router {
                    items.push(r.as_poll_item(zmq::POLLIN));
                    sources.push(Source::Router);
                }
                for (i, s) in self.slots.iter().enumerate() {
                    if let Route::Dealer(d) = &s.route {
                        items.push(d.as_poll_item(zmq::POLLIN));
                        sources.push(Source::Dealer(i as u32));
                    }
                    if let Some(m) = &s.monitor {
                        items.push(m.as_poll_item(zmq::POLLIN));
                        sources.push(Source::Monitor(i as u32));
                    }
                }
                let wait_ms = self
                    .next_tick
                    .saturating_duration_since(Instant::now())
                    .as_millis() as i64;
                if let Err(e) = zmq::poll(&mut items, wait_ms.max(0) + 1) {
                    tracing::error!(%e, "zmq poll failed");
                }
                if items[0].is_readable() {
                    self.shared.waker.reset();
                }
                items[1..]
                    .iter()
                    .zip(&sources)
                    .filter(|(it, _)| it.is_readable())
                    .map(|(_, s)| *s)
                    .collect()
            };
            for (peer, tid) in self.shared.take_tracked() {
                if let Some(s) = self.slots.get_mut(peer as usize) {
                    s.transfers.insert(tid);
                }
            }
            // Commands first: they include our own sends, which keeps
            // request latency low under inbound load.
            self.drain_commands();
            if !self.resolving.is_empty() {
                self.poll_lookups();
            }
            for s in readable {
                self.read(s);
            }
            if Instant::now() >= self.next_tick {
                self.on_tick();
                self.next_tick = Instant::now() + self.tick;
            }
        }
    }

    fn drain_commands(&mut self) {
        for _ in 0..COMMAND_BUDGET {
            let Ok(cmd) = self.rx.try_recv() else { break };
            match cmd {
                BridgeCmd::Send { peer, tid, bytes } => {
                    if let (Some(t), Some(s)) = (tid, self.slots.get_mut(peer as usize)) {
                        s.transfers.insert(t);
                    }
                    self.send_bytes(peer, bytes);
                }
                BridgeCmd::Inbound { peer, tid, msg } => self.on_transfer_msg(peer, tid, msg),
                BridgeCmd::Resolve {
                    tid,
                    target,
                    aborted,
                } => {
                    let give_up = Instant::now() + self.shared.config.timeouts.bootstrap_timeout;
                    let p = Pending {
                        tid,
                        target,
                        give_up,
                        aborted,
                    };
                    if !self.try_resolve(&p) {
                        self.pending.push(p);
                    }
                }
                BridgeCmd::Directory { target, result } => {
                    let entry = match result {
                        Ok(ranks) => Dir::Known(ranks),
                        Err(LookupError::Client(e)) if e.is_refusal() => {
                            tracing::error!(
                                ?target,
                                %e,
                                "the bootstrap service refused this node; requests to this \
                                 prefill engine fail"
                            );
                            Dir::Refused(Instant::now())
                        }
                        Err(e) => {
                            tracing::warn!(?target, %e, "bootstrap query failed; retrying");
                            Dir::Failed(Instant::now())
                        }
                    };
                    self.directory.insert(target, entry);
                    self.routes_changed(None);
                    self.retry_pending();
                }
                BridgeCmd::PeerUnreachable { peer } => {
                    if !self.liveness.is_dead(peer) {
                        tracing::warn!(peer, "data-plane connection failed; peer marked dead");
                    }
                    self.liveness.handle_dropped(peer);
                    self.on_deaths();
                }
                BridgeCmd::Stop => self.stop = true,
            }
        }
        // Leftovers wake us again at once.
        if !self.rx.is_empty() {
            self.shared.waker.wake();
        }
    }

    fn send_bytes(&mut self, peer: u32, bytes: Vec<u8>) {
        let Some(slot) = self.slots.get_mut(peer as usize) else {
            self.shared
                .counters
                .dropped_frames
                .fetch_add(1, Ordering::Relaxed);
            return;
        };
        let bytes = match slot.gate.outgoing(bytes) {
            auth::Outgoing::Send(b) => b,
            auth::Outgoing::Held => return,
            auth::Outgoing::Dropped => {
                self.shared
                    .counters
                    .dropped_frames
                    .fetch_add(1, Ordering::Relaxed);
                return;
            }
        };
        let slot = &self.slots[peer as usize];
        let r = match &slot.route {
            Route::Identity(id) => match &self.router {
                Some(router) => router
                    .send(id.as_slice(), zmq::SNDMORE | zmq::DONTWAIT)
                    .and_then(|()| router.send(bytes, zmq::DONTWAIT)),
                None => Err(zmq::Error::ENOTSOCK),
            },
            Route::Dealer(d) => d.send(bytes, zmq::DONTWAIT),
        };
        if r.is_ok() {
            Counters::inc(&self.shared.counters.sidechannel_sent);
        }
        if let Err(e) = r {
            tracing::debug!(peer, %e, "frame not sent");
            self.shared
                .counters
                .dropped_frames
                .fetch_add(1, Ordering::Relaxed);
        }
    }

    fn send_frame(&mut self, peer: u32, frame: &Frame) {
        self.send_bytes(peer, wire::encode(frame));
    }

    fn read(&mut self, source: Source) {
        if let Source::Monitor(i) = source {
            self.read_monitor(i);
            return;
        }
        for _ in 0..READ_BUDGET {
            let Some(parts) = self.receive(source) else {
                return;
            };
            self.on_message(source, parts);
        }
    }

    /// The next message waiting on `source`; `None` when there is none
    /// (or no socket, or it failed).
    fn receive(&self, source: Source) -> Option<Vec<Vec<u8>>> {
        let parts = match source {
            Source::Router => match &self.router {
                Some(r) => r.recv_multipart(zmq::DONTWAIT),
                None => return None,
            },
            Source::Dealer(i) => match self.slots.get(i as usize).map(|s| &s.route) {
                Some(Route::Dealer(d)) => d.recv_multipart(zmq::DONTWAIT),
                _ => return None,
            },
            Source::Monitor(_) => return None,
        };
        match parts {
            Ok(p) => Some(p),
            Err(zmq::Error::EAGAIN) => None,
            Err(e) => {
                tracing::warn!(%e, "zmq receive failed");
                None
            }
        }
    }

    /// Handles one message read from `source`: a handshake step, or a
    /// sealed frame for `handle_frame`.
    fn on_message(&mut self, source: Source, parts: Vec<Vec<u8>>) {
        let Some((peer, payload)) = self.sender_and_payload(source, parts) else {
            return;
        };
        if let Some((step, body)) = auth::handshake_message(&payload) {
            match (source, peer) {
                (Source::Dealer(i), _) => self.dealer_handshake(i, step, body),
                (_, Err(identity)) => self.router_handshake(identity, step, body),
                (_, Ok(p)) => {
                    if let Route::Identity(id) = &self.slots[p as usize].route {
                        self.router_handshake(id.clone(), step, body);
                    }
                }
            }
            return;
        }
        let Some(payload) = self.unseal(&peer, payload) else {
            return;
        };
        let frame = match wire::decode(&payload, &self.shared.config.frame_limits) {
            Ok(f) => {
                Counters::inc(&self.shared.counters.sidechannel_received);
                f
            }
            Err(wire::WireError::UnsupportedVersion { theirs, .. }) => {
                self.refuse(peer, theirs);
                return;
            }
            Err(e) => {
                self.bad_frame(&e.to_string());
                return;
            }
        };
        self.handle_frame(peer, frame);
    }

    /// Who sent `parts` (the slot, or the unknown ROUTER identity) and
    /// what it says; `None`, counted as a bad frame, when the parts are
    /// not those of `source`'s socket.
    fn sender_and_payload(
        &self,
        source: Source,
        mut parts: Vec<Vec<u8>>,
    ) -> Option<(Sender, Vec<u8>)> {
        match source {
            Source::Router => {
                if parts.len() != 2 {
                    self.bad_frame("wrong number of parts");
                    return None;
                }
                let payload = parts.pop().unwrap_or_default();
                let identity = parts.pop().unwrap_or_default();
                Some((
                    self.by_identity.get(&identity).copied().ok_or(identity),
                    payload,
                ))
            }
            Source::Dealer(i) => {
                if parts.len() != 1 {
                    self.bad_frame("wrong number of parts");
                    return None;
                }
                Some((Ok(i), parts.pop().unwrap_or_default()))
            }
            Source::Monitor(_) => None,
        }
    }

    /// Drains the monitor of slot `i`: a dropped connection marks the peer
    /// dead at once, failing its transfers fast. ZeroMQ reconnects by
    /// itself; the next hello answered clears the mark.
    fn read_monitor(&mut self, i: u32) {
        for _ in 0..READ_BUDGET {
            let Some(m) = self.slots.get(i as usize).and_then(|s| s.monitor.as_ref()) else {
                return;
            };
            let parts = match m.recv_multipart(zmq::DONTWAIT) {
                Ok(p) => p,
                Err(_) => return,
            };
            // Frame 1: event id (u16, little endian) and value (u32).
            let event = parts
                .first()
                .and_then(|f| f.get(..2))
                .map(|b| u16::from_le_bytes([b[0], b[1]]));
            if event == Some(zmq::SocketEvent::DISCONNECTED as u16) {
                self.rekey_dealer(i);
                self.liveness.handle_dropped(i);
                self.on_deaths();
            }
        }
    }

    fn bad_frame(&self, why: &str) {
        tracing::warn!(why, "side-channel frame rejected");
        self.shared
            .counters
            .bad_frames
            .fetch_add(1, Ordering::Relaxed);
    }

    /// `peer` is the slot, or the unknown ROUTER identity.
    fn handle_frame(&mut self, peer: Sender, frame: Frame) {
        let now = Instant::now();
        if let Frame::Refuse(refuse) = frame {
            self.on_refused(peer.ok(), refuse);
            return;
        }
        let peer = match peer {
            Ok(p) => p,
            Err(identity) => {
                // Only a hello introduces a new decode peer.
                let Frame::Hello(_) = &frame else {
                    self.bad_frame("frame from a peer that never said hello");
                    return;
                };
                // Decode ranks that restart come back with new identities;
                // when the table is full the slot of a dead one that no
                // transfer refers to any more is reused, so it stays bounded
                // without refusing newcomers forever.
                let Some(at) = self.room_for(false) else {
                    self.bad_frame("too many peers");
                    return;
                };
                let mut slot = Slot::new(Route::Identity(identity.clone()), None, String::new());
                if let Some(gate) = self.router_gates.take_session(&identity) {
                    slot.gate = gate;
                }
                let id = self.install(at, slot);
                self.by_identity.insert(identity, id);
                id
            }
        };
        if self.liveness.handle_heard(now, peer) {
            // The gauge first: whoever sees the recovery sees it cleared.
            self.publish_dead_count();
            Counters::inc(&self.shared.counters.peer_recoveries);
            let addr = self.slots.get(peer as usize).map(|s| s.addr.as_str());
            tracing::info!(peer, ?addr, "peer answered again; dead mark cleared");
        }
        match frame {
            Frame::Hello(h) => self.handle_hello(peer, h),
            Frame::Heartbeat { seq } => {
                // Recorded before it leaves, so the time can only be early.
                if self.slots.get(peer as usize).is_some() {
                    self.shared
                        .ack_sent(peer, seq, Instant::now(), TICKETS_KEPT);
                }
                self.send_frame(peer, &Frame::HeartbeatAck { seq });
            }
            Frame::HeartbeatAck { seq } => {
                if self.slots.get(peer as usize).is_some() {
                    self.shared.routes().set_ticket(peer, seq, now);
                }
            }
            Frame::Transfer { transfer_id, msg } => self.on_transfer_msg(peer, transfer_id, msg),
            Frame::NamedTransfer {
                transfer_id,
                request_id,
                msg,
            } => self.on_named_transfer(peer, transfer_id, request_id, msg),
            Frame::IdCollision { transfer_id } => self.on_id_collision(peer, transfer_id),
            Frame::Refuse(_) => unreachable!("handled before the peer lookup"),
        }
    }

    fn on_transfer_msg(&mut self, peer: u32, tid: TransferId, msg: Msg) {
        if self.intercept_refused(peer, tid, &msg) {
            return;
        }
        // Only transfers a machine took are tracked, so a peer sending
        // made-up ids cannot grow the set.
        if self.deliver(peer, tid, msg) {
            if let Some(s) = self.slots.get_mut(peer as usize) {
                s.transfers.insert(tid);
            }
        }
    }

    fn own_hello(&self) -> Option<Hello> {
        let local = self.shared.local.get()?;
        Some(Hello {
            engine_id: self.shared.config.engine_id.clone(),
            mode: self.shared.config.mode,
            model: local.model,
            layout: local.layout.clone(),
            endpoint: crate::resolve::advertised(
                &self.shared.config.host,
                self.shared.endpoint.get().map_or("", String::as_str),
            ),
        })
    }

    /// A peer's hello: its data-plane endpoint is looked up first when it
    /// names a host (a lookup on another thread: the bridge goes on, and
    /// [`Bridge::poll_lookups`] finishes the hello with the answer). A name
    /// is looked up again at every hello (and decode says hello again to a
    /// peer whose connection failed), so a peer that moved is reached at
    /// its new address.
    fn handle_hello(&mut self, peer: u32, h: Hello) {
        if self.shared.local.get().is_none() {
            // Not registered yet: the peer retries its hello every tick.
            return;
        }
        let named = h.endpoint.strip_prefix("tcp://").and_then(|rest| {
            crate::resolve::HostPort::parse(rest)
                .ok()
                .filter(|hp| hp.is_name())
        });
        if let (Some(host), Some(slot)) = (named, self.slots.get_mut(peer as usize)) {
            match self.resolver.start(&host) {
                Ok(lookup) => {
                    slot.hello_lookup = Some((h, lookup));
                    self.resolving.insert(peer);
                    return;
                }
                Err(e) => {
                    tracing::warn!(peer, %e, "peer's data-plane endpoint not looked up");
                    return self.complete_hello(peer, (h, None));
                }
            }
        }
        let endpoint = EndpointAddr::resolve(&h.endpoint, &self.resolver)
            .inspect_err(|e| tracing::warn!(peer, %e, "peer's data-plane endpoint unusable"))
            .ok();
        self.complete_hello(peer, (h, endpoint));
    }

    /// The hello of slot `i` whose endpoint lookup has its answer, if any.
    fn take_hello_answer(&mut self, i: usize) -> Option<(Hello, Option<EndpointAddr>)> {
        let slot = self.slots.get_mut(i)?;
        let answer = slot.hello_lookup.as_mut()?.1.poll()?;
        let (h, _) = slot.hello_lookup.take()?;
        let endpoint = answer
            .inspect_err(|e| tracing::warn!(peer = i, %e, "peer's data-plane endpoint unusable"))
            .ok()
            .map(EndpointAddr::Tcp);
        Some((h, endpoint))
    }

    /// Pairs with the peer of `h` (at data-plane `endpoint`, if usable)
    /// and answers its hello.
    fn complete_hello(&mut self, peer: u32, (h, endpoint): (Hello, Option<EndpointAddr>)) {
        let (Some(local), Some(direction)) = (self.shared.local.get(), self.direction(peer)) else {
            return;
        };
        let pair = if h.mode != self.shared.config.mode {
            Err(PeerUnfit::Mode {
                theirs: h.mode,
                ours: self.shared.config.mode,
            })
        } else if h.model != local.model {
            Err(PeerUnfit::Model)
        } else {
            let r = match direction {
                Direction::Send => PairLayout::new(&local.model, &local.layout, &h.layout),
                Direction::Recv => PairLayout::new(&local.model, &h.layout, &local.layout),
            };
            r.map_err(PeerUnfit::Layout)
        };
        if let Err(e) = &pair {
            tracing::warn!(peer, %e, "peer layout does not fit; its transfers will fail");
        }
        let data = Arc::new(PeerData {
            hello: h,
            pair,
            endpoint,
            direction,
        });
        self.shared.set_peer(peer, data);
        if let Some(s) = self.slots.get_mut(peer as usize) {
            s.ready = true;
            s.refused = None;
        }
        match direction {
            // Only decode ranks start a hello (prefill answers every one,
            // decode answers none), so no hello is ever answered twice.
            Direction::Send => {
                if let Some(mine) = self.own_hello() {
                    self.send_frame(peer, &Frame::Hello(mine));
                }
            }
            Direction::Recv => {
                // A first heartbeat at once, so the first requests to this
                // peer already carry a lease ticket.
                self.hb_seq += 1;
                let seq = self.hb_seq;
                self.send_frame(peer, &Frame::Heartbeat { seq });
                self.retry_pending();
            }
        }
    }

    /// Hands `msg` to the machine of `tid`; true if a live machine took it.
    fn deliver(&mut self, peer: u32, tid: TransferId, msg: Msg) -> bool {
        if self.handle.poll(tid).is_some_and(|p| p.is_terminal()) {
            // Finished here (released, nothing in flight) but not collected
            // yet: answer like for an unknown transfer so the peer does not
            // wait out its deadline.
            self.answer_unknown(peer, tid, msg);
            return false;
        }
        let shared = self.shared.clone();
        let delivery = match self.direction(peer) {
            Some(Direction::Send) => to_sender(&shared, &self.handle, PeerId(peer), tid, msg),
            Some(Direction::Recv) => to_receiver(&self.handle, PeerId(peer), tid, msg),
            None => return false,
        };
        match delivery {
            Delivery::Taken => return true,
            Delivery::Answer(answer) => self.send_frame(
                peer,
                &Frame::Transfer {
                    transfer_id: tid,
                    msg: answer,
                },
            ),
            Delivery::NoRoom => self.send_frame(
                peer,
                &Frame::Transfer {
                    transfer_id: tid,
                    msg: Msg::Abort,
                },
            ),
            Delivery::Refused(SubmitError::UnknownTransfer(_), Some(msg)) => {
                self.answer_unknown(peer, tid, msg)
            }
            Delivery::Refused(e, _) => {
                tracing::debug!(?tid, %e, "message not delivered");
                self.shared
                    .counters
                    .dropped_frames
                    .fetch_add(1, Ordering::Relaxed);
            }
        }
        false
    }

    /// We do not know (or no longer know) this transfer: tell the peer at
    /// once so it does not wait out its deadline, by the machines' rule
    /// ([`late_answer`]): after a success, the ended machine's last words
    /// again; otherwise an `Abort` to whoever wants to touch its blocks.
    fn answer_unknown(&mut self, peer: u32, tid: TransferId, msg: Msg) {
        // The machine's own last words (a `Status`, `Done` or `Abort`) are
        // queued before its phase turned terminal; send them first so our
        // answer never overtakes them.
        for _ in 0..64 {
            if self.rx.is_empty() {
                break;
            }
            self.drain_commands();
        }
        let outcome = (self.handle.poll(tid))
            .filter(|p| p.is_terminal())
            .or_else(|| self.shared.finished_phase(tid));
        // A late `Pull` is answered with a success only if it names the
        // blocks the transfer wrote to this peer: one that does not is a
        // new request reusing the id, and is told `Abort`.
        let outcome = match (&msg, self.shared.config.mode, outcome) {
            (Msg::Pull { dst_blocks, .. }, Mode::Push, Some(Phase::Success))
                if !self.shared.wrote(tid, PeerId(peer), dst_blocks) =>
            {
                None
            }
            _ => outcome,
        };
        let Some(answer) = late_answer(&msg, self.shared.config.mode, outcome) else {
            return;
        };
        tracing::debug!(
            ?tid,
            peer,
            ?answer,
            "answering a message for an unknown or finished transfer"
        );
        Counters::inc(&self.shared.counters.late_answers);
        self.send_frame(
            peer,
            &Frame::Transfer {
                transfer_id: tid,
                msg: answer,
            },
        );
    }

    fn on_tick(&mut self) {
        let now = Instant::now();
        let hello = self.own_hello();
        let (beat, probe) = (self.heartbeat.is_due(now), self.probe.is_due(now));
        if beat {
            self.hb_seq += 1;
        }
        let seq = self.hb_seq;
        for i in 0..self.slots.len() {
            // Decode probes its prefill peers; prefill only answers.
            if let Route::Dealer(_) = self.slots[i].route {
                let live = !self.liveness.is_dead(i as u32);
                if !(self.slots[i].ready && live) {
                    self.reresolve(i, probe);
                }
                if probe {
                    self.rehello_if_unanswered(i as u32, self.probe.period);
                }
                // A dealer whose name was never resolved has nowhere to send.
                let connected = !self.slots[i].connected.is_empty();
                let frame = match (&hello, self.slots[i].ready && live) {
                    (_, true) if beat => Some(Frame::Heartbeat { seq }),
                    (Some(h), false) if probe && connected => Some(Frame::Hello(h.clone())),
                    _ => None,
                };
                if let Some(f) = frame {
                    self.send_frame(i as u32, &f);
                }
            }
            // Forget transfers that ended, so the sets stay bounded by the
            // live requests.
            let handle = &self.handle;
            self.slots[i]
                .transfers
                .retain(|tid| handle.poll(*tid).is_some_and(|p| !p.is_terminal()));
        }
        // Decode ranks probe their prefill peers every tick (hello or
        // heartbeat), so on either side silence means the peer is gone,
        // busy or idle.
        self.liveness.handle_tick(now);
        self.on_deaths();
        if !self.pending.is_empty() {
            self.retry_pending();
        }
    }
}

/// What became of a message handed to the machine of its transfer.
enum Delivery {
    /// A live machine took it.
    Taken,
    /// No machine took it; the peer gets this answer.
    Answer(Msg),
    /// No machine took it: why, and the message when it came back.
    Refused(SubmitError, Option<Msg>),
    /// A `Pull` needed a new machine and the engine had no room for one;
    /// the peer is told to abort.
    NoRoom,
}

/// Hands `msg` to the send machine of `tid`, creating the machine when
/// decode's `Pull` (or `Unneeded`) comes before the engine's `sender`.
fn to_sender(
    shared: &Shared,
    h: &EngineHandle,
    peer: PeerId,
    tid: TransferId,
    msg: Msg,
) -> Delivery {
    if shared.is_receiving(tid) {
        // `Role::Both`: the id is this rank's receive, not a send; the
        // decode peer is told at once.
        tracing::warn!(
            ?tid,
            ?peer,
            "a decode peer names a transfer this rank receives"
        );
        return Delivery::Answer(Msg::Abort);
    }
    let event = inbound(shared, Direction::Send, peer, msg);
    match h.send_event(tid, event) {
        Ok(()) => Delivery::Taken,
        Err(r) => match (r.error, unwrap_send(r.value)) {
            // The first words of a transfer that already ended here (and
            // was collected): tell decode at once, as for any unknown
            // transfer, instead of starting a second machine that would
            // wait for an engine that is done.
            (SubmitError::UnknownTransfer(_), event) if shared.finished_phase(tid).is_some() => {
                match event {
                    send::Event::UnpairedPull { .. } => Delivery::Answer(Msg::NotPaired),
                    send::Event::Msg { msg, .. } => Delivery::Refused(r.error, Some(msg)),
                    _ => Delivery::Refused(r.error, None),
                }
            }
            (SubmitError::UnknownTransfer(_), event) if opens_transfer(&event) => {
                sender_for_early(shared, h, tid, event)
            }
            (e, send::Event::Msg { msg, .. }) => Delivery::Refused(e, Some(msg)),
            (e, _) => Delivery::Refused(e, None),
        },
    }
}

/// True for what decode sends first to a P rank: a `Pull` (paired or
/// not), an `Unneeded`, or the `Abort` of a request that ended on decode
/// before its `Pull` left. Each ends or starts the engine's request
/// whenever the engine gets to it.
fn opens_transfer(event: &send::Event) -> bool {
    matches!(
        event,
        send::Event::UnpairedPull { .. }
            | send::Event::Msg {
                msg: Msg::Pull { .. } | Msg::Unneeded | Msg::Abort,
                ..
            }
    )
}

/// Creates the send machine of `tid` for decode's early first words and
/// hands them to it.
fn sender_for_early(
    shared: &Shared,
    h: &EngineHandle,
    tid: TransferId,
    event: send::Event,
) -> Delivery {
    if let send::Event::Msg { msg, .. } = &event {
        announce_remote_request(shared, tid, msg);
    }
    // D asked before the engine called `sender`: create
    // the machine now (either may come first).
    if let Err(e) = shared.create_sender(h, tid) {
        tracing::warn!(?tid, error = %e, "cannot take a new transfer");
        return Delivery::NoRoom;
    }
    match h.send_event(tid, duplex::Event::Send(event)) {
        Ok(()) => Delivery::Taken,
        Err(r) => Delivery::Refused(r.error, None),
    }
}

/// The send event in a refused `event` (every event `to_sender` makes is one).
fn unwrap_send(event: duplex::Event) -> send::Event {
    match event {
        duplex::Event::Send(e) => e,
        duplex::Event::Recv(_) => unreachable!("to_sender sends send events only"),
    }
}

/// Reports a decode `Pull` for a transfer the engine has not started to
/// the node's event sink, if any, with how many blocks it asks for in each
/// group.
fn announce_remote_request(shared: &Shared, tid: TransferId, msg: &Msg) {
    let (
        Some(sink),
        Msg::Pull {
            dst_blocks,
            prefix_blocks,
            ..
        },
    ) = (&shared.config.events, msg)
    else {
        return;
    };
    let blocks_per_group = dst_blocks
        .iter()
        .zip(prefix_blocks)
        .map(|(d, p)| (d.len() as u32).saturating_add(*p))
        .collect();
    let _ = sink.tx.try_send(super::Event {
        tag: sink.tag,
        transfer_id: tid,
        kind: super::EventKind::Requested { blocks_per_group },
    });
}

/// Hands `msg` to the receive machine of `tid`.
fn to_receiver(h: &EngineHandle, peer: PeerId, tid: TransferId, msg: Msg) -> Delivery {
    match h.send_event(tid, duplex::Event::Recv(recv::Event::Msg { peer, msg })) {
        Ok(()) => Delivery::Taken,
        Err(r) => match r.value {
            duplex::Event::Recv(recv::Event::Msg { msg, .. }) => {
                Delivery::Refused(r.error, Some(msg))
            }
            _ => Delivery::Refused(r.error, None),
        },
    }
}

impl Bridge {
    /// Which way this rank moves KV with the peer in slot `peer`: it sends
    /// to a decode peer behind the ROUTER, and receives from a prefill peer
    /// behind one of its DEALERs.
    fn direction(&self, peer: u32) -> Option<Direction> {
        self.slots.get(peer as usize).map(|s| match s.route {
            Route::Identity(_) => Direction::Send,
            Route::Dealer(_) => Direction::Recv,
        })
    }

    fn abort_engine(&self, tid: TransferId) -> Result<(), SubmitError> {
        self.handle.abort(tid, AbortReason::Engine)
    }

    /// Tells the machine of `tid` that the peer in slot `peer` is dead.
    fn peer_dead(&self, tid: TransferId, peer: u32) {
        let p = PeerId(peer);
        let event = match self.direction(peer) {
            Some(Direction::Send) => duplex::Event::Send(send::Event::PeerDead { peer: p }),
            Some(Direction::Recv) => duplex::Event::Recv(recv::Event::PeerDead { peer: p }),
            None => return,
        };
        let _ = self.handle.send_event(tid, event);
    }
}

/// Number of peers marked dead now.
pub(crate) fn dead_peers(shared: &Shared) -> usize {
    shared.counters.dead_now.load(Ordering::Relaxed) as usize
}
