//! The ZeroMQ side channel: one bridge thread per node owns every socket
//! (a ROUTER bound per prefill rank, a DEALER per decode rank and prefill
//! peer) and moves [`wire::Message`]s between them and the executors over
//! bounded flume channels.
//!
//! libzmq sockets are not thread-safe and are not io_uring-aware, so they
//! cannot live on the glommio executors; the bridge keeps them on one plain
//! thread and the executors only ever touch flume channels (which have async
//! `recv_async`/`send_async`).
//!
//! ```text
//!  executors ──Outbox::send──▶ [flume, bounded] ──▶ bridge ──zmq──▶ peers
//!            ◀── sink (flume, bounded, one per socket) ◀── decode ◀──
//! ```
//!
//! # Waking the bridge
//!
//! The bridge sleeps in `zmq_poll` on its sockets plus an `eventfd`.
//! [`Outbox::send`] pushes the message into the command channel and then
//! writes the eventfd, but only when no wake-up is already pending (an
//! atomic flag), so a burst of sends costs one `write` syscall and one
//! wake-up, not one per message. The alternative, polling with a short
//! timeout, either adds up to the timeout to every outgoing message (a
//! 1 ms timeout is five times the ~190 µs p50 of a bare DEALER/ROUTER round
//! trip) or burns a core spinning; the eventfd costs one `write` and one
//! `read` syscall per burst and nothing while idle (`benches/sidechannel.rs`
//! measures the whole bridge round trip next to a bare ZeroMQ one). An
//! inproc PAIR socket would work too but would need a lock around its
//! sending end, since many executors send.
//!
//! # Bad input
//!
//! Every inbound frame goes through [`wire::decode`] with the configured
//! [`Limits`]; frames with the wrong shape (wrong number of parts) or that
//! fail to decode are logged with `tracing`, counted in
//! [`Metrics::record_sidechannel_decode_error`] and [`SideChannel::decode_errors`],
//! and dropped. The bridge keeps serving. ZeroMQ's `MAXMSGSIZE` is set to
//! `max_frame_bytes`, so an oversized frame makes libzmq drop that peer's
//! connection before the bytes are ever buffered.
//!
//! # Connection events
//!
//! Each DEALER has a libzmq socket monitor; its sink receives
//! [`Event::PeerConnected`] after every completed handshake and
//! [`Event::PeerDisconnected`] when the connection drops (ZeroMQ then
//! reconnects by itself). Dealers use a stable routing id and routers enable
//! `ROUTER_HANDOVER`, so after a reconnect the prefill side reaches the
//! decode rank through the same [`Route`]. Routers get no such events: a
//! prefill rank learns that a decode rank is gone from missed heartbeats.
//!
//! # Use
//!
//! ```no_run
//! # use std::sync::Arc;
//! # use kvferry::bootstrap::Metrics;
//! # use kvferry::sidechannel::*;
//! # use kvferry::wire::*;
//! let metrics = Arc::new(Metrics::new());
//! let sc = SideChannel::start(SideChannelConfig::default(), metrics).unwrap();
//! // Prefill rank: bind a router, advertise `endpoint` via the bootstrap service.
//! let (p_sink, p_events) = flume::bounded(4096);
//! let (_router, endpoint) = sc.bind_router("tcp://0.0.0.0:0", p_sink).unwrap();
//! // Decode rank: one dealer per prefill rank it pairs with.
//! let (d_sink, d_events) = flume::bounded(4096);
//! let dealer = sc.connect_dealer(&endpoint, d_sink).unwrap();
//! let outbox = sc.outbox(); // clone into every executor
//! outbox.send(Outgoing { to: Route::Dealer(dealer),
//!                        msg: Message::AbortAck(AbortAck { transfer_id: 1 }) }).unwrap();
//! // On an executor: `while let Ok(ev) = p_events.recv_async().await { .. }`;
//! // reply with `Outgoing { to: from, .. }` where `from` came with the event.
//! # let _ = (p_events, d_events);
//! sc.shutdown();
//! ```
//!
//! # Backpressure
//!
//! Sinks are bounded. When a sink is full the bridge keeps the one event it
//! could not deliver, stops reading that socket (so ZeroMQ's high-water mark
//! pushes back on the peer) and retries every `stall_retry_ms`. Nothing is
//! dropped because a consumer is slow.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crate::bootstrap::Metrics;
use crate::wire::{self, Limits, Message};

