//! The `kvferry://HOST:PORT` backend: an engine's side of `kvferry store
//! serve` (store/DESIGN.md, "The store server").
//!
//! The engine copies no value: it registers its KV memory with a tcp
//! data-plane endpoint of its own, tells the server where that endpoint
//! listens, and sends control requests ([`super::proto`]) naming the
//! segments of each value; the server reads them (put) or writes them
//! (get) over the data plane.
//!
//! # Threads and the fence
//!
//! The endpoint and the control connection live on one glommio executor
//! thread of this backend. The backend's calls (on the connector's backend
//! thread) hand each request to it and wait for its answer. For each call
//! the executor opens the engine's block fence for exactly the blocks of
//! the call's segments, and closes it when the answer arrives or, at the
//! latest, [`fence_margin`] before the call's deadline, *before* it
//! answers; the endpoint checks the
//! fence right before every socket call that touches engine memory, on
//! the same thread. So the server can touch an engine block only while a
//! call naming it is out, never after the connector was told the call
//! ended (a late server's frames are refused, and its batch fails). The
//! fence does not tell reads from writes: a put's blocks are open to
//! writes too while it runs; the server is trusted as far as that.
//!
//! A call that fails or times out drops the control connection (a late
//! reply would otherwise answer the next call); the next call reconnects
//! and says hello again, so a restarted server is picked up by itself.

use std::net::{IpAddr, SocketAddr, ToSocketAddrs, UdpSocket};
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_lite::AsyncWriteExt;
use glommio::net::TcpStream;
use glommio::{LocalExecutorBuilder, Placement};
use kvferry_machines::store::ChunkKey;
use kvferry_machines::RankLayout;

use super::backend::{Answers, CallError, GetItem, ItemError, PutItem, PutOutcome, StoreBackend};
use super::proto::{self, Answer, Channel, Item, KeyAnswer, Reply, Request, Span};
use kvferry_transport::BlockFence;
use kvferry_transport::{RegionId, Transport, TransportError};
use kvferry_transport::{TcpConfig, TcpTransport};

/// Most removed keys held for `take_removed`; more are dropped and counted.
pub(crate) const REMOVED_HELD_MAX: usize = 1 << 16;

/// Bound on connecting to the server, by default.
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// The least time before a call's deadline at which its fence closes.
pub(crate) const FENCE_MARGIN_MIN: Duration = Duration::from_millis(5);

/// How long before its deadline a call gives up and closes its fence: a
/// twentieth of the time it has, at least [`FENCE_MARGIN_MIN`], at most
/// half. The connector hands the blocks back at the deadline; the
/// executor may be inside one frame's receive when the timer is due, so
/// the close must come early enough for that frame to end first.
pub(crate) fn fence_margin(left: Duration) -> Duration {
    (left / 20).max(FENCE_MARGIN_MIN).min(left / 2)
}

/// How a [`RemoteStore`] runs.
#[derive(Clone, Debug)]
pub struct RemoteConfig {
    /// The server, `HOST:PORT` (the URL without `kvferry://`).
    pub server: String,
    /// The address the engine's data-plane endpoint binds (port 0); by
    /// default the local address of the route to the server.
    pub data_ip: Option<IpAddr>,
    /// The endpoint's settings.
    pub tcp: TcpConfig,
    /// Bound on connecting to the server.
    pub connect_timeout: Duration,
}

impl RemoteConfig {
    /// The settings for `kvferry://HOST:PORT` (or `HOST:PORT`).
    pub fn from_url(url: &str) -> RemoteConfig {
        RemoteConfig {
            server: url.strip_prefix("kvferry://").unwrap_or(url).to_string(),
            data_ip: None,
            tcp: proto::data_plane(),
            connect_timeout: CONNECT_TIMEOUT,
        }
    }
}

