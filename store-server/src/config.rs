//! How a server runs ([`ServeConfig`]), the check of its settings, and
//! why one did not start ([`ServeError`]).

use std::net::SocketAddr;
use std::time::Duration;

use kvferry_auth::ClusterKey;
use kvferry_transport::{TcpConfig, TransportError};

/// How a store server runs.
#[derive(Clone, Debug)]
pub struct ServeConfig {
    /// Where engines connect (port 0: any free port).
    pub listen: SocketAddr,
    /// Bytes of RAM for values; allocated at start.
    pub capacity_bytes: u64,
    /// Where `/metrics` and `/health` are served, if anywhere.
    pub metrics_listen: Option<String>,
    /// The data-plane endpoint's settings.
    pub tcp: TcpConfig,
    /// Most values held at once, whatever their sizes (the index's bound);
    /// past it the least recently used make room, as for bytes.
    pub max_values: usize,
    /// Most engine connections served at once; more are closed at once.
    pub max_connections: usize,
    /// Most connections served at once from one address, so one host
    /// cannot take every slot (counted in
    /// `kvferry_rate_limited_total{surface="store"}` when it tries).
    pub max_connections_per_addr: usize,
    /// The longest budget a request may ask for.
    pub budget_max: Duration,
    /// A connection with no request for this long is closed (its engine
    /// reconnects on its next call).
    pub idle_max: Duration,
    /// The core the executor is pinned to, if any.
    pub core: Option<usize>,
    /// The cluster key: with one, every control connection and every
    /// data-plane connection is authenticated (docs/security.md); engines
    /// without it are refused and counted.
    pub key: Option<ClusterKey>,
    /// Listen beyond loopback without a key (anyone who reaches the port
    /// may put, get and remove values).
    pub allow_unauthenticated_remote: bool,
}

impl Default for ServeConfig {
    fn default() -> Self {
        ServeConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            capacity_bytes: 1 << 30,
            metrics_listen: None,
            tcp: kvferry_store::internal::proto::data_plane(),
            max_values: 1 << 22,
            max_connections: 256,
            max_connections_per_addr: 64,
            budget_max: Duration::from_secs(60),
            idle_max: Duration::from_secs(600),
            core: None,
            key: None,
            allow_unauthenticated_remote: false,
        }
    }
}

/// Why a server did not start.
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// A setting is out of range.
    #[error("bad configuration: {0}")]
    Config(String),
    /// The listen address could not be bound.
    #[error("binding {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The arena could not be allocated.
    #[error("allocating {bytes} bytes of store memory failed")]
    Alloc {
        /// Its size.
        bytes: u64,
    },
    /// The data-plane endpoint could not start.
    #[error("data plane: {0}")]
    Transport(#[from] TransportError),
    /// The metrics endpoint could not start.
    #[error("metrics endpoint: {0}")]
    Metrics(String),
    /// The executor thread could not start or ended early.
    #[error("executor: {0}")]
    Executor(String),
}

pub(crate) fn validate(cfg: &ServeConfig) -> Result<(), ServeError> {
    let bad = |s: &str| Err(ServeError::Config(s.into()));
    if cfg.capacity_bytes == 0 || usize::try_from(cfg.capacity_bytes).is_err() {
        return bad("capacity_bytes must be positive and addressable");
    }
    if cfg.max_connections == 0
        || cfg.max_connections_per_addr == 0
        || cfg.max_values == 0
        || cfg.budget_max.is_zero()
        || cfg.idle_max.is_zero()
    {
        return bad("max_connections (also per address), max_values, budget_max and idle_max must be positive");
    }
    if cfg.key.is_none() && !cfg.listen.ip().is_loopback() && !cfg.allow_unauthenticated_remote {
        return Err(ServeError::Config(format!(
            "listening on {} without a cluster key: set {} (or allow unauthenticated \
             remote engines explicitly)",
            cfg.listen,
            kvferry_auth::KEY_FILE_ENV
        )));
    }
    cfg.tcp
        .validate()
        .map_err(|e| ServeError::Config(e.to_string()))
}
