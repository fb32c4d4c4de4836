//! The ZeroMQ side channel over tcp://127.0.0.1: every message type both
//! ways, hostile frames at a live ROUTER, backpressure, send failures.

use std::sync::Arc;
use std::time::Duration;

use kvferry::bootstrap::Metrics;
use kvferry::sidechannel::{
    Event, Outgoing, Route, SendError, SendFailure, SideChannel, SideChannelConfig,
    SideChannelError, SocketId,
};
use kvferry::wire::{
    self, Abort, AbortAck, AbortCode, Done, ErrorCode, Heartbeat, HeartbeatAck, Hello, LayoutKind,
    LeaseGrant, LeaseRequest, Limits, Message, Pull, Ready, RegionInfo, Status, TransferMode,
    MAGIC, VERSION,
};

/// Upper bound on waiting for one event; a failure bound, never a pacing.
const WAIT: Duration = Duration::from_secs(10);

fn recv(rx: &flume::Receiver<Event>) -> Event {
    rx.recv_timeout(WAIT).expect("event within the deadline")
}

fn recv_msg(rx: &flume::Receiver<Event>) -> (Route, Message) {
    match recv(rx) {
        Event::Message { from, msg } => (from, msg),
        other => panic!("expected a message, got {other:?}"),
    }
}

fn hello(engine_id: &str) -> Message {
    Message::Hello(Hello {
        engine_id: engine_id.into(),
        dp_rank: 0,
        tp_rank: 1,
        pp_rank: 0,
        tp_size: 2,
        total_kv_heads: 8,
        block_tokens: 16,
        num_blocks: 1000,
        layout: LayoutKind::Hnd,
        mode: TransferMode::Push,
        regions: (0..4)
            .map(|layer| RegionInfo {
                base: 0x7f00_0000_0000 + layer as u64 * (1 << 20),
                len_bytes: 1 << 20,
                block_len_bytes: 1024,
                kv_block_len_bytes: 512,
                group: 0,
                layer,
            })
            .collect(),
        transport_endpoint: "127.0.0.1:7000".into(),
    })
}

fn every_message() -> Vec<Message> {
    vec![
        hello("decode-0"),
        Message::Pull(Pull {
            transfer_id: 42,
            dst_blocks: vec![vec![1, 2, 3], vec![7]],
            prefix_blocks: vec![0, 1],
            expected_senders: 2,
            receivers_expected: 1,
            lease_seq: Some(0),
            deadline_ms: 30_000,
            lease_ms: 10_000,
        }),
        Message::Ready(Ready {
            transfer_id: 43,
            chunk: 0,
            start_blocks: vec![0],
            src_blocks: vec![vec![9, 8]],
            is_last: true,
        }),
        Message::LeaseRequest(LeaseRequest {
            transfer_id: 43,
            seq: 1,
        }),
        Message::LeaseGrant(LeaseGrant {
            transfer_id: 43,
            seq: 1,
            duration_ms: 10_000,
        }),
        Message::Done(Done {
            transfer_id: 43,
            ok: true,
        }),
        Message::Status(Status {
            transfer_id: 42,
            result: Ok(()),
        }),
        Message::Status(Status {
            transfer_id: 44,
            result: Err(ErrorCode::Transport),
        }),
        Message::Abort(Abort {
            transfer_id: 45,
            reason: AbortCode::ClientDisconnect,
        }),
        Message::AbortAck(AbortAck { transfer_id: 45 }),
        Message::Heartbeat(Heartbeat {
            seq: 1,
            renew: vec![42, 43],
            lease_ms: 10_000,
        }),
        Message::HeartbeatAck(HeartbeatAck {
            seq: 1,
            unknown: vec![43],
        }),
    ]
}

struct Pair {
    prefill: SideChannel,
    decode: SideChannel,
    p_metrics: Arc<Metrics>,
    p_rx: flume::Receiver<Event>,
    d_rx: flume::Receiver<Event>,
    endpoint: String,
    dealer: Route,
}