/// Bridge settings. Every queue is bounded by one of these.
#[derive(Clone, Debug)]
pub struct SideChannelConfig {
    /// Decoder limits; `max_frame_bytes` is also ZeroMQ's `MAXMSGSIZE`.
    pub limits: Limits,
    /// Outgoing messages and commands queued for the bridge.
    pub command_capacity: usize,
    /// Sockets (routers + dealers) the bridge will own.
    pub max_sockets: usize,
    /// ZeroMQ send/receive high-water marks, in messages per peer.
    pub high_water_mark: i32,
    /// Messages read from one socket before the bridge looks at the others
    /// and at its command queue again (fairness).
    pub read_budget: usize,
    /// Commands handled per loop iteration, for the same reason.
    pub command_budget: usize,
    /// How often a stalled (full) sink is retried.
    pub stall_retry_ms: u64,
    /// How long `bind_router`/`connect_dealer` wait for the bridge.
    pub reply_timeout: Duration,
}

impl Default for SideChannelConfig {
    fn default() -> Self {
        SideChannelConfig {
            limits: Limits::default(),
            command_capacity: 65_536,
            max_sockets: 1024,
            high_water_mark: 100_000,
            read_budget: 256,
            command_budget: 1024,
            stall_retry_ms: 1,
            reply_timeout: Duration::from_secs(10),
        }
    }
}

/// A ROUTER socket owned by the bridge.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RouterId(pub u64);

/// A DEALER socket (one connection to one peer) owned by the bridge.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DealerId(pub u64);

/// Where a message came from, and where a reply goes.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Route {
    /// A peer connected to one of our routers, by its ZeroMQ routing id.
    Router { router: RouterId, identity: Vec<u8> },
    /// The peer at the other end of one of our dealers.
    Dealer(DealerId),
}

/// A message to send.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Outgoing {
    pub to: Route,
    pub msg: Message,
}

/// Why an outgoing message was not sent. Reported to the sink of the socket
/// it was meant for.
#[non_exhaustive]
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SendFailure {
    /// The router does not know this identity (the peer disconnected or
    /// never connected).
    #[error("peer not connected")]
    Unroutable,
    /// ZeroMQ's high-water mark for this peer is reached.
    #[error("peer queue full")]
    QueueFull,
    /// The message exceeds the limits the peer enforces (our misuse).
    #[error("message exceeds wire limits: {0}")]
    TooLarge(wire::WireError),
    /// Any other ZeroMQ error.
    #[error("zmq: {0}")]
    Zmq(String),
}

/// What a sink receives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// A decoded message from a peer.
    Message { from: Route, msg: Message },
    /// A message we sent through this socket could not be sent.
    SendFailed {
        to: Route,
        msg: Message,
        reason: SendFailure,
    },
    /// A dealer's connection to its peer completed the ZeroMQ handshake
    /// (first connect or reconnect).
    PeerConnected { dealer: DealerId },
    /// A dealer's connection to its peer dropped. ZeroMQ reconnects by
    /// itself; a `PeerConnected` follows if the peer comes back. This
    /// travels on a separate monitor socket, so messages the peer sent just
    /// before the drop may be delivered after it.
    PeerDisconnected { dealer: DealerId },
}

/// Why a side-channel call failed.
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum SideChannelError {
    /// The bridge thread is gone (shut down or panicked).
    #[error("side channel is closed")]
    Closed,
    /// The bridge did not answer within `reply_timeout`.
    #[error("side channel bridge did not answer in time")]
    Timeout,
    /// `max_sockets` sockets exist already (misuse or leak).
    #[error("too many side-channel sockets (limit {max})")]
    TooManySockets { max: usize },
    /// The endpoint is not a ZeroMQ endpoint (misuse).
    #[error("invalid side-channel endpoint {0:?}")]
    InvalidEndpoint(String),
    /// A ZeroMQ call failed (transport).
    #[error("zmq {op} {endpoint:?}: {source}")]
    Zmq {
        op: &'static str,
        endpoint: String,
        #[source]
        source: zmq::Error,
    },
    /// No router or dealer with that id (misuse).
    #[error("unknown side-channel socket")]
    UnknownSocket,
    /// The OS refused a thread or an eventfd.
    #[error("side channel setup: {0}")]
    Io(#[from] std::io::Error),
}

/// Why [`Outbox::try_send`]/[`Outbox::send`] did not queue a message; the
/// message comes back so nothing is lost.
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum SendError {
    /// The command queue is full (`try_send` only).
    #[error("side-channel queue full")]
    Full(Box<Outgoing>),
    /// The bridge is gone.
    #[error("side channel is closed")]
    Closed(Box<Outgoing>),
}

impl SendError {
    /// The message that was not queued.
    pub fn into_inner(self) -> Outgoing {
        match self {
            SendError::Full(o) | SendError::Closed(o) => *o,
        }
    }
}

enum Command {
    BindRouter {
        endpoint: String,
        sink: flume::Sender<Event>,
        reply: flume::Sender<Result<(RouterId, String), SideChannelError>>,
    },
    ConnectDealer {
        endpoint: String,
        sink: flume::Sender<Event>,
        reply: flume::Sender<Result<DealerId, SideChannelError>>,
    },
    Close {
        socket: SocketId,
        reply: flume::Sender<Result<(), SideChannelError>>,
    },
    Send(Outgoing),
}

/// Either kind of socket, for [`SideChannel::close`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SocketId {
    Router(RouterId),
    Dealer(DealerId),
}

