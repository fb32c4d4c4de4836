//! The HTTP side of metrics: `GET /metrics` and `GET /health` on an address
//! of their own ([`MetricsServer`], for a node's `metrics_listen` and the
//! store server's `--metrics-listen`), and the listening socket every HTTP
//! server of kvferry binds ([`bind`], the bootstrap service's too).
//!
//! `tiny_http` was chosen because it is small, maintained, synchronous and
//! has no Tokio in its tree: a scrape now and then needs a plain thread,
//! not a second async runtime next to glommio.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use kvferry_auth::request::Verifier;

/// Renders the metrics for `GET /metrics`.
pub type MetricsSource = Arc<dyn Fn() -> String + Send + Sync>;

/// The content type of `/metrics` (OpenMetrics text, which Prometheus
/// scrapes).
pub const METRICS_CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Why the server could not start.
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// The listen address does not parse or resolve.
    #[error("bad listen address {addr:?}: {source}")]
    BadAddress {
        /// The address asked for.
        addr: String,
        /// Why.
        #[source]
        source: kvferry_transport::internal::resolve::ResolveError,
    },
    /// Binding the listening socket failed (port in use, permissions...).
    #[error("cannot listen on {addr}: {reason}")]
    Bind {
        /// The address asked for.
        addr: String,
        /// Why it failed.
        reason: String,
    },
    /// The OS refused to start a thread.
    #[error("cannot spawn server thread: {0}")]
    Spawn(#[from] std::io::Error),
}

/// What `GET /metrics` requires when it is authenticated: a request signed
/// with the cluster key ([`kvferry_auth::request`]); `/health` stays open.
/// A refusal (401) counts on `surface`.
pub struct ScrapeAuth {
    /// The cluster key.
    pub key: kvferry_auth::ClusterKey,
    /// Where refusals are counted.
    pub rejects: Arc<kvferry_auth::Rejects>,
    /// Which surface they count on.
    pub surface: kvferry_auth::Surface,
}

impl ScrapeAuth {
    /// Whether `request` is signed; a refusal is counted.
    fn allows(&self, request: &tiny_http::Request, verifier: &mut Verifier) -> bool {
        let ok = verify_signed(verifier, &self.key, request, b"").is_ok();
        if !ok {
            self.rejects.count(self.surface);
        }
        ok
    }
}

/// Milliseconds since the Unix epoch: the clock signed requests carry
/// (hosts of one cluster keep theirs in step, as for any TLS deployment).
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Checks the signature of `request` (whose body is `body`) against
/// `key` at the wall clock ([`kvferry_auth::request`]): what every
/// authenticated HTTP endpoint of kvferry asks of a request.
pub fn verify_signed(
    verifier: &mut Verifier,
    key: &kvferry_auth::ClusterKey,
    request: &tiny_http::Request,
    body: &[u8],
) -> Result<(), kvferry_auth::AuthError> {
    let header = request
        .headers()
        .iter()
        .find(|h| h.field.equiv(kvferry_auth::request::HEADER))
        .map(|h| h.value.as_str());
    let method = request.method().as_str();
    verifier.verify(key, unix_ms(), method, request.url(), body, header)
}

/// Signatures a metrics endpoint remembers (a scrape every few seconds
/// fits many times over in a 30 s window).
const SCRAPES_REMEMBERED: usize = 4096;

/// A running metrics endpoint; dropping it stops and joins its thread.
pub struct MetricsServer {
    server: Arc<tiny_http::Server>,
    local_addr: SocketAddr,
    stopping: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl MetricsServer {
    /// Serves `source` on `addr` (port 0: any free port).
    pub fn start(addr: &str, source: MetricsSource) -> Result<MetricsServer, ServerError> {
        Self::start_with(addr, source, None)
    }

    /// [`MetricsServer::start`], `/metrics` only to signed requests when
    /// `auth` is set.
    pub fn start_with(
        addr: &str,
        source: MetricsSource,
        auth: Option<ScrapeAuth>,
    ) -> Result<MetricsServer, ServerError> {
        let (server, local_addr) = bind(addr)?;
        let server = Arc::new(server);
        let stopping = Arc::new(AtomicBool::new(false));
        let (s, stop) = (server.clone(), stopping.clone());
        let thread = std::thread::Builder::new()
            .name("kvferry-metrics".into())
            .spawn(move || serve(&s, &stop, &source, auth.as_ref()))?;
        tracing::info!(addr = %local_addr, "metrics endpoint listening");
        Ok(MetricsServer {
            server,
            local_addr,
            stopping,
            thread: Some(thread),
        })
    }

    /// The address it listens on (the real port when started with port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.stopping.store(true, Ordering::SeqCst);
        self.server.unblock();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn serve(
    server: &tiny_http::Server,
    stopping: &AtomicBool,
    source: &MetricsSource,
    auth: Option<&ScrapeAuth>,
) {
    let mut verifier = Verifier::new(30_000, SCRAPES_REMEMBERED);
    while !stopping.load(Ordering::SeqCst) {
        let Ok(request) = server.recv() else {
            // tiny_http reports `unblock` as an interrupted error.
            continue;
        };
        let mut allowed = || auth.is_none_or(|a| a.allows(&request, &mut verifier));
        let (status, body, content_type) = match (request.method(), request.url()) {
            (tiny_http::Method::Get, "/metrics") if !allowed() => {
                (401, "unauthorized\n".to_string(), "text/plain")
            }
            (tiny_http::Method::Get, "/metrics") => (200, source(), METRICS_CONTENT_TYPE),
            (tiny_http::Method::Get, "/health") => (200, "ok\n".to_string(), "text/plain"),
            _ => (404, "not found\n".to_string(), "text/plain"),
        };
        let header = tiny_http::Header::from_bytes(&b"Content-Type"[..], content_type.as_bytes())
            .expect("static header");
        let response = tiny_http::Response::from_string(body)
            .with_status_code(status)
            .with_header(header);
        if let Err(e) = request.respond(response) {
            tracing::debug!(%e, "metrics response not sent");
        }
    }
}

/// Binds an HTTP server to `addr` (port 0: any free port); returns it and
/// the address it got.
pub fn bind(addr: &str) -> Result<(tiny_http::Server, SocketAddr), ServerError> {
    // The caller's thread waits (bounded) for a name: a node binds its
    // servers in `Node::start`, the CLI before it serves.
    let resolved = kvferry_transport::internal::resolve::Resolver::default()
        .resolve_str(addr)
        .map_err(|source| ServerError::BadAddress {
            addr: addr.to_string(),
            source,
        })?;
    let server = tiny_http::Server::http(resolved).map_err(|e| ServerError::Bind {
        addr: addr.to_string(),
        reason: e.to_string(),
    })?;
    let local_addr = server
        .server_addr()
        .to_ip()
        .expect("a server bound to an IP address reports an IP address");
    Ok((server, local_addr))
}