fn pair(p_config: SideChannelConfig, p_sink_capacity: usize) -> Pair {
    let p_metrics = Arc::new(Metrics::new());
    let prefill = SideChannel::start(p_config, Arc::clone(&p_metrics)).expect("prefill bridge");
    let decode = SideChannel::start(SideChannelConfig::default(), Arc::new(Metrics::new()))
        .expect("decode bridge");
    let (p_tx, p_rx) = flume::bounded(p_sink_capacity);
    let (d_tx, d_rx) = flume::bounded(1024);
    let (_router, endpoint) = prefill
        .bind_router("tcp://127.0.0.1:0", p_tx)
        .expect("bind router");
    assert!(endpoint.starts_with("tcp://127.0.0.1:"), "{endpoint}");
    assert!(!endpoint.ends_with(":0"));
    let dealer = decode.connect_dealer(&endpoint, d_tx).expect("connect");
    // The dealer's monitor reports the completed handshake first.
    assert_eq!(recv(&d_rx), Event::PeerConnected { dealer });
    Pair {
        prefill,
        decode,
        p_metrics,
        p_rx,
        d_rx,
        endpoint,
        dealer: Route::Dealer(dealer),
    }
}

/// D says hello, P learns D's route from it; returns that route.
fn handshake(p: &Pair) -> Route {
    p.decode
        .outbox()
        .send(Outgoing {
            to: p.dealer.clone(),
            msg: hello("decode-0"),
        })
        .expect("queued");
    let (from, msg) = recv_msg(&p.p_rx);
    assert_eq!(msg, hello("decode-0"));
    assert!(matches!(from, Route::Router { .. }));
    from
}

#[test]
fn every_message_type_both_ways() {
    let p = pair(SideChannelConfig::default(), 1024);
    let d_route = handshake(&p);
    let d_out = p.decode.outbox();
    let p_out = p.prefill.outbox();
    for msg in every_message() {
        d_out
            .send(Outgoing {
                to: p.dealer.clone(),
                msg: msg.clone(),
            })
            .expect("queued");
        let (from, got) = recv_msg(&p.p_rx);
        assert_eq!(got, msg);
        assert_eq!(from, d_route, "same peer, same route");

        p_out
            .send(Outgoing {
                to: from,
                msg: msg.clone(),
            })
            .expect("queued");
        let (from, got) = recv_msg(&p.d_rx);
        assert_eq!(got, msg);
        assert_eq!(from, p.dealer);
    }
    let n = every_message().len() as u64 + 1;
    let snap = p.p_metrics.snapshot();
    assert_eq!(snap.sidechannel_received, n);
    assert_eq!(snap.sidechannel_sent, n - 1);
    assert_eq!(snap.sidechannel_decode_errors, 0);
    assert_eq!(p.prefill.decode_errors(), 0);
    p.decode.shutdown();
    p.prefill.shutdown();
}

#[test]
fn async_send_and_order_under_a_full_sink() {
    // A sink of one: the bridge must stall the socket, not drop messages.
    let p = pair(SideChannelConfig::default(), 1);
    let d_out = p.decode.outbox();
    let count = 500u64;
    futures::executor::block_on(async {
        for seq in 0..count {
            d_out
                .send_async(Outgoing {
                    to: p.dealer.clone(),
                    msg: Message::Heartbeat(Heartbeat {
                        seq,
                        renew: vec![],
                        lease_ms: 1,
                    }),
                })
                .await
                .expect("queued");
        }
    });
    for seq in 0..count {
        match recv_msg(&p.p_rx).1 {
            Message::Heartbeat(hb) => assert_eq!(hb.seq, seq, "in order, none lost"),
            other => panic!("unexpected {other:?}"),
        }
    }
    assert!(p.p_rx.is_empty());
}

