//! Client of the bootstrap service: minimal HTTP/1.1 over `std::net`.
//!
//! The service answers a few requests per rank, so one short-lived
//! connection per request (`Connection: close`) is simpler than pooling and
//! costs nothing that matters. Only what tiny_http sends back is understood:
//! a status line, headers, and a body delimited by `Content-Length`,
//! chunked encoding, or the end of the connection.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::ops::ControlFlow;
use std::time::{Duration, Instant};

use super::{QueryResponse, RegisterRequest, RegisterResponse};
use crate::resolve::{HostPort, ResolveError, Resolver};
use kvferry_auth::ClusterKey;
use kvferry_machines::Backoff;

/// Largest response body the client reads (a registry of thousands of
/// workers is well below it).
const MAX_RESPONSE_BYTES: usize = 16 << 20;
/// Longest status or header line accepted.
const MAX_LINE_BYTES: usize = 8 * 1024;
/// Most headers accepted in one response.
const MAX_HEADERS: usize = 100;

/// Why a bootstrap request failed. Separates "the service is not there"
/// (retryable), "it said no" (our request was wrong), "it answered
/// nonsense" (its fault) and "we ran out of time".
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The address given is not `[http://]host:port[/]` (misuse).
    #[error("bad bootstrap address: {0}")]
    BadAddress(#[source] ResolveError),
    /// The address's name did not resolve within the bound (retryable:
    /// it is looked up again at the next attempt).
    #[error("bootstrap address {addr:?}: {source}")]
    Resolve {
        /// The address as given.
        addr: String,
        /// Why.
        #[source]
        source: ResolveError,
    },
    /// Connecting, writing or reading failed (transport). `register`
    /// retries these until its deadline.
    #[error("bootstrap service at {addr} unreachable: {source}")]
    Unreachable {
        /// The service's address.
        addr: SocketAddr,
        /// What the OS said.
        #[source]
        source: std::io::Error,
    },
    /// The service refused this client's credentials (HTTP 401): it holds
    /// a cluster key this client does not sign with, or this client's
    /// clock is off by more than the service's window. Not retried.
    #[error(
        "the bootstrap service refused this client's credentials (HTTP 401): both sides \
         must hold the same cluster key ({}) and clocks within the service's window",
        kvferry_auth::KEY_FILE_ENV
    )]
    Unauthorized,
    /// The service answered with an error status; `reason` is its message.
    #[error("bootstrap service refused the request: HTTP {status}: {reason}")]
    Rejected {
        /// The HTTP status.
        status: u16,
        /// The service's message.
        reason: String,
    },
    /// The response is not valid HTTP or not the expected JSON (peer).
    #[error("bad response from the bootstrap service: {0}")]
    BadResponse(String),
    /// The deadline passed before the request succeeded (timeout).
    #[error("bootstrap service not reachable within {waited_ms} ms (last error: {last})")]
    DeadlineExceeded {
        /// How long it tried.
        waited_ms: u64,
        /// The last attempt's error.
        last: String,
    },
}

impl ClientError {
    /// True when trying again later may succeed (the service is not up yet
    /// or the connection broke), false when the answer would be the same.
    pub fn is_retryable(&self) -> bool {
        match self {
            ClientError::Unreachable { .. } => true,
            ClientError::Resolve { source, .. } => source.is_retryable(),
            ClientError::Rejected { status, .. } => *status == 503 || *status == 429,
            ClientError::BadAddress(_)
            | ClientError::Unauthorized
            | ClientError::BadResponse(_)
            | ClientError::DeadlineExceeded { .. } => false,
        }
    }
    /// True when the service turned this client away for who it is (a
    /// key it does not hold, 401; another host without a key, 403):
    /// asking again gets the same answer until an operator acts.
    pub fn is_refusal(&self) -> bool {
        matches!(
            self,
            ClientError::Unauthorized | ClientError::Rejected { status: 403, .. }
        )
    }
}

