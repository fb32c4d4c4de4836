//! `kvferry demo --store STORE`: a synthetic engine saves the KV of
//! requests that share prefixes to a store, drops its copy, looks them up
//! again, loads the hits and verifies every byte ([`engine`]).

use std::io::IsTerminal;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use kvferry_store::{AnyStore, ConnectorError, StoreBackend};

mod engine;

pub(crate) use engine::{DemoProgress, StoreDemo, StoreDemoReport};

/// Most requests in flight with `--store`: the pool is this many requests'
/// blocks (6 MiB each).
const MAX_CONCURRENCY: u32 = 256;

/// Runs the store demo against `store` with `requests` requests and
/// `concurrency` in flight (the demo's defaults when `None`); exit status 1
/// when a block was lost or wrong ([`StoreDemoReport::has_errors`]).
pub(crate) fn main(
    store: &str,
    requests: Option<u64>,
    concurrency: Option<u64>,
    json: bool,
) -> ExitCode {
    let demo = match shape(requests, concurrency) {
        Ok(demo) => demo,
        Err(reason) => {
            eprintln!("kvferry demo: {reason}");
            return ExitCode::from(2);
        }
    };
    let report = match open_and_run(store, &demo, json) {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => {
            eprintln!("kvferry demo: store: {e}");
            return ExitCode::from(1);
        }
        Err(code) => return code,
    };
    if json {
        println!("{}", serde_json::to_string(&report).unwrap_or_default());
    } else {
        print_report(store, &report);
    }
    if report.has_errors() {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}

/// The demo with `--requests` and `--concurrency` applied, or why not.
fn shape(requests: Option<u64>, concurrency: Option<u64>) -> Result<StoreDemo, String> {
    let mut demo = StoreDemo::default();
    if let Some(n) = concurrency {
        demo.concurrency = (u32::try_from(n).ok())
            .filter(|n| (1..=MAX_CONCURRENCY).contains(n))
            .ok_or_else(|| format!("--concurrency {n}: 1 to {MAX_CONCURRENCY} with --store"))?;
    }
    if let Some(n) = requests {
        demo.requests = (u32::try_from(n).ok())
            .filter(|n| *n > 0)
            .ok_or_else(|| format!("--requests {n}: 1 to {} with --store", u32::MAX))?;
    }
    Ok(demo)
}

/// Opens the store `store` names and runs the demo on it; `Err` is the
/// exit status of a store that could not be opened (2: a bad URL, 1: an
/// unreachable store), with its line printed.
fn open_and_run(
    store: &str,
    demo: &StoreDemo,
    json: bool,
) -> Result<Result<StoreDemoReport, ConnectorError>, ExitCode> {
    match AnyStore::open(store) {
        Ok(backend) => Ok(run(demo, backend, json)),
        Err(e) => {
            eprintln!("kvferry demo: --store {store}: {e}");
            Err(ExitCode::from(if e.is_bad_url() { 2 } else { 1 }))
        }
    }
}

fn print_report(store: &str, r: &StoreDemoReport) {
    println!(
        "store {store}: {} requests, {} in flight, {:.1} MiB KV pool, {:.2} s",
        r.requests,
        r.concurrency,
        r.pool_bytes as f64 / f64::from(1 << 20),
        r.elapsed_s,
    );
    println!(
        "saves: {} blocks stored, {} found stored already, {} refused for room, {} errors",
        r.saved_blocks, r.dedup_skipped, r.save_refused_blocks, r.save_errors,
    );
    println!(
        "lookups: {} tokens hit, {} blocks missed, {} errors",
        r.lookup_hit_tokens, r.lookup_miss_blocks, r.lookup_errors,
    );
    println!(
        "loads: {} blocks loaded, {} evicted before their load, {} errors, {} verify errors",
        r.loaded_blocks, r.evicted_blocks, r.load_errors, r.verify_errors,
    );
    println!(
        "put {:.2} GB/s, get {:.2} GB/s, lookup and load p50 {:.3} ms p99 {:.3} ms",
        r.put_gbps, r.get_gbps, r.p50_ms, r.p99_ms,
    );
}

/// Runs the demo, with a progress bar on stderr when it is a terminal and
/// the output is not JSON.
fn run<B: StoreBackend>(
    demo: &StoreDemo,
    backend: B,
    json: bool,
) -> Result<StoreDemoReport, ConnectorError> {
    let shown = !json && std::io::stderr().is_terminal();
    let mut last_draw: Option<Instant> = None;
    // At most every 100 ms, and once at the end.
    let mut draw = |p: DemoProgress| {
        let due = last_draw.is_none_or(|t| t.elapsed() > Duration::from_millis(100));
        if !shown || !(due || p.loaded == p.of) {
            return;
        }
        last_draw = Some(Instant::now());
        let bar = crate::figures::bar(p.loaded.into(), p.of.into());
        eprint!("\rloaded {bar} {}/{} (saved {})", p.loaded, p.of, p.saved);
        if p.loaded == p.of {
            eprintln!();
        }
    };
    demo.run_observed(backend, &mut draw)
}