#[test]
fn send_failures_are_reported_to_the_sink() {
    let limits = Limits {
        max_ids: 4,
        ..Limits::default()
    };
    let p = pair(
        SideChannelConfig {
            limits,
            ..SideChannelConfig::default()
        },
        16,
    );
    let d_route = handshake(&p);
    let Route::Router { router, .. } = d_route else {
        unreachable!("handshake checked the route kind")
    };
    let out = p.prefill.outbox();

    // A peer the router never saw.
    let ghost = Route::Router {
        router,
        identity: b"ghost".to_vec(),
    };
    let ack = Message::AbortAck(AbortAck { transfer_id: 1 });
    out.send(Outgoing {
        to: ghost.clone(),
        msg: ack.clone(),
    })
    .expect("queued");
    assert_eq!(
        recv(&p.p_rx),
        Event::SendFailed {
            to: ghost,
            msg: ack,
            reason: SendFailure::Unroutable
        }
    );

    // Over our own limits: refused before it reaches the peer.
    let big = Message::HeartbeatAck(HeartbeatAck {
        seq: 1,
        unknown: (0..5).collect(),
    });
    out.send(Outgoing {
        to: d_route.clone(),
        msg: big,
    })
    .expect("queued");
    match recv(&p.p_rx) {
        Event::SendFailed {
            reason: SendFailure::TooLarge(_),
            ..
        } => {}
        other => panic!("expected TooLarge, got {other:?}"),
    }
    assert_eq!(p.p_metrics.snapshot().sidechannel_send_failures, 2);

    // Misuse is typed, and a closed bridge hands the message back.
    assert!(matches!(
        p.prefill
            .bind_router("not-an-endpoint", flume::bounded(1).0),
        Err(SideChannelError::InvalidEndpoint(_))
    ));
    assert!(matches!(
        p.prefill.bind_router(&p.endpoint, flume::bounded(1).0),
        Err(SideChannelError::Zmq { op: "bind", .. })
    ));
    p.prefill
        .close(SocketId::Router(router))
        .expect("close router");
    assert!(matches!(
        p.prefill.close(SocketId::Router(router)),
        Err(SideChannelError::UnknownSocket)
    ));
    p.prefill.shutdown();
    let msg = Message::AbortAck(AbortAck { transfer_id: 2 });
    match out.send(Outgoing {
        to: d_route,
        msg: msg.clone(),
    }) {
        Err(SendError::Closed(back)) => assert_eq!(back.msg, msg),
        other => panic!("expected Closed, got {other:?}"),
    }
}

fn header() -> Vec<u8> {
    let mut f = MAGIC.to_vec();
    f.extend_from_slice(&VERSION.to_le_bytes());
    f
}

#[test]
fn hostile_frames_at_a_live_router_are_counted_and_survived() {
    let max_frame_bytes = 64 * 1024;
    let limits = Limits {
        max_frame_bytes,
        ..Limits::default()
    };
    let p = pair(
        SideChannelConfig {
            limits,
            ..SideChannelConfig::default()
        },
        4096,
    );
    let ctx = zmq::Context::new();
    let mut rng = fastrand::Rng::with_seed(0x5eed_f022);
    let valid: Vec<Vec<u8>> = every_message().iter().map(wire::encode).collect();

    // Several raw DEALERs, each throwing multipart messages of random shape
    // at the router: garbage, truncated and bit-flipped valid frames, huge
    // claimed lengths, empty frames, too many parts, wrong versions.
    let mut expected_errors = 0u64;
    let mut expected_valid = 0u64;
    let attackers: Vec<zmq::Socket> = (0..3)
        .map(|_| {
            let s = ctx.socket(zmq::DEALER).expect("socket");
            s.set_linger(0).expect("linger");
            s.connect(&p.endpoint).expect("connect");
            s
        })
        .collect();
    for i in 0..1500 {
        let attacker = &attackers[i % attackers.len()];
        let pick = &valid[rng.usize(..valid.len())];
        let payload: Vec<u8> = match rng.u8(..8) {
            0 => (0..rng.usize(..200)).map(|_| rng.u8(..)).collect(),
            1 => pick[..rng.usize(..pick.len())].to_vec(),
            2 => {
                let mut f = pick.clone();
                for _ in 0..rng.usize(1..4) {
                    let j = rng.usize(..f.len());
                    f[j] ^= rng.u8(1..);
                }
                f
            }
            3 => {
                // Valid header, a Pull claiming 2^32-1 groups or blocks.
                let mut f = header();
                f.push(wire::encode(&every_message()[1])[wire::HEADER_LEN]);
                f.push(1);
                f.extend_from_slice(&[0xff, 0xff, 0xff, 0xff, 0x0f]);
                f
            }
            4 => Vec::new(),
            5 => {
                let mut f = pick.clone();
                f[2] = 9; // version 9
                f
            }
            6 => {
                let mut f = pick.clone();
                f.extend_from_slice(&[0, 1, 2]); // trailing bytes
                f
            }
            _ => pick.clone(),
        };
        let extra_parts = if rng.u8(..6) == 0 { rng.usize(1..5) } else { 0 };
        let mut parts = vec![payload.clone()];
        for _ in 0..extra_parts {
            parts.push((0..rng.usize(..32)).map(|_| rng.u8(..)).collect());
        }
        if extra_parts > 0 || wire::decode(&payload, &limits).is_err() {
            expected_errors += 1;
        } else {
            expected_valid += 1;
        }
        attacker.send_multipart(parts, 0).expect("send");
    }
    // A frame over MAXMSGSIZE makes libzmq drop that connection; it never
    // reaches the decoder. Its own socket, so no sentinel is lost with it.
    let oversized = ctx.socket(zmq::DEALER).expect("socket");
    oversized.set_linger(0).expect("linger");
    oversized.connect(&p.endpoint).expect("connect");
    oversized
        .send(vec![0u8; max_frame_bytes + 1], 0)
        .expect("send oversized");

    // ZeroMQ keeps each connection's order, so once every attacker's
    // sentinel is in, everything it sent before has been handled.
    let sentinel = |i: u64| {
        Message::AbortAck(AbortAck {
            transfer_id: 1_000_000 + i,
        })
    };
    for (i, attacker) in attackers.iter().enumerate() {
        attacker
            .send(wire::encode(&sentinel(i as u64)), 0)
            .expect("sentinel");
    }
    let mut sentinels = 0;
    let mut delivered_valid = 0u64;
    while sentinels < attackers.len() {
        let (_, msg) = recv_msg(&p.p_rx);
        match msg {
            Message::AbortAck(AbortAck { transfer_id }) if transfer_id >= 1_000_000 => {
                sentinels += 1
            }
            _ => delivered_valid += 1,
        }
    }
    assert!(expected_errors > 1000, "the test sends mostly garbage");
    assert_eq!(p.prefill.decode_errors(), expected_errors);
    assert_eq!(
        p.p_metrics.snapshot().sidechannel_decode_errors,
        expected_errors
    );
    assert_eq!(delivered_valid, expected_valid);

    // And the node still serves a normal peer, both ways.
    let d_route = handshake(&p);
    p.prefill
        .outbox()
        .send(Outgoing {
            to: d_route,
            msg: every_message()[6].clone(),
        })
        .expect("queued");
    assert_eq!(recv_msg(&p.d_rx).1, every_message()[6]);
    assert_eq!(p.prefill.decode_errors(), expected_errors);
}

