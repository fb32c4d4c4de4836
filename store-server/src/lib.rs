#![warn(missing_docs)]
//! `kvferry store serve`: a RAM store several engines share (docs/design.md
//! §13, "The store server").
//!
//! One glommio executor serves everything: the control connections
//! ([`kvferry_store::internal::proto`], the protocol client and server share), and a tcp data-plane endpoint through which the
//! server itself moves the bytes: for a put it reads the engine's blocks
//! into its arena ([`Op::Read`]), for a get it writes the arena into the
//! engine's blocks ([`Op::Write`]). Each descriptor is checked by the
//! server against the regions the engine's endpoint announced, by the
//! server's transport against its own arena, and by the engine's
//! endpoint against its registered regions and its fence. A put is
//! committed (visible) only once the whole batch landed.

use std::cell::RefCell;
use std::net::SocketAddr;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_lite::AsyncWriteExt;
use glommio::net::{TcpListener, TcpStream};
use glommio::{LocalExecutorBuilder, Placement};

use kvferry_auth::{ClusterKey, Rejects, Surface};
use kvferry_metrics::http::MetricsServer;
use kvferry_store::internal::arena::Arena;
use kvferry_store::internal::proto::{
    self, Answer, Channel, Item, KeyAnswer, Refusal, Reply, Request, REMOVED_PER_REPLY_MAX,
};
pub use kvferry_store::internal::space::{Space, SpaceStats, REMOVED_LOG_MAX};
use kvferry_transport::internal::registry::check_remote;
use kvferry_transport::{Desc, EndpointAddr, Op, Session, Transport, TransportError};
use kvferry_transport::{TcpConfig, TcpSession, TcpTransport};

/// How a store server runs.
#[derive(Clone, Debug)]
pub struct ServeConfig {
    /// Where engines connect (port 0: any free port).
    pub listen: SocketAddr,
    /// Bytes of RAM for values; allocated at start.
    pub capacity_bytes: u64,
    /// Where `/metrics` and `/health` are served, if anywhere.
    pub metrics_listen: Option<String>,
    /// The data-plane endpoint's settings.
    pub tcp: TcpConfig,
    /// Most values held at once, whatever their sizes (the index's bound);
    /// past it the least recently used make room, as for bytes.
    pub max_values: usize,
    /// Most engine connections served at once; more are closed at once.
    pub max_connections: usize,
    /// Most connections served at once from one address, so one host
    /// cannot take every slot (counted in
    /// `kvferry_rate_limited_total{surface="store"}` when it tries).
    pub max_connections_per_addr: usize,
    /// The longest budget a request may ask for.
    pub budget_max: Duration,
    /// A connection with no request for this long is closed (its engine
    /// reconnects on its next call).
    pub idle_max: Duration,
    /// The core the executor is pinned to, if any.
    pub core: Option<usize>,
    /// The cluster key: with one, every control connection and every
    /// data-plane connection is authenticated (docs/security.md); engines
    /// without it are refused and counted.
    pub key: Option<ClusterKey>,
    /// Listen beyond loopback without a key (anyone who reaches the port
    /// may put, get and remove values).
    pub allow_unauthenticated_remote: bool,
}

impl Default for ServeConfig {
    fn default() -> Self {
        ServeConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            capacity_bytes: 1 << 30,
            metrics_listen: None,
            tcp: kvferry_store::internal::proto::data_plane(),
            max_values: 1 << 22,
            max_connections: 256,
            max_connections_per_addr: 64,
            budget_max: Duration::from_secs(60),
            idle_max: Duration::from_secs(600),
            core: None,
            key: None,
            allow_unauthenticated_remote: false,
        }
    }
}

/// Why a server did not start.
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// A setting is out of range.
    #[error("bad configuration: {0}")]
    Config(String),
    /// The listen address could not be bound.
    #[error("binding {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The arena could not be allocated.
    #[error("allocating {bytes} bytes of store memory failed")]
    Alloc {
        /// Its size.
        bytes: u64,
    },
    /// The data-plane endpoint could not start.
    #[error("data plane: {0}")]
    Transport(#[from] TransportError),
    /// The metrics endpoint could not start.
    #[error("metrics endpoint: {0}")]
    Metrics(String),
    /// The executor thread could not start or ended early.
    #[error("executor: {0}")]
    Executor(String),
}