/// How `register` retries while the service is not up yet.
#[derive(Clone, Copy, Debug)]
pub struct RetryPolicy {
    /// Give up (with `DeadlineExceeded`) after this long.
    pub deadline: Duration,
    /// First pause between attempts; doubled after each failure.
    pub initial_backoff: Duration,
    /// Longest pause between attempts.
    pub max_backoff: Duration,
}

impl Default for RetryPolicy {
    /// vLLM retries once a second forever; a deadline makes a typo in the
    /// address an error instead of a hang, and the short first backoff makes
    /// ranks started together with the service register quickly.
    fn default() -> Self {
        RetryPolicy {
            deadline: Duration::from_secs(60),
            initial_backoff: Duration::from_millis(20),
            max_backoff: Duration::from_secs(1),
        }
    }
}

impl RetryPolicy {
    /// The pauses between attempts: `initial_backoff` doubling up to
    /// `max_backoff`.
    pub fn backoff(&self) -> Backoff {
        Backoff::doubling(self.initial_backoff, self.max_backoff)
    }

    /// Calls `attempt` until it ends the call (`Break`) or `deadline` has
    /// passed since the first attempt, pausing as [`RetryPolicy::backoff`]
    /// says between attempts and never past the deadline. `Continue`
    /// carries why the attempt did not end the call: the error names the
    /// last one when time runs out.
    fn retry<T>(
        &self,
        mut attempt: impl FnMut() -> ControlFlow<Result<T, ClientError>, String>,
    ) -> Result<T, ClientError> {
        let start = Instant::now();
        // A deadline too far for the clock to hold is no deadline.
        let deadline = start.checked_add(self.deadline);
        let mut pauses = self.backoff().start();
        loop {
            let last = match attempt() {
                ControlFlow::Break(done) => return done,
                ControlFlow::Continue(last) => last,
            };
            let now = Instant::now();
            let pause = match deadline {
                Some(deadline) => pauses.next_before(now, deadline),
                None => Some(pauses.next_delay()),
            };
            let Some(pause) = pause else {
                return Err(ClientError::DeadlineExceeded {
                    waited_ms: now.duration_since(start).as_millis() as u64,
                    last,
                });
            };
            tracing::debug!(%last, ?pause, "bootstrap service not ready, retrying");
            // Sleeping is the retry pause itself, not a stand-in for
            // synchronisation: there is nothing to wait on until the
            // service starts listening or the ranks register.
            std::thread::sleep(pause);
        }
    }
}

/// What a failed attempt means to [`RetryPolicy::retry`]: try again after
/// a retryable error, give up at once after any other.
fn again_if_retryable<T>(err: ClientError) -> ControlFlow<Result<T, ClientError>, String> {
    if err.is_retryable() {
        ControlFlow::Continue(err.to_string())
    } else {
        ControlFlow::Break(Err(err))
    }
}

/// Talks to one bootstrap service.
#[derive(Clone, Debug)]
pub struct BootstrapClient {
    /// The service's address as given (a host name is looked up at every
    /// attempt, so a service that moved is found again).
    target: HostPort,
    resolver: Resolver,
    host: String,
    /// Connect, read and write timeout of each attempt.
    io_timeout: Duration,
    /// Signs every request when set (see [`kvferry_auth::request`]).
    key: Option<ClusterKey>,
}

impl BootstrapClient {
    /// `addr` is `host:port`, optionally prefixed by `http://` and followed
    /// by `/` (vLLM passes `http://host:port`); the host is an IP address
    /// or a name, looked up by [`Resolver::default`] at every attempt
    /// (see [`BootstrapClient::with_resolver`]).
    pub fn new(addr: &str) -> Result<BootstrapClient, ClientError> {
        let trimmed = addr.trim();
        let trimmed = trimmed.strip_prefix("http://").unwrap_or(trimmed);
        let trimmed = trimmed.trim_end_matches('/');
        if trimmed.is_empty() || trimmed.contains('/') {
            return Err(ClientError::BadAddress(ResolveError::BadName(
                addr.to_string(),
            )));
        }
        let target = HostPort::parse(trimmed).map_err(ClientError::BadAddress)?;
        Ok(BootstrapClient {
            host: target.to_string(),
            target,
            resolver: Resolver::default(),
            io_timeout: Duration::from_secs(5),
            key: None,
        })
    }