/// Why a [`RemoteStore`] could not start.
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum RemoteError {
    /// `HOST:PORT` does not resolve, or no route leads to it.
    #[error("store server {server:?}: {source}")]
    Address {
        /// The address as given.
        server: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The data-plane endpoint could not start.
    #[error("the engine's data-plane endpoint: {0}")]
    Endpoint(#[from] TransportError),
    /// The endpoint's executor thread could not start, or ended while
    /// starting.
    #[error("the engine's data-plane executor: {0}")]
    Executor(#[source] std::io::Error),
}

/// What the executor thread is asked.
enum Job {
    Call {
        request: Request,
        /// Engine memory the call may have the server touch.
        spans: Vec<(u64, u64)>,
        deadline: Instant,
        reply: flume::Sender<Result<Reply, CallError>>,
    },
    Register {
        layout: RankLayout,
        reply: flume::Sender<Result<(), CallError>>,
    },
}

/// The `kvferry://` backend. See the module docs.
pub struct RemoteStore {
    jobs: Option<flume::Sender<Job>>,
    /// Requests sent to the server (hellos included).
    round_trips: Arc<AtomicU64>,
    join: Option<glommio::ExecutorJoinHandle<()>>,
    removed: Vec<ChunkKey>,
    removed_dropped: u64,
    removed_lost: u64,
}

impl std::fmt::Debug for RemoteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteStore").finish_non_exhaustive()
    }
}

impl RemoteStore {
    /// Starts the engine's endpoint; the server is connected on the first
    /// call (it need not be up yet).
    pub fn connect(cfg: RemoteConfig) -> Result<RemoteStore, RemoteError> {
        let server = resolve(&cfg.server)?;
        let data_ip = match cfg.data_ip {
            Some(ip) => ip,
            None => route_ip(server).map_err(|source| RemoteError::Address {
                server: cfg.server.clone(),
                source,
            })?,
        };
        let (jobs, rx) = flume::bounded::<Job>(1);
        let round_trips = Arc::new(AtomicU64::new(0));
        let trips = Arc::clone(&round_trips);
        let (ready_tx, ready_rx) = flume::bounded::<Result<(), TransportError>>(1);
        let join = LocalExecutorBuilder::new(Placement::Unbound)
            .name("kvferry-store-remote")
            .spawn(move || async move {
                let bound = TcpTransport::bind(SocketAddr::new(data_ip, 0), cfg.tcp.clone());
                let transport = match bound {
                    Ok(t) => t,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                let _ = ready_tx.send(Ok(()));
                let mut engine = Engine::new(transport, server, cfg.connect_timeout, trips);
                while let Ok(job) = rx.recv_async().await {
                    engine.run(job).await;
                }
            })
            .map_err(|e| RemoteError::Executor(e.into()))?;
        match ready_rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(RemoteError::Endpoint(e)),
            Err(_) => {
                let gone = std::io::Error::other("ended while starting");
                return Err(RemoteError::Executor(gone));
            }
        }
        Ok(RemoteStore {
            jobs: Some(jobs),
            round_trips,
            join: Some(join),
            removed: Vec::new(),
            removed_dropped: 0,
            removed_lost: 0,
        })
    }

    /// Requests sent to the server so far, hellos included: one per call
    /// (a lookup of any size is one).
    pub fn round_trips(&self) -> u64 {
        self.round_trips.load(Ordering::Relaxed)
    }

    /// Removed keys dropped here for want of room, and those the server
    /// could not tell of any more.
    pub fn removed_missed(&self) -> (u64, u64) {
        (self.removed_dropped, self.removed_lost)
    }

    /// Runs one request on the executor; it answers by `deadline` (its
    /// timer closes the fence and answers `Timeout`).
    fn call(
        &mut self,
        request: Request,
        spans: Vec<(u64, u64)>,
        deadline: Instant,
    ) -> Result<Answer, CallError> {
        let (reply, rx) = flume::bounded(1);
        let job = Job::Call {
            request,
            spans,
            deadline,
            reply,
        };
        let jobs = self.jobs.as_ref().ok_or(CallError::Transport)?;
        jobs.send(job).map_err(|_| CallError::Transport)?;
        // No deadline of our own: the executor's timer bounds the call, and
        // answering before its fence closed could let the server touch a
        // block the connector has handed back.
        let reply = rx.recv().map_err(|_| CallError::Transport)??;
        self.keep_removed(reply.removed, reply.removed_lost);
        match reply.answer {
            Answer::Refused(why) => {
                tracing::warn!("store: the server refused a request: {why:?}");
                Err(CallError::Refused)
            }
            a => Ok(a),
        }
    }

    fn keep_removed(&mut self, keys: Vec<String>, lost: u64) {
        self.removed_lost += lost;
        for k in keys {
            match ChunkKey::from_stored(k) {
                Ok(k) if self.removed.len() < REMOVED_HELD_MAX => self.removed.push(k),
                _ => self.removed_dropped += 1,
            }
        }
    }
}

impl Drop for RemoteStore {
    fn drop(&mut self) {
        self.jobs = None;
        if let Some(j) = self.join.take() {
            let _ = j.join();
        }
    }
}

/// The server's budget for a call: the time until its fence closes.
fn budget_ms(deadline: Instant) -> u32 {
    let left = deadline.saturating_duration_since(Instant::now());
    let until_close = left.saturating_sub(fence_margin(left));
    u32::try_from(until_close.as_millis()).unwrap_or(u32::MAX)
}

fn items_of<'a>(
    it: impl Iterator<Item = (&'a ChunkKey, &'a super::Scatter)>,
) -> (Vec<Item>, Vec<(u64, u64)>) {
    let mut spans = Vec::new();
    let items = it
        .map(|(key, scatter)| {
            let segments = (scatter.segments().iter())
                .map(|s| {
                    spans.push((s.addr, s.len));
                    Span {
                        addr: s.addr,
                        len: s.len,
                    }
                })
                .collect();
            Item {
                key: key.as_str().to_string(),
                segments,
            }
        })
        .collect();
    (items, spans)
}

