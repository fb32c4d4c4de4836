//! `kvferry decode`: one decode rank as its own process. It asks the
//! prefill engine (found through the bootstrap service) for K requests of
//! synthetic KV, verifies every byte, prints the same summary as `demo` and
//! exits. Every request ends by its deadline: a prefill engine that is
//! missing, dies or stalls turns requests into failed or expired ones, never
//! into a hang.

use std::collections::HashMap;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use super::args::Args;
use super::demo::{demo_timeouts, parse_mode, parse_transport, print_report, DemoReport};
use super::prefill::{install_signal_handlers, model_from, stop_requested};
use crate::machines::common::BlockId;
use crate::machines::Phase;
use crate::node::{Node, NodeConfig, PrefillTarget, Role};
use crate::synth::SynthKv;

const USAGE: &str = "\
usage: kvferry decode --bootstrap ADDR --requests K [--engine-id ID]
                      [--tp-size N] [--tp-rank R] [--timeout-ms MS] [--json]
                      [--concurrency C] [--blocks-per-request B]
                      [--transfer-base N] [--layers L] [--block-tokens T]
                      [--heads H] [--head-bytes X] [--layout hnd|nhd|mla]
                      [--mode push|pull] [--transport tcp|local]
";

const OPTIONS: &[&str] = &[
    "bootstrap",
    "engine-id",
    "tp-size",
    "tp-rank",
    "requests",
    "timeout-ms",
    "json",
    "concurrency",
    "blocks-per-request",
    "transfer-base",
    "layers",
    "block-tokens",
    "heads",
    "head-bytes",
    "layout",
    "mode",
    "transport",
    "host",
];

fn run(a: &Args) -> Result<DemoReport, String> {
    let e = |e: super::args::UsageError| e.to_string();
    let bootstrap = a
        .get_str("bootstrap")
        .ok_or("--bootstrap is required")?
        .to_string();
    let requests: u64 = a.get_or("requests", 0).map_err(e)?;
    let (model, layers) = model_from(a).map_err(e)?;
    let concurrency: u64 = a.get_or("concurrency", 16u64).map_err(e)?.max(1);
    let b: u32 = a.get_or("blocks-per-request", 4u32).map_err(e)?.max(1);
    let base: u64 = a.get_or("transfer-base", 1u64).map_err(e)?;
    let timeout_ms: u64 = a.get_or("timeout-ms", 10_000).map_err(e)?;
    let mut c = NodeConfig::new(Role::Decode, format!("decode-{}", std::process::id()));
    c.tp_size = a.get_or("tp-size", 1).map_err(e)?;
    c.tp_rank = a.get_or("tp-rank", 0).map_err(e)?;
    c.mode = a
        .get_str("mode")
        .map_or(Ok(c.mode), parse_mode)
        .map_err(e)?;
    c.transport = a
        .get_str("transport")
        .map_or(Ok(c.transport), parse_transport)
        .map_err(e)?;
    c.timeouts = demo_timeouts(timeout_ms);
    if let Some(h) = a.get_str("host") {
        c.host = h.to_string();
    }
    let (done_tx, done_rx) = flume::bounded(1 << 16);
    c.notify = Some(done_tx);
    let slots = concurrency.min(requests.max(1));
    let kv = SynthKv::new(model, c.tp_size, c.tp_rank, layers, slots * u64::from(b));
    install_signal_handlers();
    let node = Node::start(c).map_err(|e| e.to_string())?;
    // SAFETY: `kv` outlives the node (shut down below before `kv` drops).
    unsafe { node.register_kv_caches(kv.kv_layout()) }.map_err(|e| e.to_string())?;
    let target = PrefillTarget::Bootstrap {
        addr: bootstrap,
        engine_id: a.get_str("engine-id").unwrap_or("prefill").to_string(),
    };
    let mut report = DemoReport {
        requests,
        ..DemoReport::default()
    };
    let mut free: Vec<u64> = (0..slots).rev().collect();
    let mut live: HashMap<u64, (u64, Instant)> = HashMap::new();
    let mut latencies = Vec::new();
    let started = Instant::now();
    let (mut next, mut finished) = (0u64, 0u64);
    // The machines end every request by its deadline plus the fence; this
    // outer bound only guards against a bug, so the command cannot hang.
    let t = demo_timeouts(timeout_ms);
    let guard =
        t.bootstrap_timeout + t.waiting_timeout + t.fence() + t.lease * 2 + Duration::from_secs(5);
    let mut last_event = Instant::now();
    while finished < requests {
        while next < requests && !stop_requested() {
            let Some(slot) = free.pop() else { break };
            let tid = base + next;
            let blocks: Vec<u32> = (0..b).map(|i| (slot * u64::from(b)) as u32 + i).collect();
            kv.clear(&blocks);
            let dst = vec![blocks.iter().map(|&x| BlockId(x)).collect()];
            node.receiver(tid, &target)
                .and_then(|r| r.request(dst))
                .map_err(|e| format!("request {tid}: {e}"))?;
            live.insert(tid, (slot, Instant::now()));
            next += 1;
        }
        if stop_requested() && live.is_empty() {
            break;
        }
        let (tid, phase) = match done_rx.recv_timeout(Duration::from_millis(200)) {
            Ok((tid, phase)) => (tid.0, phase),
            Err(_) => {
                if last_event.elapsed() > guard {
                    return Err(format!(
                        "{} requests did not end within {} s",
                        live.len(),
                        guard.as_secs()
                    ));
                }
                continue;
            }
        };
        last_event = Instant::now();
        let Some((slot, at)) = live.remove(&tid) else {
            continue;
        };
        finished += 1;
        match phase {
            Phase::Success => {
                let blocks: Vec<u32> = (0..b).map(|i| (slot * u64::from(b)) as u32 + i).collect();
                if kv.verify(tid, &blocks, 0).is_err() {
                    report.verify_errors += 1;
                }
                report.ok += 1;
                report.bytes += kv.block_bytes() * u64::from(b);
                latencies.push(at.elapsed().as_secs_f64() * 1e3);
            }
            Phase::Expired => report.expired += 1,
            Phase::Failed(_)
            | Phase::Bootstrapping
            | Phase::WaitingForInput
            | Phase::Transferring => report.failed += 1,
        }
        free.push(slot);
        let _ = node.get_finished();
    }
    let elapsed = started.elapsed().as_secs_f64();
    latencies.sort_by(|x, y| x.total_cmp(y));
    let pct = |q: f64| {
        if latencies.is_empty() {
            0.0
        } else {
            latencies[(((latencies.len() - 1) as f64) * q).round() as usize]
        }
    };
    report.p50_ms = pct(0.5);
    report.p99_ms = pct(0.99);
    report.elapsed_s = elapsed;
    report.gbps = report.bytes as f64 / elapsed / 1e9;
    report.requests_per_s = report.ok as f64 / elapsed;
    node.shutdown(Duration::from_millis(200));
    drop(node);
    drop(kv);
    Ok(report)
}

pub fn main(argv: &[String]) -> ExitCode {
    let a = match Args::parse(argv, &["json"]).and_then(|a| a.reject_unknown(OPTIONS).map(|()| a)) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("kvferry decode: {e}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    match run(&a) {
        Ok(r) => {
            print_report(&r, a.flag("json"));
            if r.verify_errors > 0 {
                ExitCode::from(1)
            } else {
                ExitCode::SUCCESS
            }
        }
        Err(e) => {
            eprintln!("kvferry decode: {e}");
            ExitCode::from(1)
        }
    }
}