kvferry_metrics::counter_set! {
    /// What a server counts, shared with the metrics endpoint.
    #[derive(Debug, Default)]
    pub struct ServerCounters;
    /// A snapshot of [`ServerCounters`].
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
    pub struct ServerStats;
    /// Gets of a stored value.
    hits: Counter "kvferry_store_hits", "gets of a stored value";
    /// Gets of a key not stored.
    misses: Counter "kvferry_store_misses", "gets of a key not stored";
    /// Values evicted to make room.
    evictions: Counter "kvferry_store_evictions", "values evicted to make room";
    /// Values removed on request.
    removals: Counter "kvferry_store_removals", "values removed on request";
    /// Puts committed.
    commits: Counter "kvferry_store_commits", "puts committed";
    /// Puts refused for want of room.
    full: Counter "kvferry_store_full", "puts refused for want of room";
    /// Bytes of stored values.
    stored_bytes: Gauge "kvferry_store_stored_bytes", "bytes of stored values";
    /// Bytes stored or being written.
    used_bytes: Gauge "kvferry_store_used_bytes", "bytes stored or being written";
    /// Values stored.
    values: Gauge "kvferry_store_values", "values stored";
    /// The arena's size.
    capacity_bytes: Gauge "kvferry_store_capacity_bytes", "bytes of the arena";
    /// Bytes read from engines (puts).
    bytes_in: Counter "kvferry_store_read_bytes", "bytes read from engines";
    /// Bytes written to engines (gets).
    bytes_out: Counter "kvferry_store_written_bytes", "bytes written to engines";
    /// Requests answered.
    requests: Counter "kvferry_store_requests", "requests answered";
    /// Requests refused as a whole (malformed, no hello, unreachable).
    refused: Counter "kvferry_store_refused", "requests refused as a whole";
    /// Engine connections open now.
    connections: Gauge "kvferry_store_connections", "engine connections open";
    /// Batches whose bytes did not move (engine gone, fenced, timeout).
    transfer_failures: Counter "kvferry_store_transfer_failures", "batches whose bytes did not move";
    /// Batches to engines on this host moved through their shared memory.
    shm_batches: Counter "kvferry_store_shm_batches", "batches moved through an engine's shared memory";
}

impl ServerCounters {
    fn publish(&self, s: &SpaceStats) {
        let p = |a: &AtomicU64, v: u64| a.store(v, Ordering::Relaxed);
        p(&self.hits, s.hits);
        p(&self.misses, s.misses);
        p(&self.evictions, s.evictions);
        p(&self.removals, s.removals);
        p(&self.commits, s.commits);
        p(&self.full, s.full);
        p(&self.stored_bytes, s.stored_bytes);
        p(&self.used_bytes, s.used_bytes);
        p(&self.values, s.values);
    }

    fn add(a: &AtomicU64, n: u64) {
        a.fetch_add(n, Ordering::Relaxed);
    }
}

/// The OpenMetrics text of a server's stats and refusals.
pub fn metrics_text(s: &ServerStats, rejects: &Arc<Rejects>) -> String {
    let families = s.families();
    let rejects = Arc::clone(rejects);
    kvferry_metrics::render(move |encoder| {
        kvferry_metrics::encode_families(encoder, &families)?;
        kvferry_metrics::encode_auth_rejects(encoder, &rejects)
    })
}

/// A running store server; dropping it stops it.
pub struct StoreServer {
    local_addr: SocketAddr,
    counters: Arc<ServerCounters>,
    rejects: Arc<Rejects>,
    metrics: Option<MetricsServer>,
    stop: Option<flume::Sender<()>>,
    join: Option<glommio::ExecutorJoinHandle<()>>,
}

impl std::fmt::Debug for StoreServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreServer")
            .field("local_addr", &self.local_addr)
            .finish()
    }
}

