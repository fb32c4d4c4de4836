//! `kvferry demo`: the bootstrap service, prefill ranks and decode ranks in
//! one process on 127.0.0.1, N requests with synthetic KV, every byte
//! verified on decode.

use kvferry::Latency;
use std::collections::HashMap;
use std::io::{IsTerminal, Write};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Args;
use kvferry::machines::sliding_window_blocks;
use kvferry::machines::{Phase, TransferId};
use kvferry_testkit::synth::Cluster;

use crate::figures::{bar, ms};
use crate::shape::{cluster_spec, slot_blocks, with_default, DemoOptions, ShapeArgs};
use crate::soak::{self, SoakArgs};

/// `kvferry demo` and `kvferry demo --soak`: one request shape, the options
/// of either run.
#[derive(Debug, Args)]
pub(crate) struct DemoArgs {
    #[command(flatten)]
    pub shape: ShapeArgs,
    #[command(flatten)]
    pub demo: DemoOnlyArgs,
    #[command(flatten)]
    pub soak: SoakArgs,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// The options of `kvferry demo` that the soak does not take.
#[derive(Clone, Debug, Args)]
pub(crate) struct DemoOnlyArgs {
    #[arg(long, value_name = "N", conflicts_with = "soak",
          help = with_default(&format!("Requests to run ({} with --store)",
                                       crate::store_demo::StoreDemo::default().requests),
                              |o| o.requests))]
    requests: Option<u64>,
    /// Also time a bare 256-byte ZeroMQ DEALER/ROUTER round trip, same run.
    #[arg(long, conflicts_with = "soak")]
    zmq_baseline: bool,
    #[arg(long, value_name = "N", conflicts_with = "soak",
          value_parser = clap::value_parser!(u32).range(1..=16),
          help = with_default("KV-cache groups per request", |o| o.groups))]
    groups: Option<u32>,
    #[arg(long, value_name = "T", conflicts_with = "soak",
          help = with_default("Sliding window (tokens) of every group but the first; 0: full attention",
                              |o| o.window_tokens))]
    window_tokens: Option<u64>,
    /// Fault injection: every node drops this many parts per million of
    /// the control messages its machines emit (the report counts what was
    /// dropped and resent).
    #[arg(long, value_name = "PPM", conflicts_with = "soak",
          value_parser = clap::value_parser!(u32).range(0..=1_000_000))]
    drop_control_ppm: Option<u32>,
    /// Instead of moving KV between engines: save requests that share
    /// prefixes to this store, look them up, load the hits and verify every
    /// byte, from a fixed pool of blocks with --concurrency requests in
    /// flight (stores: inproc, kvferry://HOST:PORT, redis://HOST:PORT,
    /// redis+cluster://HOST:PORT, mooncake://HOST:PORT).
    #[arg(long, value_name = "STORE", conflicts_with = "soak")]
    store: Option<String>,
}

/// Most request ids a report lists in `failed_request_ids`.
pub(crate) const MAX_FAILED_IDS: usize = 64;

/// What the demo measured.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub(crate) struct DemoReport {
    /// Requests run.
    pub requests: u64,
    /// Ended in `Success` on every decode rank.
    pub ok: u64,
    /// Ended `Failed` on a decode rank.
    pub failed: u64,
    /// Ended `Expired` on a decode rank.
    pub expired: u64,
    /// Successful requests with a wrong byte on some decode rank.
    pub verify_errors: u64,
    /// Verified payload bytes.
    pub bytes: u64,
    /// Gigabytes (1e9 bytes) per second of verified payload, wall clock.
    pub gbps: f64,
    /// Successful requests per second, wall clock.
    pub requests_per_s: f64,
    /// Median request latency.
    pub p50_ms: f64,
    /// 99th percentile request latency.
    pub p99_ms: f64,
    /// Wall-clock time of the run.
    pub elapsed_s: f64,
    /// With `--zmq-baseline`: p50 / p99 of a bare 256-byte DEALER/ROUTER
    /// round trip on loopback, both sockets in one ZeroMQ context (one I/O
    /// thread carries both ends), measured in the same process just before.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub zmq_rtt_p50_ms: Option<f64>,
    /// p99 of the same round trip.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub zmq_rtt_p99_ms: Option<f64>,
    /// The same round trip with each socket in its own context, as between
    /// a decode and a prefill process (two I/O threads).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub zmq_rtt_two_ctx_p50_ms: Option<f64>,
    /// p99 of the same round trip.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub zmq_rtt_two_ctx_p99_ms: Option<f64>,
    /// Requests named by string request id that did not succeed (at most
    /// [`MAX_FAILED_IDS`]), so an operator can look them up in both sides'
    /// logs (`request_id` fields).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub failed_request_ids: Vec<String>,
    /// The prefill side, where the run has prefill ranks (the demo).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefill: Option<PrefillReport>,
    /// Control messages dropped (fault injection) and resent, summed over
    /// every node (the demo).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub control: Option<ControlReport>,
}

