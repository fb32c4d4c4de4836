//! The embeddable HTTP server of the bootstrap service, on kvferry's one
//! HTTP server ([`kvferry_http`]): the service answers a handful of
//! requests per rank at startup plus an occasional scrape, so a couple of
//! plain threads are all it needs.

use kvferry_reactor::lock;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvferry_auth::limits::{Budget, PeerBudget};
use kvferry_auth::request::Verifier;
use kvferry_auth::{AuthError, ClusterKey, Rejects, Surface};

use kvferry_http::{
    verify_signed, Access, Config, Gate, Listener, Method, Refusal, Reply, Request, Routes, Server,
};

use kvferry_metrics::http::ServerError;

use super::{MetricsSource, RegisterError, RegisterRequest, Registry, RegistryLimits};

/// Server settings.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Largest request body accepted; larger ones get HTTP 413.
    pub max_body_bytes: usize,
    /// Bounds on the registry (workers, string lengths, ranks).
    pub registry: RegistryLimits,
    /// Threads answering requests. Registration bursts are small (one
    /// request per rank), so two keep a slow client from blocking others.
    pub workers: usize,
    /// Authenticate requests with a cluster key; `None`: whoever reaches
    /// the port is trusted, so a service listening beyond loopback serves
    /// callers on its own host only, unless `allow_unauthenticated_remote`.
    pub auth: Option<ServerAuth>,
    /// Without a key, serve callers on other hosts too (anyone who
    /// reaches the port may register ranks and redirect decode ranks).
    pub allow_unauthenticated_remote: bool,
    /// The ranks of the engine this service is embedded in: until each
    /// has registered, `/query` for every engine answers 503 (a router
    /// retries; one that kept an early, partial answer would keep it for
    /// good). `/query?engine_id=` answers with what is registered, as
    /// always. `None`: answer with whatever is registered.
    pub expect: Option<ExpectedRanks>,
    /// Where refused requests are counted (shared with the node that
    /// embeds the service, so its `/metrics` shows them).
    pub rejects: Arc<Rejects>,
    /// Per-address budgets: of requests served, and (apart, so a flood
    /// of bad requests from an address never locks out its good ones) of
    /// refusals answered. Past either, a request gets 429, counted in
    /// `kvferry_rate_limited_total{surface="bootstrap"}`.
    pub limits: ServerLimits,
}

/// The bootstrap service's per-address budgets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServerLimits {
    /// Requests served per address (registrations, queries, scrapes).
    pub requests: Budget,
    /// Requests refused for failing authentication per address.
    pub refusals: Budget,
}

impl Default for ServerLimits {
    /// A rank registers once and a decode rank queries once per prefill
    /// engine it meets: a thousand a second from one host is a runaway.
    fn default() -> Self {
        ServerLimits {
            requests: Budget {
                per_second: 1000,
                burst: 10_000,
                max_addrs: 4096,
            },
            refusals: Budget {
                per_second: 10,
                burst: 100,
                max_addrs: 4096,
            },
        }
    }
}

/// How the service authenticates its requests.
#[derive(Clone, Debug)]
pub struct ServerAuth {
    /// The cluster key.
    pub key: ClusterKey,
    /// Largest difference accepted between a request's time and the
    /// service's clock.
    pub window: Duration,
    /// Most signatures remembered to refuse replays (each for `2 × window`
    /// at most); past it signed requests get 503 until some expire.
    pub replay_capacity: usize,
    /// Serve `/metrics` to anyone (a Prometheus scraper without the key).
    pub open_metrics: bool,
    /// Serve `GET /query` to anyone: routers (vllm-router) ask it unsigned
    /// for engine ids. It names engine ids and side-channel addresses,
    /// which are of no use without the key (docs/security.md).
    pub open_query: bool,
}

/// The ranks an engine's bootstrap service waits for before `/query`
/// answers: `dp_size` data-parallel ranks of `workers` (TP × PP) each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpectedRanks {
    /// Data-parallel ranks.
    pub dp_size: u32,
    /// Workers (TP ranks × PP stages) of each.
    pub workers: usize,
}

