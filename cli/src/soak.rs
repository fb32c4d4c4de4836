//! `kvferry demo --soak SECONDS`: the demo cluster under a continuous load
//! with random aborts, to show (not claim) that nothing leaks, corrupts or
//! hangs.
//!
//! The soak keeps `--concurrency` requests in flight for SECONDS. Each
//! request is started on the decode side first; its KV becomes ready on the
//! prefill side after a random "prefill" delay, as in a real engine. A
//! random fraction of the requests is aborted at a random moment: before the
//! prefill side has the KV, or after it handed the KV over (usually while it
//! moves, sometimes after it arrived), from the decode side
//! ([`Receiver::abort`]), the prefill side ([`Sender::abort`]) or both.
//! Every request that ends in `Success` has every byte checked. Block slots
//! are reused only once every rank reported a terminal phase, so a late
//! write or read of an aborted transfer lands in blocks that belong to
//! another request and fails that request's verification.
//!
//! Once a second the process's resident set size is sampled. After the load
//! stops, the soak drains, checks that no request and no machine on either
//! node is left live, and judges whether RSS stayed flat (see
//! [`RssVerdict`]).

use kvferry::Latency;
use std::collections::{BinaryHeap, HashMap};
use std::io::{IsTerminal, Write};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Args;
use kvferry::machines::BlockId;
use kvferry::machines::Phase;
use kvferry::node::{NodeStats, Receiver, Sender};
use kvferry::TransferId;
use kvferry_testkit::synth::Cluster;

use crate::shape::{cluster_spec, DemoOptions, ShapeArgs};
use crate::usage::{usage_error, UsageError};

/// The options of `kvferry demo --soak` that the demo does not take.
#[derive(Clone, Debug, Args)]
pub(crate) struct SoakArgs {
    /// Soak: keep --concurrency requests in flight for SECONDS with random
    /// aborts; checks every byte, that nothing stays live and that RSS stays
    /// flat.
    #[arg(long, value_name = "SECONDS", value_parser = parse_seconds)]
    pub soak: Option<f64>,
    #[arg(long, value_name = "R", requires = "soak", value_parser = parse_ratio,
          help = soak_default("Fraction of requests aborted at a random moment", |o| o.abort_ratio))]
    abort_ratio: Option<f64>,
    /// Seed of the random plan (default: from the clock; the report prints it).
    #[arg(long, value_name = "S", requires = "soak")]
    seed: Option<u64>,
    #[arg(long, value_name = "US", requires = "soak",
          help = soak_default("Prefill KV is ready a random 0..=US after decode asks", |o| o.prefill_delay_us))]
    prefill_delay_us: Option<u64>,
    /// Seconds of warm-up before the RSS baseline [default: 10 % of SECONDS,
    /// at least 1].
    #[arg(long, value_name = "W", requires = "soak")]
    warmup_s: Option<f64>,
}

/// `text` followed by the default of the field `f` picks from
/// [`SoakOptions::default`], as clap prints a default.
fn soak_default<T: std::fmt::Display>(text: &str, f: impl Fn(&SoakOptions) -> T) -> String {
    format!("{text} [default: {}]", f(&SoakOptions::default()))
}

fn parse_seconds(s: &str) -> Result<f64, String> {
    let v: f64 = s.parse().map_err(|e| format!("{e}"))?;
    if v.is_finite() && v > 0.0 && v <= 86_400.0 {
        Ok(v)
    } else {
        Err("expected seconds in (0, 86400]".into())
    }
}

fn parse_ratio(s: &str) -> Result<f64, String> {
    let v: f64 = s.parse().map_err(|e| format!("{e}"))?;
    if (0.0..=1.0).contains(&v) {
        Ok(v)
    } else {
        Err("expected 0..=1".into())
    }
}

/// What `kvferry demo --help` says of the soak's defaults, from
/// [`soak_shape`].
pub(crate) fn defaults_help() -> String {
    let d = soak_shape();
    format!(
        "\
With --soak the defaults are --concurrency {} --layers {} --blocks-per-request {} \
--block-tokens {} --heads {} --head-bytes {} (a small request, so that thousands fit \
in memory). The soak exits 1 on a verify error, a request or machine still live after \
draining, a block slot not returned, or RSS growth past the threshold (rss_flat \
false). Each node remembers the final phase of its last NodeConfig::max_finished_records \
transfers (~100 bytes a request for both nodes), so RSS climbs until that many \
requests ended and is flat after: to judge the plateau, put --warmup-s past that point.",
        d.concurrency, d.layers, d.blocks_per_request, d.block_tokens, d.heads, d.head_bytes
    )
}

/// RSS growth after warm-up that still counts as flat, whichever is larger:
/// 8 MiB, or 5 % of the RSS at the end of warm-up. Why these: the
/// allocator keeps freed memory in per-thread caches and arenas and returns
/// it lazily, and how many requests, frames and batches are in flight at a
/// sampling instant varies, so a leak-free process wanders by a few MiB; a
/// leak does not wander, it grows with the number of requests. The report
/// states the smallest per-request leak the run would have caught
/// (`rss_leak_floor_bytes_per_request`): the threshold divided by the
/// requests completed after warm-up, so a longer soak catches a smaller leak.
///
/// Measured: each node keeps the final phase of its last
/// `NodeConfig::max_finished_records` transfers, about 100 bytes a request
/// for a P and a D node together, so RSS grows in hash-table steps until
/// that many requests ended and is flat after. With the old default of
/// 2^20 records a soak whose warm-up ended before a million requests
/// reported that growth (`rss_flat: false`); the default is now 65 536.
pub(crate) const RSS_GROWTH_FLOOR_KIB: u64 = 8 * 1024;
/// See [`RSS_GROWTH_FLOOR_KIB`].
pub(crate) const RSS_GROWTH_FRACTION: f64 = 0.05;
/// Share of the soak's duration treated as warm-up (buffers first touched,
/// connections opened, allocator caches filled): at least one second.
pub(crate) const WARMUP_FRACTION: f64 = 0.10;

/// The soak's settings.
#[derive(Clone, Debug)]
pub(crate) struct SoakOptions {
    /// Request shape, cluster and timeouts; `requests` is ignored.
    pub demo: DemoOptions,
    /// How long new requests are started.
    pub duration: Duration,
    /// Fraction of requests aborted at a random moment, in 0..=1.
    pub abort_ratio: f64,
    /// Seed of the random plan (prefill delays, which requests abort, when
    /// and from which side). Timing still varies between runs.
    pub seed: u64,
    /// The prefill side's KV is ready a random 0..=this many microseconds
    /// after the decode side asked for it.
    pub prefill_delay_us: u64,
    /// Seconds of warm-up before the RSS baseline; `None`:
    /// [`WARMUP_FRACTION`] of the duration, at least one second.
    pub warmup_s: Option<f64>,
}

