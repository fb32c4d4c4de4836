//! End-to-end with string request ids: prefill and decode nodes in one
//! process, real side channel and tcp data plane, every byte verified.
//! Collisions are forced with a hash that maps every `cmpl-` id to one
//! transfer id, on every node alike.

use std::time::Duration;

use kvferry::machines::internal::common::Mode;
use kvferry::machines::Phase;
use kvferry::{AbortReason, BlockId, FailReason, IdCollision, NodeError, TransferId};
use kvferry_testkit::model;
use kvferry_testkit::synth::{Cluster, ClusterSpec, Rank};

const WAIT: Duration = Duration::from_secs(10);

/// Every `cmpl-` id has transfer id 77; others hash as usual.
fn colliding(id: &str) -> TransferId {
    if id.starts_with("cmpl-") {
        TransferId(77)
    } else {
        TransferId::of_request_id(id)
    }
}

fn blocks(ids: &[u32]) -> Vec<Vec<BlockId>> {
    vec![ids.iter().map(|&b| BlockId(b)).collect()]
}

fn run_named(mode: Mode) {
    let spec = ClusterSpec::new(model::small(), mode);
    let c = Cluster::start(&spec).expect("cluster starts");
    let (p, d) = (&c.prefill[0].node, &c.decode[0].node);
    let ids = [
        "cmpl-6f2c0e1a9b7d4c3e8f2a1b0c9d8e7f6a-0".to_string(),
        "3f8e2d1c-4b5a-4968-8776-a5b4c3d2e1f0".to_string(),
        "x".repeat(kvferry::REQUEST_ID_MAX_BYTES),
    ];
    for (i, id) in ids.iter().enumerate() {
        let tid = p.transfer_id_of(id).unwrap();
        assert_eq!(tid, TransferId::of_request_id(id));
        assert_eq!(d.transfer_id_of(id).unwrap(), tid);
        let (src, dst) = ([1 + i as u32, 9], [30 + i as u32, 20]);
        c.fill(tid, &src);
        let rx = d.receiver_named(id, &c.target).unwrap();
        assert_eq!(rx.request_id(), Some(id.as_str()));
        rx.request(blocks(&dst)).unwrap();
        let tx = p.sender_named(id).unwrap();
        assert_eq!(tx.request_id(), Some(id.as_str()));
        tx.send(blocks(&src), true).unwrap();
        assert_eq!(rx.wait(WAIT), Phase::Success, "{id}");
        assert_eq!(tx.wait(WAIT), Phase::Success, "{id}");
        assert_eq!(c.verify(tid, &dst, 0), 0, "{id}: bytes differ on decode");
    }
    assert!(matches!(
        p.transfer_id_of(""),
        Err(NodeError::Misuse(kvferry::Misuse::RequestId(_)))
    ));
    let long = "y".repeat(kvferry::REQUEST_ID_MAX_BYTES + 1);
    assert!(matches!(
        d.receiver_named(&long, &c.target),
        Err(NodeError::Misuse(kvferry::Misuse::RequestId(_)))
    ));
}

#[test]
fn string_request_ids_move_every_byte_push() {
    run_named(Mode::Push);
}

#[test]
fn string_request_ids_move_every_byte_pull() {
    run_named(Mode::Pull);
}

fn collision(c: &IdCollision, request_id: &str, held: &str) -> bool {
    c.transfer_id == TransferId(77) && c.request_id == request_id && c.held == held
}

