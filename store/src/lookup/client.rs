//! The scheduler process's end: a REQ socket, one round trip per lookup.

use std::time::Duration;

use kvferry_machines::store::lookup::LookupHit;

use super::server::{check_endpoint, LookupServerError};
use super::wire::{decode_reply, encode_query, LookupWireError, LOOKUP_MESSAGE_MAX_BYTES};
use super::{LookupFailure, LookupQuery, PrefixLookup};

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
    pub(super) timeout: Duration,
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
            None => self
                .make_socket()
                .map_err(|e| LookupFailure::Transport(e.into()))?,
        };
        let timeout = |e| match e {
            zmq::Error::EAGAIN => LookupFailure::Timeout(self.timeout),
            e => LookupFailure::Transport(e.into()),
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