    /// Signs every request with `key` (a service started with a key
    /// refuses unsigned `/register` and `/query`).
    pub fn with_key(mut self, key: Option<ClusterKey>) -> BootstrapClient {
        self.key = key;
        self
    }

    /// Changes the per-attempt connect/read/write timeout (default 5 s).
    pub fn with_io_timeout(mut self, timeout: Duration) -> BootstrapClient {
        self.io_timeout = timeout.max(Duration::from_millis(1));
        self
    }

    /// Looks the service's name up with `resolver` (a node passes one
    /// bounded by its `resolve_timeout`; a test, one whose answer changes).
    pub fn with_resolver(mut self, resolver: Resolver) -> BootstrapClient {
        self.resolver = resolver;
        self
    }

    /// The service's address as given.
    pub fn addr(&self) -> &HostPort {
        &self.target
    }

    /// The service's address now: looked up again for every connection,
    /// so a name whose address changed is followed.
    fn resolve(&self) -> Result<SocketAddr, ClientError> {
        self.resolver
            .resolve(&self.target)
            .map_err(|source| ClientError::Resolve {
                addr: self.target.to_string(),
                source,
            })
    }

    /// Registers one worker, retrying with exponential backoff while the
    /// service is unreachable (not started yet) or full, until
    /// `policy.deadline`. A refusal (bad request, engine mismatch) is
    /// returned at once.
    pub fn register(
        &self,
        req: &RegisterRequest,
        policy: RetryPolicy,
    ) -> Result<RegisterResponse, ClientError> {
        let body = serde_json::to_vec(req).expect("registration serializes");
        policy.retry(|| match self.request("POST", "/register", Some(&body)) {
            Ok((200, body)) => ControlFlow::Break(
                serde_json::from_slice(&body)
                    .map_err(|e| ClientError::BadResponse(format!("register: {e}"))),
            ),
            Ok((status, body)) => again_if_retryable(rejected(status, &body)),
            Err(err) => again_if_retryable(err),
        })
    }

    /// All registered engines, or only `engine_id`'s dp ranks. One attempt.
    pub fn query(&self, engine_id: Option<&str>) -> Result<QueryResponse, ClientError> {
        let path = match engine_id {
            Some(id) => format!("/query?engine_id={}", percent_encode(id)),
            None => "/query".to_string(),
        };
        match self.request("GET", &path, None)? {
            (200, body) => serde_json::from_slice(&body)
                .map_err(|e| ClientError::BadResponse(format!("query: {e}"))),
            (status, body) => Err(rejected(status, &body)),
        }
    }

    /// Queries until `engine_id` has at least one dp rank and every one of
    /// its dp ranks has `tp_size` tp ranks registered (prefill ranks of one
    /// engine start and register independently), retrying like `register`
    /// while the service is unreachable or the engine incomplete.
    pub fn wait_for_engine(
        &self,
        engine_id: &str,
        tp_size: usize,
        policy: RetryPolicy,
    ) -> Result<QueryResponse, ClientError> {
        self.wait_for_stages(engine_id, tp_size, 1, policy)
    }

