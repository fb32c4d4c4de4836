//! Every node serves its counters on `/metrics`: after real transfers, an
//! abort, an expired hold, a limit hit, junk and a peer of another protocol
//! version, each family of a named list moved, on a prefill and on a decode
//! node, scraped over HTTP.

use std::time::{Duration, Instant};

use kvferry::bootstrap::BootstrapClient;
use kvferry::machines::internal::common::{BlockId, Config, Mode, Msg};
use kvferry::machines::internal::wire::{self, Frame};
use kvferry::machines::{FailReason, Phase, TransferId};
use kvferry::machines::{ModelSpec, RankLayout};
use kvferry::node::{Node, NodeConfig, PrefillTarget, Role, TransportKind};
use kvferry_testkit::model::ModelSpecExt;
use kvferry_testkit::synth::SynthKv;

/// Two 64-byte heads in 4-token blocks.
fn model() -> ModelSpec {
    kvferry_testkit::model::small()
        .with_heads(2)
        .with_head_bytes(64)
}

fn timeouts(bootstrap: Duration) -> Config {
    Config {
        bootstrap_timeout: bootstrap,
        waiting_timeout: Duration::from_secs(5),
        claim_timeout: Duration::from_secs(5),
        lease: Duration::from_millis(600),
        hold_limit: Duration::from_secs(10),
        transfer_bound: Duration::from_millis(500),
        fence_margin: Duration::from_millis(100),
        heartbeat_interval: Duration::from_millis(100),
        // No peer is marked dead by silence while the test runs.
        heartbeat_misses: 1000,
        ..Config::default()
    }
}

fn ids(b: &[u32]) -> Vec<Vec<BlockId>> {
    vec![b.iter().copied().map(BlockId).collect()]
}

fn scrape(node: &Node) -> String {
    let addr = node.metrics_addr().expect("metrics_listen is set");
    let client = BootstrapClient::new(&addr.to_string()).unwrap();
    let (status, _) = client.request("GET", "/health", None).unwrap();
    assert_eq!(status, 200);
    client.metrics_text().unwrap()
}

fn value(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series).and_then(|v| v.strip_prefix(' ')))
        .unwrap_or_else(|| panic!("no {series} in\n{text}"))
        .parse()
        .expect("number")
}

fn assert_moved(text: &str, families: &[&str]) {
    for series in families {
        assert!(value(text, series) > 0.0, "{series} did not move:\n{text}");
    }
}

/// Until `f` holds, for at most 20 s: a deadline for threads that two
/// loaded cores (the rest of the suite runs beside this test) can leave
/// unscheduled for seconds, not a time anything is expected to take.
fn eventually(what: &str, f: impl Fn() -> bool) {
    within(Duration::from_secs(20), what, f)
}

/// Until `f` holds, for at most `bound`.
fn within(bound: Duration, what: &str, f: impl Fn() -> bool) {
    let deadline = Instant::now() + bound;
    while !f() {
        assert!(Instant::now() < deadline, "{what} within {bound:?}");
        std::thread::yield_now();
    }
}

fn hello(kv: &SynthKv) -> Frame {
    Frame::Hello(wire::Hello {
        engine_id: "raw".into(),
        mode: Mode::Push,
        model: model(),
        layout: RankLayout {
            tp_size: 1,
            tp_rank: 0,
            num_blocks: 16,
            regions: kv.kv_layout().regions,
            stage: kvferry::machines::Stage::SINGLE,
            pools: Vec::new(),
        },
        endpoint: "tcp://127.0.0.1:1".into(),
    })
}

fn recv_within(s: &zmq::Socket) -> Vec<u8> {
    let mut items = [s.as_poll_item(zmq::POLLIN)];
    assert_eq!(
        zmq::poll(&mut items, 5000).unwrap(),
        1,
        "an answer within 5 s"
    );
    s.recv_bytes(0).unwrap()
}

/// A decode rank played by a bare socket: says hello, asks for `tid` and
/// disappears, so the prefill rank's next frame for it cannot be sent.
fn vanishing_decode_rank(p: &Node, dkv: &SynthKv, tid: u64) {
    let ctx = zmq::Context::new();
    let s = ctx.socket(zmq::DEALER).unwrap();
    s.set_linger(0).unwrap();
    s.connect(&p.side_channel_addr()).unwrap();
    s.send(wire::encode(&hello(dkv)), 0).unwrap();
    assert!(matches!(
        wire::decode(&recv_within(&s), &wire::Limits::default()),
        Ok(Frame::Hello(_))
    ));
    let pull = Frame::Transfer {
        transfer_id: TransferId(tid),
        msg: Msg::Pull {
            receivers_expected: 1,
            dst_blocks: ids(&[7]),
            prefix_blocks: vec![0],
            lease_seq: None,
        },
    };
    s.send(wire::encode(&pull), 0).unwrap();
    eventually("prefill knows the transfer", || {
        p.phase(TransferId(tid)).is_some()
    });
    drop(s);
    // Returns once the socket is closed and its connection gone.
    drop(ctx);
}