impl StoreServer {
    /// Allocates the arena, binds `cfg.listen` and starts serving.
    pub fn start(cfg: ServeConfig) -> Result<StoreServer, ServeError> {
        validate(&cfg)?;
        let std_listener =
            std::net::TcpListener::bind(cfg.listen).map_err(|source| ServeError::Bind {
                addr: cfg.listen,
                source,
            })?;
        let local_addr = (std_listener.local_addr()).map_err(|source| ServeError::Bind {
            addr: cfg.listen,
            source,
        })?;
        let counters = Arc::new(ServerCounters::default());
        counters
            .capacity_bytes
            .store(cfg.capacity_bytes, Ordering::Relaxed);
        let rejects = Arc::clone(&cfg.tcp.rejects);
        let metrics = match &cfg.metrics_listen {
            Some(addr) => {
                let (c, r) = (Arc::clone(&counters), Arc::clone(&rejects));
                let source: kvferry_metrics::http::MetricsSource =
                    Arc::new(move || metrics_text(&c.load(), &r));
                let m = MetricsServer::start(addr, source)
                    .map_err(|e| ServeError::Metrics(e.to_string()))?;
                Some(m)
            }
            None => None,
        };
        let (stop, stop_rx) = flume::bounded::<()>(1);
        let (ready_tx, ready_rx) = flume::bounded::<Result<(), ServeError>>(1);
        let c = Arc::clone(&counters);
        let placement = cfg.core.map_or(Placement::Unbound, Placement::Fixed);
        let join = LocalExecutorBuilder::new(placement)
            .name("kvferry-store-serve")
            .spawn(move || async move {
                match Server::new(&cfg, c) {
                    Ok(server) => {
                        let _ = ready_tx.send(Ok(()));
                        serve(Rc::new(server), std_listener, stop_rx).await;
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                    }
                }
            })
            .map_err(|e| ServeError::Executor(e.to_string()))?;
        match ready_rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(e),
            Err(_) => return Err(ServeError::Executor("ended while starting".into())),
        }
        Ok(StoreServer {
            local_addr,
            counters,
            rejects,
            metrics,
            stop: Some(stop),
            join: Some(join),
        })
    }

    /// Where engines connect.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Where `/metrics` is served, if it is.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics.as_ref().map(MetricsServer::local_addr)
    }

    /// The counters now.
    pub fn stats(&self) -> ServerStats {
        self.counters.load()
    }

    /// Engines and frames refused on `surface` for failing authentication.
    pub fn auth_rejected(&self, surface: Surface) -> u64 {
        self.rejects.get(surface)
    }

    /// Connections turned away on `surface` for exceeding their address's
    /// share.
    pub fn rate_limited(&self, surface: Surface) -> u64 {
        self.rejects.limited(surface)
    }

    /// Serves until the process ends.
    pub fn wait(mut self) {
        if let Some(j) = self.join.take() {
            let _ = j.join();
        }
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(j) = self.join.take() {
            let _ = j.join();
        }
    }
}

fn validate(cfg: &ServeConfig) -> Result<(), ServeError> {
    let bad = |s: &str| Err(ServeError::Config(s.into()));
    if cfg.capacity_bytes == 0 || usize::try_from(cfg.capacity_bytes).is_err() {
        return bad("capacity_bytes must be positive and addressable");
    }
    if cfg.max_connections == 0
        || cfg.max_connections_per_addr == 0
        || cfg.max_values == 0
        || cfg.budget_max.is_zero()
        || cfg.idle_max.is_zero()
    {
        return bad("max_connections (also per address), max_values, budget_max and idle_max must be positive");
    }
    if cfg.key.is_none() && !cfg.listen.ip().is_loopback() && !cfg.allow_unauthenticated_remote {
        return Err(ServeError::Config(format!(
            "listening on {} without a cluster key: set {} (or allow unauthenticated \
             remote engines explicitly)",
            cfg.listen,
            kvferry_auth::KEY_FILE_ENV
        )));
    }
    cfg.tcp
        .validate()
        .map_err(|e| ServeError::Config(e.to_string()))
}

/// Everything the executor's tasks share.
struct Server {
    /// Dropped before `arena`: it may touch the arena until then.
    transport: TcpTransport,
    /// Zeroed, prefaulted pages, touched only by the transport (registered
    /// with it) while the server lives.
    arena: Arena,
    space: RefCell<Space>,
    counters: Arc<ServerCounters>,
    budget_max: Duration,
    idle_max: Duration,
    max_connections: usize,
    max_connections_per_addr: usize,
    /// Connections open now per address (entries only while above 0:
    /// at most `max_connections` of them).
    per_addr: RefCell<std::collections::HashMap<std::net::IpAddr, usize>>,
    /// The sockets of the connections served now.
    conns: RefCell<slab::Slab<std::os::fd::RawFd>>,
    /// Set once the server stops: a failed accept ends the loop.
    stopping: std::cell::Cell<bool>,
}

