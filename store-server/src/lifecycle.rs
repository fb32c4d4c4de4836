//! A running server ([`StoreServer`]): started on an executor thread of
//! its own, asked for its addresses and counters, stopped when dropped.

use std::net::SocketAddr;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use glommio::{LocalExecutorBuilder, Placement};
use kvferry_auth::{Rejects, Surface};
use kvferry_metrics::http::MetricsServer;

use crate::accept::serve;
use crate::config::{validate, ServeConfig, ServeError};
use crate::metrics::{metrics_text, ServerCounters, ServerStats};
use crate::server::Server;

/// A running store server; dropping it stops it.
pub struct StoreServer {
    local_addr: SocketAddr,
    counters: Arc<ServerCounters>,
    rejects: Arc<Rejects>,
    metrics: Option<MetricsServer>,
    stop: Option<flume::Sender<()>>,
    join: Option<glommio::ExecutorJoinHandle<()>>,
}

impl std::fmt::Debug for StoreServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreServer")
            .field("local_addr", &self.local_addr)
            .finish()
    }
}

impl StoreServer {
    /// Allocates the arena, binds `cfg.listen` and starts serving.
    pub fn start(cfg: ServeConfig) -> Result<StoreServer, ServeError> {
        validate(&cfg)?;
        let std_listener =
            std::net::TcpListener::bind(cfg.listen).map_err(|source| ServeError::Bind {
                addr: cfg.listen,
                source,
            })?;
        let local_addr = (std_listener.local_addr()).map_err(|source| ServeError::Bind {
            addr: cfg.listen,
            source,
        })?;
        let counters = Arc::new(ServerCounters::default());
        counters
            .capacity_bytes
            .store(cfg.capacity_bytes, Ordering::Relaxed);
        let rejects = Arc::clone(&cfg.tcp.rejects);
        let metrics = match &cfg.metrics_listen {
            Some(addr) => {
                let (c, r) = (Arc::clone(&counters), Arc::clone(&rejects));
                let source: kvferry_metrics::http::MetricsSource =
                    Arc::new(move || metrics_text(&c.load(), &r));
                let m = MetricsServer::start(addr, source)
                    .map_err(|e| ServeError::Metrics(e.to_string()))?;
                Some(m)
            }
            None => None,
        };
        let (stop, stop_rx) = flume::bounded::<()>(1);
        let (ready_tx, ready_rx) = flume::bounded::<Result<(), ServeError>>(1);
        let c = Arc::clone(&counters);
        let placement = cfg.core.map_or(Placement::Unbound, Placement::Fixed);
        let join = LocalExecutorBuilder::new(placement)
            .name("kvferry-store-serve")
            .spawn(move || async move {
                match Server::new(&cfg, c) {
                    Ok(server) => {
                        let _ = ready_tx.send(Ok(()));
                        serve(Rc::new(server), std_listener, stop_rx).await;
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                    }
                }
            })
            .map_err(|e| ServeError::Executor(e.to_string()))?;
        match ready_rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(e),
            Err(_) => return Err(ServeError::Executor("ended while starting".into())),
        }
        Ok(StoreServer {
            local_addr,
            counters,
            rejects,
            metrics,
            stop: Some(stop),
            join: Some(join),
        })
    }

    /// Where engines connect.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Where `/metrics` is served, if it is.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics.as_ref().map(MetricsServer::local_addr)
    }

    /// The counters now.
    pub fn stats(&self) -> ServerStats {
        self.counters.load()
    }

    /// Engines and frames refused on `surface` for failing authentication.
    pub fn auth_rejected(&self, surface: Surface) -> u64 {
        self.rejects.get(surface)
    }

    /// Connections turned away on `surface` for exceeding their address's
    /// share.
    pub fn rate_limited(&self, surface: Surface) -> u64 {
        self.rejects.limited(surface)
    }

    /// Serves until the process ends.
    pub fn wait(mut self) {
        if let Some(j) = self.join.take() {
            let _ = j.join();
        }
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(j) = self.join.take() {
            let _ = j.join();
        }
    }
}
