//! Every configured limit of the node refuses with a clear, typed outcome
//! when reached, instead of growing or hanging: machines per executor,
//! side-channel peers, cached bootstrap targets, finished records.

use std::net::TcpListener;
use std::time::{Duration, Instant};

use kvferry::machines::internal::common::{AbortReason, BlockId, Config};
use kvferry::machines::{FailReason, Phase};
use kvferry::machines::{ModelSpec, Region};
use kvferry::node::{KvLayout, Misuse, Node, NodeConfig, NodeError, PrefillTarget, Role};
use kvferry::TransferId;
use kvferry_testkit::model;

const MODEL: ModelSpec = model::flat(16);
const BLOCKS: u64 = 8;

fn timeouts() -> Config {
    Config {
        bootstrap_timeout: Duration::from_secs(20),
        waiting_timeout: Duration::from_secs(20),
        heartbeat_interval: Duration::from_millis(100),
        ..Config::default()
    }
}

/// A node with one registered region of `BLOCKS` blocks; the memory lives
/// as long as the returned box (declared after the node, so dropped after).
fn node(mut config: NodeConfig) -> (Node, Box<[u8]>) {
    config.timeouts = timeouts();
    let node = Node::start(config).expect("node starts");
    let mut mem = vec![0u8; (BLOCKS * 16) as usize].into_boxed_slice();
    let layout = KvLayout {
        model: MODEL,
        first_region: 0,
        pools: Vec::new(),
        num_blocks: BLOCKS,
        regions: vec![Region {
            base: mem.as_mut_ptr() as u64,
            block_len: 16,
            kv_block_len: 16,
        }],
    };
    // SAFETY: `mem` outlives the node in every test (dropped after it).
    unsafe { node.register_kv_caches(layout).expect("register") };
    (node, mem)
}

fn blocks(ids: &[u32]) -> Vec<Vec<BlockId>> {
    vec![ids.iter().map(|&b| BlockId(b)).collect()]
}

/// Waits for a terminal phase, failing the test after `within`.
fn terminal(node: &Node, tid: u64, within: Duration) -> (Phase, Duration) {
    let started = Instant::now();
    let phase = node
        .receiver(
            TransferId(tid),
            &PrefillTarget::Direct {
                tp_size: 1,
                pp_size: 1,
                side_channels: vec![],
            },
        )
        .expect("decode node")
        .wait(within);
    (phase, started.elapsed())
}

#[test]
fn machines_per_executor_limit_refuses_with_busy() {
    let mut c = NodeConfig::new(Role::Decode, "d");
    c.reactor.max_machines_per_executor = 2;
    let (d, _mem) = node(c);
    // A silent "prefill": requests stay live while we fill the node.
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let target = PrefillTarget::Direct {
        tp_size: 1,
        pp_size: 1,
        side_channels: vec![format!("tcp://{}", silent.local_addr().unwrap())],
    };
    for tid in 1..=2 {
        d.receiver(TransferId(tid), &target)
            .unwrap()
            .request(blocks(&[tid as u32]))
            .expect("under the limit");
    }
    let third = d
        .receiver(TransferId(3), &target)
        .unwrap()
        .request(blocks(&[3]));
    assert!(
        matches!(third, Err(NodeError::Busy(_))),
        "third request over a limit of two: {third:?}"
    );
}

#[test]
fn side_channel_peer_limit_fails_a_request_at_once() {
    let mut c = NodeConfig::new(Role::Decode, "d");
    c.max_peers = 1;
    let (d, _mem) = node(c);
    let a = TcpListener::bind("127.0.0.1:0").unwrap();
    let b = TcpListener::bind("127.0.0.1:0").unwrap();
    let to = |l: &TcpListener| PrefillTarget::Direct {
        tp_size: 1,
        pp_size: 1,
        side_channels: vec![format!("tcp://{}", l.local_addr().unwrap())],
    };
    d.receiver(TransferId(1), &to(&a))
        .unwrap()
        .request(blocks(&[1]))
        .unwrap();
    // A second prefill address needs a second peer slot: over the limit
    // (and the first peer is not dead), so the request fails now instead of
    // waiting out its 20 s bootstrap timeout.
    d.receiver(TransferId(2), &to(&b))
        .unwrap()
        .request(blocks(&[2]))
        .unwrap();
    let (phase, took) = terminal(&d, 2, Duration::from_secs(10));
    assert_eq!(
        phase,
        Phase::Failed(FailReason::Aborted(AbortReason::Engine))
    );
    assert!(took < Duration::from_secs(5), "failed fast, took {took:?}");
    assert!(d.stats().limit_hits >= 1, "{:?}", d.stats());
    // The first request is untouched by the refusal.
    assert!(!d.phase(TransferId(1)).expect("known").is_terminal());
}