/// Control messages dropped by fault injection and resent, per channel,
/// summed over the nodes of a run.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub(crate) struct ControlReport {
    /// Dropped instead of sent over the side channel (ZeroMQ).
    pub dropped_sidechannel: u64,
    /// Dropped instead of sent in a data-plane notification.
    pub dropped_data_plane: u64,
    /// Closing statuses dropped from behind their write.
    pub dropped_trailer: u64,
    /// Resent over the side channel.
    pub resent_sidechannel: u64,
    /// Resent over a data-plane session.
    pub resent_data_plane: u64,
    /// Messages for ended transfers answered by a node.
    pub late_answers: u64,
}

impl ControlReport {
    /// The sums of `stats`.
    fn of(stats: impl Iterator<Item = kvferry::NodeStats>) -> ControlReport {
        let s: kvferry::NodeStats = stats.sum();
        ControlReport {
            dropped_sidechannel: s.dropped_sidechannel,
            dropped_data_plane: s.dropped_data_plane,
            dropped_trailer: s.dropped_trailer,
            resent_sidechannel: s.resent_sidechannel,
            resent_data_plane: s.resent_data_plane,
            late_answers: s.late_answers,
        }
    }
}

/// How the prefill ranks ended their requests, one outcome per prefill
/// rank and request.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub(crate) struct PrefillReport {
    /// Ended in `Success`.
    pub ok: u64,
    /// Ended `Failed`.
    pub failed: u64,
    /// Ended `Expired`.
    pub expired: u64,
    /// The longest any prefill rank held a request's blocks after the
    /// request ended on decode (0 when every rank ended first).
    pub held_ms_max: f64,
}

/// Per group, the blocks of `all` that move (from the group's start).
fn moved_blocks(all: &[Vec<u32>], starts: &[u32]) -> Vec<Vec<u32>> {
    (all.iter().zip(starts))
        .map(|(g, &s)| g[s as usize..].to_vec())
        .collect()
}

/// Per group, the first of a request's blocks that moves: the start of the
/// window's blocks (by the rule the scheduler applies) for every group but
/// the first, when a window is set.
fn window_starts(o: &DemoOptions) -> Vec<u32> {
    let b = o.blocks_per_request;
    let keep = sliding_window_blocks(o.window_tokens, u64::from(o.block_tokens));
    let start = match u32::try_from(keep) {
        Ok(0) => 0,
        Ok(k) => b.saturating_sub(k),
        Err(_) => 0,
    };
    (0..o.groups.max(1))
        .map(|g| if g == 0 { 0 } else { start })
        .collect()
}

impl PrefillReport {
    /// A prefill rank ended a request in `phase`; its decode side ended at
    /// `decode_ended`, if it did already.
    fn record(&mut self, phase: Phase, decode_ended: Option<Instant>) {
        match phase {
            Phase::Success => self.ok += 1,
            Phase::Failed(_) => self.failed += 1,
            Phase::Expired => self.expired += 1,
            Phase::Bootstrapping | Phase::WaitingForInput | Phase::Transferring => return,
        }
        let held = decode_ended.map_or(0.0, |t| t.elapsed().as_secs_f64() * 1e3);
        self.held_ms_max = self.held_ms_max.max(held);
    }
}

/// Times `n` bare 256-byte ZeroMQ DEALER→ROUTER→DEALER round trips on
/// loopback: the yardstick for the control plane's added latency. With
/// `two_contexts` the DEALER has its own context (its own I/O thread), as
/// when the two ends live in different processes.
pub(crate) fn zmq_baseline(n: usize, two_contexts: bool) -> Result<(f64, f64), String> {
    let e = |e: zmq::Error| e.to_string();
    let ctx = zmq::Context::new();
    let router = ctx.socket(zmq::ROUTER).map_err(e)?;
    router.set_linger(0).map_err(e)?;
    router.bind("tcp://127.0.0.1:*").map_err(e)?;
    let ep = router
        .get_last_endpoint()
        .map_err(e)?
        .map_err(|_| "endpoint".to_string())?;
    let echo = std::thread::spawn(move || {
        for _ in 0..n {
            let Ok(parts) = router.recv_multipart(0) else {
                return;
            };
            if router.send_multipart(parts, 0).is_err() {
                return;
            }
        }
    });
    let dealer_ctx = if two_contexts {
        zmq::Context::new()
    } else {
        ctx.clone()
    };
    let dealer = dealer_ctx.socket(zmq::DEALER).map_err(e)?;
    dealer.set_linger(0).map_err(e)?;
    dealer.connect(&ep).map_err(e)?;
    let payload = vec![7u8; 256];
    let mut rtt = Latency::new();
    for _ in 0..n {
        let t = Instant::now();
        dealer.send(&payload[..], 0).map_err(e)?;
        dealer.recv_bytes(0).map_err(e)?;
        rtt.record(t.elapsed());
    }
    let _ = echo.join();
    Ok((ms(rtt.quantile(0.5)), ms(rtt.quantile(0.99))))
}

