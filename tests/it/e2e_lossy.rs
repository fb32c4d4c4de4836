//! End-to-end with lost control messages: every node drops 2 % of the
//! messages its machines emit (`NodeConfig::drop_control_ppm`), on whatever
//! channel would carry them, and the machines' resends still bring almost
//! every request home, every byte verified, on both sides.

use std::time::Duration;

use kvferry::machines::internal::common::{Config, Mode};
use kvferry::machines::Phase;
use kvferry::{NodeStats, TransferId};
use kvferry_testkit::model;
use kvferry_testkit::synth::{Cluster, ClusterSpec, Rank};

/// 2 % of the control messages, as in the simulator's goodput profile.
const LOSS_PPM: u32 = 20_000;
/// Requests in flight at once (each on its own blocks).
const WAVE: u32 = 16;
/// Waves of requests per run.
const WAVES: u32 = 20;

fn spec(mode: Mode, p_tp: u32, d_tp: u32) -> ClusterSpec {
    ClusterSpec {
        prefill_blocks: u64::from(4 * WAVE),
        decode_blocks: u64::from(4 * WAVE),
        prefill_tp: p_tp,
        decode_tp: d_tp,
        timeouts: Config {
            bootstrap_timeout: Duration::from_secs(20),
            waiting_timeout: Duration::from_secs(10),
            claim_timeout: Duration::from_secs(10),
            lease: Duration::from_secs(2),
            hold_limit: Duration::from_secs(30),
            transfer_bound: Duration::from_secs(2),
            fence_margin: Duration::from_millis(100),
            heartbeat_interval: Duration::from_millis(200),
            heartbeat_misses: 5,
            resend_after: Duration::from_millis(50),
            ..Config::default()
        },
        drop_control_ppm: LOSS_PPM,
        ..ClusterSpec::new(model::small(), mode)
    }
}

/// Runs `WAVES` waves of `WAVE` requests and returns how many succeeded on
/// every rank with every byte right, and the nodes' summed counters.
fn run(spec: &ClusterSpec) -> (u32, NodeStats) {
    let c = Cluster::start(spec).expect("cluster starts");
    let mut good = 0;
    for wave in 0..WAVES {
        let slot_blocks = |k: u32| vec![4 * k, 4 * k + 1];
        for k in 0..WAVE {
            let tid = TransferId(u64::from(wave * WAVE + k));
            c.fill(tid, &slot_blocks(k));
            for r in &c.decode {
                r.kv.clear(&slot_blocks(k));
            }
            c.start_request(tid, &slot_blocks(k), &slot_blocks(k), 0)
                .expect("request starts");
        }
        for k in 0..WAVE {
            let tid = TransferId(u64::from(wave * WAVE + k));
            let decode = c.wait_decode(tid, Duration::from_secs(30));
            let prefill = c.wait_prefill(tid, Duration::from_secs(30));
            let ok = (decode.iter().chain(&prefill)).all(|p| *p == Phase::Success);
            if ok && c.verify(tid, &slot_blocks(k), 0) == 0 {
                good += 1;
            }
        }
    }
    let total = c.prefill.iter().chain(&c.decode).map(|r| r.node.stats());
    (good, total.sum())
}

fn assert_goodput(spec: &ClusterSpec) {
    let (good, s) = run(spec);
    let dropped = s.dropped_sidechannel + s.dropped_data_plane + s.dropped_trailer;
    let resent = s.resent_sidechannel + s.resent_data_plane;
    let total = WAVE * WAVES;
    println!("{good} of {total} requests good; dropped {dropped}, resent {resent}: {s:?}");
    assert!(dropped > 0, "nothing was dropped: {s:?}");
    assert!(resent > 0, "nothing was resent: {s:?}");
    // At least 99.5 % of the requests succeed on every rank.
    assert!(
        f64::from(good) >= 0.995 * f64::from(total),
        "{good} of {total} requests succeeded with {LOSS_PPM} ppm of control messages lost"
    );
}

#[test]
fn push_recovers_lost_control_messages() {
    assert_goodput(&spec(Mode::Push, 1, 1));
}

#[test]
fn pull_recovers_lost_control_messages_across_ranks() {
    assert_goodput(&spec(Mode::Pull, 2, 2));
}

#[test]
fn a_pull_reusing_an_ended_transfers_id_is_not_told_it_succeeded() {
    // Prefill remembers the push transfer's success to answer a resent
    // `Pull` with `Status{ok: true}`; a new request reusing the id (here
    // another decode engine, other blocks) must get `Abort` instead, and
    // nothing may land in its blocks.
    let mut spec = spec(Mode::Push, 1, 1);
    spec.drop_control_ppm = 0;
    let c = Cluster::start(&spec).expect("cluster starts");
    let tid = TransferId(5);
    let (src, dst) = ([1, 2], [3, 4]);
    c.fill(tid, &src);
    c.start_request(tid, &src, &dst, 0).expect("request starts");
    assert_eq!(
        c.wait_decode(tid, Duration::from_secs(10)),
        vec![Phase::Success]
    );
    assert_eq!(
        c.wait_prefill(tid, Duration::from_secs(10)),
        vec![Phase::Success]
    );
    // Collected: prefill's machine is gone, its record stays.
    let _ = c.prefill[0].node.get_finished();
    let d2 = Rank::lone_decode(&spec, "decode-2");
    let rx = d2.node.receiver(tid, &c.target).expect("receiver");
    rx.request(vec![[7u32, 8]
        .iter()
        .map(|&b| kvferry::BlockId(b))
        .collect()])
        .expect("request");
    assert_eq!(
        rx.wait(Duration::from_secs(10)),
        Phase::Failed(kvferry::FailReason::PeerAborted)
    );
    assert!(d2.untouched(&[7, 8]));
}
