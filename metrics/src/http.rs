//! The HTTP side of metrics: `GET /metrics` and `GET /health` on an address
//! of their own ([`MetricsServer`], for a node's `metrics_listen` and the
//! store server's `--metrics-listen`), on kvferry's one HTTP server
//! ([`kvferry_http`]).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};

use kvferry_auth::request::Verifier;
use kvferry_http::{Access, Config, Gate, Method, Refusal, Reply, Request, Routes, Server};

pub use kvferry_http::{unix_ms, ServerError};

/// Renders the metrics for `GET /metrics`.
pub type MetricsSource = Arc<dyn Fn() -> String + Send + Sync>;

/// The content type of `/metrics` (OpenMetrics text, which Prometheus
/// scrapes).
pub const METRICS_CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

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

/// Signatures a metrics endpoint remembers (a scrape every few seconds
/// fits many times over in a 30 s window).
const SCRAPES_REMEMBERED: usize = 4096;

/// A scrape carries no body; a client that sends one anyway gets this much
/// slack before 413.
const MAX_BODY_BYTES: usize = 4096;

/// Checks the signature of scrapes of an authenticated `/metrics`.
struct ScrapeGate {
    auth: ScrapeAuth,
    verifier: Mutex<Verifier>,
}

impl Gate for ScrapeGate {
    fn check(&self, request: &Request<'_>, access: Access) -> Result<(), Reply> {
        if access == Access::Open {
            return Ok(());
        }
        // A panic elsewhere never leaves the verifier half updated.
        let mut verifier = self.verifier.lock().unwrap_or_else(PoisonError::into_inner);
        let verdict = kvferry_http::verify_signed(&mut verifier, &self.auth.key, request);
        verdict.map_err(|_| {
            self.auth.rejects.count(self.auth.surface);
            text(401, "unauthorized\n")
        })
    }
}

fn text(status: u16, body: &str) -> Reply {
    Reply::new(status, "text/plain", body.to_string())
}

/// Refusals in plain text, as the routes answer; an unknown path keeps its
/// short answer.
fn refusal(refusal: &Refusal) -> Reply {
    match refusal {
        Refusal::NotFound { .. } => text(refusal.status(), "not found\n"),
        other => text(other.status(), &format!("{other}\n")),
    }
}

/// A running metrics endpoint; dropping it stops and joins its thread.
pub struct MetricsServer {
    server: Server,
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
        let config = Config {
            max_body_bytes: MAX_BODY_BYTES,
            refusal,
            ..Config::new("kvferry-metrics")
        };
        let server = Server::start(addr, config, routes(source, auth))?;
        tracing::info!(addr = %server.local_addr(), "metrics endpoint listening");
        Ok(MetricsServer { server })
    }

    /// The address it listens on (the real port when started with port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.server.local_addr()
    }
}

/// `GET /metrics` (signed with `auth`) and `GET /health` (open).
fn routes(source: MetricsSource, auth: Option<ScrapeAuth>) -> Routes {
    let scrape = match auth {
        Some(_) => Access::Signed,
        None => Access::Open,
    };
    let routes = Routes::new()
        .route(Method::Get, "/metrics", scrape, move |_| {
            Reply::new(200, METRICS_CONTENT_TYPE, source())
        })
        .route(Method::Get, "/health", Access::Open, |_| text(200, "ok\n"));
    match auth {
        Some(auth) => routes.gate(Arc::new(ScrapeGate {
            auth,
            verifier: Mutex::new(Verifier::new(30_000, SCRAPES_REMEMBERED)),
        })),
        None => routes,
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};

    use kvferry_auth::{request, ClusterKey, Rejects, Surface};

    use super::*;

    /// The whole answer to one request, head and body.
    fn send(server: &MetricsServer, method: &str, target: &str, auth: Option<&str>) -> String {
        let mut s = std::net::TcpStream::connect(server.local_addr()).unwrap();
        let mut head = format!("{method} {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n");
        if let Some(a) = auth {
            head.push_str(&format!("{}: {a}\r\n", request::HEADER));
        }
        s.write_all(format!("{head}\r\n").as_bytes()).unwrap();
        let mut answer = String::new();
        s.read_to_string(&mut answer).unwrap();
        answer
    }

    fn source() -> MetricsSource {
        Arc::new(|| "# EOF\n".to_string())
    }

    #[test]
    fn metrics_health_and_the_rest() {
        let server = MetricsServer::start("127.0.0.1:0", source()).unwrap();
        let scrape = send(&server, "GET", "/metrics", None);
        assert!(scrape.starts_with("HTTP/1.1 200"), "{scrape}");
        assert!(scrape.contains(METRICS_CONTENT_TYPE), "{scrape}");
        assert!(scrape.ends_with("\r\n\r\n# EOF\n"), "{scrape}");
        let health = send(&server, "GET", "/health", None);
        assert!(health.starts_with("HTTP/1.1 200"), "{health}");
        assert!(health.ends_with("\r\n\r\nok\n"), "{health}");
        let missing = send(&server, "GET", "/nope", None);
        assert!(missing.starts_with("HTTP/1.1 404"), "{missing}");
        assert!(missing.ends_with("\r\n\r\nnot found\n"), "{missing}");
        // A known path asked with another method: 405 naming the one it takes.
        let wrong = send(&server, "POST", "/metrics", None);
        assert!(wrong.starts_with("HTTP/1.1 405"), "{wrong}");
        assert!(wrong.contains("\r\nAllow: GET\r\n"), "{wrong}");
    }

    #[test]
    fn an_authenticated_scrape_is_signed_and_health_stays_open() {
        let key = ClusterKey::from_bytes(&[7; 32], None).unwrap();
        let rejects = Arc::new(Rejects::default());
        let auth = ScrapeAuth {
            key: key.clone(),
            rejects: rejects.clone(),
            surface: Surface::Bootstrap,
        };
        let server = MetricsServer::start_with("127.0.0.1:0", source(), Some(auth)).unwrap();
        let refused = send(&server, "GET", "/metrics", None);
        assert!(refused.starts_with("HTTP/1.1 401"), "{refused}");
        assert!(refused.ends_with("\r\n\r\nunauthorized\n"), "{refused}");
        assert_eq!(rejects.get(Surface::Bootstrap), 1);
        let signature = request::sign(&key, unix_ms(), "GET", "/metrics", b"").unwrap();
        let signed = send(&server, "GET", "/metrics", Some(&signature));
        assert!(signed.starts_with("HTTP/1.1 200"), "{signed}");
        assert!(send(&server, "GET", "/health", None).starts_with("HTTP/1.1 200"));
        assert!(send(&server, "GET", "/nope", None).starts_with("HTTP/1.1 404"));
        assert_eq!(rejects.get(Surface::Bootstrap), 1);
    }
}
