//! A prefill node's part in the bootstrap service: serving it embedded,
//! and registering the rank at it.

use kvferry_auth::ClusterKey;

use super::{NodeConfig, NodeError, Shared};
use crate::bootstrap::{
    BootstrapClient, BootstrapServer, ExpectedRanks, MetricsSource, RegisterRequest, RetryPolicy,
    ServerAuth, ServerConfig,
};

/// The bootstrap service embedded in a prefill node.
pub(crate) struct EmbeddedBootstrap {
    server: BootstrapServer,
}

impl EmbeddedBootstrap {
    /// Serves on `addr`, with the node's key and refusal counters,
    /// answering `/query` once the engine's ranks have registered.
    pub(crate) fn start(
        addr: &str,
        metrics: MetricsSource,
        shared: &Shared,
    ) -> Result<EmbeddedBootstrap, NodeError> {
        let config = ServerConfig {
            auth: shared.key.clone().map(|key| ServerAuth {
                open_metrics: !shared.config.authenticate_metrics,
                ..ServerAuth::new(key)
            }),
            allow_unauthenticated_remote: shared.config.allow_unauthenticated_remote,
            expect: Some(ExpectedRanks {
                dp_size: shared.config.dp_size.max(1),
                workers: (shared.config.tp_size.max(1) * shared.config.pp_size.max(1)) as usize,
            }),
            rejects: shared.counters.auth.clone(),
            ..ServerConfig::default()
        };
        let server = BootstrapServer::start_with(addr, config, Some(metrics))?;
        Ok(EmbeddedBootstrap { server })
    }

    /// The address it listens on.
    pub(crate) fn addr(&self) -> String {
        self.server.local_addr().to_string()
    }

    /// Stops it and joins its threads.
    pub(crate) fn stop(self) {
        self.server.shutdown();
    }
}

/// Registers a prefill rank at the bootstrap service, retrying in the
/// background while the service is not up yet (the rank serves requests
/// meanwhile; decode finds it once the registration lands).
pub(crate) fn register_in_background(
    addr: String,
    config: &NodeConfig,
    key: Option<ClusterKey>,
    side_channel: String,
) {
    let req = RegisterRequest {
        engine_id: config.engine_id.clone(),
        dp_rank: config.dp_rank,
        tp_rank: config.tp_rank,
        pp_rank: config.pp_rank,
        addr: side_channel,
    };
    let resolver = config.resolver();
    let spawned = std::thread::Builder::new().name("kvferry-register".into()).spawn(move || {
        let result = BootstrapClient::new(&addr)
            .map(|c| c.with_resolver(resolver).with_key(key))
            .and_then(|c| c.register(&req, RetryPolicy::default()));
        match result {
            Ok(_) => tracing::info!(%addr, tp_rank = req.tp_rank, "registered at the bootstrap service"),
            Err(e) => tracing::error!(%addr, %e, "registration at the bootstrap service failed"),
        }
    });
    if let Err(e) = spawned {
        tracing::error!(%e, "cannot start the registration thread");
    }
}