/// Wakes the bridge out of `zmq_poll` through an eventfd, at most once per
/// batch of commands (see the module docs).
struct Waker {
    fd: OwnedFd,
    pending: AtomicBool,
}

impl Waker {
    fn new() -> std::io::Result<Waker> {
        // SAFETY: eventfd has no memory-safety preconditions; the returned fd
        // is checked and then owned exclusively by `OwnedFd`.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Waker {
            // SAFETY: `fd` is a fresh, valid descriptor nobody else owns.
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
            pending: AtomicBool::new(false),
        })
    }

    /// Called after queuing a command. The swap is AcqRel so that when it
    /// sees `true` (a wake-up is pending and will not be repeated), the
    /// bridge's later `swap(false)` synchronises with it and the bridge's
    /// drain sees our command.
    fn wake(&self) {
        if !self.pending.swap(true, Ordering::AcqRel) {
            let one: u64 = 1;
            // SAFETY: writes 8 bytes from a valid u64 to our own eventfd.
            // EAGAIN (counter saturated) still leaves the fd readable, which
            // is all we need, so the result is ignored.
            unsafe {
                libc::write(
                    self.fd.as_raw_fd(),
                    (&one as *const u64).cast(),
                    std::mem::size_of::<u64>(),
                );
            }
        }
    }

    /// Called by the bridge when the eventfd is readable, before draining.
    fn reset(&self) {
        let mut buf: u64 = 0;
        // SAFETY: reads 8 bytes into a valid u64 from our own nonblocking
        // eventfd; EAGAIN just means there was nothing to reset.
        unsafe {
            libc::read(
                self.fd.as_raw_fd(),
                (&mut buf as *mut u64).cast(),
                std::mem::size_of::<u64>(),
            );
        }
        self.pending.swap(false, Ordering::AcqRel);
    }
}

/// Sending half for executors: cheap to clone, `Send + Sync`.
#[derive(Clone)]
pub struct Outbox {
    tx: flume::Sender<Command>,
    waker: Arc<Waker>,
}

impl Outbox {
    /// Queues `out`, waiting while the queue is full.
    pub fn send(&self, out: Outgoing) -> Result<(), SendError> {
        match self.tx.send(Command::Send(out)) {
            Ok(()) => {
                self.waker.wake();
                Ok(())
            }
            Err(flume::SendError(cmd)) => Err(SendError::Closed(Box::new(unwrap_send(cmd)))),
        }
    }

    /// Queues `out` or fails at once when the queue is full.
    pub fn try_send(&self, out: Outgoing) -> Result<(), SendError> {
        match self.tx.try_send(Command::Send(out)) {
            Ok(()) => {
                self.waker.wake();
                Ok(())
            }
            Err(flume::TrySendError::Full(cmd)) => Err(SendError::Full(Box::new(unwrap_send(cmd)))),
            Err(flume::TrySendError::Disconnected(cmd)) => {
                Err(SendError::Closed(Box::new(unwrap_send(cmd))))
            }
        }
    }

    /// Queues `out`, yielding to the executor while the queue is full.
    pub async fn send_async(&self, out: Outgoing) -> Result<(), SendError> {
        match self.tx.send_async(Command::Send(out)).await {
            Ok(()) => {
                self.waker.wake();
                Ok(())
            }
            Err(flume::SendError(cmd)) => Err(SendError::Closed(Box::new(unwrap_send(cmd)))),
        }
    }

    fn command(&self, cmd: Command) -> Result<(), SideChannelError> {
        self.tx.send(cmd).map_err(|_| SideChannelError::Closed)?;
        self.waker.wake();
        Ok(())
    }
}

fn unwrap_send(cmd: Command) -> Outgoing {
    match cmd {
        Command::Send(out) => out,
        Command::BindRouter { .. } | Command::ConnectDealer { .. } | Command::Close { .. } => {
            unreachable!("only Send commands are queued through Outbox::send")
        }
    }
}

/// The node's side channel: the bridge thread and the handle to drive it.
/// Dropping it shuts the bridge down like [`SideChannel::shutdown`].
pub struct SideChannel {
    outbox: Outbox,
    stop: Arc<AtomicBool>,
    decode_errors: Arc<AtomicU64>,
    reply_timeout: Duration,
    thread: Option<JoinHandle<()>>,
}

