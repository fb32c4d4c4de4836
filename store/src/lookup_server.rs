//! Prefix lookups across processes (docs/design.md, "Store: the lookup
//! server"): vLLM's scheduler runs in its own process, the store clients in
//! the workers', so the rank-0 worker answers the scheduler's lookups.
//!
//! * [`LookupServer`]: a ZeroMQ REP socket on a thread of its own, bound on
//!   an `ipc://` or `tcp://127.0.0.1` endpoint, answering each request with
//!   a [`PrefixLookup`] it owns. [`LookupServer::spawn_for_store`] gives it
//!   a connector of its own over a second handle of the worker's store
//!   ([`ExistsOnly`]), so it never needs the engine's connector and the
//!   engine's thread never waits on it.
//! * [`LookupClient`]: a REQ socket with a receive timeout, one round trip
//!   per lookup; a socket that timed out is dropped and made again (a REQ
//!   socket waits for its reply forever otherwise).
//!
//! # Messages
//!
//! One frame each way, postcard, the version first (a `u16`,
//! [`LOOKUP_WIRE_VERSION`]) then a sequence number the reply repeats:
//!
//! * request: `version, seq, token_len: u32, group_lens: [u32], hashes:
//!   [bytes], lora: Option<str>, extra_keys: [str]` (the hashes of every
//!   group in one list, `group_lens` saying how many each has);
//! * reply: `version, seq, Hit { tokens: u32, load: [(u32, u32)] }` or
//!   `Failed(ServerFault)`.
//!
//! A message is at most [`LOOKUP_MESSAGE_MAX_BYTES`], a request names at
//! most [`LOOKUP_HASHES_MAX`] hashes and [`GROUPS_MAX`] groups; the
//! decoders answer a typed [`LookupWireError`] for anything else and never
//! panic, whatever the bytes (`fuzz/fuzz_targets/lookup_msg_decode.rs`).

use std::ops::Range;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use kvferry_machines::store::key::GROUPS_MAX;
use kvferry_machines::store::lookup::LookupHit;
use kvferry_machines::store::{ChunkKey, StoreFault};

use super::backend::{Answers, CallError, GetItem, PutItem, PutOutcome, StoreBackend};
use super::config::{ConnectorConfig, ConnectorError};
use super::connector::StoreConnector;
use super::scheduler::{LookupFailure, LookupQuery, PrefixLookup, WireHash};

/// The message format's version, the first field of every message.
pub const LOOKUP_WIRE_VERSION: u16 = 1;
/// Most bytes of one message.
pub const LOOKUP_MESSAGE_MAX_BYTES: usize = 1 << 20;
/// Most hashes one request names, every group together (a 128k-token
/// request with two groups of 16-token blocks).
pub const LOOKUP_HASHES_MAX: usize = 1 << 14;

/// Why a message was not decoded (or not encoded).
#[non_exhaustive]
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LookupWireError {
    /// Longer than [`LOOKUP_MESSAGE_MAX_BYTES`].
    #[error("a lookup message of {len} bytes, at most {LOOKUP_MESSAGE_MAX_BYTES}")]
    TooLarge {
        /// Its length.
        len: usize,
    },
    /// Another version than [`LOOKUP_WIRE_VERSION`].
    #[error("lookup message version {got}, this side speaks {LOOKUP_WIRE_VERSION}")]
    Version {
        /// The version it names.
        got: u16,
    },
    /// Not a message of this version (a truncated or corrupt one).
    #[error("a malformed lookup message")]
    Malformed,
    /// Bytes after the message.
    #[error("{extra} bytes after a lookup message")]
    TrailingBytes {
        /// How many.
        extra: usize,
    },
    /// More than [`LOOKUP_HASHES_MAX`] hashes.
    #[error("{count} hashes in a lookup, at most {LOOKUP_HASHES_MAX}")]
    TooManyHashes {
        /// How many.
        count: usize,
    },
    /// More than [`GROUPS_MAX`] groups.
    #[error("{count} groups in a lookup message, at most {GROUPS_MAX}")]
    TooManyGroups {
        /// How many.
        count: usize,
    },
    /// The group lengths do not add up to the hashes sent.
    #[error("group lengths add up to {sum}, {hashes} hashes sent")]
    GroupLengths {
        /// Their sum (saturating).
        sum: usize,
        /// Hashes in the message.
        hashes: usize,
    },
    /// A reply to another request than the one asked.
    #[error("the reply answers request {got}, request {want} was asked")]
    WrongSeq {
        /// The reply's sequence number.
        got: u64,
        /// The request's.
        want: u64,
    },
    /// More than one frame.
    #[error("a lookup message of {frames} frames, one expected")]
    Frames {
        /// How many.
        frames: usize,
    },
}