impl Default for SoakOptions {
    fn default() -> Self {
        SoakOptions {
            demo: soak_shape(),
            duration: Duration::from_secs(60),
            abort_ratio: 0.05,
            seed: 1,
            prefill_delay_us: 1000,
            warmup_s: None,
        }
    }
}

/// The soak's default request shape: small, so thousands fit in memory.
fn soak_shape() -> DemoOptions {
    DemoOptions {
        concurrency: 2000,
        layers: 2,
        blocks_per_request: 2,
        block_tokens: 16,
        heads: 4,
        head_bytes: 64,
        ..DemoOptions::default()
    }
}

/// Counters of one role, summed over its ranks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub(crate) struct RoleStats {
    /// Machines the soak created on this role's ranks.
    pub machines_created: u64,
    /// Terminal phases the ranks counted (`ok + failed + expired`).
    pub terminal: u64,
    /// [`NodeStats::ok`], summed.
    pub ok: u64,
    /// [`NodeStats::failed`], summed.
    pub failed: u64,
    /// [`NodeStats::expired`], summed.
    pub expired: u64,
    /// [`NodeStats::bytes`], summed.
    pub bytes: u64,
    /// [`NodeStats::transport_errors`], summed.
    pub transport_errors: u64,
    /// [`NodeStats::peers_marked_dead`], summed.
    pub peers_marked_dead: u64,
    /// [`NodeStats::bad_frames`], summed.
    pub bad_frames: u64,
    /// [`NodeStats::dropped_frames`], summed.
    pub dropped_frames: u64,
    /// Machines still live after draining, found by asking the node for
    /// the phase of every transfer id the soak used.
    pub live_after_drain: u64,
}

impl RoleStats {
    fn add(&mut self, s: &NodeStats) {
        self.ok += s.ok;
        self.failed += s.failed;
        self.expired += s.expired;
        self.terminal += s.ok + s.failed + s.expired;
        self.bytes += s.bytes;
        self.transport_errors += s.transport_errors;
        self.peers_marked_dead += s.peers_marked_dead;
        self.bad_frames += s.bad_frames;
        self.dropped_frames += s.dropped_frames;
    }
}

/// When and from where the soak aborted requests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub(crate) struct AbortStats {
    /// Aborts issued (one per aborted request, whatever the sides).
    pub issued: u64,
    /// Issued through the decode side only ([`Receiver::abort`]).
    pub decode_side: u64,
    /// Issued through the prefill side only ([`Sender::abort`]).
    pub prefill_side: u64,
    /// Issued through both sides.
    pub both_sides: u64,
    /// Before the prefill side had the KV (its send not yet issued).
    pub before_kv: u64,
    /// After the send, while the decode side was not yet terminal.
    pub while_moving: u64,
    /// Planned aborts that came too late: the decode side was already
    /// terminal (the call is still made), or the whole request had finished
    /// and its blocks were reused (no call is made, as an engine would not
    /// abort a finished request). Such requests count by their outcome.
    pub too_late: u64,
    /// Aborts issued whose request still ended in `Success` on every
    /// decode rank (counted in `ok`, bytes verified).
    pub ended_ok: u64,
    /// Abort calls the node refused (the transfer had already finished).
    pub refused_calls: u64,
    /// Aborted requests whose decode side ended `Expired` instead of
    /// `Failed`: an abort that did not reach the peer and had to wait out
    /// a deadline.
    pub ended_expired: u64,
    /// `ended_expired` by the plan that aborted them.
    pub ended_expired_by_plan: AbortPlanCounts,
    /// Aborted requests whose prefill side ended `Expired`, by plan.
    pub prefill_expired_by_plan: AbortPlanCounts,
}

/// A count per abort plan: side, and whether the abort was planned before
/// the prefill side's KV was ready or after (while moving or too late).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub(crate) struct AbortPlanCounts {
    /// Decode side, before the KV was ready.
    pub decode_before_kv: u64,
    /// Decode side, after the send.
    pub decode_after_send: u64,
    /// Prefill side, before the KV was ready.
    pub prefill_before_kv: u64,
    /// Prefill side, after the send.
    pub prefill_after_send: u64,
    /// Both sides, before the KV was ready.
    pub both_before_kv: u64,
    /// Both sides, after the send.
    pub both_after_send: u64,
}

impl AbortPlanCounts {
    fn bump(&mut self, side: Side, early: bool) {
        let cell = match (side, early) {
            (Side::Decode, true) => &mut self.decode_before_kv,
            (Side::Decode, false) => &mut self.decode_after_send,
            (Side::Prefill, true) => &mut self.prefill_before_kv,
            (Side::Prefill, false) => &mut self.prefill_after_send,
            (Side::Both, true) => &mut self.both_before_kv,
            (Side::Both, false) => &mut self.both_after_send,
        };
        *cell += 1;
    }
}

/// Where stray terminal notifications came from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub(crate) struct StrayStats {
    /// Strays from prefill ranks.
    pub prefill: u64,
    /// Strays from decode ranks.
    pub decode: u64,
    /// Strays that ended `Expired` (a machine that waited out a deadline).
    pub expired: u64,
    /// Strays of requests that were not aborted (or aborted too long ago
    /// to be remembered).
    pub not_aborted: u64,
    /// Strays of aborted requests, by plan.
    pub by_plan: AbortPlanCounts,
}

/// One RSS sample.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub(crate) struct RssSample {
    /// Seconds since the load started.
    pub t_s: f64,
    /// Resident set size.
    pub rss_kib: u64,
    /// Requests that had reached a terminal outcome.
    pub completed: u64,
}

