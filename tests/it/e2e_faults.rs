//! End-to-end faults in one process: aborts, and a prefill rank that stops
//! answering (peer-dead detection, fail-fast, recovery).

use std::time::{Duration, Instant};

use kvferry::machines::internal::common::{BlockId, Config, Mode};
use kvferry::machines::{FailReason, Phase};
use kvferry::TransferId;
use kvferry_testkit::model::{self, ModelSpecExt};
use kvferry_testkit::synth::{Cluster, ClusterSpec};

fn timeouts() -> Config {
    Config {
        bootstrap_timeout: Duration::from_secs(3),
        waiting_timeout: Duration::from_secs(3),
        claim_timeout: Duration::from_secs(3),
        lease: Duration::from_millis(600),
        hold_limit: Duration::from_secs(6),
        transfer_bound: Duration::from_millis(500),
        fence_margin: Duration::from_millis(100),
        heartbeat_interval: Duration::from_millis(100),
        heartbeat_misses: 3,
        ..Config::default()
    }
}

fn spec(mode: Mode) -> ClusterSpec {
    ClusterSpec {
        prefill_blocks: 32,
        decode_blocks: 32,
        timeouts: timeouts(),
        ..ClusterSpec::new(model::small().with_heads(2).with_head_bytes(64), mode)
    }
}

/// Collects prefill's finished transfers (like an engine step) until `tid`
/// is among them or 5 s passed: its completion is queued just after its
/// phase turns terminal. Returns everything collected.
fn collect_sent_until(node: &kvferry::node::Node, tid: TransferId) -> Vec<TransferId> {
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut sent = Vec::new();
    while !sent.contains(&tid) && Instant::now() < deadline {
        sent.extend(node.get_finished().0);
        std::thread::yield_now();
    }
    sent
}

fn ids(v: &[u32]) -> Vec<Vec<BlockId>> {
    vec![v.iter().map(|&b| BlockId(b)).collect()]
}

#[test]
fn decode_abort_releases_prefill_once_and_no_write_lands_after() {
    for mode in [Mode::Push, Mode::Pull] {
        let c = Cluster::start(&spec(mode)).unwrap();
        let (p, d) = (&c.prefill[0], &c.decode[0]);
        let src = [1, 2, 3];
        let dst = [7, 8, 9];
        c.fill(TransferId(5), &src);
        d.kv.clear(&dst);
        let rx = d.node.receiver(TransferId(5), &c.target).unwrap();
        rx.request(ids(&dst)).unwrap();
        let tx = p.node.sender(TransferId(5)).unwrap();
        // D gives up before P has its KV (client disconnect on D).
        rx.abort().unwrap();
        let phase = rx.wait(Duration::from_secs(5));
        assert!(matches!(phase, Phase::Failed(_)), "{mode:?}: {phase:?}");
        // P's KV shows up late: nothing may be written into D's blocks now.
        let _ = tx.send(ids(&src), true);
        let p_phase = tx.wait(Duration::from_secs(5));
        assert!(
            p_phase.is_terminal() && p_phase != Phase::Success,
            "{mode:?}: {p_phase:?}"
        );
        let s = p.node.stats();
        assert_eq!(
            s.ok + s.failed + s.expired,
            1,
            "{mode:?}: P released exactly once"
        );
        assert_eq!(s.bytes, 0, "{mode:?}: P moved no byte");
        assert!(
            d.kv.verify(TransferId(5), &dst, 0).is_err(),
            "{mode:?}: D blocks must not hold P's KV"
        );
    }
}

#[test]
fn prefill_abort_fails_decode_promptly() {
    let c = Cluster::start(&spec(Mode::Push)).unwrap();
    let rx = c.decode[0].node.receiver(TransferId(9), &c.target).unwrap();
    rx.request(ids(&[1])).unwrap();
    let tx = c.prefill[0].node.sender(TransferId(9)).unwrap();
    let t0 = Instant::now();
    tx.abort().unwrap();
    let phase = rx.wait(Duration::from_secs(5));
    assert_eq!(phase, Phase::Failed(FailReason::PeerAborted));
    assert!(
        t0.elapsed() < Duration::from_secs(2),
        "abort took {:?}",
        t0.elapsed()
    );
}