/// Why the server could not answer a lookup.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ServerFault {
    /// The store call failed as a whole (`StoreFault::Transport`).
    StoreTransport,
    /// The store call passed its deadline.
    StoreTimeout,
    /// The store refused the call.
    StoreRefused,
    /// The request does not fit the server's keyspace or bounds.
    BadRequest,
    /// The request did not decode.
    Undecodable,
}

impl From<&LookupFailure> for ServerFault {
    fn from(e: &LookupFailure) -> ServerFault {
        match e {
            LookupFailure::Connector(ConnectorError::Lookup(f)) => match f {
                StoreFault::Timeout => ServerFault::StoreTimeout,
                StoreFault::Refused => ServerFault::StoreRefused,
                _ => ServerFault::StoreTransport,
            },
            LookupFailure::Connector(_) => ServerFault::BadRequest,
            LookupFailure::Server(f) => *f,
            _ => ServerFault::StoreTransport,
        }
    }
}

#[derive(Serialize, Deserialize)]
struct QueryWire {
    version: u16,
    seq: u64,
    token_len: u32,
    group_lens: Vec<u32>,
    hashes: Vec<WireHash>,
    lora: Option<String>,
    extra_keys: Vec<String>,
}

#[derive(Serialize, Deserialize)]
enum AnswerWire {
    Hit { tokens: u32, load: Vec<Range<u32>> },
    Failed(ServerFault),
}

#[derive(Serialize, Deserialize)]
struct ReplyWire {
    version: u16,
    seq: u64,
    answer: AnswerWire,
}

/// A lookup's answer as a reply carries it.
pub type LookupAnswer = Result<LookupHit, ServerFault>;

/// Checks the length and the version, then decodes all of `bytes`.
fn decode<'a, T: Deserialize<'a>>(bytes: &'a [u8]) -> Result<T, LookupWireError> {
    if bytes.len() > LOOKUP_MESSAGE_MAX_BYTES {
        return Err(LookupWireError::TooLarge { len: bytes.len() });
    }
    let (version, _) =
        postcard::take_from_bytes::<u16>(bytes).map_err(|_| LookupWireError::Malformed)?;
    if version != LOOKUP_WIRE_VERSION {
        return Err(LookupWireError::Version { got: version });
    }
    match postcard::take_from_bytes::<T>(bytes) {
        Ok((msg, [])) => Ok(msg),
        Ok((_, rest)) => Err(LookupWireError::TrailingBytes { extra: rest.len() }),
        Err(_) => Err(LookupWireError::Malformed),
    }
}

fn encode<T: Serialize>(msg: &T) -> Result<Vec<u8>, LookupWireError> {
    let bytes = postcard::to_allocvec(msg).map_err(|_| LookupWireError::Malformed)?;
    if bytes.len() > LOOKUP_MESSAGE_MAX_BYTES {
        return Err(LookupWireError::TooLarge { len: bytes.len() });
    }
    Ok(bytes)
}

/// A request's bytes, checked against the bounds the server checks.
pub fn encode_query(seq: u64, q: &LookupQuery) -> Result<Vec<u8>, LookupWireError> {
    let count: usize = q.block_hashes.iter().map(Vec::len).sum();
    check_shape(q.block_hashes.len(), count)?;
    encode(&QueryWire {
        version: LOOKUP_WIRE_VERSION,
        seq,
        token_len: q.token_len,
        group_lens: q.block_hashes.iter().map(|g| g.len() as u32).collect(),
        hashes: (q.block_hashes.iter().flatten())
            .map(|h| WireHash(*h))
            .collect(),
        lora: q.lora.clone(),
        extra_keys: q.extra_keys.clone(),
    })
}

fn check_shape(groups: usize, hashes: usize) -> Result<(), LookupWireError> {
    if groups > GROUPS_MAX {
        return Err(LookupWireError::TooManyGroups { count: groups });
    }
    if hashes > LOOKUP_HASHES_MAX {
        return Err(LookupWireError::TooManyHashes { count: hashes });
    }
    Ok(())
}