impl SideChannel {
    /// Starts the bridge thread (it owns a fresh ZeroMQ context).
    pub fn start(
        config: SideChannelConfig,
        metrics: Arc<Metrics>,
    ) -> Result<SideChannel, SideChannelError> {
        let (tx, rx) = flume::bounded(config.command_capacity.max(1));
        let waker = Arc::new(Waker::new()?);
        let stop = Arc::new(AtomicBool::new(false));
        let decode_errors = Arc::new(AtomicU64::new(0));
        let bridge = Bridge {
            ctx: zmq::Context::new(),
            config: config.clone(),
            commands: rx,
            waker: Arc::clone(&waker),
            stop: Arc::clone(&stop),
            metrics,
            decode_errors: Arc::clone(&decode_errors),
            sockets: HashMap::new(),
        };
        let thread = std::thread::Builder::new()
            .name("kvferry-zmq-bridge".into())
            .spawn(move || bridge.run())?;
        Ok(SideChannel {
            outbox: Outbox { tx, waker },
            stop,
            decode_errors,
            reply_timeout: config.reply_timeout,
            thread: Some(thread),
        })
    }

    /// Binds a ROUTER on `endpoint` (`tcp://host:port`; port `0` or `*`
    /// picks a free one). Messages it receives go to `sink`. Returns the
    /// router's id and the endpoint actually bound, as libzmq reports it:
    /// for a wildcard host (`0.0.0.0`) the caller must put a reachable host
    /// in the address it registers with the bootstrap service.
    pub fn bind_router(
        &self,
        endpoint: &str,
        sink: flume::Sender<Event>,
    ) -> Result<(RouterId, String), SideChannelError> {
        let (reply, answer) = flume::bounded(1);
        self.outbox.command(Command::BindRouter {
            endpoint: endpoint.to_string(),
            sink,
            reply,
        })?;
        self.wait(answer)
    }

    /// Connects a DEALER to the router at `endpoint`. Messages it receives go
    /// to `sink`. Returns at once: ZeroMQ connects (and reconnects) in the
    /// background and queues what is sent meanwhile.
    pub fn connect_dealer(
        &self,
        endpoint: &str,
        sink: flume::Sender<Event>,
    ) -> Result<DealerId, SideChannelError> {
        let (reply, answer) = flume::bounded(1);
        self.outbox.command(Command::ConnectDealer {
            endpoint: endpoint.to_string(),
            sink,
            reply,
        })?;
        self.wait(answer)
    }

    /// [`SideChannel::connect_dealer`] for async callers (executors that
    /// discover a new prefill peer at run time).
    pub async fn connect_dealer_async(
        &self,
        endpoint: &str,
        sink: flume::Sender<Event>,
    ) -> Result<DealerId, SideChannelError> {
        let (reply, answer) = flume::bounded(1);
        self.outbox
            .tx
            .send_async(Command::ConnectDealer {
                endpoint: endpoint.to_string(),
                sink,
                reply,
            })
            .await
            .map_err(|_| SideChannelError::Closed)?;
        self.outbox.waker.wake();
        answer
            .recv_async()
            .await
            .map_err(|_| SideChannelError::Closed)?
    }

    /// Closes a router or dealer (e.g. to drop a dead peer); messages still
    /// queued for it are discarded.
    pub fn close(&self, socket: SocketId) -> Result<(), SideChannelError> {
        let (reply, answer) = flume::bounded(1);
        self.outbox.command(Command::Close { socket, reply })?;
        self.wait(answer)
    }

    /// A sending handle for executors.
    pub fn outbox(&self) -> Outbox {
        self.outbox.clone()
    }

    /// Frames rejected by the decoder (or with the wrong number of parts)
    /// since start.
    pub fn decode_errors(&self) -> u64 {
        self.decode_errors.load(Ordering::Relaxed)
    }

    /// Stops the bridge after it has handed the commands already queued to
    /// ZeroMQ, closes every socket (linger 0) and joins the thread.
    pub fn shutdown(mut self) {
        self.stop_and_join();
    }

    fn stop_and_join(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Force a wake even if one is pending: the flag alone would not
        // interrupt a `zmq_poll` with no timeout.
        self.outbox.waker.pending.store(false, Ordering::SeqCst);
        self.outbox.waker.wake();
        if let Some(thread) = self.thread.take() {
            if thread.join().is_err() {
                tracing::error!("side-channel bridge thread panicked");
            }
        }
    }

    fn wait<T>(
        &self,
        answer: flume::Receiver<Result<T, SideChannelError>>,
    ) -> Result<T, SideChannelError> {
        match answer.recv_timeout(self.reply_timeout) {
            Ok(result) => result,
            Err(flume::RecvTimeoutError::Timeout) => Err(SideChannelError::Timeout),
            Err(flume::RecvTimeoutError::Disconnected) => Err(SideChannelError::Closed),
        }
    }
}

impl Drop for SideChannel {
    fn drop(&mut self) {
        self.stop_and_join();
    }
}