fn keys_of(keys: &[ChunkKey]) -> Vec<String> {
    keys.iter().map(|k| k.as_str().to_string()).collect()
}

/// Per-key answers of a put, get or remove, checked for length by the
/// worker thread.
fn key_answers(a: Answer) -> Result<Vec<KeyAnswer>, CallError> {
    match a {
        Answer::Keys(v) => Ok(v),
        _ => Err(CallError::Refused),
    }
}

fn item_error(a: KeyAnswer, want_bytes: u64) -> ItemError {
    match a {
        KeyAnswer::NotFound => ItemError::NotFound,
        KeyAnswer::Full => ItemError::Full,
        KeyAnswer::TooLarge => ItemError::TooLarge,
        KeyAnswer::WrongSize { got_bytes } => ItemError::WrongSize {
            got_bytes,
            want_bytes,
        },
        KeyAnswer::Busy => ItemError::Busy,
        KeyAnswer::Timeout => ItemError::Timeout,
        KeyAnswer::Done | KeyAnswer::Exists | KeyAnswer::OutOfBounds | KeyAnswer::Transport => {
            ItemError::Transport
        }
    }
}

impl StoreBackend for RemoteStore {
    fn name(&self) -> &'static str {
        "kvferry"
    }

    fn register(&mut self, layout: &RankLayout) -> Result<(), CallError> {
        let (reply, rx) = flume::bounded(1);
        let jobs = self.jobs.as_ref().ok_or(CallError::Transport)?;
        let job = Job::Register {
            layout: layout.clone(),
            reply,
        };
        jobs.send(job).map_err(|_| CallError::Transport)?;
        rx.recv().map_err(|_| CallError::Transport)?
    }

    fn exists(&mut self, keys: &[ChunkKey], deadline: Instant) -> Result<Vec<bool>, CallError> {
        let request = Request::Exists {
            keys: keys_of(keys),
        };
        match self.call(request, Vec::new(), deadline)? {
            Answer::Exists(v) => Ok(v),
            _ => Err(CallError::Refused),
        }
    }

    fn put(&mut self, items: &[PutItem], deadline: Instant) -> Answers<PutOutcome> {
        let (wire, spans) = items_of(items.iter().map(|i| (&i.key, &i.from)));
        let request = Request::Put {
            budget_ms: budget_ms(deadline),
            items: wire,
        };
        let answers = key_answers(self.call(request, spans, deadline)?)?;
        Ok((answers.into_iter().zip(items))
            .map(|(a, it)| match a {
                KeyAnswer::Done => Ok(PutOutcome::Stored),
                KeyAnswer::Exists => Ok(PutOutcome::Exists),
                other => Err(item_error(other, it.from.len())),
            })
            .collect())
    }

    fn get(&mut self, items: &[GetItem], deadline: Instant) -> Answers<()> {
        let (wire, spans) = items_of(items.iter().map(|i| (&i.key, &i.into)));
        let request = Request::Get {
            budget_ms: budget_ms(deadline),
            items: wire,
        };
        let answers = key_answers(self.call(request, spans, deadline)?)?;
        Ok((answers.into_iter().zip(items))
            .map(|(a, it)| match a {
                KeyAnswer::Done => Ok(()),
                other => Err(item_error(other, it.into.len())),
            })
            .collect())
    }

    fn remove(&mut self, keys: &[ChunkKey], deadline: Instant) -> Answers<()> {
        let request = Request::Remove {
            keys: keys_of(keys),
        };
        let answers = key_answers(self.call(request, Vec::new(), deadline)?)?;
        Ok((answers.into_iter())
            .map(|a| match a {
                KeyAnswer::Done => Ok(()),
                other => Err(item_error(other, 0)),
            })
            .collect())
    }

    fn remove_prefix(&mut self, prefix: &str, deadline: Instant) -> Result<u64, CallError> {
        let request = Request::RemovePrefix {
            prefix: prefix.to_owned(),
        };
        match self.call(request, Vec::new(), deadline)? {
            Answer::Removed(n) => Ok(n),
            _ => Err(CallError::Refused),
        }
    }

    fn take_removed(&mut self, max: usize) -> Vec<ChunkKey> {
        let n = max.min(self.removed.len());
        self.removed.drain(..n).collect()
    }
}

