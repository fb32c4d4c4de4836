//! `kvferry decode`: one decode rank as its own process. It asks the
//! prefill engine (found through the bootstrap service) for K requests of
//! synthetic KV, verifies every byte, prints the same summary as `demo` and
//! exits. Every request ends by its deadline: a prefill engine that is
//! missing, dies or stalls turns requests into failed or expired ones, never
//! into a hang.

use std::collections::HashMap;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Args;
use kvferry::machines::BlockId;
use kvferry::machines::{Phase, TransferId};
use kvferry::node::{Event, EventSink, Node, PrefillTarget, Role};
use kvferry_testkit::demo_timeouts;
use kvferry_testkit::synth::SynthKv;

use crate::demo::{print_report, DemoReport};
use crate::shape::{slot_blocks, DemoOptions, ModelArgs, RankArgs};
use crate::signals::{stop_on_signal, stop_requested};

/// The options of `kvferry decode`.
#[derive(Clone, Debug, Args)]
pub(crate) struct DecodeArgs {
    #[command(flatten)]
    rank: RankArgs,
    /// This decode engine's own id [default: decode-PID].
    #[arg(long, value_name = "ID")]
    engine_id: Option<String>,
    /// The prefill engine to pull from.
    #[arg(long, value_name = "ID", default_value = "prefill")]
    prefill_engine_id: String,
    /// The prefill engine's data-parallel rank [default: its one rank,
    /// whichever it is].
    #[arg(long, value_name = "R")]
    prefill_dp_rank: Option<u32>,
    /// Requests to run, then exit.
    #[arg(long, value_name = "K", default_value_t = 0)]
    requests: u64,
    /// Requests in flight at once (at least 1).
    #[arg(long, value_name = "C", default_value_t = 16)]
    concurrency: u64,
    /// KV blocks per request and group (at least 1).
    #[arg(long, value_name = "B", default_value_t = 4)]
    blocks_per_request: u32,
    /// KV-cache groups per request.
    #[arg(long, value_name = "N", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..=16))]
    groups: u32,
    /// Transfer id of the first request (ids run up from it).
    #[arg(long, value_name = "N", default_value_t = 1)]
    transfer_base: u64,
    /// Name the requests by string request id, PREFIX followed by the
    /// number `--transfer-base` starts (`cmpl-1`, `cmpl-2`, ...), as vLLM
    /// routers do; the transfer id is then the id's hash
    /// (`TransferId::of_request_id`), and the string travels in the `Pull`.
    #[arg(long, value_name = "PREFIX")]
    request_id_prefix: Option<String>,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    model: ModelArgs,
}

fn run(a: &DecodeArgs) -> Result<DemoReport, String> {
    let o = a.model.apply(DemoOptions::default());
    let b = a.blocks_per_request.max(1);
    let engine_id =
        (a.engine_id.clone()).unwrap_or_else(|| format!("decode-{}", std::process::id()));
    let mut c = a.rank.node_config(Role::Decode, engine_id, &o);
    let (events_tx, events_rx) = flume::bounded(1 << 16);
    c.events = Some(EventSink {
        tag: 0,
        tx: events_tx,
    });
    let slots = a.concurrency.max(1).min(a.requests.max(1));
    let kv = SynthKv::new_stage(
        o.model(),
        c.tp_size,
        c.tp_rank,
        o.layers,
        slots * u64::from(b) * u64::from(a.groups),
        (c.pp_size, c.pp_rank),
    );
    stop_on_signal().map_err(|e| format!("cannot block signals: {e}"))?;
    let node = Node::start(c).map_err(|e| e.to_string())?;
    // SAFETY: `kv` outlives the node (shut down below before `kv` drops).
    unsafe { node.register_kv_caches(kv.kv_layout()) }.map_err(|e| e.to_string())?;
    let mut p = Pull {
        node: &node,
        kv: &kv,
        target: PrefillTarget::Bootstrap {
            addr: a.rank.bootstrap.clone(),
            engine_id: a.prefill_engine_id.clone(),
            dp_rank: a.prefill_dp_rank,
        },
        requests: a.requests,
        base: a.transfer_base,
        prefix: a.request_id_prefix.clone(),
        b,
        groups: a.groups,
        free: (0..slots).rev().collect(),
        live: HashMap::new(),
        latencies: kvferry::Latency::new(),
        report: DemoReport {
            requests: a.requests,
            ..DemoReport::default()
        },
        next: 0,
        finished: 0,
    };
    let started = Instant::now();
    p.run(&events_rx, guard(o.timeout_ms))?;
    let report = p.finish(started.elapsed().as_secs_f64());
    node.shutdown(Duration::from_millis(200));
    drop(node);
    drop(kv);
    Ok(report)
}

/// The machines end every request by its deadline plus the fence; this
/// outer bound only guards against a bug, so the command cannot hang.
fn guard(timeout_ms: u64) -> Duration {
    let t = demo_timeouts(timeout_ms);
    t.bootstrap_timeout + t.waiting_timeout + t.fence() + t.lease * 2 + Duration::from_secs(5)
}

