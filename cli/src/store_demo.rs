//! `kvferry demo --store STORE`: a synthetic engine saves the KV of
//! requests that share prefixes to a store, drops its copy, looks them up
//! again, loads the hits and verifies every byte (`kvferry::store::demo`).

use std::process::ExitCode;

use kvferry::store::demo::StoreDemo;
use kvferry::store::inproc::{InprocConfig, InprocStore};
use kvferry::store::{
    ClusterConfig, ConnectorError, DemoProgress, MooncakeStore, MooncakeStoreConfig,
    RedisClusterStore, RedisConfig, RedisStore, RemoteConfig, RemoteStore, StoreBackend,
    StoreDemoReport,
};
use std::io::IsTerminal;

/// The stores `--store` names.
pub const STORES: &str = "inproc, kvferry://HOST:PORT, redis://[user:password@]HOST:PORT, \
                          redis+cluster://[user:password@]HOST:PORT[,HOST:PORT...], \
                          mooncake://MASTER_HOST:PORT[?protocol=P&segment_mb=N]";

/// Runs the store demo against `store` with `requests` requests (the
/// demo's default when `None`); exit status 1 on any verify or load error.
pub fn main(store: &str, requests: Option<u64>, json: bool) -> ExitCode {
    let mut demo = StoreDemo::default();
    if let Some(n) = requests {
        match u32::try_from(n) {
            Ok(n) if n > 0 => demo.requests = n,
            _ => {
                eprintln!(
                    "kvferry demo: --requests {n}: 1 to {} with --store",
                    u32::MAX
                );
                return ExitCode::from(2);
            }
        }
    }
    let report = if store == "inproc" {
        run(&demo, InprocStore::new(InprocConfig::default()), json)
    } else if store.starts_with("kvferry://") {
        match RemoteStore::connect(RemoteConfig::from_url(store)) {
            Ok(remote) => run(&demo, remote, json),
            Err(e) => {
                eprintln!("kvferry demo: --store {store}: {e}");
                return ExitCode::from(1);
            }
        }
    } else if store.starts_with("redis://") {
        match RedisConfig::from_url(store) {
            Ok(cfg) => run(&demo, RedisStore::new(cfg), json),
            Err(e) => {
                eprintln!("kvferry demo: --store {e}");
                return ExitCode::from(2);
            }
        }
    } else if store.starts_with("redis+cluster://") {
        match ClusterConfig::from_url(store) {
            Ok(cfg) => run(&demo, RedisClusterStore::new(cfg), json),
            Err(e) => {
                eprintln!("kvferry demo: --store {e}");
                return ExitCode::from(2);
            }
        }
    } else if store.starts_with("mooncake://") {
        let cfg = match MooncakeStoreConfig::from_url(store) {
            Ok(cfg) => cfg,
            Err(e) => {
                eprintln!("kvferry demo: --store {e}");
                return ExitCode::from(2);
            }
        };
        match MooncakeStore::connect(&cfg) {
            Ok(s) => run(&demo, s, json),
            Err(e) => {
                eprintln!("kvferry demo: --store {store}: {e}");
                return ExitCode::from(1);
            }
        }
    } else {
        eprintln!("kvferry demo: --store {store}: the stores are {STORES}");
        return ExitCode::from(2);
    };
    let report = match report {
        Ok(r) => r,
        Err(e) => {
            eprintln!("kvferry demo: store: {e}");
            return ExitCode::from(1);
        }
    };
    if json {
        println!("{}", serde_json::to_string(&report).unwrap_or_default());
    } else {
        println!(
            "store {store}: {} requests, {} blocks saved ({} found stored already), \
             {} tokens hit on lookup, {} blocks loaded, {} load errors, {} verify errors; \
             put {:.2} GB/s, get {:.2} GB/s, lookup and load p50 {:.3} ms p99 {:.3} ms",
            report.requests,
            report.saved_blocks,
            report.dedup_skipped,
            report.lookup_hit_tokens,
            report.loaded_blocks,
            report.load_errors,
            report.verify_errors,
            report.put_gbps,
            report.get_gbps,
            report.p50_ms,
            report.p99_ms,
        );
    }
    if report.verify_errors > 0 || report.load_errors > 0 {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}

/// Runs the demo, with a progress bar on stderr when it is a terminal and
/// the output is not JSON.
fn run<B: StoreBackend>(
    demo: &StoreDemo,
    backend: B,
    json: bool,
) -> Result<StoreDemoReport, ConnectorError> {
    let bar = !json && std::io::stderr().is_terminal();
    let mut draw = |p: DemoProgress| {
        if !bar {
            return;
        }
        let (what, done, of) = match p {
            DemoProgress::Saved { done, of } => ("saved ", done, of),
            DemoProgress::Loaded { done, of } => ("loaded", done, of),
        };
        const WIDTH: u32 = 40;
        let filled = (done * WIDTH / of.max(1)) as usize;
        eprint!(
            "\r{what} [{}{}] {done}/{of}",
            "#".repeat(filled),
            " ".repeat(WIDTH as usize - filled)
        );
        if matches!(p, DemoProgress::Loaded { .. }) && done == of {
            eprintln!();
        }
    };
    demo.run_observed(backend, &mut draw)
}