impl Server {
    fn new(cfg: &ServeConfig, counters: Arc<ServerCounters>) -> Result<Server, ServeError> {
        let mut arena =
            Arena::new(cfg.capacity_bytes).map_err(|e| ServeError::Alloc { bytes: e.bytes })?;
        arena.prefault();
        let data_addr = SocketAddr::new(cfg.listen.ip(), 0);
        let tcp = TcpConfig {
            key: cfg.key.clone(),
            ..cfg.tcp.clone()
        };
        let transport = TcpTransport::bind(data_addr, tcp)?;
        // SAFETY: the arena outlives the transport (`Server`'s field order)
        // and only the transport touches it.
        unsafe { transport.register(arena.as_ptr(), cfg.capacity_bytes as usize)? };
        Ok(Server {
            transport,
            arena,
            space: RefCell::new(Space::new(cfg.capacity_bytes, cfg.max_values)),
            counters,
            budget_max: cfg.budget_max,
            idle_max: cfg.idle_max,
            max_connections: cfg.max_connections,
            max_connections_per_addr: cfg.max_connections_per_addr,
            per_addr: RefCell::default(),
            conns: RefCell::new(slab::Slab::new()),
            stopping: std::cell::Cell::new(false),
        })
    }

    /// Counts a new connection against its address's share; `None`
    /// (counted, the connection dropped) when the address holds its
    /// share already.
    fn admit(&self, stream: &TcpStream) -> Option<Option<std::net::IpAddr>> {
        let Ok(ip) = stream.peer_addr().map(|a| a.ip()) else {
            return Some(None);
        };
        let mut per_addr = self.per_addr.borrow_mut();
        let n = per_addr.entry(ip).or_insert(0);
        if *n >= self.max_connections_per_addr {
            tracing::warn!(%ip, "store server: this address holds its share of connections; one more refused");
            self.rejects().count_limited(Surface::Store);
            return None;
        }
        *n += 1;
        Some(Some(ip))
    }

    /// Gives a closed connection's share back to its address.
    fn release(&self, addr: Option<std::net::IpAddr>) {
        let Some(ip) = addr else { return };
        let mut per_addr = self.per_addr.borrow_mut();
        if let Some(n) = per_addr.get_mut(&ip) {
            *n -= 1;
            if *n == 0 {
                per_addr.remove(&ip);
            }
        }
    }

    /// The cluster key control connections must prove: the data plane's,
    /// one key for both.
    fn key(&self) -> Option<&ClusterKey> {
        self.transport.config().key.as_ref()
    }

    /// Where refusals are counted: the data plane's counters, shared with
    /// the metrics endpoint.
    fn rejects(&self) -> &Rejects {
        &self.transport.config().rejects
    }

    fn base(&self) -> u64 {
        self.arena.base()
    }

    /// Shuts every engine connection down (the tasks holding the sockets
    /// end with the executor).
    fn hang_up_all(&self) {
        for (_, &fd) in self.conns.borrow().iter() {
            // SAFETY: a socket a live connection task owns; shutting it
            // down does not close it, so the fd is not reused under it.
            unsafe { libc::shutdown(fd, libc::SHUT_RDWR) };
        }
    }

    fn publish(&self) {
        self.counters.publish(&self.space.borrow().stats());
    }
}

/// Serves until `stop` says so, then shuts the listener and every
/// connection down, so the port is free again at once and engines see the
/// server gone now rather than at their calls' deadlines.
async fn serve(server: Rc<Server>, std_listener: std::net::TcpListener, stop: flume::Receiver<()>) {
    use std::os::fd::{FromRawFd, IntoRawFd};
    let listener_fd = std_listener.into_raw_fd();
    // SAFETY: a bound, listening socket we own, handed over to glommio.
    let listener = unsafe { TcpListener::from_raw_fd(listener_fd) };
    let acceptor = glommio::spawn_local(accept_loop(Rc::clone(&server), listener));
    let _ = stop.recv_async().await;
    server.stopping.set(true);
    // Shut down while the accept is pending, so it fails and the loop
    // ends; the fd stays open until the loop drops the listener.
    // SAFETY: shutting down a socket we own, not closing it.
    unsafe { libc::shutdown(listener_fd, libc::SHUT_RDWR) };
    server.hang_up_all();
    acceptor.await;
}