#[test]
fn dead_prefill_fails_requests_fast() {
    let c = Cluster::start(&spec(Mode::Push)).unwrap();
    let (p, d) = (&c.prefill[0], &c.decode[0]);
    // One request proves the pair works.
    c.fill(TransferId(1), &[1]);
    c.start_request(TransferId(1), &[1], &[1], 0).unwrap();
    assert_eq!(
        c.wait_decode(TransferId(1), Duration::from_secs(5)),
        vec![Phase::Success]
    );
    // P stops; from now on its side channel is silent.
    p.node.shutdown(Duration::ZERO);
    let t0 = Instant::now();
    let rx = d.node.receiver(TransferId(2), &c.target).unwrap();
    rx.request(ids(&[2])).unwrap();
    // Heartbeat detection (3 x 100 ms), far below the 3 s waiting timeout.
    assert_eq!(
        rx.wait(Duration::from_secs(5)),
        Phase::Failed(FailReason::PeerDead)
    );
    assert!(
        t0.elapsed() < Duration::from_millis(1500),
        "took {:?}",
        t0.elapsed()
    );
    assert_eq!(d.node.dead_peers(), 1);
    assert!(d.node.stats().peers_marked_dead >= 1);
    // A new request to the dead peer fails at once instead of waiting.
    let t0 = Instant::now();
    let rx = d.node.receiver(TransferId(3), &c.target).unwrap();
    rx.request(ids(&[3])).unwrap();
    assert_eq!(
        rx.wait(Duration::from_secs(5)),
        Phase::Failed(FailReason::PeerDead)
    );
    assert!(
        t0.elapsed() < Duration::from_millis(250),
        "fail-fast took {:?}",
        t0.elapsed()
    );
    // Its destination blocks are reported as load errors (vLLM API).
    let errors = d.node.block_ids_with_load_errors();
    assert!(
        errors.contains(&BlockId(2)) && errors.contains(&BlockId(3)),
        "{errors:?}"
    );
}

#[test]
fn junk_frames_at_a_live_prefill_are_rejected_and_it_keeps_serving() {
    use kvferry::machines::internal::wire::{self, Frame};
    let c = Cluster::start(&spec(Mode::Push)).unwrap();
    let p = &c.prefill[0];
    let ctx = zmq::Context::new();
    let s = ctx.socket(zmq::DEALER).unwrap();
    s.set_linger(0).unwrap();
    s.connect(&p.node.side_channel_addr()).unwrap();
    let mut rng = fastrand::Rng::with_seed(7);
    let valid = wire::encode(&Frame::Heartbeat { seq: 1 });
    let mut sent = 0u64;
    for i in 0..3000 {
        let frame: Vec<u8> = match i % 4 {
            // Random bytes.
            0 => (0..rng.usize(0..200)).map(|_| rng.u8(..)).collect(),
            // Right magic, wrong version.
            1 => vec![b'K', b'N', 9, 0, 1, 2, 3],
            // A valid header with a corrupted body.
            2 => {
                let mut v = valid.clone();
                v.extend((0..rng.usize(1..50)).map(|_| rng.u8(..)));
                let at = rng.usize(4..v.len());
                v[at] = rng.u8(..);
                v
            }
            // A well-formed frame from a peer that never said hello.
            _ => wire::encode(&Frame::Transfer {
                transfer_id: kvferry::machines::TransferId(rng.u64(..)),
                msg: kvferry::machines::internal::common::Msg::LeaseRequest { seq: 1 },
            }),
        };
        // Multi-part frames are junk too.
        if i % 17 == 0 {
            s.send(&b"extra"[..], zmq::SNDMORE).unwrap();
        }
        s.send(frame, 0).unwrap();
        sent += 1;
    }
    // A normal transfer completes afterwards; the bridge handled the junk
    // in order before it (ZeroMQ keeps order per connection only, so wait
    // until the counter moved to be sure junk was seen).
    c.fill(TransferId(1), &[1, 2]);
    c.start_request(TransferId(1), &[1, 2], &[3, 4], 0).unwrap();
    assert_eq!(
        c.wait_decode(TransferId(1), Duration::from_secs(10)),
        vec![Phase::Success]
    );
    assert_eq!(c.verify(TransferId(1), &[3, 4], 0), 0);
    let deadline = Instant::now() + Duration::from_secs(10);
    while p.node.stats().bad_frames < sent / 2 && Instant::now() < deadline {
        std::thread::yield_now();
    }
    assert!(
        p.node.stats().bad_frames >= sent / 2,
        "{:?}",
        p.node.stats()
    );
    // And once more after all the junk was processed.
    c.fill(TransferId(2), &[5]);
    c.start_request(TransferId(2), &[5], &[6], 0).unwrap();
    assert_eq!(
        c.wait_decode(TransferId(2), Duration::from_secs(10)),
        vec![Phase::Success]
    );
    assert_eq!(c.verify(TransferId(2), &[6], 0), 0);
}