struct Sock {
    socket: zmq::Socket,
    /// Dealers only: the PAIR end of libzmq's socket monitor, which reports
    /// connects and disconnects.
    monitor: Option<zmq::Socket>,
    sink: flume::Sender<Event>,
    /// The event the sink had no room for; while set, the socket is not read.
    stalled: Option<Event>,
}

struct Bridge {
    ctx: zmq::Context,
    config: SideChannelConfig,
    commands: flume::Receiver<Command>,
    waker: Arc<Waker>,
    stop: Arc<AtomicBool>,
    metrics: Arc<Metrics>,
    decode_errors: Arc<AtomicU64>,
    sockets: HashMap<SocketId, Sock>,
}

/// Parts kept from one inbound multipart message; a router message has two
/// (identity, payload), a dealer message one. More is malformed, and the
/// excess parts are received and dropped without being kept.
const MAX_PARTS: usize = 2;

impl Bridge {
    fn run(mut self) {
        let mut more_commands = false;
        let mut ids: Vec<SocketId> = Vec::new();
        let mut parts: Vec<zmq::Message> = Vec::with_capacity(MAX_PARTS);
        while !self.stop.load(Ordering::SeqCst) {
            ids.clear();
            ids.extend(self.sockets.keys().copied());
            let any_stalled = self.sockets.values().any(|s| s.stalled.is_some());
            let timeout_ms: i64 = if more_commands {
                0
            } else if any_stalled {
                self.config.stall_retry_ms as i64
            } else {
                -1
            };

            let (wake_ready, readable) = {
                let mut items = Vec::with_capacity(2 * ids.len() + 1);
                items.push(zmq::PollItem::from_fd(
                    self.waker.fd.as_raw_fd(),
                    zmq::POLLIN,
                ));
                for id in &ids {
                    let sock = &self.sockets[id];
                    // A stalled socket is not polled: its peer is pushed back
                    // by ZeroMQ's high-water mark until the sink drains.
                    let events = if sock.stalled.is_some() {
                        zmq::PollEvents::empty()
                    } else {
                        zmq::POLLIN
                    };
                    items.push(sock.socket.as_poll_item(events));
                    // Routers have no monitor. Their second slot is a
                    // negative fd, which poll(2) ignores, so every socket
                    // has two slots and the readiness below maps back by
                    // index. It must not be the router socket a second
                    // time: zmq_poll reads ZMQ_EVENTS once per item, and the
                    // second read would consume the edge-triggered wake-up
                    // of a message that arrived between the two reads
                    // without reporting it, and the bridge would sleep with
                    // a message waiting.
                    match &sock.monitor {
                        Some(monitor) => items.push(monitor.as_poll_item(events)),
                        None => items.push(zmq::PollItem::from_fd(-1, zmq::PollEvents::empty())),
                    }
                }
                match zmq::poll(&mut items, timeout_ms) {
                    Ok(_) => {}
                    Err(zmq::Error::EINTR) => continue,
                    Err(err) => {
                        // Only a bug (a closed socket in the set) gets here;
                        // leave rather than spin on the error.
                        tracing::error!(%err, "side-channel bridge: zmq_poll failed, stopping");
                        break;
                    }
                }
                let wake_ready = items[0].is_readable();
                let readable: Vec<bool> = items[1..].iter().map(|i| i.is_readable()).collect();
                (wake_ready, readable)
            };

            if wake_ready {
                self.waker.reset();
            }
            more_commands = self.drain_commands();

            for (id, ready) in ids.iter().zip(readable.chunks_exact(2)) {
                self.service_socket(*id, ready[0], ready[1], &mut parts);
            }
        }
        // Hand what was queued before the shutdown to ZeroMQ, best effort:
        // with linger 0 it is only delivered if it leaves right away. One
        // queue's worth at most, so senders that keep going cannot hold the
        // shutdown up.
        let budget = self.config.command_budget.max(1);
        for _ in 0..=self.config.command_capacity / budget {
            if !self.drain_commands() {
                break;
            }
        }
        for (_, sock) in self.sockets.drain() {
            let _ = sock.socket.set_linger(0);
        }
    }

    /// Handles up to `command_budget` commands; true if more are waiting.
    fn drain_commands(&mut self) -> bool {
        for _ in 0..self.config.command_budget.max(1) {
            match self.commands.try_recv() {
                Ok(cmd) => self.handle_command(cmd),
                Err(flume::TryRecvError::Empty) => return false,
                Err(flume::TryRecvError::Disconnected) => {
                    // Every handle is gone: nobody can send or read any more.
                    self.stop.store(true, Ordering::SeqCst);
                    return false;
                }
            }
        }
        !self.commands.is_empty()
    }