/// A request from its bytes: its sequence number and query.
pub fn decode_query(bytes: &[u8]) -> Result<(u64, LookupQuery), LookupWireError> {
    let w: QueryWire = decode(bytes)?;
    check_shape(w.group_lens.len(), w.hashes.len())?;
    let sum = (w.group_lens.iter()).fold(0usize, |s, &n| s.saturating_add(n as usize));
    if sum != w.hashes.len() {
        let hashes = w.hashes.len();
        return Err(LookupWireError::GroupLengths { sum, hashes });
    }
    let mut hashes = w.hashes.into_iter().map(|h| h.0);
    let block_hashes = (w.group_lens.iter())
        .map(|&n| hashes.by_ref().take(n as usize).collect())
        .collect();
    let query = LookupQuery {
        token_len: w.token_len,
        block_hashes,
        lora: w.lora,
        extra_keys: w.extra_keys,
    };
    Ok((w.seq, query))
}

/// A reply's bytes.
pub fn encode_reply(seq: u64, answer: &LookupAnswer) -> Result<Vec<u8>, LookupWireError> {
    let answer = match answer {
        Ok(hit) => {
            check_shape(hit.load.len(), 0)?;
            AnswerWire::Hit {
                tokens: hit.tokens,
                load: hit.load.clone(),
            }
        }
        Err(f) => AnswerWire::Failed(*f),
    };
    encode(&ReplyWire {
        version: LOOKUP_WIRE_VERSION,
        seq,
        answer,
    })
}

/// A reply from its bytes: its sequence number and answer.
pub fn decode_reply(bytes: &[u8]) -> Result<(u64, LookupAnswer), LookupWireError> {
    let w: ReplyWire = decode(bytes)?;
    let answer = match w.answer {
        AnswerWire::Hit { tokens, load } => {
            check_shape(load.len(), 0)?;
            Ok(LookupHit { tokens, load })
        }
        AnswerWire::Failed(f) => Err(f),
    };
    Ok((w.seq, answer))
}

/// A backend that only answers existence calls: what a lookup server's own
/// connector runs on. Puts, gets and removes are refused; removed keys are
/// left for the engine's connector, whose KV events report them.
#[derive(Debug)]
pub struct ExistsOnly<B>(pub B);

impl<B: StoreBackend> StoreBackend for ExistsOnly<B> {
    fn name(&self) -> &'static str {
        self.0.name()
    }

    fn exists(&mut self, keys: &[ChunkKey], deadline: Instant) -> Result<Vec<bool>, CallError> {
        self.0.exists(keys, deadline)
    }

    fn put(&mut self, _: &[PutItem], _: Instant) -> Answers<PutOutcome> {
        Err(CallError::Refused)
    }

    fn get(&mut self, _: &[GetItem], _: Instant) -> Answers<()> {
        Err(CallError::Refused)
    }

    fn remove(&mut self, _: &[ChunkKey], _: Instant) -> Answers<()> {
        Err(CallError::Refused)
    }
}

/// Why a server or client could not start.
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum LookupServerError {
    /// A socket could not be made, bound or connected.
    #[error("lookup socket setup: {0}")]
    Socket(#[from] zmq::Error),
    /// The endpoint is neither `ipc://…` nor `tcp://127.0.0.1:…`.
    #[error("lookup endpoint {0:?}: ipc:// or tcp://127.0.0.1 only")]
    Endpoint(String),
    /// The server's own connector could not start.
    #[error(transparent)]
    Connector(#[from] ConnectorError),
    /// The thread could not start.
    #[error("the lookup thread could not start: {0}")]
    Spawn(#[source] std::io::Error),
}

/// Counters of a [`LookupServer`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LookupServerStats {
    /// Requests answered with a hit.
    pub answered: u64,
    /// Requests answered with a [`ServerFault`].
    pub failed: u64,
}

#[derive(Debug, Default)]
struct ServerCounters {
    answered: AtomicU64,
    failed: AtomicU64,
}

/// The rank-0 worker's lookup server. See the module docs. Dropping it
/// stops its thread (after the lookup it may be answering).
pub struct LookupServer {
    endpoint: String,
    /// Tells the thread to stop (a PAIR over `inproc://`).
    stop: zmq::Socket,
    thread: Option<JoinHandle<()>>,
    counters: Arc<ServerCounters>,
    ipc_path: Option<PathBuf>,
    _ctx: zmq::Context,
}

impl std::fmt::Debug for LookupServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        (f.debug_struct("LookupServer"))
            .field("endpoint", &self.endpoint)
            .field("stats", &self.stats())
            .finish()
    }
}