#[test]
fn prefill_and_decode_serve_every_family_after_real_events() {
    let mut pc = NodeConfig::new(Role::Prefill, "p");
    pc.timeouts = timeouts(Duration::from_millis(300));
    pc.metrics_listen = Some("127.0.0.1:0".into());
    // Sockets: a status rides behind the writes only over tcp frames
    // (`kvferry_statuses_behind_writes_total`).
    pc.transport = TransportKind::Tcp;
    let pkv = SynthKv::new(model(), 1, 0, 2, 16);
    let p = Node::start(pc).unwrap();
    // SAFETY: `p` is shut down at the end, before `pkv` drops.
    unsafe { p.register_kv_caches(pkv.kv_layout()).unwrap() };
    let mut dc = NodeConfig::new(Role::Decode, "d");
    dc.timeouts = timeouts(Duration::from_secs(5));
    dc.metrics_listen = Some("127.0.0.1:0".into());
    dc.transport = TransportKind::Tcp;
    // The engine never collects: the third finished record is a limit hit.
    dc.max_finished_records = 2;
    let dkv = SynthKv::new(model(), 1, 0, 2, 16);
    let d = Node::start(dc).unwrap();
    // SAFETY: `d` is shut down at the end, before `dkv` drops.
    unsafe { d.register_kv_caches(dkv.kv_layout()).unwrap() };
    let target = PrefillTarget::Direct {
        tp_size: 1,
        pp_size: 1,
        side_channels: vec![p.side_channel_addr()],
    };
    for tid in 1..=3u64 {
        pkv.fill(TransferId(tid), &[tid as u32], 0);
        let rx = d.receiver(TransferId(tid), &target).unwrap();
        rx.request(ids(&[tid as u32])).unwrap();
        let tx = p.sender(TransferId(tid)).unwrap();
        tx.send(ids(&[tid as u32]), true).unwrap();
        assert_eq!(rx.wait(Duration::from_secs(5)), Phase::Success);
        assert_eq!(tx.wait(Duration::from_secs(5)), Phase::Success);
        assert!(dkv.verify(TransferId(tid), &[tid as u32], 0).is_ok());
    }
    // Prefill aborts a request decode asked for.
    let rx = d.receiver(TransferId(4), &target).unwrap();
    rx.request(ids(&[4])).unwrap();
    eventually("prefill knows request 4", || {
        p.phase(TransferId(4)).is_some()
    });
    p.sender(TransferId(4)).unwrap().abort().unwrap();
    assert_eq!(
        rx.wait(Duration::from_secs(5)),
        Phase::Failed(FailReason::PeerAborted)
    );
    // KV nobody asks for: prefill's hold expires.
    let tx = p.sender(TransferId(5)).unwrap();
    tx.send(ids(&[5]), true).unwrap();
    assert_eq!(tx.wait(Duration::from_secs(5)), Phase::Expired);
    // Junk and a peer of the next protocol version.
    let ctx = zmq::Context::new();
    let s = ctx.socket(zmq::DEALER).unwrap();
    s.set_linger(0).unwrap();
    s.connect(&p.side_channel_addr()).unwrap();
    let mut junk = wire::MAGIC.to_vec();
    junk.extend_from_slice(&wire::VERSION.to_le_bytes());
    junk.extend_from_slice(b"junk");
    s.send(junk, 0).unwrap();
    let mut future = Vec::new();
    wire::encode_versioned(&hello(&dkv), wire::VERSION + 1, &mut future);
    s.send(future, 0).unwrap();
    assert!(matches!(
        wire::decode(&recv_within(&s), &wire::Limits::default()),
        Ok(Frame::Refuse(_))
    ));
    // A frame for a decode rank that is gone cannot be sent.
    vanishing_decode_rank(&p, &dkv, 6);
    p.sender(TransferId(6)).unwrap().abort().unwrap();
    // The abort may be queued before ZeroMQ saw the peer's connection go;
    // a later heartbeat to it (every 100 ms here) is then the frame that
    // cannot be sent. The bound is a deadline for the bridge thread to get
    // there, which took over 5 s once on two loaded cores.
    within(
        Duration::from_secs(20),
        "the abort or a heartbeat for the vanished rank was attempted",
        || p.stats().dropped_frames > 0,
    );

    let text = scrape(&p);
    assert_moved(
        &text,
        &[
            "kvferry_transfers_total{outcome=\"ok\"}",
            "kvferry_transfers_total{outcome=\"aborted\"}",
            "kvferry_transfers_total{outcome=\"expired\"}",
            "kvferry_transfer_bytes_total",
            "kvferry_transfer_descriptors_total",
            "kvferry_transfer_duration_seconds_count",
            "kvferry_expired_holds_total",
            "kvferry_sidechannel_received_total",
            "kvferry_sidechannel_sent_total",
            "kvferry_sidechannel_decode_errors_total",
            "kvferry_sidechannel_send_failures_total",
            "kvferry_version_refusals_sent_total",
            "kvferry_data_plane_messages_total",
            "kvferry_statuses_behind_writes_total",
        ],
    );
    let text = scrape(&d);
    assert_moved(
        &text,
        &[
            "kvferry_transfers_total{outcome=\"ok\"}",
            "kvferry_transfers_total{outcome=\"aborted\"}",
            "kvferry_transfer_duration_seconds_count",
            "kvferry_sidechannel_received_total",
            "kvferry_sidechannel_sent_total",
            "kvferry_limit_hits_total",
            "kvferry_data_plane_messages_total",
        ],
    );
    // The two views read the same counters.
    let stats = d.stats();
    assert_eq!(
        value(&text, "kvferry_transfers_total{outcome=\"ok\"}"),
        stats.ok as f64
    );
    assert_eq!(d.latency().count(), stats.ok);
    d.shutdown(Duration::ZERO);
    p.shutdown(Duration::ZERO);
}