    /// Like [`BootstrapClient::wait_for_engine`], and with pipeline
    /// parallelism until TP rank 0 of every dp rank has `pp_size` stages
    /// registered too (each stage registers on its own).
    pub fn wait_for_stages(
        &self,
        engine_id: &str,
        tp_size: usize,
        pp_size: usize,
        policy: RetryPolicy,
    ) -> Result<QueryResponse, ClientError> {
        let complete = |e: &super::EngineEntry| {
            e.tp_size() >= tp_size && (pp_size <= 1 || e.pp_size() >= pp_size)
        };
        policy.retry(|| match self.query(Some(engine_id)) {
            Ok(found) if !found.is_empty() && found.values().all(complete) => {
                ControlFlow::Break(Ok(found))
            }
            Ok(found) => ControlFlow::Continue(format!(
                "engine {engine_id:?} has {} of {tp_size} tp ranks and {} of {pp_size} stages registered",
                found.values().map(|e| e.tp_size()).min().unwrap_or(0),
                found.values().map(|e| e.pp_size()).min().unwrap_or(0)
            )),
            Err(err) => again_if_retryable(err),
        })
    }

    /// `Ok(())` when `GET /health` answers 200. One attempt.
    pub fn health(&self) -> Result<(), ClientError> {
        match self.request("GET", "/health", None)? {
            (200, _) => Ok(()),
            (status, body) => Err(rejected(status, &body)),
        }
    }

    /// The Prometheus text of `GET /metrics`. One attempt.
    pub fn metrics_text(&self) -> Result<String, ClientError> {
        match self.request("GET", "/metrics", None)? {
            (200, body) => String::from_utf8(body)
                .map_err(|_| ClientError::BadResponse("metrics are not UTF-8".into())),
            (status, body) => Err(rejected(status, &body)),
        }
    }

