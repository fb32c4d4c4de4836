//! The node's one set of counters, and its two views: [`NodeStats`] (a
//! snapshot for the embedder) and the Prometheus exposition of `/metrics`
//! (rendered from the same counters at scrape time, through
//! `prometheus-client`'s encoder). Every counter is declared once, in
//! `kvferry_metrics::counter_set!`, the store server's macro too: its
//! field, its metric family and its help text.
//!
//! Every field is an independent relaxed atomic: the counters are only read
//! for reporting, no decision depends on two of them being consistent with
//! each other, and updating one from any thread costs one uncontended add.

pub use kvferry_metrics::http::MetricsServer;
pub use kvferry_metrics::{Latency, LATENCY_BUCKETS_S};

use kvferry_reactor::lock;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvferry_metrics::Family;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::MetricType;

use kvferry_machines::{FailReason, Phase};

/// The outcome counters share one family, labelled by outcome.
const TRANSFERS: &str = "kvferry_transfers";
const TRANSFERS_HELP: &str = "Requests finished, by outcome.";

kvferry_metrics::counter_set! {
    /// The node's counters, one set per node.
    #[derive(Debug, Default)]
    pub(crate) struct CounterSet;
    /// A snapshot of the node's counters (each read individually).
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
    pub struct NodeStats;
    /// Requests that ended in `Success`.
    ok: Counter "kvferry_transfers", "Requests finished, by outcome.";
    /// Requests that ended in `Failed` (aborts included).
    failed: Counter "kvferry_transfers", "Requests finished, by outcome.";
    /// Of `failed`, those ended by an abort (local or the peer's).
    aborted: Counter "kvferry_transfers", "Requests finished, by outcome.";
    /// Requests that ended in `Expired`.
    expired: Counter "kvferry_transfers", "Requests finished, by outcome.";
    /// Peers marked dead now (not cumulative).
    dead_now: Gauge "kvferry_peers_dead", "Peers marked dead now.";
    /// Payload bytes this node moved (writes it posted or reads it made).
    bytes: Counter "kvferry_transfer_bytes", "Payload bytes moved by the data plane.";
    /// Of `bytes`, those copied straight through a peer's shared memory
    /// or its device memory opened by IPC handle (a peer on this host,
    /// `TransportKind::Auto` or `Shm`).
    shm_bytes: Counter "kvferry_transfer_shm_bytes",
        "Payload bytes copied through a peer's shared memory.";
    /// Descriptors posted.
    descriptors: Counter "kvferry_transfer_descriptors", "Descriptors posted to the data plane.";
    /// Batches that failed in the transport.
    transport_errors: Counter "kvferry_transport_errors", "Data-plane batches that failed.";
    /// Times a peer was marked dead.
    peers_marked_dead: Counter "kvferry_peers_marked_dead",
        "Peers marked dead after missed heartbeats or a dropped connection.";
    /// Times a peer marked dead answered again and its mark was cleared.
    peer_recoveries: Counter "kvferry_peer_recoveries",
        "Peers marked dead whose mark a later frame from them cleared.";
    /// Prefill: requests whose blocks were released because decode's claim
    /// or lease ran out (decode never came, or went silent).
    expired_holds: Counter "kvferry_expired_holds",
        "Block holds released because a claim or lease ran out.";
    /// Side-channel frames decoded and handled.
    sidechannel_received: Counter "kvferry_sidechannel_received",
        "Side-channel frames received and decoded.";
    /// Side-channel frames handed to ZeroMQ.
    sidechannel_sent: Counter "kvferry_sidechannel_sent", "Side-channel frames sent.";
    /// Side-channel frames rejected by the decoder.
    bad_frames: Counter "kvferry_sidechannel_decode_errors",
        "Side-channel frames rejected by the decoder.";
    /// Side-channel frames not sent: a queue was full, or the peer's slot
    /// is gone.
    dropped_frames: Counter "kvferry_sidechannel_send_failures",
        "Side-channel frames that could not be sent.";
    /// Times a configured limit of the node (see `NodeConfig`) refused or
    /// dropped something; each is also logged with the limit's name.
    limit_hits: Counter "kvferry_limit_hits", "Times a configured limit refused or dropped something.";
    /// Side-channel messages this node sent over a data-plane session
    /// instead of ZeroMQ (the peer took them).
    data_plane_messages: Counter "kvferry_data_plane_messages",
        "Side-channel messages sent over a data-plane session.";
    /// Messages that were to go over the data plane but went over ZeroMQ
    /// after all (the peer refused them, or the session failed).
    data_plane_fallbacks: Counter "kvferry_data_plane_fallbacks",
        "Messages meant for the data plane that went over ZeroMQ after all.";
    /// Push mode: closing `Status` messages that rode behind their
    /// transfer's last write (also counted in `data_plane_messages`).
    statuses_behind_writes: Counter "kvferry_statuses_behind_writes",
        "Closing statuses that rode behind their transfer's last write.";
    /// Control messages the machines sent again because the answer they
    /// wait for may have been lost (`Timeouts::resend_after`), by channel:
    /// the side channel (ZeroMQ; this includes the second `Unneeded` each
    /// unpaired prefill rank is told when its request ends) ...
    resent_sidechannel: Counter "kvferry_control_resent_sidechannel",
        "Control messages resent over the side channel.";
    /// ... and a data-plane session. (A write's status trailer carries only
    /// a first `Status`, never a resent one.)
    resent_data_plane: Counter "kvferry_control_resent_data_plane",
        "Control messages resent over a data-plane session.";
    /// Answers to a message for a transfer that had ended here (or was
    /// unknown): its last words again after a success, else an `Abort`.
    late_answers: Counter "kvferry_late_answers",
        "Messages for ended or unknown transfers answered.";
    /// Fault injection (`NodeConfig::drop_control_ppm`): control messages
    /// dropped instead of sent, by channel: the side channel ...
    dropped_sidechannel: Counter "kvferry_control_dropped_sidechannel",
        "Control messages dropped by fault injection on the side channel.";
    /// ... a data-plane notification ...
    dropped_data_plane: Counter "kvferry_control_dropped_data_plane",
        "Control messages dropped by fault injection on a data-plane session.";
    /// ... and a write's status trailer.
    dropped_trailer: Counter "kvferry_control_dropped_trailer",
        "Closing statuses dropped by fault injection from behind their write.";
    /// String request ids refused because another request id holds their
    /// transfer id (the hashes collide): opened here, named by a decode
    /// rank's `Pull`, or refused by the prefill rank asked.
    id_collisions: Counter "kvferry_id_collisions",
        "Request ids refused because another request id holds their transfer id.";
    /// Frames of another protocol version this node refused (answered with
    /// a `Refuse`).
    version_refusals_sent: Counter "kvferry_version_refusals_sent",
        "Frames of another protocol version refused.";
    /// `Refuse` frames this node received: a peer of another protocol
    /// version will not read its frames.
    version_refusals_received: Counter "kvferry_version_refusals_received",
        "Refusals received from peers of another protocol version.";
}

