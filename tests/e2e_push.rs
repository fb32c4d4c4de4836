//! End-to-end: prefill and decode nodes in one process, real side channel
//! (ZeroMQ over loopback), real data plane, every byte verified.

use std::time::Duration;

use kvferry::machines::common::{Config, Mode};
use kvferry::machines::layout::{LayoutKind, ModelSpec};
use kvferry::machines::Phase;
use kvferry::node::TransportKind;
use kvferry::synth::{Cluster, ClusterSpec};

fn timeouts() -> Config {
    Config {
        bootstrap_timeout: Duration::from_secs(5),
        waiting_timeout: Duration::from_secs(5),
        claim_timeout: Duration::from_secs(5),
        lease: Duration::from_millis(2000),
        hold_limit: Duration::from_secs(10),
        transfer_bound: Duration::from_secs(2),
        fence_margin: Duration::from_millis(100),
        heartbeat_interval: Duration::from_millis(100),
        heartbeat_misses: 3,
        ..Config::default()
    }
}

fn spec(kind: LayoutKind, p_tp: u32, d_tp: u32, mode: Mode, transport: TransportKind) -> ClusterSpec {
    ClusterSpec {
        model: ModelSpec { layout: kind, total_kv_heads: 4, block_tokens: 4, head_bytes: 32 },
        layers: 2,
        prefill_blocks: 64,
        decode_blocks: 64,
        prefill_tp: p_tp,
        decode_tp: d_tp,
        mode,
        transport,
        timeouts: timeouts(),
        bootstrap: None,
    }
}

/// Runs a few requests with different block placements and checks every byte.
fn run(spec: &ClusterSpec, requests: u64) {
    let c = Cluster::start(spec).expect("cluster starts");
    for t in 0..requests {
        let tid = 100 + t;
        let n = 1 + (t as u32 % 5);
        let src: Vec<u32> = (0..n).map(|i| 2 * i + t as u32 % 3).collect();
        let dst: Vec<u32> = (0..n).map(|i| 40 - 3 * i - t as u32 % 2).collect();
        c.fill(tid, &src);
        for r in &c.decode {
            r.kv.clear(&dst);
        }
        c.start_request(tid, &src, &dst, 0).expect("request starts");
        let phases = c.wait_decode(tid, Duration::from_secs(10));
        assert!(phases.iter().all(|p| *p == Phase::Success), "request {tid}: {phases:?}");
        assert_eq!(c.verify(tid, &dst, 0), 0, "request {tid}: bytes differ on decode");
    }
    let stats: u64 = c.decode.iter().map(|r| r.node.stats().ok).sum();
    assert_eq!(stats, requests * spec.decode_tp as u64);
}

#[test]
fn push_tp1_to_tp1_local_transport() {
    run(&spec(LayoutKind::Hnd, 1, 1, Mode::Push, TransportKind::Local), 8);
}

#[test]
fn push_tp1_to_tp1_tcp_transport() {
    run(&spec(LayoutKind::Hnd, 1, 1, Mode::Push, TransportKind::Tcp), 8);
}