impl ServerAuth {
    /// `key` with a 30 s window, 65 536 remembered signatures, and open
    /// `/metrics` and `/query`.
    pub fn new(key: ClusterKey) -> ServerAuth {
        ServerAuth {
            key,
            window: Duration::from_secs(30),
            replay_capacity: 65_536,
            open_metrics: true,
            open_query: true,
        }
    }
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            max_body_bytes: 64 * 1024,
            registry: RegistryLimits::default(),
            workers: 2,
            auth: None,
            allow_unauthenticated_remote: false,
            expect: None,
            rejects: Arc::default(),
            limits: ServerLimits::default(),
        }
    }
}

struct Shared {
    registry: Mutex<Registry>,
    verifier: Mutex<Verifier>,
    /// `(requests, refusals)` budgets per address.
    budgets: Mutex<(PeerBudget, PeerBudget)>,
    /// The budgets' clock.
    started: std::time::Instant,
    metrics: Option<MetricsSource>,
    config: ServerConfig,
    /// No key, listening beyond loopback, and not told to trust anyone:
    /// callers from other hosts are turned away ([`LOCAL_ONLY`]).
    local_only: bool,
}

/// What a caller from another host hears from a service without a key
/// (and what the service logs): the two ways to let it in.
pub const LOCAL_ONLY: &str = "this bootstrap service has no cluster key and serves its own host \
     only: set the same cluster key (cluster_key_file, KVFERRY_CLUSTER_KEY_FILE) on every node, \
     or allow_unauthenticated_remote to trust anyone who reaches it";

/// A running bootstrap service. Dropping it shuts it down (and joins its
/// threads) like [`BootstrapServer::shutdown`].
pub struct BootstrapServer {
    server: Server,
    shared: Arc<Shared>,
}

impl BootstrapServer {
    /// Starts the service on `addr` (e.g. `"127.0.0.1:8998"`, or port 0 for
    /// any free port) with default settings and no `/metrics`.
    pub fn start(addr: &str) -> Result<BootstrapServer, ServerError> {
        Self::start_with(addr, ServerConfig::default(), None)
    }

    /// Starts the service, serving `metrics` (a node's, when the service is
    /// embedded in it) on `GET /metrics`.
    pub fn start_with(
        addr: &str,
        config: ServerConfig,
        metrics: Option<MetricsSource>,
    ) -> Result<BootstrapServer, ServerError> {
        // Bound first: whether callers on other hosts are served depends on
        // the address it got.
        let listener = Listener::bind(addr)?;
        let local_addr = listener.local_addr();
        let remote = !local_addr.ip().is_loopback() && config.auth.is_none();
        let local_only = remote && !config.allow_unauthenticated_remote;
        if local_only {
            tracing::info!(addr = %local_addr, "bootstrap service without a cluster key: callers on other hosts are refused");
        } else if remote {
            tracing::warn!(addr = %local_addr, "bootstrap service beyond loopback without a cluster key: anyone who reaches it is trusted");
        }
        let http = Config {
            workers: config.workers,
            max_body_bytes: config.max_body_bytes,
            refusal,
            ..Config::new("kvferry-bootstrap")
        };
        let shared = Arc::new(Shared {
            registry: Mutex::new(Registry::new(config.registry)),
            budgets: Mutex::new((
                PeerBudget::new(config.limits.requests),
                PeerBudget::new(config.limits.refusals),
            )),
            started: std::time::Instant::now(),
            verifier: Mutex::new(Verifier::new(
                config
                    .auth
                    .as_ref()
                    .map_or(0, |a| a.window.as_millis() as u64),
                config.auth.as_ref().map_or(0, |a| a.replay_capacity),
            )),
            metrics,
            config,
            local_only,
        });
        let server = listener.serve(http, routes(&shared))?;
        tracing::info!(addr = %local_addr, "bootstrap service listening");
        Ok(BootstrapServer { server, shared })
    }