/// The node's counter set and the latency histogram of its successes.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    set: CounterSet,
    latency: Mutex<Latency>,
    /// Refusals of unauthenticated peers, shared with the embedded
    /// bootstrap service.
    pub(crate) auth: Arc<kvferry_auth::Rejects>,
}

/// Every counter of the set reads as a field of the node's counters.
impl std::ops::Deref for Counters {
    type Target = CounterSet;
    fn deref(&self) -> &CounterSet {
        &self.set
    }
}

impl Counters {
    /// Reads every counter.
    pub(crate) fn snapshot(&self) -> NodeStats {
        self.set.load()
    }

    /// Counts a request that reached `phase`, which took `latency` from its
    /// first report. Only successes enter the latency histogram: failed and
    /// expired requests end at deadlines, and mixing them in would hide the
    /// latency of the requests that worked.
    pub(crate) fn record_terminal(&self, phase: Phase, latency: Duration) {
        match phase {
            Phase::Success => {
                self.ok.fetch_add(1, Relaxed);
                let mut l = lock(&self.latency);
                l.record(latency);
            }
            Phase::Failed(FailReason::Aborted(_) | FailReason::PeerAborted) => {
                self.failed.fetch_add(1, Relaxed);
                self.aborted.fetch_add(1, Relaxed);
            }
            Phase::Failed(_) => {
                self.failed.fetch_add(1, Relaxed);
            }
            Phase::Expired => {
                self.expired.fetch_add(1, Relaxed);
            }
            Phase::Bootstrapping | Phase::WaitingForInput | Phase::Transferring => {}
        }
    }