/// The decode rank's requests between events.
struct Pull<'a> {
    node: &'a Node,
    kv: &'a SynthKv,
    target: PrefillTarget,
    requests: u64,
    /// Transfer id (or with `prefix`, number in the request id) of the
    /// first request.
    base: u64,
    /// `--request-id-prefix`.
    prefix: Option<String>,
    /// Blocks per request and group.
    b: u32,
    /// KV-cache groups per request.
    groups: u32,
    free: Vec<u64>,
    /// Slot, start and string request id of every request in flight, by
    /// transfer id.
    live: HashMap<u64, (u64, Instant, Option<String>)>,
    latencies: kvferry::Latency,
    report: DemoReport,
    next: u64,
    finished: u64,
}

impl Pull<'_> {
    /// Per group, the blocks of request slot `slot`.
    fn blocks(&self, slot: u64) -> Vec<Vec<u32>> {
        slot_blocks(self.b, self.groups as usize, slot)
    }

    /// Runs every request to its end, or until a signal asked to stop and
    /// nothing is in flight.
    fn run(&mut self, events: &flume::Receiver<Event>, guard: Duration) -> Result<(), String> {
        let mut last_event = Instant::now();
        while self.finished < self.requests {
            self.launch()?;
            if stop_requested() && self.live.is_empty() {
                break;
            }
            let (tid, phase) = match events.recv_timeout(Duration::from_millis(200)) {
                Ok(e) => match e.finished() {
                    Some(phase) => (e.transfer_id.0, phase),
                    None => continue,
                },
                Err(_) => {
                    if last_event.elapsed() > guard {
                        return Err(format!(
                            "{} requests did not end within {} s",
                            self.live.len(),
                            guard.as_secs()
                        ));
                    }
                    continue;
                }
            };
            last_event = Instant::now();
            self.done(tid, phase);
        }
        Ok(())
    }

    /// Asks for a request in every free slot, until all were asked or a
    /// signal asked to stop.
    fn launch(&mut self) -> Result<(), String> {
        while self.next < self.requests && !stop_requested() {
            let Some(slot) = self.free.pop() else { break };
            let n = self.base + self.next;
            let name = self.prefix.as_ref().map(|p| format!("{p}{n}"));
            let blocks = self.blocks(slot);
            self.kv.clear(&blocks.concat());
            let dst = (blocks.iter())
                .map(|g| g.iter().map(|&x| BlockId(x)).collect())
                .collect();
            let rx = match &name {
                Some(id) => self.node.receiver_named(id, &self.target),
                None => self.node.receiver(TransferId(n), &self.target),
            };
            let rx = (rx.and_then(|r| r.request(dst).map(|()| r))).map_err(|e| {
                format!("request {}: {e}", name.as_deref().unwrap_or(&n.to_string()))
            })?;
            let tid = rx.transfer_id().0;
            self.live.insert(tid, (slot, Instant::now(), name));
            self.next += 1;
        }
        Ok(())
    }

    /// The end of `tid`: counted, every byte of a success verified, its
    /// slot free again.
    fn done(&mut self, tid: u64, phase: Phase) {
        let Some((slot, at, name)) = self.live.remove(&tid) else {
            return;
        };
        if let (Some(id), false) = (&name, phase == Phase::Success) {
            tracing::warn!(request_id = %id, transfer_id = tid, ?phase, "request did not succeed");
            if self.report.failed_request_ids.len() < crate::demo::MAX_FAILED_IDS {
                self.report.failed_request_ids.push(id.clone());
            }
        }
        self.finished += 1;
        let blocks = self.blocks(slot);
        let report = &mut self.report;
        match phase {
            Phase::Success => {
                // The pattern `kvferry prefill` fills (`fill_groups`).
                let kv = self.kv;
                let none = vec![0; blocks.len()];
                let bad = kv.verify_groups(TransferId(tid), &blocks, &none).is_err();
                report.verify_errors += u64::from(bad);
                report.ok += 1;
                report.bytes += kv.block_bytes() * u64::from(self.b) * u64::from(self.groups);
                self.latencies.record(at.elapsed());
            }
            Phase::Expired => report.expired += 1,
            Phase::Failed(_)
            | Phase::Bootstrapping
            | Phase::WaitingForInput
            | Phase::Transferring => report.failed += 1,
        }
        self.free.push(slot);
        let _ = self.node.get_finished();
    }

    /// The report of a run that took `elapsed` seconds.
    fn finish(self, elapsed: f64) -> DemoReport {
        let mut report = self.report;
        let pct = |q: f64| self.latencies.quantile(q).as_secs_f64() * 1e3;
        report.p50_ms = pct(0.5);
        report.p99_ms = pct(0.99);
        report.elapsed_s = elapsed;
        report.gbps = report.bytes as f64 / elapsed / 1e9;
        report.requests_per_s = report.ok as f64 / elapsed;
        report
    }
}

/// `kvferry decode`.
pub(crate) fn main(a: &DecodeArgs) -> ExitCode {
    match run(a) {
        Ok(r) => {
            print_report(&r, a.json);
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