/// Prefill holds "cmpl-a"; a second decode engine asks for "cmpl-b" with
/// the same transfer id. Its request fails `IdCollision` and none of
/// prefill's bytes reach it; "cmpl-a" then moves from the first decode
/// engine as if nothing happened, and neither node opens the other string.
#[test]
fn a_pull_naming_another_request_id_fails_only_that_request() {
    let spec = ClusterSpec::new(model::small(), Mode::Push);
    let c = Cluster::start(&spec).expect("cluster starts");
    let d2 = Rank::lone_decode(&spec, "decode-2");
    let (p, d1) = (&c.prefill[0].node, &c.decode[0].node);
    for n in [p, d1, &d2.node] {
        assert!(n.set_request_id_hash(colliding));
    }
    let (src, dst_a, dst_b) = ([3, 4, 5], [10, 11, 12], [20, 21, 22]);
    c.fill(TransferId(77), &src);
    let tx = p.sender_named("cmpl-a").unwrap();
    tx.send(blocks(&src), true).unwrap();

    let rx_b = d2.node.receiver_named("cmpl-b", &c.target).unwrap();
    assert_eq!(rx_b.transfer_id(), TransferId(77));
    rx_b.request(blocks(&dst_b)).unwrap();
    assert_eq!(
        rx_b.wait(WAIT),
        Phase::Failed(FailReason::Aborted(AbortReason::IdCollision))
    );
    assert!(d2.untouched(&dst_b), "bytes of cmpl-a reached cmpl-b");
    match p.sender_named("cmpl-b") {
        Err(NodeError::IdCollision(e)) => assert!(collision(&e, "cmpl-b", "cmpl-a"), "{e:?}"),
        other => panic!("prefill opened a second string for one transfer id: {other:?}"),
    }
    // The refused decode rank's abort did not end prefill's request.
    assert_eq!(tx.poll(), Phase::Bootstrapping);

    let rx_a = d1.receiver_named("cmpl-a", &c.target).unwrap();
    rx_a.request(blocks(&dst_a)).unwrap();
    assert_eq!(rx_a.wait(WAIT), Phase::Success);
    assert_eq!(tx.wait(WAIT), Phase::Success);
    assert_eq!(c.verify(TransferId(77), &dst_a, 0), 0, "cmpl-a differs");
    assert!(d2.untouched(&dst_b), "bytes of cmpl-a reached cmpl-b");
    // Each decode node keeps its string for the transfer id.
    match d1.receiver_named("cmpl-b", &c.target) {
        Err(NodeError::IdCollision(e)) => assert!(collision(&e, "cmpl-b", "cmpl-a"), "{e:?}"),
        other => panic!("decode opened a second string for one transfer id: {other:?}"),
    }
    match d2.node.receiver_named("cmpl-a", &c.target) {
        Err(NodeError::IdCollision(e)) => assert!(collision(&e, "cmpl-a", "cmpl-b"), "{e:?}"),
        other => panic!("decode opened a second string for one transfer id: {other:?}"),
    }
    // Counted where refused: prefill refused the Pull and its own second
    // string; d2 was refused once by prefill and once by itself; d1 once.
    let collisions = |n: &kvferry::Node| n.stats().id_collisions;
    assert_eq!(
        (collisions(p), collisions(&d2.node), collisions(d1)),
        (2, 2, 1)
    );
    drop(d2);
}

/// A decode rank's `Pull` for "cmpl-b" comes before prefill's engine opens
/// anything: prefill takes it, and its engine's "cmpl-a" with the same
/// transfer id is refused.
#[test]
fn a_string_first_named_by_a_pull_holds_its_transfer_id() {
    let spec = ClusterSpec::new(model::small(), Mode::Push);
    let c = Cluster::start(&spec).expect("cluster starts");
    let (p, d) = (&c.prefill[0].node, &c.decode[0].node);
    for n in [p, d] {
        assert!(n.set_request_id_hash(colliding));
    }
    let rx = d.receiver_named("cmpl-b", &c.target).unwrap();
    rx.request(blocks(&[7])).unwrap();
    // The prefill rank learns of the request from the `Pull`.
    let requested = c
        .prefill_events
        .recv_timeout(WAIT)
        .expect("prefill hears of the pull");
    assert_eq!(requested.transfer_id, TransferId(77));
    match p.sender_named("cmpl-a") {
        Err(NodeError::IdCollision(e)) => assert!(collision(&e, "cmpl-a", "cmpl-b"), "{e:?}"),
        other => panic!("prefill opened a second string for one transfer id: {other:?}"),
    }
    c.fill(TransferId(77), &[2]);
    let tx = p.sender_named("cmpl-b").unwrap();
    tx.send(blocks(&[2]), true).unwrap();
    assert_eq!(rx.wait(WAIT), Phase::Success);
    assert_eq!(c.verify(TransferId(77), &[7], 0), 0);
}