/// Whether RSS stayed flat, from the samples of one run.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub(crate) struct RssVerdict {
    /// First sample.
    pub rss_start_kib: u64,
    /// First sample at or after the end of warm-up.
    pub rss_warmup_kib: u64,
    /// Largest sample at or after the end of warm-up (drain included).
    pub rss_max_kib: u64,
    /// Last sample (after draining).
    pub rss_end_kib: u64,
    /// `rss_max_kib - rss_warmup_kib`.
    pub rss_growth_kib: u64,
    /// The most growth that counts as flat (see [`RSS_GROWTH_FLOOR_KIB`]).
    pub rss_threshold_kib: u64,
    /// Least-squares slope of RSS against completed requests over the
    /// steady part (after warm-up, before draining), KiB per 1000 requests.
    pub rss_slope_kib_per_1000_requests: f64,
    /// Requests completed between the end of warm-up and the end of load.
    pub steady_requests: u64,
    /// The threshold spread over the steady requests: a leak at least this
    /// large per request would have failed the verdict.
    pub rss_leak_floor_bytes_per_request: f64,
    /// `rss_growth_kib <= rss_threshold_kib`.
    pub rss_flat: bool,
}

/// Judges RSS flatness. `samples` are in time order; those with `t_s >
/// load_s` were taken while draining (they count for the maximum and the
/// end, not for the slope).
pub(crate) fn rss_verdict(samples: &[RssSample], warmup_s: f64, load_s: f64) -> RssVerdict {
    let Some(first) = samples.first() else {
        return RssVerdict::default();
    };
    let last = samples[samples.len() - 1];
    let warm_i = samples
        .iter()
        .position(|s| s.t_s >= warmup_s)
        .unwrap_or(samples.len() - 1);
    let warm = samples[warm_i];
    let after = &samples[warm_i..];
    let max = after
        .iter()
        .map(|s| s.rss_kib)
        .max()
        .unwrap_or(warm.rss_kib);
    let steady: Vec<&RssSample> = after.iter().filter(|s| s.t_s <= load_s).collect();
    let slope = least_squares_slope(
        steady
            .iter()
            .map(|s| (s.completed as f64 / 1000.0, s.rss_kib as f64)),
    );
    let steady_requests = match (steady.first(), steady.last()) {
        (Some(a), Some(b)) => b.completed.saturating_sub(a.completed),
        _ => 0,
    };
    let threshold = RSS_GROWTH_FLOOR_KIB.max((warm.rss_kib as f64 * RSS_GROWTH_FRACTION) as u64);
    let growth = max.saturating_sub(warm.rss_kib);
    RssVerdict {
        rss_start_kib: first.rss_kib,
        rss_warmup_kib: warm.rss_kib,
        rss_max_kib: max,
        rss_end_kib: last.rss_kib,
        rss_growth_kib: growth,
        rss_threshold_kib: threshold,
        rss_slope_kib_per_1000_requests: slope,
        steady_requests,
        rss_leak_floor_bytes_per_request: if steady_requests == 0 {
            f64::INFINITY
        } else {
            threshold as f64 * 1024.0 / steady_requests as f64
        },
        rss_flat: growth <= threshold,
    }
}

/// Slope of the least-squares line through `points`; 0 with fewer than two
/// distinct x.
fn least_squares_slope(points: impl Iterator<Item = (f64, f64)> + Clone) -> f64 {
    let (mut n, mut sx, mut sy) = (0.0, 0.0, 0.0);
    for (x, y) in points.clone() {
        n += 1.0;
        sx += x;
        sy += y;
    }
    if n < 2.0 {
        return 0.0;
    }
    let (mx, my) = (sx / n, sy / n);
    let (mut sxy, mut sxx) = (0.0, 0.0);
    for (x, y) in points {
        sxy += (x - mx) * (y - my);
        sxx += (x - mx) * (x - mx);
    }
    if sxx <= f64::EPSILON {
        0.0
    } else {
        sxy / sxx
    }
}

/// What the soak measured. `--json` prints it as one object.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub(crate) struct SoakReport {
    /// Seconds new requests were started.
    pub seconds: f64,
    /// Seconds of warm-up before the RSS baseline.
    pub warmup_s: f64,
    /// Requests kept in flight.
    pub concurrency: u64,
    /// Fraction of requests planned to be aborted.
    pub abort_ratio: f64,
    /// Seed of the random plan (`--seed` repeats it).
    pub seed: u64,
    /// Requests started.
    pub requests: u64,
    /// Ended in `Success` on every decode rank (aborted too late included).
    pub ok: u64,
    /// Not aborted, ended `Failed` on a decode rank.
    pub failed: u64,
    /// Aborted and did not end in `Success`.
    pub aborted: u64,
    /// Not aborted, ended `Expired` on a decode rank.
    pub expired: u64,
    /// The node refused to start the request (back-pressure).
    pub refused: u64,
    /// Successful requests with a wrong byte on some decode rank.
    pub verify_errors: u64,
    /// Requests without a terminal phase on every rank after draining.
    pub non_terminal: u64,
    /// Block slots not returned after draining (held by a request that
    /// some rank never finished).
    pub blocks_outstanding: u64,
    /// Prefill sends the node refused for a request that was not aborted.
    pub send_refused: u64,
    /// Terminal notifications for transfers no longer tracked (a rank
    /// finishing the same transfer twice: a second machine was created for
    /// a transfer that had already finished there).
    pub stray_notifications: u64,
    /// `stray_notifications` by role, phase and (for recently aborted
    /// requests) abort plan.
    pub stray: StrayStats,
    /// Terminal phases found by polling because no notification came.
    pub missed_notifications: u64,
    /// When and from where requests were aborted.
    pub aborts: AbortStats,
    /// Verified payload bytes.
    pub bytes: u64,
    /// Successful requests per second of load.
    pub requests_per_s: f64,
    /// Gigabytes (1e9 bytes) per second of verified payload during the load.
    pub gbps: f64,
    /// Latency of successful requests, decode request to decode terminal.
    pub p50_ms: f64,
    /// 99th percentile of the same latency.
    pub p99_ms: f64,
    /// Seconds of load.
    pub elapsed_s: f64,
    /// Seconds of draining after the load.
    pub drain_s: f64,
    /// Whether RSS stayed flat.
    #[serde(flatten)]
    pub rss: RssVerdict,
    /// RSS once a second, and once after draining.
    pub rss_samples: Vec<RssSample>,
    /// Counters of the prefill ranks.
    pub prefill: RoleStats,
    /// Counters of the decode ranks.
    pub decode: RoleStats,
}