fn resolve(server: &str) -> Result<SocketAddr, RemoteError> {
    let fail = |source: std::io::Error| RemoteError::Address {
        server: server.to_string(),
        source,
    };
    let mut addrs = server.to_socket_addrs().map_err(fail)?;
    let none = || std::io::Error::new(std::io::ErrorKind::NotFound, "no address");
    addrs.next().ok_or_else(|| fail(none()))
}

/// The local address of the route to `server` (a UDP socket's connect
/// sends nothing).
fn route_ip(server: SocketAddr) -> std::io::Result<IpAddr> {
    let any: SocketAddr = match server {
        SocketAddr::V4(_) => SocketAddr::from(([0, 0, 0, 0], 0)),
        SocketAddr::V6(_) => SocketAddr::from(([0u16; 8], 0)),
    };
    let s = UdpSocket::bind(any)?;
    s.connect(server)?;
    Ok(s.local_addr()?.ip())
}

/// The executor's side: the endpoint, its fence and the control
/// connection.
struct Engine {
    transport: TcpTransport,
    fence: Option<Rc<BlockFence>>,
    regions: Vec<RegionId>,
    server: SocketAddr,
    connect_timeout: Duration,
    /// The control connection and its framing (authenticated when the
    /// endpoint has a cluster key).
    control: Option<(Channel, TcpStream)>,
    next_id: u64,
    round_trips: Arc<AtomicU64>,
    /// The server's log position after its last reply, for the next
    /// hello: removals between two connections are told too.
    removed_next: Option<u64>,
}

impl Engine {
    fn new(
        transport: TcpTransport,
        server: SocketAddr,
        connect_timeout: Duration,
        round_trips: Arc<AtomicU64>,
    ) -> Engine {
        Engine {
            transport,
            fence: None,
            regions: Vec::new(),
            server,
            connect_timeout,
            control: None,
            next_id: 1,
            round_trips,
            removed_next: None,
        }
    }

    async fn run(&mut self, job: Job) {
        match job {
            Job::Register { layout, reply } => {
                let _ = reply.send(self.register(&layout));
            }
            Job::Call {
                request,
                spans,
                deadline,
                reply,
            } => {
                let _ = reply.send(self.call(request, &spans, deadline).await);
            }
        }
    }

    /// Registers the KV regions and puts them under a fence, every block
    /// closed; the next call says hello again so the server re-learns
    /// the regions. The old regions go first and the new fence is set
    /// before any new region is registered, so no registered byte is
    /// ever outside the fence (bytes outside it are not fenced).
    fn register(&mut self, layout: &RankLayout) -> Result<(), CallError> {
        self.control = None;
        while let Some(&id) = self.regions.last() {
            if let Err(e) = self.transport.unregister(id) {
                tracing::warn!("store: engine memory still in use: {e}");
                return Err(CallError::Refused);
            }
            self.regions.pop();
        }
        let spans: Vec<(u64, u64)> = (layout.regions.iter())
            .map(|r| (r.base, r.block_len))
            .collect();
        let fence = Rc::new(BlockFence::new(&spans, layout.num_blocks));
        self.transport.set_fence(Some(Rc::clone(&fence)));
        self.fence = Some(fence);
        for r in &layout.regions {
            let len = usize::try_from(r.block_len.saturating_mul(layout.num_blocks));
            // SAFETY: the connector's `register_kv_caches` contract: the
            // memory stays valid while the connector (and so this
            // backend) lives; the fence keeps the server off every block
            // no call names.
            let done = len
                .map_err(|_| "region too large".to_string())
                .and_then(|len| unsafe {
                    (self.transport.register(r.base as *mut u8, len)).map_err(|e| e.to_string())
                });
            match done {
                Ok(id) => self.regions.push(id),
                Err(e) => {
                    tracing::warn!("store: registering engine memory: {e}");
                    for id in self.regions.drain(..) {
                        let _ = self.transport.unregister(id);
                    }
                    return Err(CallError::Refused);
                }
            }
        }
        Ok(())
    }

