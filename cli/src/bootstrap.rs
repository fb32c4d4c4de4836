//! `kvferry bootstrap --listen ADDR`: the standalone bootstrap service.
//!
//! Runs until SIGINT or SIGTERM, then shuts the server down cleanly (joins
//! its threads) and exits 0.

use std::process::ExitCode;

use std::sync::Arc;

use clap::Args;
use kvferry::auth::{ClusterKey, Rejects};
use kvferry::bootstrap::{BootstrapServer, MetricsSource, ServerAuth, ServerConfig, DEFAULT_PORT};
use kvferry::stats::MetricsServer;

use crate::signals::ShutdownSignals;

/// The options of `kvferry bootstrap`.
#[derive(Clone, Debug, Args)]
pub(crate) struct BootstrapArgs {
    /// Address to listen on (0.0.0.0:PORT serves every interface; the host
    /// may be a name, bound at its address).
    #[arg(long, value_name = "ADDR", default_value_t = format!("127.0.0.1:{DEFAULT_PORT}"))]
    listen: String,
    /// Also serve `/metrics` and `/health` here (the service serves them
    /// on --listen too).
    #[arg(long, value_name = "ADDR")]
    metrics_listen: Option<String>,
    /// Without a cluster key (KVFERRY_CLUSTER_KEY_FILE), serve callers on
    /// other hosts too (otherwise they get 403): anyone who reaches the
    /// port may register ranks and redirect decode ranks.
    #[arg(long)]
    insecure: bool,
}

/// Entry point of `kvferry bootstrap`.
pub(crate) fn main(a: &BootstrapArgs) -> ExitCode {
    // Block the signals before any thread exists so every thread inherits the
    // mask and only `sigwait` below ever sees them: no handler runs inside
    // arbitrary code, and no flag has to be polled.
    let signals = match ShutdownSignals::block() {
        Ok(s) => s,
        Err(err) => {
            eprintln!("kvferry bootstrap: cannot block signals: {err}");
            return ExitCode::FAILURE;
        }
    };
    let (server, metrics) = match start(a) {
        Ok(s) => s,
        Err(err) => {
            eprintln!("kvferry bootstrap: {err}");
            return ExitCode::FAILURE;
        }
    };
    println!("bootstrap service listening on {}", server.local_addr());
    if let Some(m) = &metrics {
        println!("metrics on http://{}/metrics", m.local_addr());
    }
    let signal = signals.wait();
    eprintln!("kvferry bootstrap: signal {signal}, shutting down");
    server.shutdown();
    ExitCode::SUCCESS
}

/// The service (with the cluster key of `KVFERRY_CLUSTER_KEY_FILE`, or
/// serving this host's callers only without one unless `--insecure`) and
/// its metrics endpoint.
fn start(a: &BootstrapArgs) -> Result<(BootstrapServer, Option<MetricsServer>), String> {
    let key = ClusterKey::from_env().map_err(|e| e.to_string())?;
    let rejects = Arc::new(Rejects::default());
    let r = Arc::clone(&rejects);
    let source: MetricsSource = Arc::new(move || {
        let r = Arc::clone(&r);
        kvferry_metrics::render(move |e| kvferry_metrics::encode_auth_rejects(e, &r))
    });
    let config = ServerConfig {
        auth: key.map(ServerAuth::new),
        allow_unauthenticated_remote: a.insecure,
        rejects,
        ..ServerConfig::default()
    };
    let server = BootstrapServer::start_with(&a.listen, config, Some(source.clone()))
        .map_err(|e| e.to_string())?;
    let metrics = match &a.metrics_listen {
        Some(addr) => Some(MetricsServer::start(addr, source).map_err(|e| e.to_string())?),
        None => None,
    };
    Ok((server, metrics))
}