impl SoakReport {
    /// Everything that makes the soak fail, as sentences; empty if it passed.
    pub(crate) fn problems(&self) -> Vec<String> {
        let mut p = Vec::new();
        if self.verify_errors > 0 {
            p.push(format!("{} requests had wrong bytes", self.verify_errors));
        }
        if self.non_terminal > 0 {
            p.push(format!(
                "{} requests not terminal after draining",
                self.non_terminal
            ));
        }
        if self.blocks_outstanding > 0 {
            p.push(format!(
                "{} block slots not returned",
                self.blocks_outstanding
            ));
        }
        for (role, s) in [("prefill", &self.prefill), ("decode", &self.decode)] {
            if s.live_after_drain > 0 {
                p.push(format!(
                    "{} {role} machines live after draining",
                    s.live_after_drain
                ));
            }
        }
        // Every decode machine the soak created reports exactly one terminal
        // phase; the counters must agree with what the soak created.
        if self.decode.terminal != self.decode.machines_created {
            p.push(format!(
                "decode created {} machines but counted {} terminal phases",
                self.decode.machines_created, self.decode.terminal
            ));
        }
        if !self.rss.rss_flat {
            p.push(format!(
                "RSS grew {} KiB after warm-up (threshold {} KiB)",
                self.rss.rss_growth_kib, self.rss.rss_threshold_kib
            ));
        }
        p
    }
}

/// Resident set size of this process, from `/proc/self/statm`.
pub(crate) fn rss_kib() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = s.split_whitespace().nth(1)?.parse().ok()?;
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    let page = if page > 0 { page as u64 } else { 4096 };
    Some(pages * page / 1024)
}

/// SplitMix64: a small seeded generator for the soak's plan (the binary
/// has no RNG dependency).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..=max`.
    fn upto(&mut self, max: u64) -> u64 {
        if max == u64::MAX {
            self.next()
        } else {
            self.next() % (max + 1)
        }
    }

    /// Uniform in `[0, 1)`.
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Where an abort comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Side {
    Decode,
    Prefill,
    Both,
}

/// A timed step of one request. `Abort` sorts before `Send` so an abort
/// planned for the send's instant comes before the KV is ready.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Action {
    Abort,
    Send,
}

/// One request in flight.
struct Live {
    slot: u64,
    started: Instant,
    sent_at: Option<Instant>,
    receivers: Vec<Receiver>,
    senders: Vec<Sender>,
    /// Decode / prefill ranks that have not reported a terminal phase, as
    /// bit masks (rank r is bit r).
    decode_wait: u64,
    prefill_wait: u64,
    all_ok: bool,
    any_expired: bool,
    outcome_counted: bool,
    abort: Option<(Side, bool)>,
    aborted: bool,
    refused: bool,
}

/// The soak's state between events.
struct Soak<'a> {
    o: &'a SoakOptions,
    c: &'a Cluster,
    rng: Rng,
    free: Vec<u64>,
    live: HashMap<u64, Live>,
    timers: BinaryHeap<std::cmp::Reverse<(Instant, Action, u64)>>,
    report: SoakReport,
    latencies: Latency,
    /// Moving average of send-to-decode-terminal time of successful
    /// requests: aborts "while moving" are spread over about this long.
    move_ewma: Duration,
    bytes_per_request: u64,
    next_tid: u64,
    /// Slots of refused requests, free again after the next collection.
    parked: Vec<u64>,
    /// Terminal notifications since the last [`Soak::collect`].
    terminals_since_collect: u64,
    /// Abort plans of the last [`RECENT_ABORTS_MAX`] aborted requests.
    recent_aborts: HashMap<u64, (Side, bool)>,
    recent_order: std::collections::VecDeque<u64>,
}

/// Aborted requests remembered after they finished (for [`StrayStats`]).
const RECENT_ABORTS_MAX: usize = 1 << 14;