async fn accept_loop(server: Rc<Server>, listener: TcpListener) {
    loop {
        let stream = match listener.accept().await {
            Ok(s) => s,
            Err(_) if server.stopping.get() => return,
            Err(e) => {
                tracing::warn!("store server: accept failed: {e}");
                continue;
            }
        };
        let open = server.counters.connections.load(Ordering::Relaxed);
        if open >= server.max_connections as u64 {
            tracing::warn!("store server: {open} connections open; one more refused");
            continue;
        }
        let Some(addr) = server.admit(&stream) else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        ServerCounters::add(&server.counters.connections, 1);
        let fd = std::os::fd::AsRawFd::as_raw_fd(&stream);
        let slot = server.conns.borrow_mut().insert(fd);
        let s = Rc::clone(&server);
        glommio::spawn_local(async move {
            Conn::new(&s, &stream).serve(&s, stream).await;
            s.conns.borrow_mut().remove(slot);
            s.release(addr);
            s.counters.connections.fetch_sub(1, Ordering::Relaxed);
        })
        .detach();
    }
}

/// One engine's connection.
struct Conn {
    /// The engine's address on this connection: a hello must name an
    /// endpoint at this IP.
    peer: Option<std::net::IpAddr>,
    endpoint: Option<EndpointAddr>,
    session: Option<TcpSession>,
    /// The next removed key to tell this engine of.
    removed_at: u64,
}

/// Why a connection stops reading.
enum ReadEnd {
    Closed,
    Malformed(proto::ProtoError),
    Unauthenticated,
}

/// The connection's framing: with a key, after the handshake that must
/// open it (within the connect timeout); `None` when it failed (counted).
async fn open_channel(server: &Server, stream: &mut TcpStream) -> Option<Channel> {
    let Some(key) = server.key() else {
        return Some(Channel::plain());
    };
    let handshake = async { Some(Channel::respond(stream, key).await) };
    let timeout = async {
        glommio::timer::Timer::new(HANDSHAKE_TIMEOUT).await;
        None
    };
    match futures_lite::future::or(handshake, timeout).await {
        Some(Ok(channel)) => Some(channel),
        Some(Err(proto::ReadError::Closed)) => None,
        _ => {
            server.rejects().count(Surface::Store);
            tracing::warn!("store server: an engine did not authenticate; connection closed");
            None
        }
    }
}

/// Bound on a connection's handshake: a peer that connects and says
/// nothing holds its slot no longer.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

impl Conn {
    fn new(server: &Server, stream: &TcpStream) -> Conn {
        Conn {
            peer: stream.peer_addr().ok().map(|a| a.ip()),
            endpoint: None,
            session: None,
            removed_at: server.space.borrow().removed_end(),
        }
    }

    async fn serve(mut self, server: &Server, mut stream: TcpStream) {
        let Some(mut channel) = open_channel(server, &mut stream).await else {
            return;
        };
        loop {
            // Idle past the bound: a crashed engine's half-open
            // connection gives its slot back; a live one reconnects.
            let idle = async {
                glommio::timer::Timer::new(server.idle_max).await;
                Err(ReadEnd::Closed)
            };
            let read = read_request(&mut channel, &mut stream);
            let (id, req) = match futures_lite::future::or(read, idle).await {
                Ok(r) => r,
                Err(ReadEnd::Closed) => return,
                Err(ReadEnd::Unauthenticated) => {
                    server.rejects().count(Surface::Store);
                    tracing::warn!(
                        "store server: a frame's tag does not verify; connection closed"
                    );
                    return;
                }
                Err(ReadEnd::Malformed(e)) => {
                    tracing::warn!("store server: malformed request: {e}");
                    let refused = Answer::Refused(Refusal::Malformed);
                    let _ = self
                        .answer(server, (&mut channel, &mut stream), 0, refused)
                        .await;
                    return;
                }
            };
            let answer = self.handle(server, req).await;
            let to = (&mut channel, &mut stream);
            if self.answer(server, to, id, answer).await.is_err() {
                return;
            }
        }
    }

