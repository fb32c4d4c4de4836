//! Node-wide counters, rendered as Prometheus text by `GET /metrics`.
//!
//! Every field is an independent relaxed atomic: the counters are only ever
//! read for reporting, no decision depends on two of them being consistent
//! with each other, so no stronger ordering is needed and updating them from
//! any executor costs one uncontended atomic add.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

/// Upper bounds (seconds) of the transfer latency histogram buckets. Fixed so
/// that histograms from different nodes and runs can be summed.
pub const LATENCY_BUCKETS_S: [f64; 16] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0,
];

/// How one transfer ended, from the point of view of the node counting it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Outcome {
    Ok,
    Failed,
    Expired,
    Aborted,
}

impl Outcome {
    /// Every outcome, in the order they are rendered.
    pub const ALL: [Outcome; 4] = [
        Outcome::Ok,
        Outcome::Failed,
        Outcome::Expired,
        Outcome::Aborted,
    ];

    /// The `outcome` label value.
    pub fn label(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Failed => "failed",
            Outcome::Expired => "expired",
            Outcome::Aborted => "aborted",
        }
    }

    fn index(self) -> usize {
        match self {
            Outcome::Ok => 0,
            Outcome::Failed => 1,
            Outcome::Expired => 2,
            Outcome::Aborted => 3,
        }
    }
}

/// Shared counters. Create one per node, wrap it in an `Arc`, hand it to the
/// bootstrap server, the side channel and the executors.
#[derive(Debug, Default)]
pub struct Metrics {
    transfers: [AtomicU64; 4],
    bytes: AtomicU64,
    descriptors: AtomicU64,
    /// Non-cumulative bucket counts; the last slot is `+Inf`.
    latency_buckets: [AtomicU64; LATENCY_BUCKETS_S.len() + 1],
    latency_sum_us: AtomicU64,
    expired_holds: AtomicU64,
    peers_marked_dead: AtomicU64,
    sidechannel_received: AtomicU64,
    sidechannel_sent: AtomicU64,
    sidechannel_decode_errors: AtomicU64,
    sidechannel_send_failures: AtomicU64,
}

/// A copy of every counter at one moment (each read individually).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MetricsSnapshot {
    /// Indexed like [`Outcome::ALL`].
    pub transfers: [u64; 4],
    pub bytes: u64,
    pub descriptors: u64,
    /// Non-cumulative counts per bucket of [`LATENCY_BUCKETS_S`], then `+Inf`.
    pub latency_buckets: [u64; LATENCY_BUCKETS_S.len() + 1],
    pub latency_sum_us: u64,
    pub expired_holds: u64,
    pub peers_marked_dead: u64,
    pub sidechannel_received: u64,
    pub sidechannel_sent: u64,
    pub sidechannel_decode_errors: u64,
    pub sidechannel_send_failures: u64,
}

impl MetricsSnapshot {
    /// Transfers that ended with `outcome`.
    pub fn transfers(&self, outcome: Outcome) -> u64 {
        self.transfers[outcome.index()]
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        Metrics::default()
    }

    /// Counts one finished transfer. The latency lands in the histogram only
    /// for `Outcome::Ok`: failed and expired transfers end at deadlines, and
    /// mixing them in would hide the latency of the transfers that worked.
    pub fn record_transfer(&self, outcome: Outcome, latency: Duration) {
        self.transfers[outcome.index()].fetch_add(1, Relaxed);
        if outcome == Outcome::Ok {
            let secs = latency.as_secs_f64();
            let bucket = LATENCY_BUCKETS_S
                .iter()
                .position(|&le| secs <= le)
                .unwrap_or(LATENCY_BUCKETS_S.len());
            self.latency_buckets[bucket].fetch_add(1, Relaxed);
            let us = u64::try_from(latency.as_micros()).unwrap_or(u64::MAX);
            self.latency_sum_us.fetch_add(us, Relaxed);
        }
    }

    /// Bytes moved by the data plane.
    pub fn add_bytes(&self, bytes: u64) {
        self.bytes.fetch_add(bytes, Relaxed);
    }

    /// Transfer descriptors posted to the data plane.
    pub fn add_descriptors(&self, count: u64) {
        self.descriptors.fetch_add(count, Relaxed);
    }

    /// P released blocks because their claim or lease ran out (D never
    /// came, or went silent), rather than on D's word.
    pub fn record_expired_hold(&self) {
        self.expired_holds.fetch_add(1, Relaxed);
    }

    /// A peer missed its heartbeats or dropped its connection.
    pub fn record_peer_marked_dead(&self) {
        self.peers_marked_dead.fetch_add(1, Relaxed);
    }