impl Soak<'_> {
    fn blocks(&self, slot: u64) -> Vec<BlockId> {
        let b = u64::from(self.o.demo.blocks_per_request);
        (0..b).map(|i| BlockId((slot * b + i) as u32)).collect()
    }

    fn block_ids(&self, slot: u64) -> Vec<u32> {
        self.blocks(slot).into_iter().map(|b| b.0).collect()
    }

    /// Starts one request in `slot`: decode asks for the KV now, the
    /// prefill side's KV is ready after a random delay. False if a node
    /// refused it (back-pressure): the caller collects finished transfers
    /// and backs off before starting more.
    fn launch(&mut self, slot: u64, now: Instant) -> bool {
        self.next_tid += 1;
        let tid = self.next_tid;
        self.report.requests += 1;
        let ids = self.block_ids(slot);
        self.c.fill(TransferId(tid), &ids);
        let mut l = Live {
            slot,
            started: now,
            sent_at: None,
            receivers: Vec::with_capacity(self.c.decode.len()),
            senders: Vec::with_capacity(self.c.prefill.len()),
            decode_wait: 0,
            prefill_wait: 0,
            all_ok: true,
            any_expired: false,
            outcome_counted: false,
            abort: None,
            aborted: false,
            refused: false,
        };
        self.start_handles(tid, &mut l);
        if l.refused {
            self.undo_refused(tid, l);
            return false;
        }
        self.plan(tid, &mut l, now);
        self.live.insert(tid, l);
        true
    }

    /// Asks every decode rank for the KV, then opens a sender on every
    /// prefill rank; stops at the first refusal and sets `l.refused`.
    fn start_handles(&mut self, tid: u64, l: &mut Live) {
        let blocks = self.blocks(l.slot);
        for (i, r) in self.c.decode.iter().enumerate() {
            let started = r
                .node
                .receiver(TransferId(tid), &self.c.target)
                .and_then(|h| {
                    h.request_with_prefix(vec![blocks.clone()], vec![0])
                        .map(|()| h)
                });
            match started {
                Ok(h) => {
                    l.receivers.push(h);
                    l.decode_wait |= 1 << i;
                    self.report.decode.machines_created += 1;
                }
                Err(e) => {
                    Self::log_refusal(self.report.refused, tid, &e);
                    l.refused = true;
                    break;
                }
            }
        }
        if !l.refused {
            for (i, r) in self.c.prefill.iter().enumerate() {
                match r.node.sender(TransferId(tid)) {
                    Ok(h) => {
                        l.senders.push(h);
                        l.prefill_wait |= 1 << i;
                        self.report.prefill.machines_created += 1;
                    }
                    Err(e) => {
                        Self::log_refusal(self.report.refused, tid, &e);
                        l.refused = true;
                        break;
                    }
                }
            }
        }
    }

    /// A request a node refused: whatever started is aborted; the slot
    /// comes back once those ranks are terminal.
    fn undo_refused(&mut self, tid: u64, mut l: Live) {
        self.report.refused += 1;
        l.outcome_counted = true;
        Self::abort_handles(&mut self.report, &l, Side::Both);
        if l.decode_wait == 0 && l.prefill_wait == 0 {
            // Not free at once: relaunching in the same pass would spin
            // on a node that is still full.
            self.parked.push(l.slot);
        } else {
            self.live.insert(tid, l);
        }
    }

    /// The random plan of a started request: when its KV is ready on the
    /// prefill side and whether, when and from which side it is aborted.
    fn plan(&mut self, tid: u64, l: &mut Live, now: Instant) {
        let delay = Duration::from_micros(self.rng.upto(self.o.prefill_delay_us));
        let send_at = now + delay;
        self.timers
            .push(std::cmp::Reverse((send_at, Action::Send, tid)));
        if self.rng.unit() < self.o.abort_ratio {
            let side = match self.rng.upto(2) {
                0 => Side::Decode,
                1 => Side::Prefill,
                _ => Side::Both,
            };
            let early = self.rng.upto(1) == 0;
            let at = if early {
                // Strictly before the send (ties sort the abort first).
                now + Duration::from_nanos(self.rng.upto(delay.as_nanos() as u64))
            } else {
                let window = (self.move_ewma * 3 / 2)
                    .clamp(Duration::from_micros(50), Duration::from_secs(1));
                send_at + Duration::from_nanos(self.rng.upto(window.as_nanos() as u64))
            };
            l.abort = Some((side, early));
            self.timers
                .push(std::cmp::Reverse((at, Action::Abort, tid)));
        }
    }

    /// The first refusal is a warning, the rest are counted in `refused`.
    fn log_refusal(refused_before: u64, tid: u64, e: &kvferry::node::NodeError) {
        if refused_before == 0 {
            tracing::warn!(tid, error = %e, "a node refused a soak request; backing off");
        } else {
            tracing::debug!(tid, error = %e, "a node refused a soak request");
        }
    }

    /// What an engine does every scheduler step: collect the finished
    /// transfers (the node's executor keeps each finished transfer until it
    /// is collected, and refuses new ones once it holds its maximum).
    fn collect(&mut self) {
        for r in self.c.prefill.iter().chain(&self.c.decode) {
            let _ = r.node.get_finished();
            let _ = r.node.block_ids_with_load_errors();
        }
        self.free.append(&mut self.parked);
        self.terminals_since_collect = 0;
    }

    fn abort_handles(report: &mut SoakReport, l: &Live, side: Side) {
        let mut refused = 0;
        if matches!(side, Side::Decode | Side::Both) {
            refused += l.receivers.iter().filter(|h| h.abort().is_err()).count();
        }
        if matches!(side, Side::Prefill | Side::Both) {
            refused += l.senders.iter().filter(|h| h.abort().is_err()).count();
        }
        report.aborts.refused_calls += refused as u64;
    }

    fn fire(&mut self, action: Action, tid: u64, now: Instant) {
        let Some(l) = self.live.get_mut(&tid) else {
            if action == Action::Abort {
                self.report.aborts.too_late += 1;
            }
            return;
        };
        match action {
            Action::Send => {
                // An engine that aborted on the prefill side before the KV
                // was ready never hands it over.
                let cancelled =
                    l.aborted && matches!(l.abort, Some((Side::Prefill | Side::Both, _)));
                if cancelled {
                    return;
                }
                let blocks = {
                    let b = u64::from(self.o.demo.blocks_per_request);
                    (0..b)
                        .map(|i| BlockId((l.slot * b + i) as u32))
                        .collect::<Vec<_>>()
                };
                for h in &l.senders {
                    // Refusal after an abort is expected: the machine may
                    // already have ended on the peer's word.
                    if h.send(vec![blocks.clone()], true).is_err() && !l.aborted {
                        self.report.send_refused += 1;
                    }
                }
                l.sent_at = Some(now);
            }
            Action::Abort => {
                let Some((side, _)) = l.abort else {
                    return;
                };
                let a = &mut self.report.aborts;
                a.issued += 1;
                match side {
                    Side::Decode => a.decode_side += 1,
                    Side::Prefill => a.prefill_side += 1,
                    Side::Both => a.both_sides += 1,
                }
                if l.sent_at.is_none() {
                    a.before_kv += 1;
                } else if l.decode_wait == 0 {
                    a.too_late += 1;
                } else {
                    a.while_moving += 1;
                }
                l.aborted = true;
                Self::abort_handles(&mut self.report, l, side);
            }
        }
    }

    /// A terminal phase of `tid` on a rank.
    fn terminal(&mut self, decode: bool, rank: u32, tid: u64, phase: Phase, now: Instant) {
        self.terminals_since_collect += 1;
        if !self.rank_done(decode, rank, tid, phase) {
            self.stray(decode, tid, phase);
            return;
        }
        let Some(l) = self.live.get_mut(&tid) else {
            return;
        };
        let count = l.decode_wait == 0 && !l.outcome_counted;
        if count {
            l.outcome_counted = true;
        }
        let done = l.decode_wait == 0 && l.prefill_wait == 0;
        if count {
            self.count_outcome(tid, now);
        }
        if done {
            self.retire(tid);
        }
    }

    /// Marks `rank` of `tid` terminal; false if that rank was not awaited
    /// (a stray notification).
    fn rank_done(&mut self, decode: bool, rank: u32, tid: u64, phase: Phase) -> bool {
        let Some(l) = self.live.get_mut(&tid) else {
            return false;
        };
        let bit = 1u64 << rank.min(63);
        if decode {
            if l.decode_wait & bit == 0 {
                return false;
            }
            l.decode_wait &= !bit;
            match phase {
                Phase::Success => {}
                Phase::Expired => {
                    l.all_ok = false;
                    l.any_expired = true;
                }
                Phase::Failed(_) => l.all_ok = false,
                Phase::Bootstrapping | Phase::WaitingForInput | Phase::Transferring => {}
            }
        } else {
            if l.prefill_wait & bit == 0 {
                return false;
            }
            l.prefill_wait &= !bit;
            if let (Phase::Expired, Some((side, early)), true) = (phase, l.abort, l.aborted) {
                self.report.aborts.prefill_expired_by_plan.bump(side, early);
            }
        }
        true
    }

    /// Counts the outcome of `tid` once every decode rank is terminal;
    /// verifies every byte of a success.
    fn count_outcome(&mut self, tid: u64, now: Instant) {
        let Some(l) = self.live.get(&tid) else {
            return;
        };
        let r = &mut self.report;
        if l.all_ok {
            r.ok += 1;
            if l.aborted {
                r.aborts.ended_ok += 1;
            }
            r.bytes += self.bytes_per_request;
            self.latencies.record(now - l.started);
            if let Some(sent) = l.sent_at {
                let d = now.saturating_duration_since(sent);
                self.move_ewma = (self.move_ewma * 7 + d) / 8;
            }
            let b = u64::from(self.o.demo.blocks_per_request);
            let ids: Vec<u32> = (0..b).map(|i| (l.slot * b + i) as u32).collect();
            if self.c.verify(TransferId(tid), &ids, 0) > 0 {
                r.verify_errors += 1;
            }
        } else if l.aborted {
            r.aborted += 1;
            if l.any_expired {
                r.aborts.ended_expired += 1;
                if let Some((side, early)) = l.abort {
                    r.aborts.ended_expired_by_plan.bump(side, early);
                }
            }
        } else if l.any_expired {
            r.expired += 1;
        } else {
            r.failed += 1;
        }
    }

    /// Every rank of `tid` is terminal: its slot is free again.
    fn retire(&mut self, tid: u64) {
        let Some(l) = self.live.remove(&tid) else {
            return;
        };
        self.free.push(l.slot);
        if let Some(plan) = l.abort.filter(|_| l.aborted) {
            // Remembered (bounded) so a stray notification that comes
            // later can be attributed to its abort plan.
            if self.recent_aborts.len() >= RECENT_ABORTS_MAX {
                if let Some(old) = self.recent_order.pop_front() {
                    self.recent_aborts.remove(&old);
                }
            }
            self.recent_aborts.insert(tid, plan);
            self.recent_order.push_back(tid);
        }
    }

    fn stray(&mut self, decode: bool, tid: u64, phase: Phase) {
        let r = &mut self.report;
        r.stray_notifications += 1;
        if decode {
            r.stray.decode += 1;
        } else {
            r.stray.prefill += 1;
        }
        if phase == Phase::Expired {
            r.stray.expired += 1;
        }
        match self.recent_aborts.get(&tid) {
            Some(&(side, early)) => r.stray.by_plan.bump(side, early),
            None => r.stray.not_aborted += 1,
        }
    }

    /// Terminal phases that no notification brought (the node's notify
    /// channel drops when full): asks every rank still awaited.
    fn reconcile(&mut self, now: Instant) {
        let mut found = Vec::new();
        for (&tid, l) in &self.live {
            for (i, r) in self.c.decode.iter().enumerate() {
                if l.decode_wait & (1 << i) != 0 {
                    if let Some(p) = r.node.phase(TransferId(tid)).filter(Phase::is_terminal) {
                        found.push((true, i as u32, tid, p));
                    }
                }
            }
            for (i, r) in self.c.prefill.iter().enumerate() {
                if l.prefill_wait & (1 << i) != 0 {
                    if let Some(p) = r.node.phase(TransferId(tid)).filter(Phase::is_terminal) {
                        found.push((false, i as u32, tid, p));
                    }
                }
            }
        }
        self.report.missed_notifications += found.len() as u64;
        for (decode, rank, tid, p) in found {
            self.terminal(decode, rank, tid, p, now);
        }
    }
}