    async fn answer(
        &mut self,
        server: &Server,
        (channel, stream): (&mut Channel, &mut TcpStream),
        id: u64,
        answer: Answer,
    ) -> std::io::Result<()> {
        if matches!(answer, Answer::Refused(_)) {
            ServerCounters::add(&server.counters.refused, 1);
        }
        ServerCounters::add(&server.counters.requests, 1);
        server.publish();
        // A hello's answer tells none: the engine takes removed keys from
        // the answers to its calls only.
        let max = match answer {
            Answer::Hello { .. } => 0,
            _ => REMOVED_PER_REPLY_MAX,
        };
        let (removed, removed_lost, next) =
            (server.space.borrow()).removed_since(self.removed_at, max);
        self.removed_at = next;
        let reply = Reply {
            answer,
            removed,
            removed_lost,
            removed_next: next,
        };
        let frame = channel
            .encode(id, &reply)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
        stream.write_all(&frame).await
    }

    async fn handle(&mut self, server: &Server, req: Request) -> Answer {
        match req {
            Request::Hello {
                endpoint,
                removed_from,
            } => self.hello(server, &endpoint, removed_from),
            Request::Exists { keys } => {
                let space = server.space.borrow();
                Answer::Exists(keys.iter().map(|k| space.exists(k)).collect())
            }
            Request::Remove { keys } => {
                let mut space = server.space.borrow_mut();
                Answer::Keys(keys.iter().map(|k| space.remove(k)).collect())
            }
            Request::RemovePrefix { prefix } => {
                Answer::Removed(server.space.borrow_mut().remove_prefix(&prefix))
            }
            Request::Put { budget_ms, items } => {
                self.moved(server, Op::Read, budget_ms, &items).await
            }
            Request::Get { budget_ms, items } => {
                self.moved(server, Op::Write, budget_ms, &items).await
            }
        }
    }

    /// Takes the engine's endpoint: only one at the IP this connection
    /// comes from, and never the server's own, so a client can point the
    /// server's reads and writes neither at another engine nor at the
    /// arena itself.
    fn hello(&mut self, server: &Server, endpoint: &str, removed_from: Option<u64>) -> Answer {
        let own = server.transport.endpoint_addr();
        match endpoint.parse::<EndpointAddr>() {
            Ok(ep @ EndpointAddr::Tcp(addr)) if Some(addr.ip()) == self.peer && ep != own => {
                self.endpoint = Some(ep);
                self.session = None;
                let space = server.space.borrow();
                if let Some(from) = removed_from {
                    // A later position than the log's end is no position.
                    self.removed_at = from.min(space.removed_end());
                }
                Answer::Hello {
                    capacity_bytes: space.capacity(),
                }
            }
            _ => {
                tracing::warn!("store server: hello naming {endpoint:?} refused");
                Answer::Refused(Refusal::NoHello)
            }
        }
    }

    /// The session to the engine's endpoint, opened on first use within
    /// `bound` (an endpoint that accepts and never answers costs no more).
    async fn session(&mut self, server: &Server, bound: Duration) -> Result<TcpSession, Refusal> {
        if let Some(s) = &self.session {
            return Ok(s.clone());
        }
        let ep = self.endpoint.ok_or(Refusal::NoHello)?;
        match kvferry_transport::within(bound, server.transport.open(&ep)).await {
            Ok(s) => {
                self.session = Some(s.clone());
                Ok(s)
            }
            Err(e) => {
                tracing::warn!("store server: engine endpoint {ep}: {e}");
                Err(Refusal::EndpointUnreachable)
            }
        }
    }