const STOP_ENDPOINT: &str = "inproc://kvferry-lookup-stop";

fn check_endpoint(endpoint: &str) -> Result<Option<PathBuf>, LookupServerError> {
    if let Some(path) = endpoint.strip_prefix("ipc://") {
        return Ok(Some(PathBuf::from(path)));
    }
    if endpoint.starts_with("tcp://127.0.0.1:") {
        return Ok(None);
    }
    Err(LookupServerError::Endpoint(endpoint.to_owned()))
}

impl LookupServer {
    /// Binds `endpoint` (`ipc://PATH`, a stale socket file there removed
    /// first, or `tcp://127.0.0.1:PORT`, port 0 for any) and answers every
    /// request with `lookup`, on a thread of its own.
    pub fn spawn<L>(endpoint: &str, lookup: L) -> Result<LookupServer, LookupServerError>
    where
        L: PrefixLookup + Send + 'static,
    {
        let ipc_path = check_endpoint(endpoint)?;
        if let Some(p) = &ipc_path {
            let _ = std::fs::remove_file(p);
        }
        let ctx = zmq::Context::new();
        let rep = ctx.socket(zmq::REP)?;
        rep.set_linger(0)?;
        rep.set_maxmsgsize(LOOKUP_MESSAGE_MAX_BYTES as i64)?;
        rep.bind(endpoint)?;
        let bound = rep
            .get_last_endpoint()?
            .unwrap_or_else(|_| endpoint.to_owned());
        let stop_rx = ctx.socket(zmq::PAIR)?;
        stop_rx.bind(STOP_ENDPOINT)?;
        let stop = ctx.socket(zmq::PAIR)?;
        stop.set_linger(0)?;
        stop.connect(STOP_ENDPOINT)?;
        let counters = Arc::new(ServerCounters::default());
        let c = Arc::clone(&counters);
        let thread = std::thread::Builder::new()
            .name("kvferry-lookup".into())
            .spawn(move || serve(rep, stop_rx, lookup, &c))
            .map_err(LookupServerError::Spawn)?;
        Ok(LookupServer {
            endpoint: bound,
            stop,
            thread: Some(thread),
            counters,
            ipc_path,
            _ctx: ctx,
        })
    }

    /// A server with a connector of its own over `backend` (a second
    /// handle of the worker's store), made with the worker's `cfg`.
    pub fn spawn_for_store<B: StoreBackend>(
        endpoint: &str,
        cfg: ConnectorConfig,
        backend: B,
    ) -> Result<LookupServer, LookupServerError> {
        let connector = StoreConnector::new(cfg, ExistsOnly(backend))?;
        LookupServer::spawn(endpoint, connector)
    }

    /// The endpoint bound (with the port chosen for port 0).
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Counters.
    pub fn stats(&self) -> LookupServerStats {
        LookupServerStats {
            answered: self.counters.answered.load(Ordering::Relaxed),
            failed: self.counters.failed.load(Ordering::Relaxed),
        }
    }
}

