//! The listening socket ([`Listener`]) and the worker threads that answer
//! on it ([`Server`]).

use std::io::Read;
use std::net::SocketAddr;
use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use crate::{Refusal, Reply, Request, Routes};

/// Why a server could not start.
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

/// How a server runs.
#[derive(Clone, Debug)]
pub struct Config {
    /// Names its threads (`NAME`, or `NAME-i` with several workers) and
    /// its log lines.
    pub name: String,
    /// Threads answering requests (at least one): with two, a slow client
    /// does not hold up the others.
    pub workers: usize,
    /// Largest request body taken; a longer one is refused (413) before
    /// the gate or a handler sees it.
    pub max_body_bytes: usize,
    /// How the server words the answers it gives itself (each service
    /// answers errors in its own format: plain text, JSON).
    pub refusal: fn(&Refusal) -> Reply,
}

impl Config {
    /// One worker, bodies up to 64 KiB, refusals in plain text.
    pub fn new(name: &str) -> Config {
        Config {
            name: name.to_string(),
            workers: 1,
            max_body_bytes: 64 * 1024,
            refusal: plain_refusal,
        }
    }
}

/// A refusal's reason as plain text.
fn plain_refusal(refusal: &Refusal) -> Reply {
    Reply::new(
        refusal.status(),
        "text/plain; charset=utf-8",
        format!("{refusal}\n"),
    )
}

/// A bound listening socket, not answering yet: its address is known
/// before the routes that may depend on it are built.
pub struct Listener {
    server: tiny_http::Server,
    local_addr: SocketAddr,
}

impl Listener {
    /// Binds `addr` (port 0: any free port).
    pub fn bind(addr: &str) -> Result<Listener, ServerError> {
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
        Ok(Listener { server, local_addr })
    }

    /// The address it listens on (the real port when bound to port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Answers requests with `routes` on `config.workers` threads.
    pub fn serve(self, config: Config, routes: Routes) -> Result<Server, ServerError> {
        let workers = config.workers.max(1);
        let mut server = Server {
            listener: Arc::new(self.server),
            local_addr: self.local_addr,
            stopping: Arc::new(AtomicBool::new(false)),
            threads: Vec::with_capacity(workers),
            name: config.name.clone(),
        };
        // The workers alone hold the routes: once they are joined, so is
        // whatever the handlers captured.
        let service = Arc::new(Service { config, routes });
        for i in 0..workers {
            let name = match workers {
                1 => server.name.clone(),
                _ => format!("{}-{i}", server.name),
            };
            let (listener, stopping, service) = (
                Arc::clone(&server.listener),
                Arc::clone(&server.stopping),
                Arc::clone(&service),
            );
            // On a spawn failure `server` is dropped, which stops and joins
            // the threads already started.
            let thread = std::thread::Builder::new()
                .name(name)
                .spawn(move || service.run(&listener, &stopping))?;
            server.threads.push(thread);
        }
        Ok(server)
    }
}

/// A running server. Dropping it stops it like [`Server::stop`].
pub struct Server {
    listener: Arc<tiny_http::Server>,
    local_addr: SocketAddr,
    stopping: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    name: String,
}

impl Server {
    /// Binds `addr` (port 0: any free port) and answers requests with
    /// `routes`.
    pub fn start(addr: &str, config: Config, routes: Routes) -> Result<Server, ServerError> {
        Listener::bind(addr)?.serve(config, routes)
    }

    /// The address it listens on (the real port when started with port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Stops taking requests and joins the worker threads; requests being
    /// answered are finished first. Stopping twice does nothing more.
    pub fn stop(&mut self) {
        self.stopping.store(true, Ordering::SeqCst);
        // `unblock` wakes one blocked `recv` per call; every worker either
        // sees the flag before blocking or consumes one of these.
        for _ in 0..self.threads.len() {
            self.listener.unblock();
        }
        for thread in self.threads.drain(..) {
            if thread.join().is_err() {
                let server = self.name.as_str();
                tracing::error!(server, "an HTTP server thread panicked");
            }
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
    }
}

/// What every worker of one server shares.
struct Service {
    config: Config,
    routes: Routes,
}

impl Service {
    fn run(&self, listener: &tiny_http::Server, stopping: &AtomicBool) {
        while !stopping.load(Ordering::SeqCst) {
            match listener.recv() {
                Ok(request) => self.answer(request),
                // tiny_http reports `unblock` as an error too.
                Err(err) if !stopping.load(Ordering::SeqCst) => {
                    let server = self.config.name.as_str();
                    tracing::warn!(server, %err, "HTTP server: accept failed");
                }
                Err(_) => {}
            }
        }
    }

    fn answer(&self, mut raw: tiny_http::Request) {
        let reply = match read_body(&mut raw, self.config.max_body_bytes) {
            Ok(body) => self.reply(&Request::new(&raw, &body)),
            Err(refusal) => self.refuse(&refusal),
        };
        let server = self.config.name.as_str();
        if reply.status >= 400 {
            let (method, url) = (raw.method().as_str(), raw.url());
            tracing::debug!(server, method, url, status = reply.status, body = %reply.body, "HTTP request refused");
        }
        if let Err(err) = raw.respond(reply.into_response()) {
            tracing::debug!(server, %err, "HTTP client went away before the response");
        }
    }

    /// The routes' answer; a panic in the gate or a handler answers 500
    /// and leaves this worker serving.
    fn reply(&self, request: &Request<'_>) -> Reply {
        match panic::catch_unwind(AssertUnwindSafe(|| self.routes.dispatch(request))) {
            Ok(Ok(reply)) => reply,
            Ok(Err(refusal)) => self.refuse(&refusal),
            Err(_) => {
                let (server, method, url) = (&self.config.name, request.method(), request.url());
                tracing::error!(server, method, url, "HTTP handler panicked");
                self.refuse(&Refusal::Internal)
            }
        }
    }

    /// The server's wording of `refusal`, with the `Allow` header of a 405.
    fn refuse(&self, refusal: &Refusal) -> Reply {
        let reply = (self.config.refusal)(refusal);
        match refusal.allow() {
            Some(allow) => reply.with_header("Allow", allow),
            None => reply,
        }
    }
}

/// Reads a request's body, at most `max` bytes.
fn read_body(request: &mut tiny_http::Request, max: usize) -> Result<Vec<u8>, Refusal> {
    if request.body_length().is_some_and(|len| len > max) {
        return Err(Refusal::BodyTooLarge { max });
    }
    // The declared length may be absent (chunked) or a lie; read at most one
    // byte more than allowed to tell "too large" from "exactly the limit".
    let mut body = Vec::with_capacity(request.body_length().unwrap_or(0).min(max));
    request
        .as_reader()
        .take(max as u64 + 1)
        .read_to_end(&mut body)
        .map_err(Refusal::BadBody)?;
    if body.len() > max {
        return Err(Refusal::BodyTooLarge { max });
    }
    Ok(body)
}
