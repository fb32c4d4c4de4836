//! `kvferry prefill`: one prefill rank as its own process, serving synthetic
//! KV for whatever decode ranks ask, until SIGTERM or SIGINT.
//!
//! A decode request reaches this rank as a `Pull` for a transfer the
//! "engine" (this command) has not seen; the node reports it through
//! `NodeConfig::on_remote_request`, and the command allocates blocks,
//! fills them with the pattern of that transfer (after `--delay-ms`, which
//! stands in for the prefill computation) and sends them. Blocks go back to
//! the free list when the transfer's phase turns terminal.

use std::collections::{HashMap, VecDeque};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::args::{Args, UsageError};
use super::demo::{demo_timeouts, parse_layout, parse_mode, parse_transport};
use crate::machines::common::BlockId;
use crate::machines::layout::{LayoutKind, ModelSpec};
use crate::node::{Node, NodeConfig, RemoteRequest, Role};
use crate::synth::SynthKv;

const USAGE: &str = "\
usage: kvferry prefill --bootstrap ADDR [--serve-bootstrap] [--engine-id ID]
                       [--tp-size N] [--tp-rank R] [--blocks N] [--layers L]
                       [--block-tokens T] [--heads H] [--head-bytes X]
                       [--layout hnd|nhd|mla] [--mode push|pull]
                       [--transport tcp|local] [--timeout-ms MS] [--delay-ms MS]
                       [--host HOST] [--side-channel-port PORT]
";

const OPTIONS: &[&str] = &[
    "bootstrap",
    "serve-bootstrap",
    "engine-id",
    "tp-size",
    "tp-rank",
    "blocks",
    "layers",
    "block-tokens",
    "heads",
    "head-bytes",
    "layout",
    "mode",
    "transport",
    "timeout-ms",
    "delay-ms",
    "host",
    "side-channel-port",
];

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    // Only an atomic store: async-signal-safe.
    STOP.store(true, Ordering::SeqCst);
}

/// Makes SIGTERM and SIGINT set [`STOP`]-style flags instead of killing us.
pub(crate) fn install_signal_handlers() {
    let handler = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
    // SAFETY: the handler only performs an atomic store.
    unsafe {
        libc::signal(libc::SIGTERM, handler);
        libc::signal(libc::SIGINT, handler);
    }
}

pub(crate) fn stop_requested() -> bool {
    STOP.load(Ordering::SeqCst)
}

/// The model options shared by `prefill` and `decode`.
pub(crate) fn model_from(a: &Args) -> Result<(ModelSpec, u32), UsageError> {
    let layout = a
        .get_str("layout")
        .map_or(Ok(LayoutKind::Hnd), parse_layout)?;
    let heads: u32 = a.get_or("heads", 8)?;
    let model = ModelSpec {
        layout,
        total_kv_heads: if layout == LayoutKind::Mla { 1 } else { heads },
        block_tokens: a.get_or("block-tokens", 16)?,
        head_bytes: a.get_or("head-bytes", 128)?,
    };
    let layers: u32 = a.get_or("layers", 4)?;
    if model.block_tokens == 0 || model.head_bytes == 0 || heads == 0 || layers == 0 {
        return Err(UsageError(
            "--block-tokens, --head-bytes, --heads and --layers must be positive".into(),
        ));
    }
    Ok((model, layers))
}