/// Collected every 256 terminal phases or every 5 ms, like an engine's
/// scheduler steps; a refusal also backs new requests off for 1 ms.
const COLLECT_EVERY: Duration = Duration::from_millis(5);

/// Requests that had reached a terminal outcome.
fn completed(r: &SoakReport) -> u64 {
    r.ok + r.failed + r.aborted + r.expired + r.refused
}

/// When the soak loop next collects, launches and samples, and when it
/// stops.
struct Schedule {
    started: Instant,
    load_end: Instant,
    /// Every request is terminal within its deadlines plus the fence; past
    /// this, what is still live is reported, not waited for.
    drain_limit: Duration,
    /// Set when the load stops: the end of the drain.
    drain_end: Option<Instant>,
    next_sample: Instant,
    last_event: Instant,
    next_collect: Instant,
    backoff_until: Instant,
    samples: Vec<RssSample>,
}

impl Schedule {
    fn new(o: &SoakOptions) -> Self {
        let samples = Vec::with_capacity(o.duration.as_secs() as usize + 64);
        let started = Instant::now();
        Schedule {
            started,
            load_end: started + o.duration,
            drain_limit: Duration::from_millis(o.demo.timeout_ms) * 4 + Duration::from_secs(30),
            drain_end: None,
            next_sample: started,
            last_event: started,
            next_collect: started,
            backoff_until: started,
            samples,
        }
    }
}

impl<'a> Soak<'a> {
    fn new(o: &'a SoakOptions, c: &'a Cluster) -> Self {
        let slots = o.demo.concurrency;
        let bytes_per_request = c
            .decode
            .iter()
            .map(|r| r.kv.block_bytes() * u64::from(o.demo.blocks_per_request))
            .sum();
        Soak {
            o,
            c,
            rng: Rng(o.seed),
            free: (0..slots).rev().collect(),
            live: HashMap::with_capacity(slots as usize),
            timers: BinaryHeap::with_capacity(2 * slots as usize),
            report: SoakReport {
                seconds: o.duration.as_secs_f64(),
                concurrency: o.demo.concurrency,
                abort_ratio: o.abort_ratio,
                seed: o.seed,
                ..SoakReport::default()
            },
            latencies: Latency::new(),
            move_ewma: Duration::from_millis(1),
            bytes_per_request,
            next_tid: 0,
            parked: Vec::new(),
            terminals_since_collect: 0,
            recent_aborts: HashMap::with_capacity(RECENT_ABORTS_MAX),
            recent_order: std::collections::VecDeque::with_capacity(RECENT_ABORTS_MAX),
        }
    }

    /// The load, then the drain: until nothing is live or the drain limit
    /// passed.
    fn run(&mut self, t: &mut Schedule, progress: bool) -> Result<(), String> {
        loop {
            self.step(t, Instant::now(), progress);
            let handled = self.take_queued();
            let now = Instant::now();
            if handled {
                t.last_event = now;
                continue;
            }
            if let Some(end) = t.drain_end {
                if self.live.is_empty() || now >= end {
                    return Ok(());
                }
                if now.duration_since(t.last_event) > Duration::from_secs(1) {
                    self.reconcile(now);
                    t.last_event = now;
                    continue;
                }
            }
            self.wait(t)?;
        }
    }