    /// A copy of the latency histogram of successful requests.
    pub(crate) fn latency(&self) -> Latency {
        lock(&self.latency).clone()
    }

    fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Relaxed);
    }

    /// Adds one to `counter` (a field of this set).
    pub(crate) fn inc(counter: &AtomicU64) {
        Self::add(counter, 1);
    }
}

/// Renders `counters` as OpenMetrics text (which Prometheus scrapes).
pub(crate) fn render(counters: &std::sync::Arc<Counters>) -> String {
    let counters = counters.clone();
    kvferry_metrics::render(move |encoder| scrape(&counters, encoder))
}

/// Encodes the counters, read at scrape time.
fn scrape(counters: &Counters, encoder: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
    let s = counters.snapshot();
    let by_outcome = [
        ("ok", s.ok),
        // Each counter is read on its own: a scrape between an abort's two
        // adds (`failed`, then `aborted`) may see it in `aborted` only.
        ("failed", s.failed.saturating_sub(s.aborted)),
        ("aborted", s.aborted),
        ("expired", s.expired),
    ];
    let mut family =
        encoder.encode_descriptor(TRANSFERS, TRANSFERS_HELP, None, MetricType::Counter)?;
    for (outcome, n) in by_outcome {
        let labels = [("outcome", outcome)];
        ConstCounter::new(n).encode(family.encode_family(&labels)?)?;
    }
    kvferry_metrics::encode_families(encoder, &s.plain())?;
    kvferry_metrics::encode_auth_rejects(encoder, &counters.auth)?;
    let latency = counters.latency();
    let buckets = latency.buckets();
    let bounds = LATENCY_BUCKETS_S.iter().copied().chain([f64::INFINITY]);
    let pairs: Vec<(f64, u64)> = bounds.zip(buckets).collect();
    let m = encoder.encode_descriptor(
        "kvferry_transfer_duration_seconds",
        "Latency of successful requests, first report to completion.",
        None,
        MetricType::Histogram,
    )?;
    encode_histogram(m, latency.sum().as_secs_f64(), latency.count(), &pairs)
}

impl NodeStats {
    /// Every family but the outcome counters, which render as one labelled
    /// family.
    fn plain(&self) -> Vec<Family> {
        let mut families = self.families();
        families.retain(|f| f.name != TRANSFERS);
        families
    }
}