/// Runs the demo. `progress` draws a progress bar on stderr.
pub(crate) fn run_demo(o: &DemoOptions, progress: bool) -> Result<DemoReport, String> {
    let slots = o.concurrency.min(o.requests.max(1));
    let spec = cluster_spec(o, slots)?;
    let c = Cluster::start(&spec).map_err(|e| e.to_string())?;
    let starts = window_starts(o);
    let moved: u64 = starts
        .iter()
        .map(|&s| u64::from(o.blocks_per_request - s))
        .sum();
    let bytes_per_request: u64 = c.decode.iter().map(|r| r.kv.block_bytes() * moved).sum();
    let mut d = Demo {
        o,
        c: &c,
        progress,
        free: (0..slots).rev().collect(),
        live: HashMap::new(),
        report: DemoReport {
            requests: o.requests,
            prefill: Some(PrefillReport::default()),
            ..DemoReport::default()
        },
        latencies: Latency::new(),
        bytes_per_request,
        starts,
        next: 0,
        finished: 0,
        last_draw: Instant::now(),
    };
    let started = Instant::now();
    let hard_deadline = Duration::from_millis(o.timeout_ms) * 4 + Duration::from_secs(30);
    let mut last_progress = Instant::now();
    let mut decode_done = None;
    // Until every prefill rank ended every request too (their outcomes
    // are in the report); the clock stops when decode is done.
    while d.finished < o.requests || !d.live.is_empty() {
        if d.finished == o.requests {
            decode_done.get_or_insert_with(|| started.elapsed());
        }
        d.launch()?;
        let Some((is_decode, tid, phase)) = d.next_event()? else {
            if last_progress.elapsed() > hard_deadline {
                return Err(format!(
                    "no progress for {} s; {} requests still live",
                    hard_deadline.as_secs(),
                    d.live.len()
                ));
            }
            continue;
        };
        last_progress = Instant::now();
        d.on_event(is_decode, tid.0, phase);
    }
    Ok(d.finish(decode_done.unwrap_or_else(|| started.elapsed())))
}

/// One request in flight.
struct Live {
    slot: u64,
    started: Instant,
    decode_left: u32,
    prefill_left: u32,
    all_ok: bool,
    verified: bool,
    /// When the last decode rank ended it.
    decode_ended: Option<Instant>,
}

/// The demo's requests between events.
struct Demo<'a> {
    o: &'a DemoOptions,
    c: &'a Cluster,
    progress: bool,
    /// Block slots: request slot s owns blocks s·B .. (s+1)·B on both
    /// sides, until both its prefill and its decode ranks are done with it.
    free: Vec<u64>,
    live: HashMap<u64, Live>,
    report: DemoReport,
    latencies: Latency,
    bytes_per_request: u64,
    /// Per group, the first of a request's blocks that moves (the window's
    /// start; 0 for full attention).
    starts: Vec<u32>,
    next: u64,
    finished: u64,
    last_draw: Instant,
}