    /// What is due at `now`: the end of the load, a collection, new
    /// requests, the timers that passed, an RSS sample.
    fn step(&mut self, t: &mut Schedule, now: Instant, progress: bool) {
        if t.drain_end.is_none() && now >= t.load_end {
            t.drain_end = Some(now + t.drain_limit);
            self.report.elapsed_s = now.duration_since(t.started).as_secs_f64();
        }
        if self.terminals_since_collect >= 256 || now >= t.next_collect {
            self.collect();
            t.next_collect = now + COLLECT_EVERY;
        }
        if t.drain_end.is_none() && now >= t.backoff_until {
            while let Some(slot) = self.free.pop() {
                if !self.launch(slot, now) {
                    t.backoff_until = now + Duration::from_millis(1);
                    t.next_collect = now;
                    break;
                }
            }
        }
        while let Some(std::cmp::Reverse((at, action, tid))) = self.timers.peek().copied() {
            if at > now {
                break;
            }
            self.timers.pop();
            self.fire(action, tid, now);
        }
        if now >= t.next_sample {
            t.next_sample += Duration::from_secs(1);
            self.sample(t, now, progress);
        }
    }

    /// Once a second: an RSS sample and, with `progress`, the status line.
    fn sample(&self, t: &mut Schedule, now: Instant, progress: bool) {
        if let Some(rss) = rss_kib() {
            t.samples.push(RssSample {
                t_s: now.duration_since(t.started).as_secs_f64(),
                rss_kib: rss,
                completed: completed(&self.report),
            });
        }
        if progress {
            let r = &self.report;
            eprint!(
                "\r{:>5.0} s  in flight {:>5}  ok {}  aborted {}  failed {}  expired {}  rss {} KiB   ",
                now.duration_since(t.started).as_secs_f64(),
                self.live.len(),
                r.ok,
                r.aborted,
                r.failed,
                r.expired,
                t.samples.last().map_or(0, |x| x.rss_kib)
            );
            let _ = std::io::stderr().flush();
        }
    }

    /// Handles the terminal phases already queued; true if there was one.
    fn take_queued(&mut self) -> bool {
        let mut handled = false;
        let queued = (self.c.decode_events.try_iter().map(|e| (true, e)))
            .chain(self.c.prefill_events.try_iter().map(|e| (false, e)));
        let finished: Vec<_> = queued
            .filter_map(|(d, e)| Some((d, e.tag, e.transfer_id, e.finished()?)))
            .collect();
        for (decode, rank, tid, p) in finished {
            self.terminal(decode, rank, tid.0, p, Instant::now());
            handled = true;
        }
        handled
    }

    /// Waits for a terminal phase, at most until the next thing due.
    fn wait(&mut self, t: &mut Schedule) -> Result<(), String> {
        let mut wake = t.next_sample.min(t.next_collect);
        if t.drain_end.is_none() && !self.free.is_empty() {
            wake = wake.min(t.backoff_until);
        }
        if let Some(std::cmp::Reverse((at, _, _))) = self.timers.peek() {
            wake = wake.min(*at);
        }
        match t.drain_end {
            None => wake = wake.min(t.load_end),
            Some(end) => {
                wake = wake
                    .min(end)
                    .min(t.last_event + Duration::from_millis(1100))
            }
        }
        let c = self.c;
        let event = flume::Selector::new()
            .recv(&c.decode_events, |r| r.map(|e| (true, e)))
            .recv(&c.prefill_events, |r| r.map(|e| (false, e)))
            .wait_deadline(wake);
        match event {
            Ok(Ok((decode, e))) => {
                // Not a terminal phase: a prefill rank heard of a request
                // before its sender (the soak starts both sides itself).
                let Some(p) = e.finished() else {
                    return Ok(());
                };
                let now = Instant::now();
                self.terminal(decode, e.tag, e.transfer_id.0, p, now);
                t.last_event = now;
            }
            Ok(Err(_)) => return Err("node notification channel closed".into()),
            Err(_) => {}
        }
        Ok(())
    }

    /// The report once the drain ended at `end`.
    fn finish(self, mut t: Schedule, end: Instant) -> SoakReport {
        let o = self.o;
        let load_s = o.duration.as_secs_f64();
        let warmup_s = o
            .warmup_s
            .unwrap_or((load_s * WARMUP_FRACTION).max(1.0))
            .min(load_s);
        let mut report = self.report;
        report.drain_s = end.duration_since(t.started).as_secs_f64() - report.elapsed_s;
        report.non_terminal = self.live.len() as u64;
        report.blocks_outstanding =
            (o.demo.concurrency - self.free.len() as u64) * u64::from(o.demo.blocks_per_request);
        report.requests_per_s = report.ok as f64 / report.elapsed_s.max(1e-9);
        report.gbps = report.bytes as f64 / report.elapsed_s.max(1e-9) / 1e9;
        report.p50_ms = self.latencies.quantile(0.50).as_secs_f64() * 1e3;
        report.p99_ms = self.latencies.quantile(0.99).as_secs_f64() * 1e3;
        count_nodes(&mut report, self.c, self.next_tid);
        if let Some(rss) = rss_kib() {
            t.samples.push(RssSample {
                t_s: Instant::now().duration_since(t.started).as_secs_f64(),
                rss_kib: rss,
                completed: completed(&report),
            });
        }
        report.warmup_s = warmup_s;
        report.rss = rss_verdict(&t.samples, warmup_s, load_s);
        report.rss_samples = t.samples;
        report
    }
}

/// The nodes' counters, and the machines still live on them: the node
/// exposes no count of live machines, so ask for the phase of every
/// transfer id the soak used (a live machine is on the executor's board,
/// hence found).
fn count_nodes(report: &mut SoakReport, c: &Cluster, last_tid: u64) {
    for (stats, ranks) in [
        (&mut report.prefill, &c.prefill),
        (&mut report.decode, &c.decode),
    ] {
        for r in ranks {
            stats.add(&r.node.stats());
            stats.live_after_drain += (1..=last_tid)
                .filter(|&t| {
                    r.node
                        .phase(TransferId(t))
                        .is_some_and(|p| !p.is_terminal())
                })
                .count() as u64;
        }
    }
}

/// Runs the soak. `progress` draws a status line on stderr.
pub(crate) fn run_soak(o: &SoakOptions, progress: bool) -> Result<SoakReport, String> {
    if o.demo.prefill_tp > 64 || o.demo.decode_tp > 64 {
        return Err("the soak tracks at most 64 ranks per side".into());
    }
    let spec = cluster_spec(&o.demo, o.demo.concurrency)?;
    let c = Cluster::start(&spec).map_err(|e| e.to_string())?;
    let mut s = Soak::new(o, &c);
    let mut t = Schedule::new(o);
    s.run(&mut t, progress)?;
    s.collect();
    let end = Instant::now();
    if progress {
        eprintln!();
    }
    Ok(s.finish(t, end))
}

