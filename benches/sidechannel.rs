//! Control-plane costs: the wire codec, and a side-channel round trip
//! through two bridges next to a bare ZeroMQ DEALER/ROUTER round trip
//! measured in the same run (issue 4's yardstick).
//!
//! `cargo bench --bench sidechannel`

use std::sync::Arc;
use std::thread;
use std::time::Duration;

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use kvferry::bootstrap::Metrics;
use kvferry::sidechannel::{Event, Outgoing, Route, SideChannel, SideChannelConfig};
use kvferry::wire::{self, Heartbeat, Limits, Message, Pull};

fn pull() -> Message {
    Message::Pull(Pull {
        transfer_id: 0x1234_5678_9abc,
        dst_blocks: vec![(1000..1064).collect(), (5000..5064).collect()],
        prefix_blocks: vec![0, 0],
        expected_senders: 2,
        receivers_expected: 1,
        lease_seq: None,
        deadline_ms: 30_000,
        lease_ms: 10_000,
    })
}

/// About 256 bytes on the wire, like the bare round trip below.
fn heartbeat(seq: u64) -> Message {
    Message::Heartbeat(Heartbeat {
        seq,
        renew: (1u64 << 40..(1u64 << 40) + 40).collect(),
        lease_ms: 10_000,
    })
}

fn codec(c: &mut Criterion) {
    let msg = pull();
    let frame = wire::encode(&msg);
    let limits = Limits::default();
    let mut g = c.benchmark_group("wire");
    g.bench_function("encode_pull_128_blocks", |b| {
        let mut buf = Vec::with_capacity(1024);
        b.iter(|| {
            buf.clear();
            wire::encode_into(black_box(&msg), &mut buf);
            buf.len()
        })
    });
    g.bench_function("decode_pull_128_blocks", |b| {
        b.iter(|| wire::decode(black_box(&frame), &limits).expect("valid"))
    });
    g.finish();
}

fn round_trips(c: &mut Criterion) {
    let mut g = c.benchmark_group("round_trip_256B");
    g.sample_size(30);
    g.measurement_time(Duration::from_secs(3));

    // Bare libzmq: DEALER → ROUTER → echo thread → DEALER.
    let ctx = zmq::Context::new();
    let router = ctx.socket(zmq::ROUTER).expect("router");
    router.set_linger(0).expect("linger");
    router.bind("tcp://127.0.0.1:*").expect("bind");
    let endpoint = router.get_last_endpoint().expect("endpoint").expect("utf8");
    let echo = thread::spawn(move || {
        // An empty frame is the stop signal.
        while let Ok(parts) = router.recv_multipart(0) {
            let stop = parts.get(1).is_none_or(|p| p.is_empty());
            router.send_multipart(parts, 0).expect("echo");
            if stop {
                break;
            }
        }
    });
    let dealer = ctx.socket(zmq::DEALER).expect("dealer");
    dealer.set_linger(0).expect("linger");
    dealer.connect(&endpoint).expect("connect");
    let payload = vec![7u8; 256];
    g.bench_function("bare_zmq", |b| {
        b.iter(|| {
            dealer.send(&payload[..], 0).expect("send");
            dealer.recv_bytes(0).expect("recv")
        })
    });
    dealer.send(&[][..], 0).expect("stop");
    let _ = dealer.recv_bytes(0);
    echo.join().expect("echo thread");

    // Through kvferry: D outbox → D bridge → P bridge → P consumer thread
    // (echoes) → P bridge → D bridge → D sink. Same wire size.
    let prefill = SideChannel::start(SideChannelConfig::default(), Arc::new(Metrics::new()))
        .expect("prefill");
    let decode =
        SideChannel::start(SideChannelConfig::default(), Arc::new(Metrics::new())).expect("decode");
    let (p_tx, p_rx) = flume::bounded::<Event>(1024);
    let (d_tx, d_rx) = flume::bounded::<Event>(1024);
    let (_, endpoint) = prefill
        .bind_router("tcp://127.0.0.1:0", p_tx)
        .expect("bind");
    let dealer = Route::Dealer(decode.connect_dealer(&endpoint, d_tx).expect("connect"));
    let p_out = prefill.outbox();
    let echo = thread::spawn(move || {
        while let Ok(event) = p_rx.recv() {
            if let Event::Message { from, msg } = event {
                if p_out.send(Outgoing { to: from, msg }).is_err() {
                    break;
                }
            }
        }
    });
    let frame_len = wire::encode(&heartbeat(0)).len();
    assert!(
        (240..=272).contains(&frame_len),
        "heartbeat frame is {frame_len} bytes, meant to be about 256"
    );
    let d_out = decode.outbox();
    let mut seq = 0;
    g.bench_function("kvferry_bridges", |b| {
        b.iter(|| {
            seq += 1;
            d_out
                .send(Outgoing {
                    to: dealer.clone(),
                    msg: heartbeat(seq),
                })
                .expect("send");
            loop {
                match d_rx.recv().expect("reply") {
                    Event::Message { .. } => break,
                    // Connection events are not part of the round trip.
                    Event::PeerConnected { .. } | Event::PeerDisconnected { .. } => {}
                    other => panic!("unexpected {other:?}"),
                }
            }
        })
    });
    g.finish();
    decode.shutdown();
    prefill.shutdown();
    echo.join().expect("echo thread");
}

criterion_group!(benches, codec, round_trips);
criterion_main!(benches);