impl Demo<'_> {
    /// The blocks of request slot `slot`.
    fn blocks(&self, slot: u64) -> Vec<Vec<u32>> {
        slot_blocks(self.o.blocks_per_request, self.starts.len(), slot)
    }

    /// Starts a request in every free slot, until all were started.
    fn launch(&mut self) -> Result<(), String> {
        while self.next < self.o.requests {
            let Some(slot) = self.free.pop() else { break };
            let tid = self.next + 1;
            let blocks = self.blocks(slot);
            self.c.fill_groups(TransferId(tid), &blocks);
            let moved = moved_blocks(&blocks, &self.starts);
            let none = vec![0; moved.len()];
            // The clock starts before the ranks are asked (an executor may
            // run on this core before `start_request` returns).
            let asked_at = Instant::now();
            let started = self
                .c
                .start_request_groups(TransferId(tid), &moved, &moved, &none);
            if let Err(e) = started {
                return Err(format!("request {tid} refused: {e}"));
            }
            self.live.insert(
                tid,
                Live {
                    slot,
                    started: asked_at,
                    decode_left: self.o.decode_tp,
                    prefill_left: self.o.prefill_tp,
                    all_ok: true,
                    verified: false,
                    decode_ended: None,
                },
            );
            self.next += 1;
        }
        Ok(())
    }

    /// The next terminal phase (decode side or not, transfer, phase);
    /// `None` if none came within 500 ms, or the event was not a terminal
    /// phase.
    fn next_event(&self) -> Result<Option<(bool, TransferId, Phase)>, String> {
        // What is queued first; otherwise wait on the side a live request
        // still waits for (decode first: its notification ends a request's
        // latency). Not a `Selector`: it registers with both channels and
        // seeds a random generator (a `getrandom` call) every time, and
        // while its lock is held the executor that fired it is preempted
        // by this thread, a lock convoy on a shared core. Both channels
        // are unbounded, so nothing waiting on the other one is dropped.
        let c = self.c;
        let ready = c
            .decode_events
            .try_recv()
            .map(|e| (true, e))
            .or_else(|_| c.prefill_events.try_recv().map(|e| (false, e)));
        if let Ok((decode, e)) = ready {
            return Ok(e.finished().map(|p| (decode, e.transfer_id, p)));
        }
        let is_decode = self.live.values().any(|l| l.decode_left > 0);
        let events = if is_decode {
            &c.decode_events
        } else {
            &c.prefill_events
        };
        match events.recv_timeout(Duration::from_millis(500)) {
            Ok(e) => Ok(e.finished().map(|p| (is_decode, e.transfer_id, p))),
            Err(flume::RecvTimeoutError::Timeout) => Ok(None),
            Err(flume::RecvTimeoutError::Disconnected) => {
                Err("node notification channel closed".into())
            }
        }
    }

    /// A terminal phase of `tid` on a rank: the request's outcome once
    /// every decode rank is terminal (every byte of a success verified),
    /// its slot once every rank is.
    fn on_event(&mut self, is_decode: bool, tid: u64, phase: Phase) {
        let Some(l) = self.live.get_mut(&tid) else {
            return;
        };
        if is_decode {
            l.decode_left = l.decode_left.saturating_sub(1);
            match phase {
                Phase::Success => {}
                Phase::Failed(_) | Phase::Expired => l.all_ok = false,
                Phase::Bootstrapping | Phase::WaitingForInput | Phase::Transferring => {}
            }
            if l.decode_left == 0 && !l.verified {
                l.verified = true;
                l.decode_ended = Some(Instant::now());
                self.finished += 1;
                let all = slot_blocks(self.o.blocks_per_request, self.starts.len(), l.slot);
                let moved = moved_blocks(&all, &self.starts);
                let report = &mut self.report;
                if l.all_ok {
                    report.ok += 1;
                    report.bytes += self.bytes_per_request;
                    self.latencies.record(l.started.elapsed());
                    let bad = self.c.verify_groups(TransferId(tid), &moved, &self.starts);
                    report.verify_errors += bad as u64;
                } else if phase == Phase::Expired {
                    report.expired += 1;
                } else {
                    report.failed += 1;
                }
            }
        } else {
            l.prefill_left = l.prefill_left.saturating_sub(1);
            if let Some(p) = &mut self.report.prefill {
                p.record(phase, l.decode_ended);
            }
        }
        if l.decode_left == 0 && l.prefill_left == 0 {
            self.free.push(l.slot);
            self.live.remove(&tid);
        }
        if self.finished.is_multiple_of(256) {
            // Collect finished records so the executors' boards stay small.
            for r in self.c.prefill.iter().chain(&self.c.decode) {
                let _ = r.node.get_finished();
            }
        }
        self.draw();
    }

    /// The progress bar, at most every 100 ms.
    fn draw(&mut self) {
        if !(self.progress && self.last_draw.elapsed() > Duration::from_millis(100)) {
            return;
        }
        self.last_draw = Instant::now();
        let (finished, requests, report) = (self.finished, self.o.requests, &self.report);
        eprint!(
            "\r{} {finished}/{} ok {} failed {} expired {}",
            bar(finished, requests),
            requests,
            report.ok,
            report.failed,
            report.expired
        );
        let _ = std::io::stderr().flush();
    }

    /// The report of a run that started at `started`.
    fn finish(self, elapsed: Duration) -> DemoReport {
        if self.progress {
            eprintln!();
        }
        for r in self.c.prefill.iter().chain(&self.c.decode) {
            tracing::debug!(stats = ?r.node.stats(), "node counters");
        }
        let mut report = self.report;
        let nodes = self.c.prefill.iter().chain(&self.c.decode);
        report.control = Some(ControlReport::of(nodes.map(|r| r.node.stats())));
        let elapsed = elapsed.as_secs_f64();
        report.elapsed_s = elapsed;
        report.gbps = report.bytes as f64 / elapsed / 1e9;
        report.requests_per_s = report.ok as f64 / elapsed;
        report.p50_ms = ms(self.latencies.quantile(0.50));
        report.p99_ms = ms(self.latencies.quantile(0.99));
        report
    }
}

