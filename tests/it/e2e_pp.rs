//! End-to-end with pipeline parallelism: a prefill engine whose stages each
//! register the regions of their layers feeds a decode engine without
//! pipeline parallelism (every stage to each decode rank) or with as many
//! stages (stage to stage), every byte of every layer verified.

use std::time::Duration;

use kvferry::machines::internal::common::{Config, Mode};
use kvferry::machines::Phase;
use kvferry::TransferId;
use kvferry_testkit::model;
use kvferry_testkit::synth::{Cluster, ClusterSpec};

/// Four layers: two per stage with two stages.
const LAYERS: u32 = 4;

fn spec(mode: Mode, (p_tp, p_pp): (u32, u32), (d_tp, d_pp): (u32, u32)) -> ClusterSpec {
    ClusterSpec {
        layers: LAYERS,
        prefill_tp: p_tp,
        decode_tp: d_tp,
        prefill_pp: p_pp,
        decode_pp: d_pp,
        timeouts: Config {
            bootstrap_timeout: Duration::from_secs(20),
            waiting_timeout: Duration::from_secs(5),
            claim_timeout: Duration::from_secs(5),
            lease: Duration::from_secs(2),
            hold_limit: Duration::from_secs(10),
            transfer_bound: Duration::from_secs(2),
            fence_margin: Duration::from_millis(100),
            heartbeat_interval: Duration::from_millis(100),
            heartbeat_misses: 3,
            ..Config::default()
        },
        bootstrap: Some("127.0.0.1:0".into()),
        ..ClusterSpec::new(model::small(), mode)
    }
}

/// Runs a few requests and checks every byte on every decode rank and the
/// outcome on every prefill rank of every stage.
fn run(spec: &ClusterSpec) {
    let c = Cluster::start(spec).expect("cluster starts");
    let stages = spec.prefill_pp as usize;
    assert_eq!(c.prefill.len(), stages * spec.prefill_tp as usize);
    for t in 0..6u64 {
        let tid = TransferId(10 + t);
        let n = 1 + t as u32 % 3;
        let src: Vec<u32> = (0..n).map(|i| 3 * i + t as u32 % 2).collect();
        let dst: Vec<u32> = (0..n).map(|i| 50 - 2 * i).collect();
        c.fill(tid, &src);
        for r in &c.decode {
            r.kv.clear(&dst);
        }
        c.start_request(tid, &src, &dst, 0).expect("request starts");
        let decode = c.wait_decode(tid, Duration::from_secs(10));
        assert!(
            decode.iter().all(|p| *p == Phase::Success),
            "{tid:?}: {decode:?}"
        );
        assert_eq!(c.verify(tid, &dst, 0), 0, "{tid:?}: bytes differ on decode");
        let prefill = c.wait_prefill(tid, Duration::from_secs(10));
        assert!(
            prefill.iter().all(|p| *p == Phase::Success),
            "{tid:?}: prefill {prefill:?}"
        );
    }
    // Every decode rank holds the regions of every layer of its stage.
    let regions: usize = c
        .decode
        .iter()
        .map(|r| r.kv.layout().rank.regions.len())
        .sum();
    let per_rank = 2 * LAYERS as usize / spec.decode_pp as usize;
    assert_eq!(regions, per_rank * c.decode.len());
}

#[test]
fn push_pp2_to_pp1() {
    run(&spec(Mode::Push, (1, 2), (1, 1)));
}

#[test]
fn pull_pp2_to_pp1() {
    run(&spec(Mode::Pull, (1, 2), (1, 1)));
}

#[test]
fn push_pp2_to_pp2() {
    run(&spec(Mode::Push, (1, 2), (1, 2)));
}

#[test]
fn pull_pp2_tp2_to_pp2_tp1() {
    run(&spec(Mode::Pull, (2, 2), (1, 2)));
}

#[test]
fn push_pp2_tp2_to_pp1_tp2() {
    run(&spec(Mode::Push, (2, 2), (2, 1)));
}