    /// A put (`Op::Read`: the engine's blocks into reserved extents) or a
    /// get (`Op::Write`: pinned values into the engine's blocks): claim
    /// each item's extent, move every claimed item's bytes in one batch,
    /// then settle the claims (commit or abort; unpin).
    async fn moved(&mut self, server: &Server, op: Op, budget_ms: u32, items: &[Item]) -> Answer {
        let deadline = Instant::now() + budget(server, budget_ms);
        let left = deadline.saturating_duration_since(Instant::now());
        let session = match self.session(server, left).await {
            Ok(s) => s,
            Err(r) => return Answer::Refused(r),
        };
        let regions = session.remote_regions();
        let mut answers = vec![KeyAnswer::Done; items.len()];
        let mut claimed = Vec::new();
        let mut descs = Vec::new();
        for (i, it) in items.iter().enumerate() {
            let claim = value_len(&regions, it).and_then(|len| {
                let mut space = server.space.borrow_mut();
                match op {
                    Op::Read => space.reserve(&it.key, len),
                    Op::Write => space.pin(&it.key, len),
                }
            });
            match claim {
                Ok(off) => {
                    claimed.push(i);
                    push_descs(&mut descs, server.base() + off, it);
                }
                Err(a) => answers[i] = a,
            }
        }
        let result = self.transfer(server, &session, op, deadline, &descs).await;
        let mut space = server.space.borrow_mut();
        for &i in &claimed {
            let key = &items[i].key;
            match (op, result) {
                (Op::Read, Ok(())) => space.commit(key),
                (Op::Read, Err(_)) => space.abort(key),
                (Op::Write, _) => space.unpin(key),
            }
            if let Err(a) = result {
                answers[i] = a;
            }
        }
        if result.is_ok() {
            let counter = match op {
                Op::Read => &server.counters.bytes_in,
                Op::Write => &server.counters.bytes_out,
            };
            ServerCounters::add(counter, total_bytes(&descs));
            if session.uses_shm() && !descs.is_empty() {
                ServerCounters::add(&server.counters.shm_batches, 1);
            }
        }
        Answer::Keys(answers)
    }

    /// Moves one batch within the request's budget; a failed batch drops
    /// the session, so the next one re-learns the engine's regions.
    async fn transfer(
        &mut self,
        server: &Server,
        session: &TcpSession,
        op: Op,
        deadline: Instant,
        descs: &[Desc],
    ) -> Result<(), KeyAnswer> {
        if descs.is_empty() {
            return Ok(());
        }
        match session.transfer_until(op, descs, None, deadline).await {
            Ok(_) => Ok(()),
            Err(e) => {
                tracing::debug!("store server: {op:?} batch of {} failed: {e}", descs.len());
                ServerCounters::add(&server.counters.transfer_failures, 1);
                self.session = None;
                Err(match e {
                    TransportError::Timeout { .. } => KeyAnswer::Timeout,
                    _ => KeyAnswer::Transport,
                })
            }
        }
    }
}

/// A request's budget, cut to the server's bound.
fn budget(server: &Server, budget_ms: u32) -> Duration {
    Duration::from_millis(budget_ms.into()).min(server.budget_max)
}

/// The value's length, once every segment is inside the engine's regions.
fn value_len(regions: &[kvferry_transport::RegionInfo], it: &Item) -> Result<u64, KeyAnswer> {
    let spans = it.segments.iter().map(|s| (s.addr, s.len));
    check_remote(regions, spans).map_err(|_| KeyAnswer::OutOfBounds)?;
    (it.segments.iter())
        .try_fold(0u64, |sum, s| sum.checked_add(s.len))
        .ok_or(KeyAnswer::OutOfBounds)
}

/// One descriptor per engine segment, the value laid out in order from
/// `local` in the arena.
fn push_descs(descs: &mut Vec<Desc>, local: u64, it: &Item) {
    let mut at = local;
    for s in &it.segments {
        descs.push(Desc {
            local_addr: at,
            remote_addr: s.addr,
            len_bytes: s.len,
        });
        at += s.len;
    }
}

fn total_bytes(descs: &[Desc]) -> u64 {
    descs.iter().map(|d| d.len_bytes).sum()
}

/// The next request of a connection.
async fn read_request(
    channel: &mut Channel,
    stream: &mut TcpStream,
) -> Result<(u64, Request), ReadEnd> {
    match channel.read_body(stream).await {
        Ok(body) => proto::decode_request(&body).map_err(ReadEnd::Malformed),
        Err(proto::ReadError::Closed) => Err(ReadEnd::Closed),
        Err(proto::ReadError::Malformed(e)) => Err(ReadEnd::Malformed(e)),
        Err(proto::ReadError::Unauthenticated) => Err(ReadEnd::Unauthenticated),
    }
}