#[test]
fn dealer_reports_disconnect_and_reconnect() {
    let p = pair(SideChannelConfig::default(), 64);
    let Route::Dealer(dealer) = p.dealer else {
        unreachable!("pair() connects a dealer")
    };
    let first_route = handshake(&p);
    let endpoint = p.endpoint.clone();
    // The prefill side goes away (as a killed process would).
    p.prefill.shutdown();
    assert_eq!(recv(&p.d_rx), Event::PeerDisconnected { dealer });

    // A new prefill node on the same endpoint: the dealer reconnects by
    // itself and the exchange works again.
    let prefill = SideChannel::start(SideChannelConfig::default(), Arc::new(Metrics::new()))
        .expect("new prefill bridge");
    let (p_tx, p_rx) = flume::bounded(64);
    prefill.bind_router(&endpoint, p_tx).expect("rebind");
    assert_eq!(recv(&p.d_rx), Event::PeerConnected { dealer });
    p.decode
        .outbox()
        .send(Outgoing {
            to: p.dealer.clone(),
            msg: hello("again"),
        })
        .expect("queued");
    let (from, msg) = recv_msg(&p_rx);
    assert_eq!(msg, hello("again"));
    // The dealer's routing id survived the reconnect.
    let (
        Route::Router {
            identity: before, ..
        },
        Route::Router {
            identity: after, ..
        },
    ) = (&first_route, &from)
    else {
        panic!("router routes expected: {first_route:?} {from:?}")
    };
    assert_eq!(before, after);
    prefill
        .outbox()
        .send(Outgoing {
            to: from,
            msg: Message::AbortAck(AbortAck { transfer_id: 5 }),
        })
        .expect("queued");
    assert_eq!(
        recv_msg(&p.d_rx).1,
        Message::AbortAck(AbortAck { transfer_id: 5 })
    );
}