    /// The address the service listens on (the real port when started with
    /// port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.server.local_addr()
    }

    /// Workers registered so far.
    pub fn registered(&self) -> usize {
        lock(&self.shared.registry).len()
    }

    /// Stops accepting requests and joins the worker threads. Requests being
    /// answered are finished first.
    pub fn shutdown(mut self) {
        self.server.stop();
    }
}

/// The service's routes. With a key each is signed unless left open, and
/// so is every request no route takes: an unsigned caller hears 401 from
/// anything but the open routes, never a 404 or 405.
fn routes(shared: &Arc<Shared>) -> Routes {
    let access = |open: fn(&ServerAuth) -> bool| match &shared.config.auth {
        Some(auth) if !open(auth) => Access::Signed,
        _ => Access::Open,
    };
    let (r, q, m) = (shared.clone(), shared.clone(), shared.clone());
    Routes::new()
        .route(Method::Post, "/register", access(|_| false), move |req| {
            register(req.body(), &r)
        })
        .route(
            Method::Get,
            "/query",
            access(|a| a.open_query),
            move |req| query_route(req.query(), &q),
        )
        .route(Method::Get, "/health", Access::Open, |_| {
            text(200, "ok\n".into())
        })
        .route(
            Method::Get,
            "/metrics",
            access(|a| a.open_metrics),
            move |_| metrics(&m),
        )
        .unmatched(access(|_| false))
        .gate(shared.clone())
}

impl Gate for Shared {
    /// Callers on other hosts turned away when the service is local-only,
    /// then the signature where the route wants one, then the address's
    /// budget of requests (after the signature, so unsigned requests spend
    /// the refusals' budget, never the good ones').
    fn check(&self, request: &Request<'_>, access: Access) -> Result<(), Reply> {
        admit(request, self)?;
        // Routes are signed only when the service has a key.
        if let (Access::Signed, Some(auth)) = (access, &self.config.auth) {
            authenticate(request, auth, self)?;
        }
        if !within_budget(request, self, |b| &mut b.0) {
            return Err(error(429, "too many requests".into()));
        }
        Ok(())
    }
}

fn metrics(shared: &Shared) -> Reply {
    match &shared.metrics {
        Some(source) => Reply::new(200, super::METRICS_CONTENT_TYPE, source()),
        None => error(404, "this service has no metrics".into()),
    }
}

fn text(status: u16, body: String) -> Reply {
    Reply::new(status, "text/plain; charset=utf-8", body)
}

fn json(status: u16, body: String) -> Reply {
    Reply::new(status, "application/json", body)
}

/// Errors are JSON too (`{"error": reason}`) so scripts can parse them.
fn error(status: u16, reason: String) -> Reply {
    json(status, serde_json::json!({ "error": reason }).to_string())
}

/// What the server answers itself (404, 405, 413...), as every error.
fn refusal(refusal: &Refusal) -> Reply {
    error(refusal.status(), refusal.to_string())
}

/// Checks the signature of a request whose route wants one: 401 without
/// a reason otherwise (the reason goes to the debug log), counted.
fn authenticate(request: &Request<'_>, auth: &ServerAuth, shared: &Shared) -> Result<(), Reply> {
    let verdict = verify_signed(&mut lock(&shared.verifier), &auth.key, request);
    verdict.map_err(|err| {
        if !within_budget(request, shared, |b| &mut b.1) {
            // Past the address's refusals: turned away without a log line.
            return error(429, "too many requests".into());
        }
        shared.config.rejects.count(Surface::Bootstrap);
        let peer = request
            .remote_addr()
            .map(|a| a.to_string())
            .unwrap_or_default();
        let (method, url) = (request.method(), request.url());
        tracing::debug!(%err, %peer, method, url, "bootstrap request not authenticated");
        match err {
            AuthError::Busy => error(503, "busy".into()),
            _ => error(401, "unauthorized".into()),
        }
    })
}