impl Drop for LookupServer {
    fn drop(&mut self) {
        // Not waiting: a thread that ended has no peer to take it.
        if self.stop.send(&[][..], zmq::DONTWAIT).is_err() {
            tracing::warn!("lookup server could not be told to stop");
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        if let Some(p) = &self.ipc_path {
            let _ = std::fs::remove_file(p);
        }
    }
}

fn serve<L: PrefixLookup>(rep: zmq::Socket, stop: zmq::Socket, mut lookup: L, c: &ServerCounters) {
    loop {
        let mut items = [
            rep.as_poll_item(zmq::POLLIN),
            stop.as_poll_item(zmq::POLLIN),
        ];
        match zmq::poll(&mut items, -1) {
            Ok(_) => {}
            Err(zmq::Error::EINTR) => continue,
            Err(e) => {
                tracing::warn!("lookup server stops: {e}");
                return;
            }
        }
        if items[1].is_readable() {
            return;
        }
        if !items[0].is_readable() {
            continue;
        }
        let reply = match rep.recv_multipart(0) {
            Ok(frames) => answer(&frames, &mut lookup, c),
            Err(e) => {
                tracing::warn!("lookup server stops: {e}");
                return;
            }
        };
        if let Err(e) = rep.send(reply, 0) {
            tracing::warn!("lookup reply not sent: {e}");
        }
    }
}

/// The reply to one request's frames.
fn answer<L: PrefixLookup>(frames: &[Vec<u8>], lookup: &mut L, c: &ServerCounters) -> Vec<u8> {
    let decoded = match frames {
        [one] => decode_query(one),
        _ => Err(LookupWireError::Frames {
            frames: frames.len(),
        }),
    };
    let (seq, answer) = match decoded {
        Ok((seq, q)) => (seq, lookup.lookup(&q).map_err(|e| ServerFault::from(&e))),
        Err(e) => {
            tracing::warn!("undecodable lookup request: {e}");
            (0, Err(ServerFault::Undecodable))
        }
    };
    let counter = if answer.is_ok() {
        &c.answered
    } else {
        &c.failed
    };
    counter.fetch_add(1, Ordering::Relaxed);
    // A hit of more groups than a message may name is a server bug; the
    // client gets a fault instead of no answer (REQ waits for one).
    (encode_reply(seq, &answer).or_else(|_| encode_reply(seq, &Err(ServerFault::BadRequest))))
        .unwrap_or_default()
}

/// Counters of a [`LookupClient`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LookupClientStats {
    /// Round trips completed (one per lookup answered).
    pub round_trips: u64,
    /// Lookups that got no reply in time.
    pub timeouts: u64,
    /// Lookups that failed otherwise (socket, decode, server fault).
    pub failures: u64,
    /// Sockets made (one, plus one after each timeout or socket error).
    pub sockets: u64,
}

/// The scheduler process's end of the lookup server. See the module docs.
pub struct LookupClient {
    ctx: zmq::Context,
    endpoint: String,
    timeout: Duration,
    socket: Option<zmq::Socket>,
    seq: u64,
    stats: LookupClientStats,
}

impl std::fmt::Debug for LookupClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        (f.debug_struct("LookupClient"))
            .field("endpoint", &self.endpoint)
            .field("stats", &self.stats)
            .finish()
    }
}

impl LookupClient {
    /// A client of the server at `endpoint`; each lookup waits at most
    /// `timeout` for its reply.
    pub fn connect(endpoint: &str, timeout: Duration) -> Result<LookupClient, LookupServerError> {
        check_endpoint(endpoint)?;
        let mut client = LookupClient {
            ctx: zmq::Context::new(),
            endpoint: endpoint.to_owned(),
            timeout,
            socket: None,
            seq: 0,
            stats: LookupClientStats::default(),
        };
        let s = client.make_socket()?;
        client.socket = Some(s);
        Ok(client)
    }

    /// Counters.
    pub fn stats(&self) -> LookupClientStats {
        self.stats
    }

    fn make_socket(&mut self) -> Result<zmq::Socket, zmq::Error> {
        let ms = i32::try_from(self.timeout.as_millis())
            .unwrap_or(i32::MAX)
            .max(1);
        let s = self.ctx.socket(zmq::REQ)?;
        s.set_linger(0)?;
        s.set_rcvtimeo(ms)?;
        s.set_sndtimeo(ms)?;
        s.set_maxmsgsize(LOOKUP_MESSAGE_MAX_BYTES as i64)?;
        s.connect(&self.endpoint)?;
        self.stats.sockets += 1;
        Ok(s)
    }

    /// One round trip; the socket is kept only when it is ready for the
    /// next request (a reply came).
    fn round_trip(&mut self, request: &[u8]) -> Result<Vec<u8>, LookupFailure> {
        let socket = match self.socket.take() {
            Some(s) => s,
            None => self.make_socket()?,
        };
        let timeout = |e| match e {
            zmq::Error::EAGAIN => LookupFailure::Timeout(self.timeout),
            e => LookupFailure::Transport(e),
        };
        socket.send(request, 0).map_err(timeout)?;
        let frames = socket.recv_multipart(0).map_err(timeout)?;
        self.socket = Some(socket);
        self.stats.round_trips += 1;
        match <[Vec<u8>; 1]>::try_from(frames) {
            Ok([one]) => Ok(one),
            Err(f) => Err(LookupWireError::Frames { frames: f.len() }.into()),
        }
    }