    fn handle_command(&mut self, cmd: Command) {
        match cmd {
            Command::BindRouter {
                endpoint,
                sink,
                reply,
            } => {
                let result = self.bind_router(&endpoint, sink);
                let _ = reply.send(result);
            }
            Command::ConnectDealer {
                endpoint,
                sink,
                reply,
            } => {
                let result = self.connect_dealer(&endpoint, sink);
                let _ = reply.send(result);
            }
            Command::Close { socket, reply } => {
                let result = match self.sockets.remove(&socket) {
                    Some(sock) => {
                        let _ = sock.socket.set_linger(0);
                        Ok(())
                    }
                    None => Err(SideChannelError::UnknownSocket),
                };
                let _ = reply.send(result);
            }
            Command::Send(out) => self.send(out),
        }
    }

    fn new_socket(
        &mut self,
        kind: zmq::SocketType,
        endpoint: &str,
    ) -> Result<zmq::Socket, SideChannelError> {
        if self.sockets.len() >= self.config.max_sockets {
            return Err(SideChannelError::TooManySockets {
                max: self.config.max_sockets,
            });
        }
        if !endpoint.contains("://") {
            return Err(SideChannelError::InvalidEndpoint(endpoint.to_string()));
        }
        let zmq_err = |op| {
            let endpoint = endpoint.to_string();
            move |source| SideChannelError::Zmq {
                op,
                endpoint,
                source,
            }
        };
        let socket = self.ctx.socket(kind).map_err(zmq_err("socket"))?;
        socket.set_linger(0).map_err(zmq_err("setsockopt"))?;
        socket
            .set_maxmsgsize(self.config.limits.max_frame_bytes as i64)
            .map_err(zmq_err("setsockopt"))?;
        socket
            .set_sndhwm(self.config.high_water_mark)
            .map_err(zmq_err("setsockopt"))?;
        socket
            .set_rcvhwm(self.config.high_water_mark)
            .map_err(zmq_err("setsockopt"))?;
        Ok(socket)
    }

    fn bind_router(
        &mut self,
        endpoint: &str,
        sink: flume::Sender<Event>,
    ) -> Result<(RouterId, String), SideChannelError> {
        let socket = self.new_socket(zmq::ROUTER, endpoint)?;
        let sockopt_err = |source| SideChannelError::Zmq {
            op: "setsockopt",
            endpoint: endpoint.to_string(),
            source,
        };
        // Unknown identities fail the send (EHOSTUNREACH) instead of being
        // silently dropped, so a reply to a vanished peer is reported.
        socket.set_router_mandatory(true).map_err(sockopt_err)?;
        // A dealer that reconnects with its (stable) routing id takes over
        // the route at once, even if the old connection is not yet known to
        // be dead; without this the reconnect would be refused.
        socket.set_router_handover(true).map_err(sockopt_err)?;
        // libzmq spells "any port" `*`; accept the usual `:0` too.
        let bind_to = match endpoint.strip_suffix(":0") {
            Some(prefix) => format!("{prefix}:*"),
            None => endpoint.to_string(),
        };
        socket
            .bind(&bind_to)
            .map_err(|source| SideChannelError::Zmq {
                op: "bind",
                endpoint: endpoint.to_string(),
                source,
            })?;
        let bound = match socket.get_last_endpoint() {
            Ok(Ok(s)) => s,
            Ok(Err(bytes)) => String::from_utf8_lossy(&bytes).into_owned(),
            Err(_) => bind_to,
        };
        let id = RouterId(next_socket_id());
        self.sockets.insert(
            SocketId::Router(id),
            Sock {
                socket,
                monitor: None,
                sink,
                stalled: None,
            },
        );
        tracing::debug!(router = id.0, endpoint = %bound, "side-channel router bound");
        Ok((id, bound))
    }

    fn connect_dealer(
        &mut self,
        endpoint: &str,
        sink: flume::Sender<Event>,
    ) -> Result<DealerId, SideChannelError> {
        let socket = self.new_socket(zmq::DEALER, endpoint)?;
        let id = DealerId(next_socket_id());
        let zmq_err = |op| {
            move |source| SideChannelError::Zmq {
                op,
                endpoint: endpoint.to_string(),
                source,
            }
        };
        // An explicit routing id that stays the same across reconnects, so
        // a peer's ROUTER keeps addressing us by the same route after a
        // network blip (libzmq would otherwise give every new connection a
        // fresh random id, and replies to the old one would be unroutable).
        socket
            .set_identity(&dealer_identity(id))
            .map_err(zmq_err("setsockopt"))?;
        // The monitor is attached before connecting so the first handshake
        // is reported too.
        let monitor_endpoint = format!("inproc://kvferry-monitor-{}", id.0);
        socket
            .monitor(
                &monitor_endpoint,
                (zmq::SocketEvent::HANDSHAKE_SUCCEEDED as i32)
                    | (zmq::SocketEvent::DISCONNECTED as i32),
            )
            .map_err(zmq_err("monitor"))?;
        let monitor = self.ctx.socket(zmq::PAIR).map_err(zmq_err("socket"))?;
        monitor.set_linger(0).map_err(zmq_err("setsockopt"))?;
        monitor
            .connect(&monitor_endpoint)
            .map_err(zmq_err("connect"))?;
        socket.connect(endpoint).map_err(zmq_err("connect"))?;
        self.sockets.insert(
            SocketId::Dealer(id),
            Sock {
                socket,
                monitor: Some(monitor),
                sink,
                stalled: None,
            },
        );
        tracing::debug!(dealer = id.0, endpoint, "side-channel dealer connected");
        Ok(id)
    }

