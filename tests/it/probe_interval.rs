//! `NodeConfig::probe_interval`: how often decode says hello again to a
//! prefill peer that is dead or has not answered, apart from the
//! heartbeat interval, and its bounds.

use std::time::{Duration, Instant};

use kvferry::node::{
    BlockId, Misuse, Node, NodeConfig, NodeError, NodeSettings, Phase, PrefillTarget, Role,
    TransferId,
};
use kvferry_testkit::model;
use kvferry_testkit::synth::SynthKv;

/// Heartbeats (and so, by default, probes) ten minutes apart: only the
/// probe interval can bring an unanswered peer back within the test.
fn slow_heartbeats(role: Role, engine_id: &str) -> NodeConfig {
    let mut c = NodeConfig::new(role, engine_id);
    c.timeouts.heartbeat_interval = Duration::from_secs(600);
    c.timeouts.lease = Duration::from_secs(1200);
    c
}

/// Waits (bounded) until `f` holds.
fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !f() {
        assert!(Instant::now() < deadline, "{what}");
        std::thread::yield_now();
    }
}

#[test]
fn decode_probes_an_unanswered_peer_at_the_probe_interval() {
    let p = Node::start(slow_heartbeats(Role::Prefill, "p")).unwrap();
    let mut dc = slow_heartbeats(Role::Decode, "d");
    dc.probe_interval = Some(Duration::from_millis(20));
    let d = Node::start(dc).unwrap();
    let (pkv, dkv) = (
        SynthKv::new(model::medium(), 1, 0, 2, 32),
        SynthKv::new(model::medium(), 1, 0, 2, 32),
    );
    // SAFETY: both KVs outlive their nodes (shut down at the end).
    unsafe { d.register_kv_caches(dkv.kv_layout()).unwrap() };
    let tid = TransferId(1);
    let target = PrefillTarget::Direct {
        tp_size: 1,
        pp_size: 1,
        side_channels: vec![p.side_channel_addr()],
    };
    let rx = d.receiver(tid, &target).unwrap();
    rx.request(vec![vec![BlockId(7), BlockId(8)]]).unwrap();
    // Decode's first hello reached a prefill node that has no KV
    // registered yet, so it went unanswered.
    wait_until("decode's hello reached prefill", || {
        p.stats().sidechannel_received >= 1
    });
    pkv.fill(tid, &[2, 3], 0);
    unsafe { p.register_kv_caches(pkv.kv_layout()).unwrap() };
    let tx = p.sender(tid).unwrap();
    tx.send(vec![vec![BlockId(2), BlockId(3)]], true).unwrap();
    // The next hello comes at the probe interval, not ten minutes later.
    assert_eq!(rx.wait(Duration::from_secs(30)), Phase::Success);
    assert_eq!(dkv.verify(tid, &[7, 8], 0), Ok(()));
    assert_eq!(tx.wait(Duration::from_secs(30)), Phase::Success);
    d.shutdown(Duration::from_millis(100));
    p.shutdown(Duration::from_millis(100));
}

#[test]
fn the_probe_interval_is_a_setting_and_is_bounded() {
    let s = NodeSettings::from_json(
        r#"{"role": "decode", "engine_id": "d", "probe_interval_ms": 250, "resolve_timeout_ms": 700}"#,
    )
    .unwrap();
    let c = s.build().unwrap();
    assert_eq!(c.probe_interval, Some(Duration::from_millis(250)));
    assert_eq!(c.probe_every(), Duration::from_millis(250));
    assert_eq!(c.resolve_timeout, Duration::from_millis(700));
    let vars = [
        ("KVFERRY_PROBE_INTERVAL_MS", "40"),
        ("KVFERRY_RESOLVE_TIMEOUT_MS", "90"),
    ]
    .map(|(k, v)| (k.to_string(), v.to_string()));
    let c = s
        .overridden_by(NodeSettings::from_vars(vars).unwrap())
        .build()
        .unwrap();
    assert_eq!(c.probe_interval, Some(Duration::from_millis(40)));
    assert_eq!(c.resolve_timeout, Duration::from_millis(90));
    // By default probes follow the heartbeat, as they always did.
    let mut c = NodeConfig::new(Role::Decode, "d");
    assert_eq!(c.probe_interval, None);
    c.timeouts.heartbeat_interval = Duration::from_millis(300);
    assert_eq!(c.probe_every(), Duration::from_millis(300));

    let refused = |c: NodeConfig, setting: &str| match Node::start(c) {
        Err(NodeError::Misuse(Misuse::OutOfRange { setting: s, .. })) => assert_eq!(s, setting),
        other => panic!("{setting}: expected OutOfRange, got {other:?}"),
    };
    let mut c = NodeConfig::new(Role::Decode, "d");
    c.probe_interval = Some(Duration::ZERO);
    refused(c, "probe_interval");
    let mut c = NodeConfig::new(Role::Decode, "d");
    c.probe_interval = Some(c.timeouts.bootstrap_timeout + Duration::from_millis(1));
    refused(c, "probe_interval");
    let mut c = NodeConfig::new(Role::Decode, "d");
    c.resolve_timeout = Duration::ZERO;
    refused(c, "resolve_timeout");
    let mut c = NodeConfig::new(Role::Decode, "d");
    c.resolve_timeout = Duration::from_secs(3600);
    refused(c, "resolve_timeout");
}
