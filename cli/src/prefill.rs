//! `kvferry prefill`: one prefill rank as its own process, serving synthetic
//! KV for whatever decode ranks ask, until SIGTERM or SIGINT.
//!
//! A decode request reaches this rank as a `Pull` for a transfer the
//! "engine" (this command) has not seen; the node reports it as an
//! `EventKind::Requested` event, and the command allocates blocks,
//! fills them with the pattern of that transfer (after `--delay-ms`, which
//! stands in for the prefill computation) and sends them. Blocks go back to
//! the free list when the transfer's phase turns terminal.

use std::collections::{HashMap, VecDeque};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Args;
use kvferry::machines::BlockId;
use kvferry::node::{Event, EventKind, EventSink, Node, Role};
use kvferry::TransferId;
use kvferry_testkit::synth::SynthKv;

use crate::shape::{DemoOptions, ModelArgs, RankArgs};
use crate::signals::{stop_on_signal, stop_requested};

/// The options of `kvferry prefill`.
#[derive(Clone, Debug, Args)]
pub(crate) struct PrefillArgs {
    #[command(flatten)]
    rank: RankArgs,
    /// Serve the bootstrap service at --bootstrap instead of using one there.
    #[arg(long)]
    serve_bootstrap: bool,
    /// This engine's id, which decode ranks ask for.
    #[arg(long, value_name = "ID", default_value = "prefill")]
    engine_id: String,
    /// KV blocks of this rank.
    #[arg(long, value_name = "N", default_value_t = 4096)]
    blocks: u32,
    /// Stand-in for the prefill computation: a request's KV is ready this
    /// long after decode asked.
    #[arg(long, value_name = "MS", default_value_t = 0)]
    delay_ms: u64,
    /// Side-channel (ZeroMQ) port; 0 picks a free one.
    #[arg(long, value_name = "PORT", default_value_t = 0)]
    side_channel_port: u16,
    #[command(flatten)]
    model: ModelArgs,
}

fn run(a: &PrefillArgs) -> Result<ExitCode, String> {
    let o = a.model.apply(DemoOptions::default());
    let num_blocks = a.blocks;
    let mut c = a.rank.node_config(Role::Prefill, a.engine_id.clone(), &o);
    c.side_channel_port = a.side_channel_port;
    let bootstrap = a.rank.bootstrap.clone();
    if a.serve_bootstrap {
        c.serve_bootstrap = Some(bootstrap);
    } else {
        c.bootstrap = Some(bootstrap);
    }
    let (events_tx, events_rx) = flume::bounded(1 << 17);
    c.events = Some(EventSink {
        tag: 0,
        tx: events_tx,
    });
    let stage = (c.pp_size, c.pp_rank);
    let kv = SynthKv::new_stage(
        o.model(),
        c.tp_size,
        c.tp_rank,
        o.layers,
        u64::from(num_blocks),
        stage,
    );
    stop_on_signal().map_err(|e| format!("cannot block signals: {e}"))?;
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
    let mut s = Serve {
        node: &node,
        kv: &kv,
        num_blocks,
        delay: Duration::from_millis(a.delay_ms),
        free: (0..num_blocks).rev().collect(),
        held: HashMap::new(),
        waiting: VecDeque::new(),
        served: 0,
    };
    while !stop_requested() {
        let now = Instant::now();
        s.start_ready(now);
        if let Ok(e) = events_rx.recv_timeout(s.wait(now)) {
            s.on_event(e);
        }
        let _ = node.get_finished();
    }
    eprintln!("kvferry prefill: stopping after {} requests", s.served);
    node.shutdown(Duration::from_millis(500));
    drop(node);
    drop(kv);
    Ok(ExitCode::SUCCESS)
}

/// The prefill rank's requests between events.
struct Serve<'a> {
    node: &'a Node,
    kv: &'a SynthKv,
    num_blocks: u32,
    /// Stand-in for the prefill computation.
    delay: Duration,
    free: Vec<u32>,
    /// Blocks of every transfer sent, until its phase turns terminal.
    held: HashMap<TransferId, Vec<u32>>,
    /// Requests waiting for their delay or for free blocks, oldest first:
    /// when they may start, the transfer and how many blocks each of its
    /// groups needs.
    waiting: VecDeque<(Instant, TransferId, Vec<u32>)>,
    served: u64,
}

impl Serve<'_> {
    /// Starts every request whose delay passed and whose blocks are free.
    fn start_ready(&mut self, now: Instant) {
        while let Some((at, tid, need)) = self.waiting.front() {
            let (at, tid) = (*at, *tid);
            let total: usize = need.iter().map(|&n| n as usize).sum();
            if at > now || total > self.free.len() {
                break;
            }
            let Some((_, _, need)) = self.waiting.pop_front() else {
                break;
            };
            let groups: Vec<Vec<u32>> = (need.iter())
                .map(|&n| (0..n).filter_map(|_| self.free.pop()).collect())
                .collect();
            // The pattern `kvferry decode` checks (`verify_groups`).
            self.kv.fill_groups(tid, &groups);
            let lists = (groups.iter())
                .map(|l| l.iter().map(|&b| BlockId(b)).collect())
                .collect();
            let sent = self.node.sender(tid).and_then(|s| s.send(lists, true));
            match sent {
                Ok(()) => {
                    self.held.insert(tid, groups.concat());
                    self.served += 1;
                }
                Err(e) => {
                    tracing::warn!(%tid, %e, "cannot send");
                    self.free.extend(groups.concat());
                }
            }
        }
    }

    /// How long to wait for an event: until the oldest waiting request's
    /// delay passes, at most 100 ms.
    fn wait(&self, now: Instant) -> Duration {
        self.waiting
            .front()
            .map_or(Duration::from_millis(100), |(at, _, _)| {
                at.saturating_duration_since(now)
            })
            .min(Duration::from_millis(100))
    }

    /// A new request waits for its delay (or is aborted if it cannot
    /// fit); a terminal phase frees its transfer's blocks.
    fn on_event(&mut self, e: Event) {
        let tid = e.transfer_id;
        match e.kind {
            EventKind::Requested { blocks_per_group } => {
                let total: u64 = blocks_per_group.iter().map(|&n| u64::from(n)).sum();
                if total <= u64::from(self.num_blocks) {
                    self.waiting
                        .push_back((Instant::now() + self.delay, tid, blocks_per_group));
                } else {
                    tracing::warn!(%tid, "request does not fit this server; aborting");
                    let _ = self.node.abort(tid);
                }
            }
            EventKind::Finished(_) => {
                if let Some(blocks) = self.held.remove(&tid) {
                    self.free.extend(blocks);
                }
            }
        }
    }
}

/// `kvferry prefill`.
pub(crate) fn main(a: &PrefillArgs) -> ExitCode {
    match run(a) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("kvferry prefill: {e}");
            ExitCode::from(1)
        }
    }
}