fn run(a: &Args) -> Result<ExitCode, String> {
    let bootstrap = a
        .get_str("bootstrap")
        .ok_or("--bootstrap is required")?
        .to_string();
    let (model, layers) = model_from(a).map_err(|e| e.to_string())?;
    let num_blocks: u32 = a.get_or("blocks", 4096).map_err(|e| e.to_string())?;
    let delay = Duration::from_millis(a.get_or("delay-ms", 0u64).map_err(|e| e.to_string())?);
    let mut c = NodeConfig::new(Role::Prefill, a.get_str("engine-id").unwrap_or("prefill"));
    c.tp_size = a.get_or("tp-size", 1).map_err(|e| e.to_string())?;
    c.tp_rank = a.get_or("tp-rank", 0).map_err(|e| e.to_string())?;
    c.mode = a
        .get_str("mode")
        .map_or(Ok(c.mode), parse_mode)
        .map_err(|e| e.to_string())?;
    c.transport = a
        .get_str("transport")
        .map_or(Ok(c.transport), parse_transport)
        .map_err(|e| e.to_string())?;
    c.timeouts = demo_timeouts(a.get_or("timeout-ms", 10_000).map_err(|e| e.to_string())?);
    if let Some(h) = a.get_str("host") {
        c.host = h.to_string();
    }
    c.side_channel_port = a
        .get_or("side-channel-port", 0)
        .map_err(|e| e.to_string())?;
    if a.flag("serve-bootstrap") {
        c.serve_bootstrap = Some(bootstrap);
    } else {
        c.bootstrap = Some(bootstrap);
    }
    let (req_tx, req_rx) = flume::bounded::<RemoteRequest>(1 << 16);
    let (done_tx, done_rx) = flume::bounded(1 << 16);
    c.on_remote_request = Some(req_tx);
    c.notify = Some(done_tx);
    let kv = SynthKv::new(model, c.tp_size, c.tp_rank, layers, u64::from(num_blocks));
    install_signal_handlers();
    let node = Node::start(c).map_err(|e| e.to_string())?;
    // SAFETY: `kv` outlives the node: the node is shut down below, before
    // `kv` goes out of scope.
    unsafe { node.register_kv_caches(kv.kv_layout()) }.map_err(|e| e.to_string())?;
    eprintln!(
        "kvferry prefill: side channel {} endpoint {} bootstrap {}",
        node.side_channel_addr(),
        node.endpoint(),
        node.bootstrap_addr().unwrap_or_default()
    );
    let mut free: Vec<u32> = (0..num_blocks).rev().collect();
    let mut held: HashMap<u64, Vec<u32>> = HashMap::new();
    // Requests waiting for their delay or for free blocks, oldest first.
    let mut waiting: VecDeque<(Instant, RemoteRequest)> = VecDeque::new();
    let mut served = 0u64;
    while !stop_requested() {
        let now = Instant::now();
        // Start every request whose delay passed and whose blocks are free.
        while let Some((at, r)) = waiting.front() {
            let need = r.blocks_per_group.first().copied().unwrap_or(0) as usize;
            if *at > now || need > free.len() {
                break;
            }
            let tid = r.transfer_id;
            waiting.pop_front();
            let blocks: Vec<u32> = (0..need).filter_map(|_| free.pop()).collect();
            kv.fill(tid, &blocks, 0);
            let sent = node
                .sender(tid)
                .and_then(|s| s.send(vec![blocks.iter().map(|&b| BlockId(b)).collect()], true));
            match sent {
                Ok(()) => {
                    held.insert(tid, blocks);
                    served += 1;
                }
                Err(e) => {
                    tracing::warn!(tid, %e, "cannot send");
                    free.extend(blocks);
                }
            }
        }
        let wait = waiting
            .front()
            .map_or(Duration::from_millis(100), |(at, _)| {
                at.saturating_duration_since(now)
            })
            .min(Duration::from_millis(100));
        let event = flume::Selector::new()
            .recv(&req_rx, |r| r.map(either_left))
            .recv(&done_rx, |r| r.map(either_right))
            .wait_timeout(wait);
        match event {
            Ok(Ok(Either::Request(r))) => {
                if r.blocks_per_group.len() == 1 && r.blocks_per_group[0] <= num_blocks {
                    waiting.push_back((Instant::now() + delay, r));
                } else {
                    tracing::warn!(
                        tid = r.transfer_id,
                        "request does not fit this server; aborting"
                    );
                    let _ = node.abort(r.transfer_id);
                }
            }
            Ok(Ok(Either::Done(tid))) => {
                if let Some(blocks) = held.remove(&tid) {
                    free.extend(blocks);
                }
            }
            Ok(Err(_)) | Err(_) => {}
        }
        let _ = node.get_finished();
    }
    eprintln!("kvferry prefill: stopping after {served} requests");
    node.shutdown(Duration::from_millis(500));
    drop(node);
    drop(kv);
    Ok(ExitCode::SUCCESS)
}

enum Either {
    Request(RemoteRequest),
    Done(u64),
}

fn either_left(r: RemoteRequest) -> Either {
    Either::Request(r)
}

fn either_right((t, _): (crate::machines::TransferId, crate::machines::Phase)) -> Either {
    Either::Done(t.0)
}

pub fn main(argv: &[String]) -> ExitCode {
    let a = match Args::parse(argv, &["serve-bootstrap"])
        .and_then(|a| a.reject_unknown(OPTIONS).map(|()| a))
    {
        Ok(a) => a,
        Err(e) => {
            eprintln!("kvferry prefill: {e}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    match run(&a) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("kvferry prefill: {e}");
            ExitCode::from(1)
        }
    }
}