    /// One side-channel message decoded and delivered.
    pub fn record_sidechannel_received(&self) {
        self.sidechannel_received.fetch_add(1, Relaxed);
    }

    /// One side-channel message handed to ZeroMQ.
    pub fn record_sidechannel_sent(&self) {
        self.sidechannel_sent.fetch_add(1, Relaxed);
    }

    /// One side-channel frame rejected by the decoder (or with a bad shape).
    pub fn record_sidechannel_decode_error(&self) {
        self.sidechannel_decode_errors.fetch_add(1, Relaxed);
    }

    /// One outgoing side-channel message that could not be sent.
    pub fn record_sidechannel_send_failure(&self) {
        self.sidechannel_send_failures.fetch_add(1, Relaxed);
    }

    /// Reads every counter.
    pub fn snapshot(&self) -> MetricsSnapshot {
        MetricsSnapshot {
            transfers: std::array::from_fn(|i| self.transfers[i].load(Relaxed)),
            bytes: self.bytes.load(Relaxed),
            descriptors: self.descriptors.load(Relaxed),
            latency_buckets: std::array::from_fn(|i| self.latency_buckets[i].load(Relaxed)),
            latency_sum_us: self.latency_sum_us.load(Relaxed),
            expired_holds: self.expired_holds.load(Relaxed),
            peers_marked_dead: self.peers_marked_dead.load(Relaxed),
            sidechannel_received: self.sidechannel_received.load(Relaxed),
            sidechannel_sent: self.sidechannel_sent.load(Relaxed),
            sidechannel_decode_errors: self.sidechannel_decode_errors.load(Relaxed),
            sidechannel_send_failures: self.sidechannel_send_failures.load(Relaxed),
        }
    }

    /// Prometheus text exposition format, version 0.0.4.
    pub fn render_prometheus(&self) -> String {
        let s = self.snapshot();
        let mut out = String::with_capacity(4096);
        // Writing to a String cannot fail.
        let w = &mut out;
        let _ = writeln!(
            w,
            "# HELP kvferry_transfers_total Transfers finished, by outcome."
        );
        let _ = writeln!(w, "# TYPE kvferry_transfers_total counter");
        for outcome in Outcome::ALL {
            let _ = writeln!(
                w,
                "kvferry_transfers_total{{outcome=\"{}\"}} {}",
                outcome.label(),
                s.transfers(outcome)
            );
        }
        counter(
            w,
            "kvferry_transfer_bytes_total",
            "Bytes moved by the data plane.",
            s.bytes,
        );
        counter(
            w,
            "kvferry_transfer_descriptors_total",
            "Descriptors posted to the data plane.",
            s.descriptors,
        );

        let name = "kvferry_transfer_duration_seconds";
        let _ = writeln!(
            w,
            "# HELP {name} Latency of successful transfers, request to completion."
        );
        let _ = writeln!(w, "# TYPE {name} histogram");
        let mut cumulative = 0u64;
        for (i, le) in LATENCY_BUCKETS_S.iter().enumerate() {
            cumulative += s.latency_buckets[i];
            let _ = writeln!(w, "{name}_bucket{{le=\"{le}\"}} {cumulative}");
        }
        cumulative += s.latency_buckets[LATENCY_BUCKETS_S.len()];
        let _ = writeln!(w, "{name}_bucket{{le=\"+Inf\"}} {cumulative}");
        let _ = writeln!(w, "{name}_sum {}", s.latency_sum_us as f64 / 1e6);
        let _ = writeln!(w, "{name}_count {cumulative}");

        counter(
            w,
            "kvferry_expired_holds_total",
            "Block holds released because a claim or lease ran out.",
            s.expired_holds,
        );
        counter(
            w,
            "kvferry_peers_marked_dead_total",
            "Peers marked dead after missed heartbeats or a dropped connection.",
            s.peers_marked_dead,
        );
        counter(
            w,
            "kvferry_sidechannel_received_total",
            "Side-channel messages received and decoded.",
            s.sidechannel_received,
        );
        counter(
            w,
            "kvferry_sidechannel_sent_total",
            "Side-channel messages sent.",
            s.sidechannel_sent,
        );
        counter(
            w,
            "kvferry_sidechannel_decode_errors_total",
            "Side-channel frames rejected by the decoder.",
            s.sidechannel_decode_errors,
        );
        counter(
            w,
            "kvferry_sidechannel_send_failures_total",
            "Side-channel messages that could not be sent.",
            s.sidechannel_send_failures,
        );
        out
    }
}

fn counter(w: &mut String, name: &str, help: &str, value: u64) {
    let _ = writeln!(w, "# HELP {name} {help}");
    let _ = writeln!(w, "# TYPE {name} counter");
    let _ = writeln!(w, "{name} {value}");
}