/// The soak's settings from the command line.
fn options(shape: &ShapeArgs, s: &SoakArgs) -> Result<SoakOptions, UsageError> {
    let d = SoakOptions::default();
    let seconds = s.soak.unwrap_or(d.duration.as_secs_f64());
    let demo = shape.apply(soak_shape());
    if demo.concurrency > 1_000_000 {
        return Err(UsageError("--concurrency: at most 1000000".into()));
    }
    if let Some(w) = s.warmup_s {
        if !(w.is_finite() && w >= 0.0 && w < seconds) {
            return Err(UsageError(
                "--warmup-s: expected seconds in [0, SECONDS)".into(),
            ));
        }
    }
    Ok(SoakOptions {
        demo,
        duration: Duration::from_secs_f64(seconds),
        abort_ratio: s.abort_ratio.unwrap_or(d.abort_ratio),
        // Printed in the report, so a run's plan can be repeated.
        seed: s.seed.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |t| t.as_nanos() as u64)
        }),
        prefill_delay_us: s.prefill_delay_us.unwrap_or(d.prefill_delay_us),
        warmup_s: s.warmup_s,
    })
}

/// `kvferry demo --soak SECONDS ...`: the demo's `shape`, the soak's
/// options `s`, one JSON object with `json`.
pub(crate) fn main(shape: &ShapeArgs, s: &SoakArgs, json: bool) -> ExitCode {
    let o = match options(shape, s) {
        Ok(o) => o,
        Err(e) => return usage_error("kvferry demo --soak", &e.0),
    };
    let progress = !json && std::io::stderr().is_terminal();
    let report = match run_soak(&o, progress) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("kvferry demo --soak: {e}");
            return ExitCode::from(1);
        }
    };
    let problems = report.problems();
    if json {
        println!("{}", serde_json::to_string(&report).unwrap_or_default());
    } else {
        print_report(&report);
    }
    for p in &problems {
        eprintln!("kvferry demo --soak: FAILED: {p}");
    }
    if problems.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

fn print_report(r: &SoakReport) {
    let v = &r.rss;
    println!(
        "soak {:.0} s, {} in flight, seed {}: {} requests, ok {} aborted {} failed {} expired {} refused {}\n\
         verify_errors {} non_terminal {} blocks_outstanding {} live machines P {} D {}\n\
         aborts {} (decode {} prefill {} both {}; before KV {} while moving {} too late {})\n\
         {:.0} requests/s, {:.3} GB/s, latency p50 {:.3} ms p99 {:.3} ms, drain {:.3} s\n\
         RSS start {} KiB, after warm-up {} KiB, max {} KiB, end {} KiB; growth {} KiB \
         (threshold {} KiB), slope {:.3} KiB/1000 requests: rss_flat {}",
        r.seconds,
        r.concurrency,
        r.seed,
        r.requests,
        r.ok,
        r.aborted,
        r.failed,
        r.expired,
        r.refused,
        r.verify_errors,
        r.non_terminal,
        r.blocks_outstanding,
        r.prefill.live_after_drain,
        r.decode.live_after_drain,
        r.aborts.issued,
        r.aborts.decode_side,
        r.aborts.prefill_side,
        r.aborts.both_sides,
        r.aborts.before_kv,
        r.aborts.while_moving,
        r.aborts.too_late,
        r.requests_per_s,
        r.gbps,
        r.p50_ms,
        r.p99_ms,
        r.drain_s,
        v.rss_start_kib,
        v.rss_warmup_kib,
        v.rss_max_kib,
        v.rss_end_kib,
        v.rss_growth_kib,
        v.rss_threshold_kib,
        v.rss_slope_kib_per_1000_requests,
        v.rss_flat
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn series(leak_kib_per_1000: f64) -> Vec<RssSample> {
        // 60 s at 10 000 requests/s on a 200 MiB base, with ±2 MiB of
        // allocator noise that a flat process shows.
        (0..=60)
            .map(|t| {
                let completed = t * 10_000;
                let noise = if t % 2 == 0 { 2048.0 } else { -2048.0 };
                let rss = 204_800.0 + noise + leak_kib_per_1000 * completed as f64 / 1000.0;
                RssSample {
                    t_s: t as f64,
                    rss_kib: rss as u64,
                    completed,
                }
            })
            .collect()
    }

    #[test]
    fn flat_series_passes_and_a_leak_fails() {
        let flat = rss_verdict(&series(0.0), 6.0, 60.0);
        assert!(flat.rss_flat, "{flat:?}");
        assert!(flat.rss_slope_kib_per_1000_requests.abs() < 0.1, "{flat:?}");
        assert_eq!(flat.rss_warmup_kib, 204_800 + 2048);
        assert_eq!(flat.steady_requests, 540_000);
        // 100 bytes per request over 540 000 steady requests is ~52 MiB.
        let leak = rss_verdict(&series(100.0 * 1000.0 / 1024.0), 6.0, 60.0);
        assert!(!leak.rss_flat, "{leak:?}");
        let slope = leak.rss_slope_kib_per_1000_requests;
        assert!((slope - 97.66).abs() < 0.5, "{slope}");
        // The threshold is 5 % of the warm RSS here (over the 8 MiB floor).
        assert_eq!(leak.rss_warmup_kib, 204_800 + 2048 + 5859);
        assert_eq!(
            leak.rss_threshold_kib,
            (leak.rss_warmup_kib as f64 * 0.05) as u64
        );
    }

    #[test]
    fn drain_samples_count_for_max_not_slope() {
        let mut s = series(0.0);
        s.push(RssSample {
            t_s: 75.0,
            rss_kib: 204_800 + 64 * 1024,
            completed: 600_000,
        });
        let v = rss_verdict(&s, 6.0, 60.0);
        assert!(!v.rss_flat, "a jump while draining must count: {v:?}");
        assert_eq!(v.rss_end_kib, 204_800 + 64 * 1024);
        assert!(v.rss_slope_kib_per_1000_requests.abs() < 0.1, "{v:?}");
    }

    #[test]
    fn rss_is_readable() {
        assert!(rss_kib().is_some_and(|k| k > 0));
    }
}