    async fn call(
        &mut self,
        request: Request,
        spans: &[(u64, u64)],
        deadline: Instant,
    ) -> Result<Reply, CallError> {
        let keys: Vec<_> = match &self.fence {
            Some(f) => spans.iter().flat_map(|&(a, l)| f.keys_in(a, l)).collect(),
            None => Vec::new(),
        };
        if let Some(f) = &self.fence {
            f.open(keys.iter().copied());
        }
        let left = deadline.saturating_duration_since(Instant::now());
        let close_in = left.saturating_sub(fence_margin(left));
        let answered = if close_in.is_zero() {
            Err(CallError::Timeout)
        } else {
            futures_lite::future::or(self.exchange(request), async {
                glommio::timer::Timer::new(close_in).await;
                Err(CallError::Timeout)
            })
            .await
        };
        // Closed before the answer leaves this thread (module docs).
        if let Some(f) = &self.fence {
            f.close(keys.iter().copied());
        }
        // After a failure, a late reply would answer the next call; after
        // a refusal, the server may have closed its side.
        let refused = matches!(
            &answered,
            Ok(Reply {
                answer: Answer::Refused(_),
                ..
            })
        );
        if answered.is_err() || refused {
            self.control = None;
        }
        answered
    }

    async fn exchange(&mut self, request: Request) -> Result<Reply, CallError> {
        if self.control.is_none() {
            self.control = Some(self.hello().await?);
        }
        let id = self.next_id;
        self.next_id += 1;
        self.round_trips.fetch_add(1, Ordering::Relaxed);
        let (channel, stream) = self.control.as_mut().ok_or(CallError::Transport)?;
        send(channel, stream, id, &request).await?;
        let (got, reply) = receive(channel, stream).await?;
        if got != id {
            return Err(CallError::Refused);
        }
        self.removed_next = Some(reply.removed_next);
        Ok(reply)
    }

    async fn hello(&mut self) -> Result<(Channel, TcpStream), CallError> {
        let mut stream = TcpStream::connect_timeout(self.server, self.connect_timeout)
            .await
            .map_err(|_| CallError::Transport)?;
        let _ = stream.set_nodelay(true);
        // The control connection proves the endpoint's key.
        let mut channel = match &self.transport.config().key {
            Some(key) => Channel::initiate(&mut stream, key).await.map_err(|e| {
                if matches!(e, proto::ReadError::Unauthenticated) {
                    tracing::error!("store: the server did not prove the cluster key");
                }
                CallError::Refused
            })?,
            None => Channel::plain(),
        };
        let endpoint = self.transport.endpoint_addr().to_string();
        let id = self.next_id;
        self.next_id += 1;
        self.round_trips.fetch_add(1, Ordering::Relaxed);
        let hello = Request::Hello {
            endpoint,
            removed_from: self.removed_next,
        };
        send(&mut channel, &mut stream, id, &hello).await?;
        match receive(&mut channel, &mut stream).await? {
            (
                got,
                Reply {
                    answer: Answer::Hello { .. },
                    ..
                },
            ) if got == id => Ok((channel, stream)),
            _ => Err(CallError::Refused),
        }
    }
}

async fn send(
    channel: &mut Channel,
    stream: &mut TcpStream,
    id: u64,
    request: &Request,
) -> Result<(), CallError> {
    let frame = channel
        .encode(id, request)
        .map_err(|_| CallError::Refused)?;
    stream
        .write_all(&frame)
        .await
        .map_err(|_| CallError::Transport)
}

async fn receive(channel: &mut Channel, stream: &mut TcpStream) -> Result<(u64, Reply), CallError> {
    let body = channel.read_body(stream).await.map_err(|e| match e {
        proto::ReadError::Closed => CallError::Transport,
        proto::ReadError::Malformed(_) | proto::ReadError::Unauthenticated => CallError::Refused,
    })?;
    proto::decode_reply(&body).map_err(|_| CallError::Refused)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fence_closes_a_twentieth_early_within_its_bounds() {
        let ms = Duration::from_millis;
        assert_eq!(fence_margin(Duration::from_secs(10)), ms(500));
        assert_eq!(fence_margin(ms(40)), FENCE_MARGIN_MIN);
        assert_eq!(fence_margin(ms(6)), ms(3), "at most half");
        assert_eq!(fence_margin(Duration::ZERO), Duration::ZERO);
    }
}