    fn ask(&mut self, q: &LookupQuery) -> Result<LookupHit, LookupFailure> {
        self.seq = self.seq.wrapping_add(1);
        let want = self.seq;
        let request = encode_query(want, q)?;
        let reply = self.round_trip(&request)?;
        let (got, answer) = decode_reply(&reply)?;
        if got != want {
            return Err(LookupWireError::WrongSeq { got, want }.into());
        }
        answer.map_err(LookupFailure::Server)
    }
}

impl PrefixLookup for LookupClient {
    fn lookup(&mut self, q: &LookupQuery) -> Result<LookupHit, LookupFailure> {
        let r = self.ask(q);
        match &r {
            Ok(_) => {}
            Err(LookupFailure::Timeout(_)) => self.stats.timeouts += 1,
            Err(_) => self.stats.failures += 1,
        }
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvferry_machines::store::BlockHash;
    use proptest::prelude::*;

    fn query(groups: usize, per_group: u32) -> LookupQuery {
        LookupQuery {
            token_len: per_group * 16,
            block_hashes: (0..groups)
                .map(|g| {
                    (0..per_group)
                        .map(|i| BlockHash::from_u64((g as u64) << 32 | u64::from(i)))
                        .collect()
                })
                .collect(),
            lora: Some("adapter".into()),
            extra_keys: vec!["mm:1".into()],
        }
    }

    fn hit(tokens: u32) -> LookupHit {
        LookupHit {
            tokens,
            load: std::iter::once(0..tokens / 16).collect(),
        }
    }

    #[test]
    fn messages_survive_their_bytes() {
        let q = query(2, 5);
        assert_eq!(decode_query(&encode_query(7, &q).unwrap()).unwrap(), (7, q));
        let a: LookupAnswer = Ok(hit(48));
        assert_eq!(decode_reply(&encode_reply(9, &a).unwrap()).unwrap(), (9, a));
        let f: LookupAnswer = Err(ServerFault::StoreTimeout);
        assert_eq!(decode_reply(&encode_reply(1, &f).unwrap()).unwrap(), (1, f));
    }

    #[test]
    fn messages_out_of_bounds_are_typed_errors() {
        let too_many = query(1, LOOKUP_HASHES_MAX as u32 + 1);
        assert_eq!(
            encode_query(1, &too_many),
            Err(LookupWireError::TooManyHashes {
                count: LOOKUP_HASHES_MAX + 1
            })
        );
        // The decoder checks the bound itself, whatever a peer encodes.
        let wire = QueryWire {
            version: LOOKUP_WIRE_VERSION,
            seq: 1,
            token_len: 0,
            group_lens: vec![LOOKUP_HASHES_MAX as u32 + 1],
            hashes: (0..=LOOKUP_HASHES_MAX as u64)
                .map(|i| WireHash(BlockHash::from_u64(i)))
                .collect(),
            lora: None,
            extra_keys: Vec::new(),
        };
        let bytes = postcard::to_allocvec(&wire).unwrap();
        assert_eq!(
            decode_query(&bytes),
            Err(LookupWireError::TooManyHashes {
                count: LOOKUP_HASHES_MAX + 1
            })
        );
        let wire = QueryWire {
            group_lens: vec![2],
            hashes: vec![WireHash(BlockHash::from_u64(0))],
            ..wire
        };
        let bytes = postcard::to_allocvec(&wire).unwrap();
        assert_eq!(
            decode_query(&bytes),
            Err(LookupWireError::GroupLengths { sum: 2, hashes: 1 })
        );
        let mut good = encode_query(1, &query(1, 2)).unwrap();
        good.push(0);
        assert_eq!(
            decode_query(&good),
            Err(LookupWireError::TrailingBytes { extra: 1 })
        );
        let mut other = encode_query(1, &query(1, 2)).unwrap();
        other[0] = 2;
        assert_eq!(
            decode_query(&other),
            Err(LookupWireError::Version { got: 2 })
        );
        let big = vec![1u8; LOOKUP_MESSAGE_MAX_BYTES + 1];
        assert_eq!(
            decode_reply(&big),
            Err(LookupWireError::TooLarge { len: big.len() })
        );
        assert_eq!(decode_reply(&[]), Err(LookupWireError::Malformed));
    }

    proptest! {
        #[test]
        fn no_bytes_make_a_decoder_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = decode_query(&bytes);
            let _ = decode_reply(&bytes);
        }

        #[test]
        fn no_corruption_of_a_message_makes_a_decoder_panic(at in any::<prop::sample::Index>(), byte in any::<u8>(), cut in any::<prop::sample::Index>()) {
            let mut q = encode_query(3, &query(2, 4)).unwrap();
            let i = at.index(q.len());
            q[i] = byte;
            q.truncate(cut.index(q.len() + 1).max(1));
            let _ = decode_query(&q);
            let mut r = encode_reply(3, &Ok(hit(64))).unwrap();
            let i = at.index(r.len());
            r[i] = byte;
            let _ = decode_reply(&r);
        }
    }