#[test]
fn bootstrap_target_limit_fails_a_request_at_once() {
    let mut c = NodeConfig::new(Role::Decode, "d");
    c.max_bootstrap_targets = 1;
    let (d, _mem) = node(c);
    // A bootstrap "service" that accepts connections and never answers, so
    // the first target stays in the middle of its query.
    let hang = TcpListener::bind("127.0.0.1:0").unwrap();
    let first = PrefillTarget::Bootstrap {
        addr: hang.local_addr().unwrap().to_string(),
        engine_id: "p1".into(),
        dp_rank: Some(0),
    };
    let second = PrefillTarget::Bootstrap {
        addr: hang.local_addr().unwrap().to_string(),
        engine_id: "p2".into(),
        dp_rank: Some(0),
    };
    d.receiver(TransferId(1), &first)
        .unwrap()
        .request(blocks(&[1]))
        .unwrap();
    // The first query is under way once it connects; the connection is
    // held open, unanswered, for the rest of the test.
    let _held = hang.accept().expect("the bridge queries the first target");
    d.receiver(TransferId(2), &second)
        .unwrap()
        .request(blocks(&[2]))
        .unwrap();
    let (phase, took) = terminal(&d, 2, Duration::from_secs(10));
    assert_eq!(
        phase,
        Phase::Failed(FailReason::Aborted(AbortReason::Engine))
    );
    assert!(took < Duration::from_secs(5), "failed fast, took {took:?}");
    assert!(d.stats().limit_hits >= 1, "{:?}", d.stats());
}

#[test]
fn finished_records_are_bounded() {
    let mut c = NodeConfig::new(Role::Decode, "d");
    c.max_finished_records = 2;
    let (d, _mem) = node(c);
    let target = PrefillTarget::Direct {
        tp_size: 1,
        pp_size: 1,
        side_channels: vec![],
    };
    for tid in 1..=5u64 {
        let rx = d.receiver(TransferId(tid), &target).unwrap();
        rx.request(blocks(&[tid as u32])).unwrap();
        rx.abort().unwrap();
        assert!(rx.wait(Duration::from_secs(10)).is_terminal());
    }
    // The last completion is queued just after its phase turned terminal:
    // collect until it is in, each collection bounded by the limit.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut seen = Vec::new();
    while !seen.contains(&TransferId(5)) && Instant::now() < deadline {
        let (_, received) = d.get_finished();
        assert!(
            received.len() <= 2,
            "at most max_finished_records kept: {received:?}"
        );
        seen.extend(received);
        std::thread::yield_now();
    }
    assert!(
        seen.contains(&TransferId(5)),
        "the newest record is kept: {seen:?}"
    );
    assert!(
        !seen.contains(&TransferId(1)),
        "the oldest was dropped: {seen:?}"
    );
    assert!(d.stats().limit_hits >= 1, "the drop is counted");
}

#[test]
fn zero_limits_are_refused_at_start() {
    for set in [
        (|c: &mut NodeConfig| c.max_peers = 0) as fn(&mut NodeConfig),
        |c| c.max_finished_records = 0,
        |c| c.bridge_queue_capacity = 0,
        |c| c.max_bootstrap_targets = 0,
        |c| c.max_data_sessions = 0,
    ] {
        let mut c = NodeConfig::new(Role::Decode, "d");
        set(&mut c);
        assert!(matches!(
            Node::start(c),
            Err(NodeError::Misuse(Misuse::ZeroBound(_)))
        ));
    }
}

#[test]
fn config_and_call_misuse_are_typed() {
    let mut c = NodeConfig::new(Role::Decode, "d");
    c.tp_size = 2;
    c.tp_rank = 2;
    assert!(matches!(
        Node::start(c),
        Err(NodeError::Misuse(Misuse::TpRank {
            tp_rank: 2,
            tp_size: 2
        }))
    ));
    let mut c = NodeConfig::new(Role::Decode, "d");
    c.timeouts.lease = c.timeouts.heartbeat_interval;
    assert!(matches!(
        Node::start(c),
        Err(NodeError::Misuse(Misuse::Timeouts(_)))
    ));
    let d = Node::start(NodeConfig::new(Role::Decode, "d")).unwrap();
    assert!(matches!(
        d.sender(TransferId(1)),
        Err(NodeError::Misuse(Misuse::WrongRole(Role::Prefill)))
    ));
    d.shutdown(std::time::Duration::ZERO);
}