/// A bare ZeroMQ ROUTER on 127.0.0.1 playing a prefill rank: its context,
/// the socket and its address.
fn bare_router() -> (zmq::Context, zmq::Socket, String) {
    let ctx = zmq::Context::new();
    let router = ctx.socket(zmq::ROUTER).unwrap();
    router.set_linger(0).unwrap();
    router.bind("tcp://127.0.0.1:*").unwrap();
    let addr = router.get_last_endpoint().unwrap().unwrap();
    (ctx, router, addr)
}

/// Receives one frame on `s` within 5 s.
fn recv_within(s: &zmq::Socket) -> Vec<Vec<u8>> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match s.recv_multipart(zmq::DONTWAIT) {
            Ok(parts) => return parts,
            Err(zmq::Error::EAGAIN) if Instant::now() < deadline => {
                let mut items = [s.as_poll_item(zmq::POLLIN)];
                zmq::poll(&mut items, 100).unwrap();
            }
            Err(e) => panic!("no frame within 5 s: {e}"),
        }
    }
}

#[test]
fn a_prefill_refuses_a_hello_of_a_future_version_and_keeps_serving() {
    use kvferry::machines::internal::wire::{self, Frame, Refuse, RefuseReason};
    let c = Cluster::start(&spec(Mode::Push)).unwrap();
    let p = &c.prefill[0];
    // A decode rank of a newer build: the hello of our model, under the next
    // version's header (its body could be anything).
    let d = &c.decode[0];
    let hello = Frame::Hello(wire::Hello {
        engine_id: "future".into(),
        mode: Mode::Push,
        model: spec(Mode::Push).model,
        layout: kvferry::machines::RankLayout {
            tp_size: 1,
            tp_rank: 0,
            num_blocks: 32,
            regions: d.kv.kv_layout().regions,
            stage: kvferry::machines::Stage::SINGLE,
            pools: Vec::new(),
        },
        endpoint: "tcp://127.0.0.1:1".into(),
    });
    let mut future = Vec::new();
    wire::encode_versioned(&hello, wire::VERSION + 1, &mut future);
    let ctx = zmq::Context::new();
    let s = ctx.socket(zmq::DEALER).unwrap();
    s.set_linger(0).unwrap();
    s.connect(&p.node.side_channel_addr()).unwrap();
    s.send(future, 0).unwrap();
    let answer = recv_within(&s);
    assert_eq!(answer.len(), 1);
    // The refusal reads the same under every version.
    assert_eq!(
        wire::decode(&answer[0], &wire::Limits::default()),
        Ok(Frame::Refuse(Refuse {
            version: wire::VERSION,
            reason: RefuseReason::UnsupportedVersion,
        }))
    );
    let stats = p.node.stats();
    assert_eq!(stats.version_refusals_sent, 1, "{stats:?}");
    assert_eq!(stats.bad_frames, 0, "{stats:?}");
    // Peers of this version are served as before.
    c.fill(TransferId(1), &[1, 2]);
    c.start_request(TransferId(1), &[1, 2], &[3, 4], 0).unwrap();
    assert_eq!(
        c.wait_decode(TransferId(1), Duration::from_secs(10)),
        vec![Phase::Success]
    );
    assert_eq!(c.verify(TransferId(1), &[3, 4], 0), 0);
}