    /// Sends one request and returns the status and body of the response.
    /// Public so tests and tools can send arbitrary bodies.
    pub fn request(
        &self,
        method: &str,
        path: &str,
        body: Option<&[u8]>,
    ) -> Result<(u16, Vec<u8>), ClientError> {
        let addr = self.resolve()?;
        let io = |source| ClientError::Unreachable { addr, source };
        let mut stream = TcpStream::connect_timeout(&addr, self.io_timeout).map_err(io)?;
        stream.set_read_timeout(Some(self.io_timeout)).map_err(io)?;
        stream
            .set_write_timeout(Some(self.io_timeout))
            .map_err(io)?;
        let _ = stream.set_nodelay(true);

        let body = body.unwrap_or(&[]);
        let mut head = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\nAccept: */*\r\n",
            self.host
        );
        if let Some(key) = &self.key {
            let now_ms = kvferry_metrics::http::unix_ms();
            let signed = kvferry_auth::request::sign(key, now_ms, method, path, body)
                .map_err(|e| io(std::io::Error::other(e)))?;
            head.push_str(&format!("{}: {signed}\r\n", kvferry_auth::request::HEADER));
        }
        if method == "POST" || !body.is_empty() {
            head.push_str(&format!(
                "Content-Type: application/json\r\nContent-Length: {}\r\n",
                body.len()
            ));
        }
        head.push_str("\r\n");
        let mut out = head.into_bytes();
        out.extend_from_slice(body);
        stream.write_all(&out).map_err(io)?;
        stream.flush().map_err(io)?;

        let mut reader = BufReader::new(stream);
        read_response(&mut reader).map_err(|e| match e {
            ReadError::Io(source) => ClientError::Unreachable { addr, source },
            ReadError::Bad(reason) => ClientError::BadResponse(reason),
        })
    }
}

fn rejected(status: u16, body: &[u8]) -> ClientError {
    if status == 401 {
        return ClientError::Unauthorized;
    }
    // The server's errors are `{"error": reason}`; show the reason alone
    // when it is, the raw text otherwise.
    let text = String::from_utf8_lossy(body);
    let reason = serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v.get("error").and_then(|e| e.as_str()).map(str::to_string))
        .unwrap_or_else(|| text.trim().chars().take(512).collect());
    ClientError::Rejected { status, reason }
}

enum ReadError {
    Io(std::io::Error),
    Bad(String),
}

impl From<std::io::Error> for ReadError {
    fn from(e: std::io::Error) -> Self {
        ReadError::Io(e)
    }
}

fn read_line<R: BufRead>(r: &mut R) -> Result<String, ReadError> {
    let mut line = Vec::new();
    r.take(MAX_LINE_BYTES as u64 + 1)
        .read_until(b'\n', &mut line)?;
    if line.len() > MAX_LINE_BYTES {
        return Err(ReadError::Bad("header line too long".into()));
    }
    if line.is_empty() {
        // The server closed the connection without a word (it was starting
        // or stopping): a transport failure, worth retrying.
        return Err(ReadError::Io(std::io::ErrorKind::UnexpectedEof.into()));
    }
    if !line.ends_with(b"\n") {
        return Err(ReadError::Bad(
            "connection closed inside the headers".into(),
        ));
    }
    let line = String::from_utf8(line).map_err(|_| ReadError::Bad("header is not UTF-8".into()))?;
    Ok(line.trim_end_matches(['\r', '\n']).to_string())
}

fn read_response<R: BufRead>(r: &mut R) -> Result<(u16, Vec<u8>), ReadError> {
    let status_line = read_line(r)?;
    let mut parts = status_line.splitn(3, ' ');
    let (Some(version), Some(code)) = (parts.next(), parts.next()) else {
        return Err(ReadError::Bad(format!("bad status line {status_line:?}")));
    };
    if !version.starts_with("HTTP/1.") {
        return Err(ReadError::Bad(format!("bad status line {status_line:?}")));
    }
    let status: u16 = code
        .parse()
        .map_err(|_| ReadError::Bad(format!("bad status code {code:?}")))?;

    let mut content_length = None;
    let mut chunked = false;
    for i in 0.. {
        if i == MAX_HEADERS {
            return Err(ReadError::Bad("too many headers".into()));
        }
        let line = read_line(r)?;
        if line.is_empty() {
            break;
        }
        let Some((name, value)) = line.split_once(':') else {
            return Err(ReadError::Bad(format!("bad header {line:?}")));
        };
        let value = value.trim();
        if name.eq_ignore_ascii_case("content-length") {
            let len: usize = value
                .parse()
                .map_err(|_| ReadError::Bad(format!("bad content-length {value:?}")))?;
            content_length = Some(len);
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            chunked = value.to_ascii_lowercase().contains("chunked");
        }
    }

    let body = if chunked {
        read_chunked(r)?
    } else if let Some(len) = content_length {
        if len > MAX_RESPONSE_BYTES {
            return Err(ReadError::Bad(format!("response body of {len} bytes")));
        }
        let mut body = vec![0; len];
        r.read_exact(&mut body)?;
        body
    } else {
        let mut body = Vec::new();
        r.take(MAX_RESPONSE_BYTES as u64 + 1)
            .read_to_end(&mut body)?;
        if body.len() > MAX_RESPONSE_BYTES {
            return Err(ReadError::Bad("response body too large".into()));
        }
        body
    };
    Ok((status, body))
}

fn read_chunked<R: BufRead>(r: &mut R) -> Result<Vec<u8>, ReadError> {
    let mut body = Vec::new();
    loop {
        let line = read_line(r)?;
        let size_text = line.split(';').next().unwrap_or("").trim();
        let size = usize::from_str_radix(size_text, 16)
            .map_err(|_| ReadError::Bad(format!("bad chunk size {size_text:?}")))?;
        if size == 0 {
            // Trailers, then the final empty line.
            while !read_line(r)?.is_empty() {}
            return Ok(body);
        }
        if body.len() + size > MAX_RESPONSE_BYTES {
            return Err(ReadError::Bad("response body too large".into()));
        }
        let start = body.len();
        body.resize(start + size, 0);
        r.read_exact(&mut body[start..])?;
        if !read_line(r)?.is_empty() {
            return Err(ReadError::Bad("chunk not followed by CRLF".into()));
        }
    }
}

fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}