fn encode_histogram(
    mut m: prometheus_client::encoding::MetricEncoder,
    sum: f64,
    count: u64,
    buckets: &[(f64, u64)],
) -> Result<(), std::fmt::Error> {
    m.encode_histogram::<prometheus_client::encoding::NoLabelSet>(sum, count, buckets, None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvferry_metrics::Kind;
    use std::sync::Arc;

    #[test]
    fn every_counter_is_rendered_once_with_its_value() {
        let c = Arc::new(Counters::default());
        c.record_terminal(Phase::Success, Duration::from_micros(700));
        c.record_terminal(Phase::Success, Duration::from_secs(100));
        c.record_terminal(Phase::Failed(FailReason::PeerDead), Duration::ZERO);
        c.record_terminal(Phase::Failed(FailReason::PeerAborted), Duration::ZERO);
        c.record_terminal(Phase::Expired, Duration::ZERO);
        Counters::add(&c.bytes, 12345);
        Counters::inc(&c.limit_hits);
        c.dead_now.fetch_add(2, Relaxed);
        let s = c.snapshot();
        assert_eq!((s.ok, s.failed, s.aborted, s.expired), (2, 2, 1, 1));
        let text = render(&c);
        let sample = |series: &str| -> f64 {
            text.lines()
                .find_map(|l| l.strip_prefix(series).and_then(|v| v.strip_prefix(' ')))
                .unwrap_or_else(|| panic!("no {series} in\n{text}"))
                .parse()
                .expect("number")
        };
        assert_eq!(sample("kvferry_transfers_total{outcome=\"ok\"}"), 2.0);
        assert_eq!(sample("kvferry_transfers_total{outcome=\"failed\"}"), 1.0);
        assert_eq!(sample("kvferry_transfers_total{outcome=\"aborted\"}"), 1.0);
        assert_eq!(sample("kvferry_transfers_total{outcome=\"expired\"}"), 1.0);
        assert_eq!(sample("kvferry_transfer_bytes_total"), 12345.0);
        assert_eq!(sample("kvferry_limit_hits_total"), 1.0);
        assert_eq!(sample("kvferry_peers_dead"), 2.0);
        let h = "kvferry_transfer_duration_seconds";
        assert_eq!(sample(&format!("{h}_bucket{{le=\"0.0005\"}}")), 0.0);
        assert_eq!(sample(&format!("{h}_bucket{{le=\"0.001\"}}")), 1.0);
        assert_eq!(sample(&format!("{h}_bucket{{le=\"60.0\"}}")), 1.0);
        assert_eq!(sample(&format!("{h}_bucket{{le=\"+Inf\"}}")), 2.0);
        assert_eq!(sample(&format!("{h}_count")), 2.0);
        assert!((sample(&format!("{h}_sum")) - 100.0007).abs() < 1e-6);
        // Buckets are cumulative: never decreasing, one line per bound + Inf.
        let buckets: Vec<f64> = text
            .lines()
            .filter(|l| l.starts_with(&format!("{h}_bucket")))
            .map(|l| {
                l.rsplit_once(' ')
                    .expect("value")
                    .1
                    .parse()
                    .expect("number")
            })
            .collect();
        assert_eq!(buckets.len(), LATENCY_BUCKETS_S.len() + 1);
        assert!(buckets.windows(2).all(|w| w[0] <= w[1]));
        check_exposition(&text);
        // One TYPE line per family, every plain counter among them.
        for family in s.plain() {
            let kind = match family.kind {
                Kind::Counter => "counter",
                Kind::Gauge => "gauge",
            };
            let declared = format!("# TYPE {} {kind}", family.name);
            assert_eq!(text.matches(&declared).count(), 1, "{declared}\n{text}");
        }
        assert!(text.ends_with("# EOF\n"), "{text}");
    }

    /// Every sample line is `name[{labels}] value` after a TYPE line of its
    /// family (`_total`, `_bucket`, `_sum`, `_count` suffixes).
    pub(crate) fn check_exposition(text: &str) {
        let mut declared: Vec<String> = Vec::new();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, kind) = rest.split_once(' ').expect("name and kind");
                assert!(matches!(kind, "counter" | "gauge" | "histogram"), "{line}");
                declared.push(name.to_string());
                continue;
            }
            if line.starts_with('#') {
                continue;
            }
            let (series, value) = line.rsplit_once(' ').expect("sample has a value");
            value.parse::<f64>().expect("numeric value");
            let name = series.split('{').next().expect("name");
            let family = ["_total", "_bucket", "_sum", "_count"]
                .iter()
                .find_map(|suffix| name.strip_suffix(suffix))
                .filter(|f| declared.iter().any(|d| d == f))
                .unwrap_or(name);
            assert!(declared.iter().any(|d| d == family), "{name} has no TYPE");
        }
    }
}
