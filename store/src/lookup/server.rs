//! The rank-0 worker's end: a REP socket on a thread of its own.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use kvferry_machines::store::ChunkKey;

use super::wire::{
    decode_query, encode_reply, LookupWireError, ServerFault, LOOKUP_MESSAGE_MAX_BYTES,
};
use super::PrefixLookup;
use crate::backend::{Answers, CallError, GetItem, PutItem, PutOutcome, StoreBackend};
use crate::config::{ConnectorConfig, ConnectorError};
use crate::connector::StoreConnector;

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

pub(super) fn check_endpoint(endpoint: &str) -> Result<Option<PathBuf>, LookupServerError> {
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
