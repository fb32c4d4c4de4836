//! End to end with nodes of role `Both` (vLLM's `kv_both`): one node sends
//! and receives, over its one side channel and its one data plane, real
//! sockets, every byte verified.

use std::collections::BTreeSet;
use std::time::Duration;

use kvferry::machines::internal::common::{Config, Mode};
use kvferry::machines::Phase;
use kvferry::node::{Misuse, NodeConfig, PrefillTarget, Receiver, Role, Sender, TransportKind};
use kvferry::reactor::SubmitError;
use kvferry::{BlockId, FailReason, NodeError, TransferId};
use kvferry_testkit::model;
use kvferry_testkit::synth::{Rank, SynthKv};

const WAIT: Duration = Duration::from_secs(10);
const BLOCKS: u64 = 64;

fn rank(role: Role, name: &str, mode: Mode) -> Rank {
    let mut c = NodeConfig::new(role, name);
    c.mode = mode;
    c.transport = TransportKind::Tcp;
    c.timeouts = Config {
        bootstrap_timeout: Duration::from_secs(30),
        heartbeat_interval: Duration::from_millis(100),
        ..Config::default()
    };
    Rank::start(c, SynthKv::new(model::small(), 1, 0, 2, BLOCKS)).expect("node starts")
}

fn target(p: &Rank) -> PrefillTarget {
    PrefillTarget::Direct {
        tp_size: 1,
        pp_size: 1,
        side_channels: vec![p.node.side_channel_addr()],
    }
}

fn blocks(ids: &[u32]) -> Vec<Vec<BlockId>> {
    vec![ids.iter().map(|&b| BlockId(b)).collect()]
}

/// Request `i` from `p` to `d`: two blocks of `p`'s first half into two of
/// `d`'s second half, so the two directions of one node never share a block.
fn opened(p: &Rank, d: &Rank, tid: TransferId, i: u32) -> (Vec<u32>, Receiver, Sender) {
    let (src, dst) = ([2 * i, 2 * i + 1], [32 + 2 * i, 33 + 2 * i]);
    p.kv.fill(tid, &src, 0);
    d.kv.clear(&dst);
    let rx = d.node.receiver(tid, &target(p)).unwrap();
    rx.request(blocks(&dst)).unwrap();
    let tx = p.node.sender(tid).unwrap();
    tx.send(blocks(&src), true).unwrap();
    (dst.to_vec(), rx, tx)
}

/// Two `Both` nodes send each other `n` requests each, all in flight at
/// once; every byte lands, and each node reports its sends and its
/// receives apart.
fn both_ways(mode: Mode, n: u32) {
    let a = rank(Role::Both, "a", mode);
    let b = rank(Role::Both, "b", mode);
    let mut open = Vec::new();
    for i in 0..n {
        let (ab, ba) = (
            TransferId(1000 + u64::from(i)),
            TransferId(2000 + u64::from(i)),
        );
        open.push((ab, &b, opened(&a, &b, ab, i)));
        open.push((ba, &a, opened(&b, &a, ba, i)));
    }
    for (tid, d, (dst, rx, tx)) in open {
        assert_eq!(rx.wait(WAIT), Phase::Success, "{tid}");
        assert_eq!(d.kv.verify(tid, &dst, 0), Ok(()), "bytes of {tid}");
        assert_eq!(tx.wait(WAIT), Phase::Success, "P's phase of {tid}");
    }
    let ids = |base: u64| (0..u64::from(n)).map(|i| TransferId(base + i)).collect();
    let expect: [(&Rank, BTreeSet<_>, BTreeSet<_>); 2] =
        [(&a, ids(1000), ids(2000)), (&b, ids(2000), ids(1000))];
    for (node, sent, received) in expect {
        let (s, r) = node.node.get_finished();
        let got: (BTreeSet<_>, BTreeSet<_>) = (s.into_iter().collect(), r.into_iter().collect());
        assert_eq!(got, (sent, received), "{:?}", node.node);
        assert!(node.node.side_channel_addr().starts_with("tcp://"));
    }
}

#[test]
fn two_both_nodes_push_to_each_other() {
    both_ways(Mode::Push, 16);
}

#[test]
fn two_both_nodes_pull_from_each_other() {
    both_ways(Mode::Pull, 16);
}

/// A `Both` node between a prefill and a decode engine: it receives from
/// one and sends to the other, with the same node and memory.
#[test]
fn a_both_node_receives_from_a_prefill_and_sends_to_a_decode() {
    for mode in [Mode::Push, Mode::Pull] {
        let p = rank(Role::Prefill, "p", mode);
        let m = rank(Role::Both, "m", mode);
        let d = rank(Role::Decode, "d", mode);
        let (dst, rx, tx) = opened(&p, &m, TransferId(1), 0);
        assert_eq!(rx.wait(WAIT), Phase::Success);
        assert_eq!(m.kv.verify(TransferId(1), &dst, 0), Ok(()));
        assert_eq!(tx.wait(WAIT), Phase::Success);
        let phase = m.send_one(&d, &target(&m), TransferId(2), (&[4, 5], &[6, 7]), WAIT);
        assert_eq!(phase, Phase::Success, "{mode:?}");
        assert_eq!(
            m.node.get_finished(),
            (vec![TransferId(2)], vec![TransferId(1)])
        );
    }
}

/// A transfer id live as a receive on a `Both` node is not also a send: the
/// engine's `sender` is refused, a decode peer's `Pull` for it fails that
/// request at once, and the receive goes on unharmed.
#[test]
fn a_receive_on_a_both_node_is_not_taken_for_a_send() {
    let mode = Mode::Push;
    let p = rank(Role::Prefill, "p", mode);
    let m = rank(Role::Both, "m", mode);
    let d = rank(Role::Decode, "d", mode);
    let tid = TransferId(9);
    let rx = m.node.receiver(tid, &target(&p)).unwrap();
    rx.request(blocks(&[40, 41])).unwrap();
    let e = m.node.sender(tid).unwrap_err();
    assert!(
        matches!(
            e,
            NodeError::Misuse(Misuse::Submit(SubmitError::DuplicateTransfer(t))) if t == tid
        ),
        "{e}"
    );
    // Another engine asks `m` for the same id, as if `m` were its prefill.
    let other = d.node.receiver(tid, &target(&m)).unwrap();
    other.request(blocks(&[0, 1])).unwrap();
    assert_eq!(other.wait(WAIT), Phase::Failed(FailReason::PeerAborted));
    assert!(d.untouched(&[0, 1]));
    // The receive was not disturbed.
    p.kv.fill(tid, &[3, 4], 0);
    let tx = p.node.sender(tid).unwrap();
    tx.send(blocks(&[3, 4]), true).unwrap();
    assert_eq!(rx.wait(WAIT), Phase::Success);
    assert_eq!(m.kv.verify(tid, &[40, 41], 0), Ok(()));
}
