//! The side channel with a cluster key: frames from a peer that did not
//! complete the handshake touch nothing and are counted; a connection
//! ZeroMQ re-establishes on its own gets a new handshake, and requests go
//! on over it.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use kvferry::auth::{handshake::Initiator, ClusterKey, Surface};
use kvferry::machines::internal::common::Mode;
use kvferry::machines::Phase;
use kvferry::node::{Node, NodeConfig, PrefillTarget, Role, TransportKind};
use kvferry::TransferId;
use kvferry_testkit::e2e_timeouts;
use kvferry_testkit::synth::{Rank, SynthKv};

use crate::e2e_auth::{key_file, model};
use crate::proxy::Proxy;

fn rank(role: Role, name: &str, key: PathBuf) -> Rank {
    let mut c = NodeConfig::new(role, name);
    c.mode = Mode::Push;
    c.transport = TransportKind::Tcp;
    c.timeouts = e2e_timeouts();
    c.cluster_key_file = Some(key);
    // Every message over the side channel, none over the data plane.
    c.data_plane_messages = false;
    Rank::start(c, SynthKv::new(model(), 1, 0, 2, 16)).expect("node starts")
}

/// Waits (bounded) until `done` holds: an observable state the node's
/// threads reach on their own.
fn until(what: &str, done: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn rejected(n: &Node) -> u64 {
    n.auth_rejected(Surface::SideChannel)
}

#[test]
fn strangers_frames_are_refused_and_counted() {
    let key = key_file("side-3", 3);
    let prefill = rank(Role::Prefill, "prefill", key.clone());
    let addr = prefill.node.side_channel_addr();
    let ctx = zmq::Context::new();
    let dealer = ctx.socket(zmq::DEALER).unwrap();
    dealer.set_linger(0).unwrap();
    dealer.connect(&addr).unwrap();
    let other = ClusterKey::from_bytes(&[4; 32], None).unwrap();
    let ours = ClusterKey::load(&key, None).unwrap();
    let hostile: Vec<(&str, Vec<u8>)> = vec![
        (
            "a machine frame without a handshake",
            b"KF\x01\x00 a hello, say".to_vec(),
        ),
        (
            "a proof without a handshake",
            [&b"KVFA\x03"[..], &[7; 32]].concat(),
        ),
        ("a HELLO of another key", {
            let i = Initiator::new(&other, "kvferry side channel").unwrap();
            [&b"KVFA\x01"[..], i.hello()].concat()
        }),
    ];
    for (n, (name, bytes)) in hostile.into_iter().enumerate() {
        dealer.send(bytes, 0).unwrap();
        until(name, || rejected(&prefill.node) == n as u64 + 1);
    }
    // A HELLO with the right key's id is answered, but a guessed proof
    // opens nothing and frames after it are refused.
    let init = Initiator::new(&ours, "kvferry side channel").unwrap();
    dealer
        .send([&b"KVFA\x01"[..], init.hello()].concat(), 0)
        .unwrap();
    let challenge = dealer.recv_bytes(0).unwrap();
    assert_eq!(&challenge[..5], b"KVFA\x02");
    dealer
        .send([&b"KVFA\x03"[..], &[9; 32]].concat(), 0)
        .unwrap();
    until("a guessed proof", || rejected(&prefill.node) == 4);
    dealer
        .send(b"KF\x01\x00 after a bad proof".to_vec(), 0)
        .unwrap();
    until("a frame after a bad proof", || rejected(&prefill.node) == 5);

    // A flood of HELLOs past the rank's budget (4096 at once) is dropped
    // and counted; the handshakes it holds are bounded by max_peers. A
    // decode rank whose HELLO was dropped says it again at its next probe.
    for _ in 0..10_000 {
        let i = Initiator::new(&ours, "kvferry side channel").unwrap();
        dealer
            .send([&b"KVFA\x01"[..], i.hello()].concat(), 0)
            .unwrap();
    }
    until("the HELLOs past the budget", || {
        prefill.node.rate_limited(Surface::SideChannel) >= 1
    });

    // The prefill rank serves its cluster as before.
    let decode = rank(Role::Decode, "decode", key);
    let target = PrefillTarget::Direct {
        tp_size: 1,
        pp_size: 1,
        side_channels: vec![addr],
    };
    let wait = Duration::from_secs(10);
    let phase = prefill.send_one(&decode, &target, TransferId(1), (&[1], &[2]), wait);
    assert_eq!(phase, Phase::Success);
}

#[test]
fn a_reconnected_side_channel_is_authenticated_anew() {
    let key = key_file("side-5", 5);
    let prefill = rank(Role::Prefill, "prefill", key.clone());
    let side = prefill.node.side_channel_addr();
    let upstream = side.trim_start_matches("tcp://").parse().unwrap();
    let proxy = Proxy::start(upstream);
    let target = PrefillTarget::Direct {
        tp_size: 1,
        pp_size: 1,
        side_channels: vec![format!("tcp://{}", proxy.addr)],
    };
    let decode = rank(Role::Decode, "decode", key);
    let wait = Duration::from_secs(10);
    let phase = prefill.send_one(&decode, &target, TransferId(1), (&[1], &[2]), wait);
    assert_eq!(phase, Phase::Success);
    assert_eq!(proxy.connections(), 1);

    // The connection drops; ZeroMQ opens another through the proxy, and
    // the peer is alive again once the new handshake and hello went
    // through (the old keys open nothing on the new connection).
    proxy.cut();
    until("a new connection", || proxy.connections() >= 2);
    until("the peer alive again", || decode.node.dead_peers() == 0);
    let phase = prefill.send_one(&decode, &target, TransferId(2), (&[3], &[4]), wait);
    assert_eq!(phase, Phase::Success, "a request over the new connection");
}