/// `kvferry demo`, `kvferry demo --soak` ([`soak`]) and `kvferry demo
/// --store` ([`crate::store_demo`]).
pub(crate) fn main(a: &DemoArgs) -> ExitCode {
    if a.soak.soak.is_some() {
        return soak::main(&a.shape, &a.soak, a.json);
    }
    if let Some(store) = &a.demo.store {
        return crate::store_demo::main(store, a.demo.requests, a.shape.concurrency(), a.json);
    }
    let mut o = a.shape.apply(DemoOptions::default());
    o.requests = a.demo.requests.unwrap_or(o.requests);
    o.groups = a.demo.groups.unwrap_or(o.groups);
    o.window_tokens = a.demo.window_tokens.unwrap_or(o.window_tokens);
    o.drop_control_ppm = a.demo.drop_control_ppm.unwrap_or(o.drop_control_ppm);
    let (json, baseline) = (a.json, a.demo.zmq_baseline);
    let progress = !json && std::io::stderr().is_terminal();
    let rtt = if baseline {
        let both =
            || -> Result<_, String> { Ok((zmq_baseline(2000, false)?, zmq_baseline(2000, true)?)) };
        match both() {
            Ok(r) => Some(r),
            Err(e) => {
                eprintln!("kvferry demo: zmq baseline: {e}");
                return ExitCode::from(1);
            }
        }
    } else {
        None
    };
    let report = match run_demo(&o, progress) {
        Ok(mut r) => {
            r.zmq_rtt_p50_ms = rtt.map(|x| x.0 .0);
            r.zmq_rtt_p99_ms = rtt.map(|x| x.0 .1);
            r.zmq_rtt_two_ctx_p50_ms = rtt.map(|x| x.1 .0);
            r.zmq_rtt_two_ctx_p99_ms = rtt.map(|x| x.1 .1);
            r
        }
        Err(e) => {
            eprintln!("kvferry demo: {e}");
            return ExitCode::from(1);
        }
    };
    print_report(&report, json);
    if report.verify_errors > 0 {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}

/// Prints the summary (one JSON object with `--json`).
pub(crate) fn print_report(r: &DemoReport, json: bool) {
    if json {
        println!("{}", serde_json::to_string(r).unwrap_or_default());
    } else {
        println!(
            "requests {} ok {} failed {} expired {} verify_errors {}\n\
             bytes {} in {:.3} s: {:.3} GB/s, {:.0} requests/s\n\
             latency p50 {:.3} ms p99 {:.3} ms",
            r.requests,
            r.ok,
            r.failed,
            r.expired,
            r.verify_errors,
            r.bytes,
            r.elapsed_s,
            r.gbps,
            r.requests_per_s,
            r.p50_ms,
            r.p99_ms
        );
        if let (Some(p50), Some(p99)) = (r.zmq_rtt_p50_ms, r.zmq_rtt_p99_ms) {
            println!("bare ZeroMQ 256 B round trip, one context: p50 {p50:.3} ms p99 {p99:.3} ms");
        }
        if let (Some(p50), Some(p99)) = (r.zmq_rtt_two_ctx_p50_ms, r.zmq_rtt_two_ctx_p99_ms) {
            println!("bare ZeroMQ 256 B round trip, two contexts: p50 {p50:.3} ms p99 {p99:.3} ms");
        }
        // The yardstick of the control plane: request p50 in bare round trips.
        let ratios: Vec<String> = [
            ("two contexts", r.zmq_rtt_two_ctx_p50_ms),
            ("one context", r.zmq_rtt_p50_ms),
        ]
        .iter()
        .filter_map(|(name, rtt)| {
            rtt.filter(|v| *v > 0.0)
                .map(|v| format!("{:.2} ({name})", r.p50_ms / v))
        })
        .collect();
        if !ratios.is_empty() {
            println!("request p50 in bare round trips: {}", ratios.join(", "));
        }
    }
}