    fn send(&mut self, out: Outgoing) {
        let socket_id = match &out.to {
            Route::Router { router, .. } => SocketId::Router(*router),
            Route::Dealer(dealer) => SocketId::Dealer(*dealer),
        };
        let Some(sock) = self.sockets.get(&socket_id) else {
            // No sink to report to: the socket was closed or never existed.
            self.metrics.record_sidechannel_send_failure();
            tracing::debug!(
                ?socket_id,
                kind = out.msg.kind(),
                "side-channel send to unknown socket dropped"
            );
            return;
        };
        let limits = &self.config.limits;
        let frame = wire::encode(&out.msg);
        let checked = match out.msg.check_limits(limits) {
            Err(err) => Err(err),
            Ok(()) if frame.len() > limits.max_frame_bytes => Err(wire::WireError::FrameTooLarge {
                len_bytes: frame.len(),
                max_bytes: limits.max_frame_bytes,
            }),
            Ok(()) => Ok(()),
        };
        let result = match checked {
            Err(err) => Err(SendFailure::TooLarge(err)),
            Ok(()) => {
                let sent = match &out.to {
                    Route::Router { identity, .. } => sock
                        .socket
                        .send(identity.as_slice(), zmq::SNDMORE | zmq::DONTWAIT)
                        .and_then(|()| sock.socket.send(frame, zmq::DONTWAIT)),
                    Route::Dealer(_) => sock.socket.send(frame, zmq::DONTWAIT),
                };
                sent.map_err(|err| match err {
                    zmq::Error::EHOSTUNREACH => SendFailure::Unroutable,
                    zmq::Error::EAGAIN => SendFailure::QueueFull,
                    other => SendFailure::Zmq(other.to_string()),
                })
            }
        };
        match result {
            Ok(()) => self.metrics.record_sidechannel_sent(),
            Err(reason) => {
                self.metrics.record_sidechannel_send_failure();
                tracing::debug!(?socket_id, kind = out.msg.kind(), %reason, "side-channel send failed");
                let event = Event::SendFailed {
                    to: out.to,
                    msg: out.msg,
                    reason,
                };
                if sock.sink.try_send(event).is_err() {
                    tracing::warn!(
                        ?socket_id,
                        "side-channel sink full or gone; send failure not reported"
                    );
                }
            }
        }
    }

    /// Delivers a stalled event if the sink has room now, then reads up to
    /// `read_budget` messages (and monitor events) if the socket is readable.
    fn service_socket(
        &mut self,
        id: SocketId,
        readable: bool,
        monitor_readable: bool,
        parts: &mut Vec<zmq::Message>,
    ) {
        let Some(sock) = self.sockets.get_mut(&id) else {
            return;
        };
        let retried = match sock.stalled.take() {
            Some(event) => {
                if !self.deliver(id, event) {
                    return;
                }
                true
            }
            None => false,
        };
        // After a retried stall there may be queued messages and monitor
        // events even if the poll did not report them: the socket was not
        // polled while stalled.
        if retried || monitor_readable {
            for _ in 0..self.config.read_budget.max(1) {
                let Some(event) = self.recv_monitor_event(id) else {
                    break;
                };
                if !self.deliver(id, event) {
                    return;
                }
            }
        }
        if !(retried || readable) {
            return;
        }
        for _ in 0..self.config.read_budget.max(1) {
            let sock = self.sockets.get_mut(&id).expect("looked up above");
            let total_parts = match recv_parts(&sock.socket, parts) {
                Ok(Some(n)) => n,
                Ok(None) => return,
                Err(err) => {
                    tracing::warn!(?id, %err, "side-channel recv failed");
                    return;
                }
            };
            let Some(event) = self.decode(id, parts, total_parts) else {
                continue;
            };
            self.metrics.record_sidechannel_received();
            if !self.deliver(id, event) {
                return;
            }
        }
    }

    /// Hands `event` to the socket's sink. False when the sink is full: the
    /// event is kept and the socket stalls until the sink has room.
    fn deliver(&mut self, id: SocketId, event: Event) -> bool {
        let sock = self
            .sockets
            .get_mut(&id)
            .expect("caller looked the socket up");
        match sock.sink.try_send(event) {
            Ok(()) => true,
            Err(flume::TrySendError::Full(event)) => {
                sock.stalled = Some(event);
                false
            }
            Err(flume::TrySendError::Disconnected(event)) => {
                tracing::debug!(?id, ?event, "side-channel sink gone; event dropped");
                true
            }
        }
    }