#[test]
fn a_decode_rank_refused_by_a_future_prefill_fails_its_request_at_once() {
    use kvferry::machines::internal::wire::{self, Frame, Refuse, RefuseReason};
    use kvferry::node::{Node, NodeConfig, PrefillTarget, Role};
    use kvferry_testkit::synth::SynthKv;
    // A prefill rank of a newer build, played by a bare ROUTER.
    let (_ctx, router, addr) = bare_router();
    let model = spec(Mode::Push).model;
    let mut dc = NodeConfig::new(Role::Decode, "d");
    dc.timeouts = timeouts();
    let dkv = SynthKv::new(model, 1, 0, 2, 8);
    let d = Node::start(dc).unwrap();
    // SAFETY: `d` is shut down at the end, before `dkv` drops.
    unsafe { d.register_kv_caches(dkv.kv_layout()).unwrap() };
    let target = PrefillTarget::Direct {
        tp_size: 1,
        pp_size: 1,
        side_channels: vec![addr],
    };
    let t0 = Instant::now();
    let rx = d.receiver(TransferId(5), &target).unwrap();
    rx.request(ids(&[2])).unwrap();
    // Decode introduces itself in this build's version...
    let hello = recv_within(&router);
    assert_eq!(hello.len(), 2);
    assert!(matches!(
        wire::decode(&hello[1], &wire::Limits::default()),
        Ok(Frame::Hello(_))
    ));
    // ...and the newer prefill refuses under its own header.
    let mut refuse = Vec::new();
    let frame = Frame::Refuse(Refuse {
        version: wire::VERSION + 1,
        reason: RefuseReason::UnsupportedVersion,
    });
    wire::encode_versioned(&frame, wire::VERSION + 1, &mut refuse);
    router
        .send_multipart([hello[0].clone(), refuse], 0)
        .unwrap();
    assert_eq!(
        rx.wait(Duration::from_secs(5)),
        Phase::Failed(FailReason::BadMetadata)
    );
    // Well before the bootstrap timeout (3 s here) would have expired it.
    assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    let stats = d.stats();
    assert_eq!(stats.version_refusals_received, 1, "{stats:?}");
    d.shutdown(Duration::ZERO);
}

#[test]
fn prefill_reuses_the_peer_slot_of_a_dead_decode_rank() {
    use kvferry::node::{Node, NodeConfig, PrefillTarget, Role};
    use kvferry_testkit::synth::SynthKv;
    let model = spec(Mode::Push).model;
    let mut pc = NodeConfig::new(Role::Prefill, "p");
    pc.timeouts = timeouts();
    pc.max_peers = 1;
    let pkv = SynthKv::new(model, 1, 0, 2, 8);
    let p = Node::start(pc).unwrap();
    // SAFETY: `p` is shut down at the end, before `pkv` drops.
    unsafe { p.register_kv_caches(pkv.kv_layout()).unwrap() };
    let target = PrefillTarget::Direct {
        tp_size: 1,
        pp_size: 1,
        side_channels: vec![p.side_channel_addr()],
    };
    for round in 0..3u64 {
        // A fresh decode rank each round: a new ZeroMQ identity at P.
        let mut dc = NodeConfig::new(Role::Decode, "d");
        dc.timeouts = timeouts();
        let dkv = SynthKv::new(model, 1, 0, 2, 8);
        let d = Node::start(dc).unwrap();
        // SAFETY: `d` is shut down below, before `dkv` drops.
        unsafe { d.register_kv_caches(dkv.kv_layout()).unwrap() };
        let tid = 100 + round;
        pkv.fill(TransferId(tid), &[1], 0);
        let rx = d.receiver(TransferId(tid), &target).unwrap();
        rx.request(ids(&[2])).unwrap();
        p.sender(TransferId(tid))
            .unwrap()
            .send(ids(&[1]), true)
            .unwrap();
        // Round 0 takes the only slot; later rounds reuse it (the previous
        // decode rank was declared dead at the end of its round).
        assert_eq!(
            rx.wait(Duration::from_secs(5)),
            Phase::Success,
            "round {round}"
        );
        assert!(dkv.verify(TransferId(tid), &[2], 0).is_ok());
        d.shutdown(Duration::ZERO);
        drop(d);
        drop(dkv);
        // P notices the silence (3 missed heartbeats) and frees the slot.
        let t0 = Instant::now();
        while p.dead_peers() != 1 {
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "P never declared the decode rank dead"
            );
            std::thread::yield_now();
        }
    }
    p.shutdown(Duration::ZERO);
}