/// Turns away a caller from another host when the service is local-only:
/// 403 with [`LOCAL_ONLY`], logged as an error on this side too (within
/// the address's refusal budget), counted.
fn admit(request: &Request<'_>, shared: &Shared) -> Result<(), Reply> {
    let Some(peer) = request.remote_addr() else {
        return Ok(());
    };
    if !shared.local_only || kvferry_transport::is_own_address(peer.ip()) {
        return Ok(());
    }
    if !within_budget(request, shared, |b| &mut b.1) {
        return Err(error(429, "too many requests".into()));
    }
    shared.config.rejects.count(Surface::Bootstrap);
    tracing::error!(%peer, url = request.url(), "refused a caller on another host: {LOCAL_ONLY}");
    Err(error(403, LOCAL_ONLY.into()))
}

/// Takes one unit of `request`'s address from the budget `which` picks;
/// false (counted) when it is spent.
fn within_budget(
    request: &Request<'_>,
    shared: &Shared,
    which: impl FnOnce(&mut (PeerBudget, PeerBudget)) -> &mut PeerBudget,
) -> bool {
    let Some(ip) = request.remote_addr().map(|a| a.ip()) else {
        return true;
    };
    let now_ms = shared.started.elapsed().as_millis() as u64;
    let allowed = which(&mut lock(&shared.budgets)).allow(now_ms, ip);
    if !allowed {
        shared.config.rejects.count_limited(Surface::Bootstrap);
    }
    allowed
}

fn register(body: &[u8], shared: &Shared) -> Reply {
    let req: RegisterRequest = match serde_json::from_slice(body) {
        Ok(req) => req,
        Err(err) => return error(400, format!("malformed registration: {err}")),
    };
    let summary = format!(
        "engine {} dp {} tp {} pp {} at {}",
        req.engine_id, req.dp_rank, req.tp_rank, req.pp_rank, req.addr
    );
    let result = lock(&shared.registry).register(req);
    match result {
        Ok(resp) if resp.replaced => {
            // A live rank's address changed: a restarted rank, or (without
            // a key) anyone who can reach the port. Worth a line either way.
            let authenticated = shared.config.auth.is_some();
            tracing::warn!(
                authenticated,
                "registration replaced the address of {summary}"
            );
            json(
                200,
                serde_json::to_string(&resp).expect("response serializes"),
            )
        }
        Ok(resp) => {
            tracing::info!("registered {summary}");
            json(
                200,
                serde_json::to_string(&resp).expect("response serializes"),
            )
        }
        Err(err) => {
            let status = match &err {
                RegisterError::Invalid(_) => 400,
                RegisterError::EngineMismatch { .. } => 409,
                RegisterError::Full { .. } => 503,
            };
            error(status, err.to_string())
        }
    }
}

fn query_route(query: &str, shared: &Shared) -> Reply {
    let mut engine_id = None;
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        match pair.split_once('=') {
            Some(("engine_id", value)) => match percent_decode(value) {
                Some(v) => engine_id = Some(v),
                None => return error(400, "engine_id is not valid percent-encoding".into()),
            },
            _ => return error(400, format!("unknown query parameter {pair:?}")),
        }
    }
    let registry = lock(&shared.registry);
    // A router asks for every engine once and keeps the answer; a decode
    // rank asks for one engine and waits for its ranks itself.
    let expect = shared.config.expect.filter(|_| engine_id.is_none());
    if let Some(missing) = expect.and_then(|e| registry.missing(e)) {
        return error(503, missing);
    }
    let result = registry.query(engine_id.as_deref());
    json(
        200,
        serde_json::to_string(&result).expect("registry serializes"),
    )
}

/// Decodes `%XX` escapes and `+`; None on a bad escape or invalid UTF-8.
pub(crate) fn percent_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' => {
                let hex = bytes.get(i + 1..i + 3)?;
                // from_str_radix would also take a sign ("%+1").
                if !hex.iter().all(u8::is_ascii_hexdigit) {
                    return None;
                }
                let hex = std::str::from_utf8(hex).ok()?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}
