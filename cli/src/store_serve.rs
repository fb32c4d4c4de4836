//! `kvferry store serve`: the RAM store engines share over `kvferry://`
//! (`kvferry_store::server`), until SIGTERM or SIGINT.

use std::net::SocketAddr;
use std::process::ExitCode;

use clap::{Args, Subcommand};
use kvferry_store_server::{ServeConfig, StoreServer};

use crate::signals::ShutdownSignals;
use crate::usage::usage_error;

/// `kvferry store ...`.
#[derive(Clone, Debug, Subcommand)]
pub(crate) enum StoreCommand {
    /// Serve a RAM store with LRU eviction to engines (`kvferry://ADDR`).
    Serve(ServeArgs),
}

/// The options of `kvferry store serve`.
#[derive(Clone, Debug, Args)]
pub(crate) struct ServeArgs {
    /// Where engines connect (IP:PORT; port 0 picks one).
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:7600")]
    listen: SocketAddr,
    /// Bytes of RAM for values, allocated at start.
    #[arg(long, value_name = "N", default_value_t = 1 << 30,
          value_parser = clap::value_parser!(u64).range(1..))]
    capacity_bytes: u64,
    /// Serve `/metrics` and `/health` here (IP:PORT).
    #[arg(long, value_name = "ADDR")]
    metrics_listen: Option<String>,
    /// TCP streams per engine for the data plane (1..=64).
    #[arg(long, value_name = "N", default_value_t = kvferry_store::internal::proto::STORE_STREAMS)]
    streams: usize,
    /// Pin the server's executor to this core.
    #[arg(long, value_name = "CORE")]
    core: Option<usize>,
    /// Listen beyond loopback without a cluster key
    /// (KVFERRY_CLUSTER_KEY_FILE): anyone who reaches the port may put,
    /// get and remove values.
    #[arg(long)]
    insecure: bool,
}

/// Runs `kvferry store ...`.
pub(crate) fn main(c: &StoreCommand) -> ExitCode {
    match c {
        StoreCommand::Serve(a) => serve(a),
    }
}

fn serve(a: &ServeArgs) -> ExitCode {
    // Blocked before the server's threads start, so they inherit the mask
    // and the signal reaches this thread's `sigwait`.
    let signals = match ShutdownSignals::block() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("kvferry store serve: blocking signals: {e}");
            return ExitCode::from(1);
        }
    };
    let key = match kvferry::auth::ClusterKey::from_env() {
        Ok(k) => k,
        Err(e) => return usage_error("kvferry store serve", &e.to_string()),
    };
    let mut cfg = ServeConfig {
        listen: a.listen,
        capacity_bytes: a.capacity_bytes,
        metrics_listen: a.metrics_listen.clone(),
        core: a.core,
        key,
        allow_unauthenticated_remote: a.insecure,
        ..ServeConfig::default()
    };
    cfg.tcp.streams = a.streams;
    cfg.tcp.inflight_max_bytes = cfg
        .tcp
        .inflight_max_bytes
        .max(cfg.tcp.frame_max_bytes * a.streams as u64);
    let server = match StoreServer::start(cfg) {
        Ok(s) => s,
        Err(e @ kvferry_store_server::ServeError::Config(_)) => {
            return usage_error("kvferry store serve", &e.to_string())
        }
        Err(e) => {
            eprintln!("kvferry store serve: {e}");
            return ExitCode::from(1);
        }
    };
    // The address line is what scripts and tests wait for.
    println!("listening on kvferry://{}", server.local_addr());
    if let Some(m) = server.metrics_addr() {
        println!("metrics on http://{m}/metrics");
    }
    let signal = signals.wait();
    eprintln!(
        "kvferry store serve: signal {signal}, stopping: {:?}",
        server.stats()
    );
    drop(server);
    ExitCode::SUCCESS
}