#[test]
fn prefill_sender_after_decode_abort_ends_at_once() {
    // Decode asks and gives up before the prefill engine has its KV; the
    // engine's later `sender`/`send` must learn the outcome at once instead
    // of holding its blocks for the bootstrap timeout (3 s here).
    for mode in [Mode::Push, Mode::Pull] {
        let c = Cluster::start(&spec(mode)).unwrap();
        let (p, d) = (&c.prefill[0], &c.decode[0]);
        let rx = d.node.receiver(TransferId(9), &c.target).unwrap();
        rx.request(ids(&[4, 5])).unwrap();
        // Wait until P learned of the transfer (its machine exists), then abort.
        let deadline = Instant::now() + Duration::from_secs(5);
        while p.node.phase(TransferId(9)).is_none() && Instant::now() < deadline {
            std::thread::yield_now();
        }
        assert!(
            p.node.phase(TransferId(9)).is_some(),
            "{mode:?}: P never heard of it"
        );
        rx.abort().unwrap();
        assert!(matches!(rx.wait(Duration::from_secs(5)), Phase::Failed(_)));
        // A connector collects finished transfers every step (vLLM's
        // `get_finished`), so the ended machine is gone from the executor.
        let sent = collect_sent_until(&p.node, TransferId(9));
        assert!(sent.contains(&TransferId(9)), "{mode:?}: {sent:?}");
        let started = Instant::now();
        let tx = p.node.sender(TransferId(9)).unwrap();
        tx.send(ids(&[1, 2]), true).unwrap();
        let phase = tx.wait(Duration::from_secs(10));
        assert_eq!(phase, Phase::Failed(FailReason::PeerAborted), "{mode:?}");
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "{mode:?}: took {:?}",
            started.elapsed()
        );
        let s = p.node.stats();
        assert_eq!(s.ok + s.failed + s.expired, 1, "{mode:?}: released once");
    }
}

#[test]
fn pull_for_a_transfer_prefill_already_ended_fails_decode_at_once() {
    // The prefill engine gives up on a request before decode asks (and the
    // connector collected it). Decode's `Pull` must be answered with an
    // abort at once, not start a second prefill machine and leave decode
    // waiting out its deadline (3 s here).
    for mode in [Mode::Push, Mode::Pull] {
        let c = Cluster::start(&spec(mode)).unwrap();
        let (p, d) = (&c.prefill[0], &c.decode[0]);
        let tx = p.node.sender(TransferId(11)).unwrap();
        tx.abort().unwrap();
        assert!(tx.wait(Duration::from_secs(5)).is_terminal(), "{mode:?}");
        let sent = collect_sent_until(&p.node, TransferId(11));
        assert!(sent.contains(&TransferId(11)), "{mode:?}: {sent:?}");
        let started = Instant::now();
        let rx = d.node.receiver(TransferId(11), &c.target).unwrap();
        rx.request(ids(&[4, 5])).unwrap();
        let phase = rx.wait(Duration::from_secs(10));
        assert_eq!(phase, Phase::Failed(FailReason::PeerAborted), "{mode:?}");
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "{mode:?}: took {:?}",
            started.elapsed()
        );
        let s = p.node.stats();
        assert_eq!(
            s.ok + s.failed + s.expired,
            1,
            "{mode:?}: no second prefill machine"
        );
    }
}

/// Frames from decode on a bare ROUTER playing a prefill rank, decoded,
/// until `want` picks one; `(identity, picked)`.
fn recv_until<T>(
    router: &zmq::Socket,
    mut want: impl FnMut(kvferry::machines::internal::wire::Frame) -> Option<T>,
) -> (Vec<u8>, T) {
    use kvferry::machines::internal::wire;
    loop {
        let parts = recv_within(router);
        let frame = wire::decode(&parts[1], &wire::Limits::default()).unwrap();
        if let Some(t) = want(frame) {
            return (parts[0].clone(), t);
        }
    }
}