    fn fixed(tokens: u32) -> impl FnMut(&LookupQuery) -> Result<LookupHit, LookupFailure> + Send {
        move |q: &LookupQuery| Ok(hit(tokens.min(q.token_len / 16 * 16)))
    }

    #[test]
    fn a_client_gets_one_answer_per_round_trip() {
        let server = LookupServer::spawn("tcp://127.0.0.1:0", fixed(32)).unwrap();
        let mut client = LookupClient::connect(server.endpoint(), Duration::from_secs(30)).unwrap();
        for n in [1u32, 2, 5] {
            let want = hit(32.min(n * 16));
            assert_eq!(client.lookup(&query(1, n)).unwrap(), want);
        }
        let stats = client.stats();
        assert_eq!(
            (stats.round_trips, stats.timeouts, stats.sockets),
            (3, 0, 1)
        );
        assert_eq!(server.stats().answered, 3);
    }

    #[test]
    fn a_client_makes_a_new_socket_after_a_timeout() {
        let path = std::env::temp_dir().join(format!("kvferry-lookup-{}.sock", std::process::id()));
        let endpoint = format!("ipc://{}", path.display());
        let _ = std::fs::remove_file(&path);
        // No server yet: the request is not answered in time.
        let mut client = LookupClient::connect(&endpoint, Duration::from_millis(50)).unwrap();
        let e = client.lookup(&query(1, 2));
        assert!(matches!(e, Err(LookupFailure::Timeout(_))), "{e:?}");
        let server = LookupServer::spawn(&endpoint, fixed(16)).unwrap();
        let mut client2 = client;
        // The stuck REQ socket is gone: the next lookup goes out on a new
        // one (with a longer wait, since the server is there now).
        client2.timeout = Duration::from_secs(30);
        assert_eq!(client2.lookup(&query(1, 2)).unwrap(), hit(16));
        let stats = client2.stats();
        assert_eq!(
            (stats.round_trips, stats.timeouts, stats.sockets),
            (1, 1, 2)
        );
        drop(server);
        assert!(!path.exists(), "the socket file stays behind");
    }

    #[test]
    fn an_undecodable_request_gets_a_fault_and_the_server_goes_on() {
        let server = LookupServer::spawn("tcp://127.0.0.1:0", fixed(16)).unwrap();
        let ctx = zmq::Context::new();
        let raw = ctx.socket(zmq::REQ).unwrap();
        raw.set_linger(0).unwrap();
        raw.connect(server.endpoint()).unwrap();
        raw.send(&[0xff, 0xff, 0xff][..], 0).unwrap();
        let reply = raw.recv_bytes(0).unwrap();
        assert_eq!(
            decode_reply(&reply).unwrap(),
            (0, Err(ServerFault::Undecodable))
        );
        let mut client = LookupClient::connect(server.endpoint(), Duration::from_secs(30)).unwrap();
        assert_eq!(client.lookup(&query(1, 1)).unwrap(), hit(16));
        assert_eq!(
            server.stats(),
            LookupServerStats {
                answered: 1,
                failed: 1
            }
        );
    }

    #[test]
    fn only_local_endpoints_are_served() {
        let e = LookupServer::spawn("tcp://0.0.0.0:0", fixed(0));
        assert!(matches!(e, Err(LookupServerError::Endpoint(_))));
    }
}