#[test]
fn replies_reach_the_right_decode_rank() {
    // Two decode nodes (two bridges in one process, as in the demo) on one
    // prefill router: distinct routes, and each reply lands where it should.
    let p = pair(SideChannelConfig::default(), 64);
    let d1_route = handshake(&p);
    let other = SideChannel::start(SideChannelConfig::default(), Arc::new(Metrics::new()))
        .expect("second decode bridge");
    let (tx2, rx2) = flume::bounded(64);
    let dealer2 = other.connect_dealer(&p.endpoint, tx2).expect("connect");
    assert_eq!(recv(&rx2), Event::PeerConnected { dealer: dealer2 });
    other
        .outbox()
        .send(Outgoing {
            to: Route::Dealer(dealer2),
            msg: hello("decode-1"),
        })
        .expect("queued");
    let (d2_route, msg) = recv_msg(&p.p_rx);
    assert_eq!(msg, hello("decode-1"));
    assert_ne!(d1_route, d2_route);

    let out = p.prefill.outbox();
    for (route, id) in [(&d2_route, 2), (&d1_route, 1)] {
        out.send(Outgoing {
            to: route.clone(),
            msg: Message::AbortAck(AbortAck { transfer_id: id }),
        })
        .expect("queued");
    }
    assert_eq!(
        recv_msg(&rx2).1,
        Message::AbortAck(AbortAck { transfer_id: 2 })
    );
    assert_eq!(
        recv_msg(&p.d_rx).1,
        Message::AbortAck(AbortAck { transfer_id: 1 })
    );
}

#[test]
fn many_round_trips_never_stall() {
    // Liveness of the ping-pong path, where every message is the last one
    // in flight and a missed wake-up would stall for good. The bridge once
    // had such a bug (a router polled twice in one zmq_poll call lost the
    // edge-triggered wake-up of a message arriving between the two
    // ZMQ_EVENTS reads); `cargo bench --bench sidechannel` found it after
    // thousands of round trips. Its window is too narrow for this test to
    // hit reliably, but any stall fails it: every wait is bounded.
    let p = pair(SideChannelConfig::default(), 64);
    let d_route = handshake(&p);
    let p_out = p.prefill.outbox();
    let d_out = p.decode.outbox();
    for seq in 0..3000u64 {
        d_out
            .send(Outgoing {
                to: p.dealer.clone(),
                msg: Message::LeaseRequest(LeaseRequest {
                    transfer_id: 1,
                    seq,
                }),
            })
            .expect("queued");
        let (from, msg) = recv_msg(&p.p_rx);
        assert_eq!(from, d_route);
        assert_eq!(
            msg,
            Message::LeaseRequest(LeaseRequest {
                transfer_id: 1,
                seq
            })
        );
        p_out
            .send(Outgoing {
                to: from,
                msg: Message::LeaseGrant(LeaseGrant {
                    transfer_id: 1,
                    seq,
                    duration_ms: 10,
                }),
            })
            .expect("queued");
        match recv_msg(&p.d_rx).1 {
            Message::LeaseGrant(g) => assert_eq!(g.seq, seq),
            other => panic!("unexpected {other:?}"),
        }
    }
}

#[test]
fn glommio_executor_consumes_and_replies() {
    // The consumers are glommio executors: events arrive through
    // `recv_async` and replies leave through `send_async`, without blocking
    // the executor thread.
    let p = pair(SideChannelConfig::default(), 64);
    let p_rx = p.p_rx.clone();
    let p_out = p.prefill.outbox();
    let rounds = 100u64;
    let executor = glommio::LocalExecutorBuilder::new(glommio::Placement::Unbound)
        .name("sidechannel-test")
        .spawn(move || async move {
            let mut answered = 0u64;
            while answered < rounds {
                match p_rx.recv_async().await.expect("event") {
                    Event::Message {
                        from,
                        msg: Message::LeaseRequest(req),
                    } => {
                        p_out
                            .send_async(Outgoing {
                                to: from,
                                msg: Message::LeaseGrant(LeaseGrant {
                                    transfer_id: req.transfer_id,
                                    seq: req.seq,
                                    duration_ms: 5,
                                }),
                            })
                            .await
                            .expect("queued");
                        answered += 1;
                    }
                    other => panic!("unexpected {other:?}"),
                }
            }
            answered
        })
        .expect("executor starts");
    let d_out = p.decode.outbox();
    for seq in 0..rounds {
        d_out
            .send(Outgoing {
                to: p.dealer.clone(),
                msg: Message::LeaseRequest(LeaseRequest {
                    transfer_id: 9,
                    seq,
                }),
            })
            .expect("queued");
    }
    for seq in 0..rounds {
        assert_eq!(
            recv_msg(&p.d_rx).1,
            Message::LeaseGrant(LeaseGrant {
                transfer_id: 9,
                seq,
                duration_ms: 5
            })
        );
    }
    assert_eq!(executor.join().expect("executor"), rounds);
}