/// A data-plane connection to a prefill rank that fails (refused here)
/// marks the rank dead at once: the next request to it fails fast, before
/// any heartbeat could miss. Its answer to decode's next probe clears the
/// mark, and the recovery is counted.
#[test]
fn a_failed_data_plane_connection_marks_the_peer_dead_until_it_answers() {
    use kvferry::machines::internal::common::Msg;
    use kvferry::machines::internal::wire::{self, Frame};
    use kvferry::machines::{RankLayout, Region};
    use kvferry::node::{Node, NodeConfig, PrefillTarget, Role};
    use kvferry_testkit::synth::SynthKv;
    // A prefill rank played by a bare ROUTER whose hello names a
    // data-plane endpoint where nothing listens.
    let (_ctx, router, addr) = bare_router();
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("tcp://{}", closed.local_addr().unwrap());
    drop(closed);
    let model = spec(Mode::Pull).model;
    let mut dc = NodeConfig::new(Role::Decode, "d");
    dc.mode = Mode::Pull;
    dc.timeouts = Config {
        // Silence never kills the peer here: only the failed connection.
        heartbeat_misses: 100_000,
        ..timeouts()
    };
    let dkv = SynthKv::new(model, 1, 0, 2, 8);
    let d = Node::start(dc).unwrap();
    // SAFETY: `d` is shut down at the end, before `dkv` drops.
    unsafe { d.register_kv_caches(dkv.kv_layout()).unwrap() };
    let target = PrefillTarget::Direct {
        tp_size: 1,
        pp_size: 1,
        side_channels: vec![addr],
    };
    let regions: Vec<Region> = dkv.kv_layout().regions;
    let hello = Frame::Hello(wire::Hello {
        engine_id: "p".into(),
        mode: Mode::Pull,
        model,
        layout: RankLayout {
            tp_size: 1,
            tp_rank: 0,
            num_blocks: 8,
            regions,
            stage: kvferry::machines::Stage::SINGLE,
            pools: Vec::new(),
        },
        endpoint,
    });
    let rx = d.receiver(TransferId(1), &target).unwrap();
    rx.request(ids(&[2])).unwrap();
    let (id, ()) = recv_until(&router, |f| matches!(f, Frame::Hello(_)).then_some(()));
    router
        .send_multipart([id, wire::encode(&hello)], 0)
        .unwrap();
    // Decode's `Pull` carries its lease request: grant it, announce a chunk.
    let (id, seq) = recv_until(&router, |f| match f {
        Frame::Transfer {
            msg: Msg::Pull { lease_seq, .. },
            ..
        } => lease_seq,
        _ => None,
    });
    for msg in [
        Msg::LeaseGrant {
            seq,
            duration_ms: 5000,
        },
        Msg::Ready {
            chunk: 0,
            start_blocks: vec![0],
            src_blocks: ids(&[1]),
            is_last: true,
        },
    ] {
        let frame = Frame::Transfer {
            transfer_id: TransferId(1),
            msg,
        };
        router
            .send_multipart([id.clone(), wire::encode(&frame)], 0)
            .unwrap();
    }
    let phase = rx.wait(Duration::from_secs(5));
    assert!(
        matches!(
            phase,
            Phase::Failed(FailReason::Transport | FailReason::PeerDead)
        ),
        "{phase:?}"
    );
    // The read's failure and the mark travel apart (executor, bridge).
    let deadline = Instant::now() + Duration::from_secs(5);
    while d.stats().peers_marked_dead == 0 && Instant::now() < deadline {
        std::thread::yield_now();
    }
    let s = d.stats();
    assert_eq!((s.peers_marked_dead, s.dead_now), (1, 1), "{s:?}");
    // A new request to that rank fails at once.
    let rx = d.receiver(TransferId(2), &target).unwrap();
    rx.request(ids(&[3])).unwrap();
    assert_eq!(
        rx.wait(Duration::from_secs(5)),
        Phase::Failed(FailReason::PeerDead)
    );
    // Decode probes the dead rank with hellos; an answer revives it.
    let (id, ()) = recv_until(&router, |f| matches!(f, Frame::Hello(_)).then_some(()));
    router
        .send_multipart([id, wire::encode(&hello)], 0)
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while d.stats().peer_recoveries == 0 && Instant::now() < deadline {
        std::thread::yield_now();
    }
    let s = d.stats();
    assert_eq!((s.peer_recoveries, s.dead_now), (1, 0), "{s:?}");
    d.shutdown(Duration::ZERO);
}
