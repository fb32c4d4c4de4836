//! `GET /metrics` and `GET /health` of one node, on the address its config
//! names (`NodeConfig::metrics_listen`).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use crate::bootstrap::{MetricsSource, ServerError, METRICS_CONTENT_TYPE};

/// A running metrics endpoint; dropping it stops and joins its thread.
pub(crate) struct MetricsServer {
    server: Arc<tiny_http::Server>,
    local_addr: SocketAddr,
    stopping: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl MetricsServer {
    /// Serves `source` on `addr` (port 0: any free port).
    pub(crate) fn start(addr: &str, source: MetricsSource) -> Result<MetricsServer, ServerError> {
        let (server, local_addr) = crate::bootstrap::bind(addr)?;
        let server = Arc::new(server);
        let stopping = Arc::new(AtomicBool::new(false));
        let (s, stop) = (server.clone(), stopping.clone());
        let thread = std::thread::Builder::new()
            .name("kvferry-metrics".into())
            .spawn(move || serve(&s, &stop, &source))?;
        tracing::info!(addr = %local_addr, "metrics endpoint listening");
        Ok(MetricsServer {
            server,
            local_addr,
            stopping,
            thread: Some(thread),
        })
    }

    /// The address it listens on (the real port when started with port 0).
    pub(crate) fn local_addr(&self) -> SocketAddr {
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

fn serve(server: &tiny_http::Server, stopping: &AtomicBool, source: &MetricsSource) {
    while !stopping.load(Ordering::SeqCst) {
        let Ok(request) = server.recv() else {
            // tiny_http reports `unblock` as an interrupted error.
            continue;
        };
        let (status, body, content_type) = match (request.method(), request.url()) {
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