    /// Reads one event from a dealer's monitor, if one is waiting. libzmq
    /// sends each as two parts: 2 bytes of event id and 4 of value, then
    /// the endpoint.
    fn recv_monitor_event(&mut self, id: SocketId) -> Option<Event> {
        let SocketId::Dealer(dealer) = id else {
            return None;
        };
        let monitor = self.sockets.get(&id)?.monitor.as_ref()?;
        loop {
            let frames = match monitor.recv_multipart(zmq::DONTWAIT) {
                Ok(frames) => frames,
                Err(zmq::Error::EAGAIN) => return None,
                Err(err) => {
                    tracing::warn!(?id, %err, "side-channel monitor recv failed");
                    return None;
                }
            };
            let Some(head) = frames.first().filter(|f| f.len() >= 2) else {
                continue;
            };
            let event = u16::from_ne_bytes([head[0], head[1]]);
            if event == zmq::SocketEvent::HANDSHAKE_SUCCEEDED.to_raw() {
                tracing::debug!(dealer = dealer.0, "side-channel peer connected");
                return Some(Event::PeerConnected { dealer });
            }
            if event == zmq::SocketEvent::DISCONNECTED.to_raw() {
                tracing::info!(dealer = dealer.0, "side-channel peer disconnected");
                return Some(Event::PeerDisconnected { dealer });
            }
            // Other events (monitor stopped) carry nothing for consumers.
        }
    }

    /// Turns the parts of one inbound message into an event, or counts and
    /// logs why it cannot.
    fn decode(&self, id: SocketId, parts: &[zmq::Message], total_parts: usize) -> Option<Event> {
        let (from, payload) = match (id, total_parts) {
            (SocketId::Router(router), 2) => (
                Route::Router {
                    router,
                    identity: parts[0].to_vec(),
                },
                &parts[1],
            ),
            (SocketId::Dealer(dealer), 1) => (Route::Dealer(dealer), &parts[0]),
            (SocketId::Router(_) | SocketId::Dealer(_), n) => {
                self.count_decode_error();
                tracing::warn!(
                    ?id,
                    parts = n,
                    "side-channel message with the wrong number of parts dropped"
                );
                return None;
            }
        };
        match wire::decode(payload, &self.config.limits) {
            Ok(msg) => Some(Event::Message { from, msg }),
            Err(err) => {
                self.count_decode_error();
                tracing::warn!(?id, ?from, %err, len_bytes = payload.len(), "side-channel frame rejected");
                None
            }
        }
    }

    fn count_decode_error(&self) {
        self.decode_errors.fetch_add(1, Ordering::Relaxed);
        self.metrics.record_sidechannel_decode_error();
    }
}

/// Socket ids are unique in the process, not just per bridge, so dealer
/// routing ids derived from them never collide between two bridges of one
/// process (a demo runs several nodes in one process).
fn next_socket_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// A routing id unique to this process, bridge and dealer: a marker byte
/// (ids starting with 0 are reserved by libzmq), the pid, a per-process
/// random value, and the dealer id.
fn dealer_identity(id: DealerId) -> Vec<u8> {
    use std::hash::{BuildHasher, Hasher};
    static NONCE: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    let nonce = *NONCE.get_or_init(|| {
        // RandomState is seeded from the OS; hashing the time on top keeps
        // two bridges of one process apart even if it were not.
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0),
        );
        h.finish()
    });
    let mut out = Vec::with_capacity(21);
    out.push(b'k');
    out.extend_from_slice(&std::process::id().to_le_bytes());
    out.extend_from_slice(&nonce.to_le_bytes());
    out.extend_from_slice(&id.0.to_le_bytes());
    out
}

/// Receives one multipart message without blocking. Keeps at most
/// `MAX_PARTS` parts in `parts` and returns how many parts there were in
/// total, or `None` when nothing is waiting.
fn recv_parts(
    socket: &zmq::Socket,
    parts: &mut Vec<zmq::Message>,
) -> Result<Option<usize>, zmq::Error> {
    parts.clear();
    let mut first = zmq::Message::new();
    match socket.recv(&mut first, zmq::DONTWAIT) {
        Ok(()) => {}
        Err(zmq::Error::EAGAIN) => return Ok(None),
        Err(err) => return Err(err),
    }
    parts.push(first);
    let mut total = 1;
    // ZeroMQ delivers a multipart message atomically: once the first part is
    // here, the rest are too, so these receives do not wait.
    while socket.get_rcvmore()? {
        let mut part = zmq::Message::new();
        socket.recv(&mut part, 0)?;
        total += 1;
        if parts.len() < MAX_PARTS {
            parts.push(part);
        }
    }
    Ok(Some(total))
}
