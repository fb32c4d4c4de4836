//! The `tcp` transport moves real bytes, validates every descriptor on both
//! ends, survives hostile frames, peer failures and peer restarts.
//!
//! Both endpoints of a test live on one glommio executor (the target's tasks
//! run whenever the initiator awaits), so no test needs threads or sleeps.

use std::future::Future;
use std::net::SocketAddr;
use std::os::fd::AsRawFd;

use futures::io::{AsyncReadExt, AsyncWriteExt};
use glommio::net::{TcpListener, TcpStream};
use glommio::{LocalExecutorBuilder, Placement};
use kvferry::transport::internal::wire::{self, Header, RejectReason};
use kvferry::transport::{
    Desc, EndpointAddr, MisuseError, Op, PeerError, PollPolicy, RangeFault, Session, Transport,
    TransportError,
};
use kvferry::transport::{ShmConfig, ShmMode, TcpConfig, TcpSession, TcpTransport};

fn block_on<T>(f: impl Future<Output = T>) -> T {
    LocalExecutorBuilder::new(Placement::Unbound)
        .make()
        .expect("executor")
        .run(f)
}

fn any_port() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

/// A registered buffer and its base address.
struct Buf {
    bytes: Vec<u8>,
}

impl Buf {
    fn random(len: usize, seed: u64) -> Buf {
        let mut bytes = vec![0u8; len];
        fastrand::Rng::with_seed(seed).fill(&mut bytes);
        Buf { bytes }
    }
    fn filled(len: usize, byte: u8) -> Buf {
        Buf {
            bytes: vec![byte; len],
        }
    }
    fn addr(&self) -> u64 {
        self.bytes.as_ptr() as u64
    }
    fn register(&mut self, t: &impl Transport) -> kvferry::transport::RegionId {
        // SAFETY: every buffer outlives the endpoints in these tests, and
        // nothing reads it while a transfer runs.
        unsafe {
            t.register(self.bytes.as_mut_ptr(), self.bytes.len())
                .expect("register")
        }
    }
}

async fn pair(config: TcpConfig) -> (TcpTransport, TcpTransport, TcpSession) {
    let target = TcpTransport::bind(any_port(), config.clone()).unwrap();
    let initiator = TcpTransport::bind(any_port(), config).unwrap();
    let session = initiator.open(&target.endpoint_addr()).await.unwrap();
    (target, initiator, session)
}

/// Non-overlapping random `(offset, len)` pieces covering a prefix of a
/// buffer of `total` bytes, in shuffled order.
fn pieces(sizes: &[u64], rng: &mut fastrand::Rng) -> Vec<(u64, u64)> {
    let mut off = 0;
    let mut out: Vec<(u64, u64)> = sizes
        .iter()
        .map(|&len| {
            let p = (off, len);
            off += len + rng.u64(0..4); // small gaps that must stay untouched
            p
        })
        .collect();
    rng.shuffle(&mut out);
    out
}

fn span(p: &[(u64, u64)]) -> usize {
    p.iter().map(|&(o, l)| o + l).max().unwrap_or(0) as usize + 8
}

/// Writes random pieces one way, reads them back the other, checks every
/// byte including the untouched gaps.
async fn round_trip(config: TcpConfig, sizes: &[u64], seed: u64) {
    let mut rng = fastrand::Rng::with_seed(seed);
    let src_pieces = pieces(sizes, &mut rng);
    let dst_pieces = pieces(sizes, &mut rng);
    let (target, initiator, session) = pair(config).await;
    let mut src = Buf::random(span(&src_pieces), seed);
    let mut dst = Buf::filled(span(&dst_pieces), 0xA5);
    let mut back = Buf::filled(span(&src_pieces), 0x5A);
    src.register(&initiator);
    back.register(&initiator);
    dst.register(&target);
    // Pair pieces of equal length: sort both by length with a stable order.
    let mut s = src_pieces.clone();
    let mut d = dst_pieces.clone();
    s.sort_by_key(|&(o, l)| (l, o));
    d.sort_by_key(|&(o, l)| (l, o));
    let descs: Vec<Desc> = s
        .iter()
        .zip(&d)
        .map(|(&(so, l), &(dof, _))| Desc {
            local_addr: src.addr() + so,
            remote_addr: dst.addr() + dof,
            len_bytes: l,
        })
        .collect();
    session
        .transfer(Op::Write, &descs)
        .await
        .expect("write batch");
    let mut expected = vec![0xA5u8; dst.bytes.len()];
    for dsc in &descs {
        let so = (dsc.local_addr - src.addr()) as usize;
        let dof = (dsc.remote_addr - dst.addr()) as usize;
        let l = dsc.len_bytes as usize;
        expected[dof..dof + l].copy_from_slice(&src.bytes[so..so + l]);
    }
    assert!(dst.bytes == expected, "written bytes differ");
    // Pull everything back into `back` at the source offsets.
    let reads: Vec<Desc> = descs
        .iter()
        .map(|d| Desc {
            local_addr: d.local_addr - src.addr() + back.addr(),
            ..*d
        })
        .collect();
    session
        .transfer(Op::Read, &reads)
        .await
        .expect("read batch");
    let mut expected_back = vec![0x5Au8; back.bytes.len()];
    for dsc in &descs {
        let so = (dsc.local_addr - src.addr()) as usize;
        let l = dsc.len_bytes as usize;
        expected_back[so..so + l].copy_from_slice(&src.bytes[so..so + l]);
    }
    assert!(back.bytes == expected_back, "read-back bytes differ");
    session.close().await;
    drop((target, initiator));
}

#[test]
fn sizes_from_one_byte_to_64_mib_both_directions() {
    let sizes = [
        1,
        2,
        3,
        7,
        64,
        4095,
        4096,
        4097,
        65_537,
        (1 << 20) + 3,
        5 << 20,
        64 << 20,
    ];
    for (i, poll) in [PollPolicy::default(), PollPolicy::Park]
        .into_iter()
        .enumerate()
    {
        let config = TcpConfig {
            streams: 3,
            poll,
            ..TcpConfig::default()
        };
        block_on(round_trip(config, &sizes, 11 + i as u64));
    }
}

#[test]
fn thousands_of_small_descriptors_over_several_frames() {
    let mut rng = fastrand::Rng::with_seed(7);
    let sizes: Vec<u64> = (0..5000).map(|_| rng.u64(1..=300)).collect();
    let config = TcpConfig {
        streams: 2,
        frame_max_descs: 1024,
        ..TcpConfig::default()
    };
    block_on(round_trip(config, &sizes, 3));
}

#[test]
fn tight_inflight_bound_still_completes() {
    // Credits for exactly one frame per stream: the sender must wait for
    // every acknowledgement, and the batch must still finish intact.
    let config = TcpConfig {
        streams: 2,
        frame_max_bytes: 64 << 10,
        inflight_max_bytes: 128 << 10,
        ..TcpConfig::default()
    };
    block_on(round_trip(config, &[8 << 20, 100_000, 1], 5));
}

#[test]
fn concurrent_batches_on_one_session() {
    block_on(async {
        let (target, initiator, session) = pair(TcpConfig::default()).await;
        let mut src = Buf::random(8 << 20, 1);
        let mut dst = Buf::filled(8 << 20, 0);
        src.register(&initiator);
        dst.register(&target);
        let chunk = 1u64 << 20;
        let batches: Vec<Vec<Desc>> = (0..8)
            .map(|i| {
                // Batch i: one large descriptor or 256 small ones.
                let base = i * chunk;
                if i % 2 == 0 {
                    vec![Desc {
                        local_addr: src.addr() + base,
                        remote_addr: dst.addr() + base,
                        len_bytes: chunk,
                    }]
                } else {
                    (0..256)
                        .map(|k| Desc {
                            local_addr: src.addr() + base + k * 4096,
                            remote_addr: dst.addr() + base + k * 4096,
                            len_bytes: 4096,
                        })
                        .collect()
                }
            })
            .collect();
        let results =
            futures::future::join_all(batches.iter().map(|b| session.transfer(Op::Write, b))).await;
        for r in results {
            r.expect("concurrent batch");
        }
        assert!(src.bytes == dst.bytes);
        drop((target, initiator));
    });
}

#[test]
fn out_of_region_batches_fail_typed_and_move_nothing() {
    block_on(async {
        let (target, initiator, session) = pair(TcpConfig::default()).await;
        let mut src = Buf::random(1 << 20, 2);
        let mut dst = Buf::filled(1 << 20, 0x11);
        src.register(&initiator);
        let dst_region = dst.register(&target);
        let (src_addr, dst_addr) = (src.addr(), dst.addr());
        let good = |k: u64| Desc {
            local_addr: src_addr + k * 64,
            remote_addr: dst_addr + k * 64,
            len_bytes: 64,
        };
        // Remote side out of region at index 1500 of 3000 (several frames).
        let mut descs: Vec<Desc> = (0..3000).map(good).collect();
        descs[1500].remote_addr = dst.addr() + (1 << 20) - 10;
        let err = session.transfer(Op::Write, &descs).await.unwrap_err();
        assert!(
            matches!(
                err,
                TransportError::Misuse(MisuseError::RemoteDescriptor {
                    index: 1500,
                    fault: RangeFault::OutOfRegion
                })
            ),
            "{err:?}"
        );
        // Local side out of region.
        let mut descs: Vec<Desc> = (0..3000).map(good).collect();
        descs[2999].local_addr = src.addr() + (1 << 20);
        let err = session.transfer(Op::Write, &descs).await.unwrap_err();
        assert!(
            matches!(
                err,
                TransportError::Misuse(MisuseError::LocalDescriptor {
                    index: 2999,
                    fault: RangeFault::OutOfRegion
                })
            ),
            "{err:?}"
        );
        // Zero length and overflow are rejected too, in both directions.
        let mut descs: Vec<Desc> = (0..10).map(good).collect();
        descs[3].len_bytes = 0;
        let err = session.transfer(Op::Read, &descs).await.unwrap_err();
        assert!(
            matches!(
                err,
                TransportError::Misuse(MisuseError::LocalDescriptor {
                    index: 3,
                    fault: RangeFault::Empty
                })
            ),
            "{err:?}"
        );
        let mut descs: Vec<Desc> = (0..10).map(good).collect();
        descs[4].remote_addr = u64::MAX - 8;
        let err = session.transfer(Op::Read, &descs).await.unwrap_err();
        assert!(
            matches!(
                err,
                TransportError::Misuse(MisuseError::RemoteDescriptor {
                    index: 4,
                    fault: RangeFault::Overflow
                })
            ),
            "{err:?}"
        );
        assert!(
            dst.bytes.iter().all(|&b| b == 0x11),
            "a rejected batch moved bytes"
        );
        // The target unregisters behind the initiator's back: the target's
        // own check rejects the frame and nothing lands.
        target.unregister(dst_region).unwrap();
        let err = session.transfer(Op::Write, &[good(0)]).await.unwrap_err();
        assert!(
            matches!(
                err,
                TransportError::Peer(PeerError::Rejected {
                    reason: RejectReason::OutOfRegion,
                    index: 0
                })
            ),
            "{err:?}"
        );
        assert!(
            dst.bytes.iter().all(|&b| b == 0x11),
            "a rejected frame moved bytes"
        );
        // After re-registering, the same session works again.
        dst.register(&target);
        session
            .transfer(Op::Write, &[good(0), good(5)])
            .await
            .expect("after re-register");
        assert_eq!(&dst.bytes[..64], &src.bytes[..64]);
        assert_eq!(&dst.bytes[320..384], &src.bytes[320..384]);
        drop((target, initiator));
    });
}

// ---------------------------------------------------------------------------
// Crafted frames straight at a target
// ---------------------------------------------------------------------------

fn request(opcode: u8, entries: &[(u64, u64)], payload_len: u64, req_id: u64) -> Vec<u8> {
    let h = Header {
        opcode,
        count: entries.len() as u32,
        req_id,
        payload_len,
        ..Header::default()
    };
    let mut b = h.encode().to_vec();
    for &(a, l) in entries {
        wire::encode_entry(&mut b, a, l);
    }
    b
}

async fn response(s: &mut TcpStream) -> Header {
    let mut hb = [0u8; wire::HEADER_LEN];
    s.read_exact(&mut hb).await.expect("response header");
    Header::decode(&hb).expect("valid response header")
}

/// True once the target has closed the connection.
async fn is_closed(s: &mut TcpStream) -> bool {
    let mut b = [0u8; 1];
    matches!(s.read(&mut b).await, Ok(0) | Err(_))
}

#[test]
fn crafted_frames_are_rejected_and_the_endpoint_keeps_serving() {
    block_on(async {
        let config = TcpConfig::default();
        let target = TcpTransport::bind(any_port(), config.clone()).unwrap();
        let initiator = TcpTransport::bind(any_port(), config).unwrap();
        // The target registers the middle of a larger allocation; the guard
        // bytes around it must never change.
        let mut whole = Buf::filled(3 * 4096, 0xEE);
        let region_addr = whole.addr() + 4096;
        // SAFETY: `whole` outlives the endpoint.
        unsafe {
            target
                .register(whole.bytes.as_mut_ptr().add(4096), 4096)
                .unwrap()
        };
        let mut src = Buf::random(4096, 9);
        src.register(&initiator);
        let addr = target.local_addr();
        let payload = vec![0x77u8; 100];

        // Each case: the frame, the expected reject, whether the connection
        // must stay usable afterwards.
        let cases: Vec<(&str, Vec<u8>, RejectReason, bool)> = vec![
            (
                "write past the region end",
                [
                    request(wire::OP_WRITE, &[(region_addr + 4000, 100)], 100, 1),
                    payload.clone(),
                ]
                .concat(),
                RejectReason::OutOfRegion,
                true,
            ),
            (
                "write before the region",
                [
                    request(wire::OP_WRITE, &[(region_addr - 50, 100)], 100, 2),
                    payload.clone(),
                ]
                .concat(),
                RejectReason::OutOfRegion,
                true,
            ),
            (
                "second descriptor out of region",
                [
                    request(
                        wire::OP_WRITE,
                        &[(region_addr, 50), (region_addr + 8192, 50)],
                        100,
                        3,
                    ),
                    payload.clone(),
                ]
                .concat(),
                RejectReason::OutOfRegion,
                true,
            ),
            (
                "overflowing addr + len",
                [
                    request(wire::OP_WRITE, &[(u64::MAX - 10, 100)], 100, 4),
                    payload.clone(),
                ]
                .concat(),
                RejectReason::Overflow,
                true,
            ),
            (
                "zero-length descriptor",
                [
                    request(
                        wire::OP_WRITE,
                        &[(region_addr, 0), (region_addr, 100)],
                        100,
                        5,
                    ),
                    payload.clone(),
                ]
                .concat(),
                RejectReason::EmptyDescriptor,
                true,
            ),
            (
                "read out of region",
                request(wire::OP_READ, &[(region_addr + 4096, 1)], 0, 6),
                RejectReason::OutOfRegion,
                true,
            ),
            (
                "payload length mismatch",
                [
                    request(wire::OP_WRITE, &[(region_addr, 100)], 99, 7),
                    payload[..99].to_vec(),
                ]
                .concat(),
                RejectReason::LengthMismatch,
                false,
            ),
            (
                "read with a payload",
                request(wire::OP_READ, &[(region_addr, 100)], 100, 8),
                RejectReason::LengthMismatch,
                false,
            ),
            (
                "too many descriptors",
                Header {
                    opcode: wire::OP_WRITE,
                    count: wire::MAX_FRAME_DESCS + 1,
                    req_id: 9,
                    payload_len: 0,
                    ..Header::default()
                }
                .encode()
                .to_vec(),
                RejectReason::TooLarge,
                false,
            ),
            (
                "zero descriptors",
                request(wire::OP_WRITE, &[], 0, 10),
                RejectReason::TooLarge,
                false,
            ),
            (
                "frame larger than the limit",
                request(
                    wire::OP_READ,
                    &[(region_addr, wire::MAX_FRAME_BYTES), (region_addr, 1)],
                    0,
                    11,
                ),
                RejectReason::TooLarge,
                false,
            ),
            (
                "lengths summing past u64",
                request(
                    wire::OP_WRITE,
                    &[(region_addr, u64::MAX), (region_addr, 2)],
                    1,
                    12,
                ),
                RejectReason::TooLarge,
                false,
            ),
            (
                "unknown opcode",
                request(99, &[(region_addr, 1)], 0, 13),
                RejectReason::UnknownOpcode,
                false,
            ),
            (
                "bad magic",
                {
                    let mut b = request(wire::OP_WRITE, &[(region_addr, 1)], 1, 14);
                    b[0] = b'X';
                    b
                },
                RejectReason::BadHeader,
                false,
            ),
            (
                "status byte in a request",
                {
                    let mut b = request(wire::OP_READ, &[(region_addr, 1)], 0, 15);
                    b[5] = 1;
                    b
                },
                RejectReason::BadHeader,
                false,
            ),
            (
                "regions request with a body",
                request(wire::OP_REGIONS, &[(region_addr, 1)], 0, 16),
                RejectReason::BadHeader,
                false,
            ),
        ];
        for (name, frame, reason, keeps) in cases {
            let mut s = TcpStream::connect(addr).await.unwrap();
            s.write_all(&frame).await.unwrap();
            let h = response(&mut s).await;
            assert_eq!(RejectReason::from_status(h.status), reason, "{name}");
            assert_eq!(h.payload_len, 0, "{name}: a reject carries no payload");
            if keeps {
                // Same connection: a valid 16-byte write still lands.
                let ok = [
                    request(wire::OP_WRITE, &[(region_addr + 16, 16)], 16, 100),
                    vec![0x42; 16],
                ]
                .concat();
                s.write_all(&ok).await.unwrap();
                let h = response(&mut s).await;
                assert_eq!(
                    (h.status, h.req_id),
                    (wire::STATUS_OK, 100),
                    "{name}: connection unusable"
                );
            } else {
                assert!(
                    is_closed(&mut s).await,
                    "{name}: connection should be closed"
                );
            }
            assert!(
                whole.bytes[..4096].iter().all(|&b| b == 0xEE),
                "{name}: guard before changed"
            );
            assert!(
                whole.bytes[8192..].iter().all(|&b| b == 0xEE),
                "{name}: guard after changed"
            );
            let untouched = whole.bytes[4096..4096 + 16]
                .iter()
                .chain(&whole.bytes[4096 + 32..8192]);
            assert!(
                untouched.into_iter().all(|&b| b == 0xEE),
                "{name}: region changed outside the valid write"
            );
        }

        // Truncated frames: a partial header, a partial table, a partial
        // payload, each followed by a close. No response, no panic.
        for cut in [
            5usize,
            wire::HEADER_LEN + 3,
            wire::HEADER_LEN + wire::ENTRY_LEN + 10,
        ] {
            let mut s = TcpStream::connect(addr).await.unwrap();
            let frame = [
                request(wire::OP_WRITE, &[(region_addr + 64, 100)], 100, 20),
                payload.clone(),
            ]
            .concat();
            s.write_all(&frame[..cut]).await.unwrap();
            s.shutdown(std::net::Shutdown::Write).await.unwrap();
            assert!(is_closed(&mut s).await, "cut at {cut}: target should close");
        }
        assert!(whole.bytes[..4096].iter().all(|&b| b == 0xEE));
        assert!(whole.bytes[8192..].iter().all(|&b| b == 0xEE));

        // The endpoint still serves a normal session after all of that.
        let session = initiator.open(&target.endpoint_addr()).await.unwrap();
        let d = Desc {
            local_addr: src.addr(),
            remote_addr: region_addr,
            len_bytes: 4096,
        };
        session
            .transfer(Op::Write, &[d])
            .await
            .expect("valid batch after hostile frames");
        assert_eq!(&whole.bytes[4096..8192], &src.bytes[..]);
        assert!(whole.bytes[..4096].iter().all(|&b| b == 0xEE));
        // Connections of the hostile clients are all gone or idle.
        assert!(
            target.connections() <= 3 + 1,
            "connections leaked: {}",
            target.connections()
        );
        drop((target, initiator));
    });
}

// ---------------------------------------------------------------------------
// Peer failures
// ---------------------------------------------------------------------------

/// A fake target: answers the REGIONS query with one region, then runs
/// `behave` on the connection that carries the batch.
/// Reads the REGIONS request a session opens with and answers with one
/// region.
async fn answer_regions(s: &mut TcpStream, region: (u64, u64)) {
    let mut hb = [0u8; wire::HEADER_LEN];
    s.read_exact(&mut hb).await.unwrap();
    let q = Header::decode(&hb).unwrap();
    assert_eq!(q.opcode, wire::OP_REGIONS);
    let h = Header {
        opcode: wire::OP_REGIONS,
        count: 1,
        req_id: q.req_id,
        payload_len: 16,
        ..Header::default()
    };
    let mut b = h.encode().to_vec();
    wire::encode_entry(&mut b, region.0, region.1);
    s.write_all(&b).await.unwrap();
}

async fn fake_target<F, Fut>(region: (u64, u64), behave: F) -> SocketAddr
where
    F: FnOnce(TcpStream) -> Fut + 'static,
    Fut: Future<Output = ()> + 'static,
{
    let listener = TcpListener::bind(any_port()).unwrap();
    let addr = listener.local_addr().unwrap();
    glommio::spawn_local(async move {
        let mut s = listener.accept().await.unwrap();
        answer_regions(&mut s, region).await;
        behave(s).await;
        // Keep the listener alive until the behaviour is done.
        drop(listener);
    })
    .detach();
    addr
}

#[test]
fn peer_closing_mid_batch_fails_the_batch_without_hanging() {
    block_on(async {
        // 4 MiB frames: the fake reader below answers one such frame.
        let initiator = TcpTransport::bind(
            any_port(),
            TcpConfig {
                streams: 1,
                frame_max_bytes: 4 << 20,
                ..TcpConfig::default()
            },
        )
        .unwrap();
        let mut src = Buf::random(8 << 20, 4);
        src.register(&initiator);
        let remote = (1u64 << 40, 16u64 << 20);
        let d = [Desc {
            local_addr: src.addr(),
            remote_addr: remote.0,
            len_bytes: 8 << 20,
        }];

        // Write: the peer reads a little of the payload, then closes.
        let peer = fake_target(remote, |mut s| async move {
            let mut buf = vec![0u8; 100_000];
            s.read_exact(&mut buf).await.unwrap();
            drop(s);
        })
        .await;
        let session = initiator.open(&EndpointAddr::Tcp(peer)).await.unwrap();
        let err = session.transfer(Op::Write, &d).await.unwrap_err();
        assert!(
            matches!(
                err,
                TransportError::Disconnected { .. } | TransportError::Io { .. }
            ),
            "{err:?}"
        );

        // Read: the peer answers OK and sends part of the payload, then closes.
        let peer = fake_target(remote, |mut s| async move {
            let mut req = [0u8; wire::HEADER_LEN + wire::ENTRY_LEN];
            s.read_exact(&mut req).await.unwrap();
            let mut hb = [0u8; wire::HEADER_LEN];
            hb.copy_from_slice(&req[..wire::HEADER_LEN]);
            let q = Header::decode(&hb).unwrap();
            let h = Header {
                opcode: wire::OP_READ,
                req_id: q.req_id,
                payload_len: 4 << 20,
                ..Header::default()
            };
            s.write_all(&h.encode()).await.unwrap();
            s.write_all(&[1u8; 1000]).await.unwrap();
            drop(s);
        })
        .await;
        let session = initiator.open(&EndpointAddr::Tcp(peer)).await.unwrap();
        let err = session.transfer(Op::Read, &d).await.unwrap_err();
        assert!(
            matches!(err, TransportError::Disconnected { .. }),
            "{err:?}"
        );

        // A response that does not belong to the request is a protocol error.
        let peer = fake_target(remote, |mut s| async move {
            let mut req = [0u8; wire::HEADER_LEN + wire::ENTRY_LEN];
            s.read_exact(&mut req).await.unwrap();
            let h = Header {
                opcode: wire::OP_READ,
                req_id: 424242,
                payload_len: 1,
                ..Header::default()
            };
            s.write_all(&h.encode()).await.unwrap();
            let mut rest = [0u8; 1];
            let _ = s.read(&mut rest).await;
        })
        .await;
        let session = initiator.open(&EndpointAddr::Tcp(peer)).await.unwrap();
        let one = [Desc {
            len_bytes: 1,
            ..d[0]
        }];
        let err = session.transfer(Op::Read, &one).await.unwrap_err();
        assert!(
            matches!(err, TransportError::Peer(PeerError::Protocol(_))),
            "{err:?}"
        );
    });
}

#[test]
fn silent_peer_times_out() {
    block_on(async {
        let config = TcpConfig {
            streams: 1,
            batch_timeout: std::time::Duration::from_millis(200),
            ..TcpConfig::default()
        };
        let initiator = TcpTransport::bind(any_port(), config).unwrap();
        let mut src = Buf::random(4096, 4);
        src.register(&initiator);
        let remote = (1u64 << 40, 4096u64);
        // The peer takes the request and never answers (but stays connected
        // until the initiator gives up and closes).
        let peer = fake_target(remote, |mut s| async move {
            let mut rest = vec![0u8; 1 << 16];
            while let Ok(n) = s.read(&mut rest).await {
                if n == 0 {
                    break;
                }
            }
        })
        .await;
        let session = initiator.open(&EndpointAddr::Tcp(peer)).await.unwrap();
        let d = [Desc {
            local_addr: src.addr(),
            remote_addr: remote.0,
            len_bytes: 4096,
        }];
        let err = session.transfer(Op::Write, &d).await.unwrap_err();
        assert!(
            matches!(err, TransportError::Timeout { after_ms: 200 }),
            "{err:?}"
        );
    });
}

/// A caller's deadline bounds the batch in place of the endpoint's own
/// (much longer) batch bound: the batch fails at the deadline, and a write
/// that carries a trailer does too.
#[test]
fn silent_peer_fails_the_batch_at_the_callers_deadline() {
    block_on(async {
        let config = TcpConfig {
            streams: 1,
            batch_timeout: std::time::Duration::from_secs(600),
            ..TcpConfig::default()
        };
        let initiator = TcpTransport::bind(any_port(), config).unwrap();
        let mut src = Buf::random(4096, 4);
        src.register(&initiator);
        let remote = (1u64 << 40, 4096u64);
        let d = [Desc {
            local_addr: src.addr(),
            remote_addr: remote.0,
            len_bytes: 4096,
        }];
        for trailer in [None, Some(&b"landed"[..])] {
            let peer = fake_target(remote, |mut s| async move {
                let mut rest = vec![0u8; 1 << 16];
                while let Ok(n) = s.read(&mut rest).await {
                    if n == 0 {
                        break;
                    }
                }
            })
            .await;
            let session = initiator.open(&EndpointAddr::Tcp(peer)).await.unwrap();
            let deadline = std::time::Instant::now() + std::time::Duration::from_millis(100);
            let err = session
                .transfer_until(Op::Write, &d, trailer, deadline)
                .await
                .unwrap_err();
            assert!(
                matches!(err, TransportError::Timeout { after_ms } if after_ms <= 100),
                "{err:?}"
            );
        }
    });
}

#[test]
fn session_reconnects_after_the_peer_restarts() {
    block_on(async {
        let config = TcpConfig {
            streams: 2,
            ..TcpConfig::default()
        };
        let mut target = TcpTransport::bind(any_port(), config.clone()).unwrap();
        let addr = target.local_addr();
        let initiator = TcpTransport::bind(any_port(), config.clone()).unwrap();
        let mut src = Buf::random(4 << 20, 8);
        let mut dst1 = Buf::filled(4 << 20, 0);
        src.register(&initiator);
        dst1.register(&target);
        let session = initiator.open(&target.endpoint_addr()).await.unwrap();
        let whole = |dst: &Buf| {
            (0..4u64)
                .map(|i| Desc {
                    local_addr: src.addr() + (i << 20),
                    remote_addr: dst.addr() + (i << 20),
                    len_bytes: 1 << 20,
                })
                .collect::<Vec<_>>()
        };
        session.transfer(Op::Write, &whole(&dst1)).await.unwrap();
        assert!(dst1.bytes == src.bytes);

        // The peer goes away: batches fail (connection refused), nothing hangs.
        target.shutdown();
        drop(target);
        let err = session
            .transfer(Op::Write, &whole(&dst1))
            .await
            .unwrap_err();
        assert!(
            matches!(
                err,
                TransportError::Io { .. } | TransportError::Disconnected { .. }
            ),
            "{err:?}"
        );

        // It restarts on the same port with new memory: the same session
        // reconnects, learns the new regions and delivers.
        let target2 = TcpTransport::bind(addr, config).unwrap();
        let mut dst2 = Buf::filled(4 << 20, 0);
        dst2.register(&target2);
        session
            .transfer(Op::Write, &whole(&dst2))
            .await
            .expect("after restart");
        assert!(dst2.bytes == src.bytes);
        // And the old memory is no longer reachable.
        let err = session
            .transfer(Op::Write, &whole(&dst1))
            .await
            .unwrap_err();
        assert!(
            matches!(
                err,
                TransportError::Misuse(MisuseError::RemoteDescriptor { index: 0, .. })
            ),
            "{err:?}"
        );
        drop((target2, initiator));
    });
}

#[test]
fn shutdown_closes_served_connections_at_once() {
    block_on(async {
        let mut target = TcpTransport::bind(any_port(), TcpConfig::default()).unwrap();
        let mut s = TcpStream::connect(target.local_addr()).await.unwrap();
        // Wait until the target has accepted the connection: a REGIONS
        // round trip proves the connection task is serving.
        s.write_all(&request(wire::OP_REGIONS, &[], 0, 1))
            .await
            .unwrap();
        let h = response(&mut s).await;
        assert_eq!(h.count, 0);
        assert_eq!(target.connections(), 1);
        target.shutdown();
        assert!(is_closed(&mut s).await);
        assert!(s.as_raw_fd() >= 0);
    });
}

#[test]
fn random_garbage_never_touches_memory_outside_the_region() {
    block_on(async {
        let target = TcpTransport::bind(any_port(), TcpConfig::default()).unwrap();
        let mut whole = Buf::filled(3 * 4096, 0xEE);
        let region_addr = whole.addr() + 4096;
        // SAFETY: `whole` outlives the endpoint.
        unsafe {
            target
                .register(whole.bytes.as_mut_ptr().add(4096), 4096)
                .unwrap()
        };
        let mut rng = fastrand::Rng::with_seed(99);
        for round in 0..300 {
            // Half the frames start with a valid magic and opcode so they get
            // past the first checks; addresses aim around the region.
            let mut frame = vec![0u8; rng.usize(1..200)];
            rng.fill(&mut frame);
            if round % 2 == 0 && frame.len() >= wire::HEADER_LEN + wire::ENTRY_LEN {
                let count = rng.u32(1..4);
                let h = Header {
                    opcode: rng.u8(1..=3),
                    count,
                    req_id: round,
                    payload_len: rng.u64(0..64),
                    ..Header::default()
                };
                frame[..wire::HEADER_LEN].copy_from_slice(&h.encode());
                let addr = region_addr - 64 + rng.u64(0..4096 + 128);
                frame[wire::HEADER_LEN..wire::HEADER_LEN + 8].copy_from_slice(&addr.to_le_bytes());
            }
            let mut s = TcpStream::connect(target.local_addr()).await.unwrap();
            s.write_all(&frame).await.unwrap();
            s.shutdown(std::net::Shutdown::Write).await.unwrap();
            // Drain whatever the target answers until it closes.
            let mut sink = vec![0u8; 1 << 16];
            while let Ok(n) = s.read(&mut sink).await {
                if n == 0 {
                    break;
                }
            }
        }
        assert!(
            whole.bytes[..4096].iter().all(|&b| b == 0xEE),
            "guard before the region changed"
        );
        assert!(
            whole.bytes[8192..].iter().all(|&b| b == 0xEE),
            "guard after the region changed"
        );
        // Still serving.
        let mut s = TcpStream::connect(target.local_addr()).await.unwrap();
        s.write_all(&request(wire::OP_REGIONS, &[], 0, 7))
            .await
            .unwrap();
        let h = response(&mut s).await;
        assert_eq!((h.status, h.count, h.req_id), (wire::STATUS_OK, 1, 7));
    });
}

#[test]
fn a_slow_peer_never_has_more_than_the_inflight_bound_outstanding() {
    block_on(async {
        let frame_bytes = 64u64 << 10;
        let config = TcpConfig {
            streams: 1,
            frame_max_bytes: frame_bytes,
            inflight_max_bytes: 2 * frame_bytes,
            ..TcpConfig::default()
        };
        let initiator = TcpTransport::bind(any_port(), config).unwrap();
        let mut src = Buf::random(8 << 20, 6);
        src.register(&initiator);
        let remote = (1u64 << 40, 8u64 << 20);
        let (seen_tx, seen_rx) = flume::bounded::<(bool, bool)>(1);
        // The peer reads two whole frames without acknowledging them and
        // checks that nothing more arrives; then it acknowledges one and
        // checks that exactly one more frame follows.
        let peer = fake_target(remote, move |mut s| async move {
            let frame_len = wire::HEADER_LEN + wire::ENTRY_LEN + frame_bytes as usize;
            let mut buf = vec![0u8; 2 * frame_len];
            s.read_exact(&mut buf).await.unwrap();
            let quiet_before_ack = {
                glommio::timer::sleep(std::time::Duration::from_millis(100)).await;
                let mut b = [0u8; 1];
                // SAFETY: peeking one byte into a local buffer.
                let r = unsafe {
                    libc::recv(
                        s.as_raw_fd(),
                        b.as_mut_ptr().cast(),
                        1,
                        libc::MSG_PEEK | libc::MSG_DONTWAIT,
                    )
                };
                r < 0
            };
            let mut hb = [0u8; wire::HEADER_LEN];
            hb.copy_from_slice(&buf[..wire::HEADER_LEN]);
            let first = Header::decode(&hb).unwrap();
            let ack = Header {
                opcode: wire::OP_WRITE,
                req_id: first.req_id,
                ..Header::default()
            };
            s.write_all(&ack.encode()).await.unwrap();
            let mut next = vec![0u8; frame_len];
            let one_more = s.read_exact(&mut next).await.is_ok();
            seen_tx
                .send_async((quiet_before_ack, one_more))
                .await
                .unwrap();
            drop(s);
        })
        .await;
        let session = initiator.open(&EndpointAddr::Tcp(peer)).await.unwrap();
        let d = [Desc {
            local_addr: src.addr(),
            remote_addr: remote.0,
            len_bytes: 8 << 20,
        }];
        let err = session.transfer(Op::Write, &d).await.unwrap_err();
        assert!(
            matches!(
                err,
                TransportError::Disconnected { .. } | TransportError::Io { .. }
            ),
            "{err:?}"
        );
        let (quiet_before_ack, one_more) = seen_rx.recv_async().await.unwrap();
        assert!(
            quiet_before_ack,
            "the initiator sent past its in-flight bound"
        );
        assert!(
            one_more,
            "an acknowledgement did not release the next frame"
        );
    });
}

#[test]
fn a_malformed_region_list_from_the_peer_is_a_protocol_error() {
    block_on(async {
        let initiator = TcpTransport::bind(any_port(), TcpConfig::default()).unwrap();
        // A region whose end wraps around the address space.
        // The fake keeps the connection until the initiator drops it.
        let peer = fake_target((u64::MAX - 10, 100), |mut s| async move {
            let mut rest = [0u8; 64];
            let _ = s.read(&mut rest).await;
        })
        .await;
        let err = initiator
            .open(&EndpointAddr::Tcp(peer))
            .await
            .err()
            .expect("open must fail");
        assert!(
            matches!(err, TransportError::Peer(PeerError::Protocol(_))),
            "{err:?}"
        );
        // A remote address that wraps when the batch is split into frames
        // is rejected by the remote check, not by an arithmetic panic.
        let mut src = Buf::random(16 << 20, 1);
        src.register(&initiator);
        // This peer answers every REGIONS query (the initiator re-asks once
        // before it blames the caller).
        let peer = fake_target((1 << 40, 1 << 30), |mut s| async move {
            let mut hb = [0u8; wire::HEADER_LEN];
            while s.read_exact(&mut hb).await.is_ok() {
                let q = Header::decode(&hb).unwrap();
                assert_eq!(
                    q.opcode,
                    wire::OP_REGIONS,
                    "only REGIONS may reach this peer"
                );
                let h = Header {
                    opcode: wire::OP_REGIONS,
                    count: 1,
                    req_id: q.req_id,
                    payload_len: 16,
                    ..Header::default()
                };
                let mut b = h.encode().to_vec();
                wire::encode_entry(&mut b, 1 << 40, 1 << 30);
                s.write_all(&b).await.unwrap();
            }
        })
        .await;
        let session = initiator.open(&EndpointAddr::Tcp(peer)).await.unwrap();
        let d = [Desc {
            local_addr: src.addr(),
            remote_addr: u64::MAX - 100,
            len_bytes: 16 << 20,
        }];
        let err = session.transfer(Op::Write, &d).await.unwrap_err();
        assert!(
            matches!(
                err,
                TransportError::Misuse(MisuseError::RemoteDescriptor {
                    index: 0,
                    fault: RangeFault::Overflow
                })
            ),
            "{err:?}"
        );
    });
}

/// NOTIFY: the bytes reach the target's handler after the frames sent
/// before them on the session; without a handler, or when it refuses, the
/// sender gets a typed `Undeliverable` and the session keeps working; a
/// crafted NOTIFY that breaks the framing rules closes the connection.
#[test]
fn notifications_reach_the_handler_or_come_back_undeliverable() {
    use std::cell::RefCell;
    use std::rc::Rc;
    block_on(async {
        let config = TcpConfig::default();
        let (target, initiator, session) = pair(config).await;
        let mut dst = Buf::filled(4096, 0);
        dst.register(&target);
        let mut src = Buf::random(4096, 3);
        src.register(&initiator);
        let write = [Desc {
            local_addr: src.addr(),
            remote_addr: dst.addr(),
            len_bytes: 4096,
        }];

        // No handler yet: refused, typed, and the session still moves bytes.
        let e = session.notify(b"nobody listens").await.unwrap_err();
        assert!(
            matches!(
                e,
                TransportError::Peer(PeerError::Rejected {
                    reason: RejectReason::Undeliverable,
                    ..
                })
            ),
            "{e:?}"
        );
        session.transfer(Op::Write, &write).await.unwrap();
        assert_eq!(dst.bytes, src.bytes);

        // A handler that records what it gets, and what the region held at
        // that moment (the write sent before it on this session).
        // What the handler got, and whether the earlier write had landed.
        type Seen = Rc<RefCell<Vec<(Vec<u8>, bool)>>>;
        let seen: Seen = Rc::default();
        let dst_addr = dst.addr() as usize;
        let want = src.bytes[4095];
        let log = seen.clone();
        target.set_notify_handler(Some(Rc::new(move |bytes: &[u8]| {
            // SAFETY: the region outlives the endpoint; one byte is read
            // on the target's own executor, between frames.
            let landed = unsafe { *(dst_addr as *const u8).add(4095) } == want;
            log.borrow_mut().push((bytes.to_vec(), landed));
            bytes != b"refuse"
        })));
        dst.bytes.fill(0);
        session.transfer(Op::Write, &write).await.unwrap();
        session.notify(b"after the write").await.unwrap();
        let big = vec![7u8; wire::MAX_NOTIFY_BYTES as usize];
        session.notify(&big).await.unwrap();
        let e = session.notify(b"refuse").await.unwrap_err();
        assert!(matches!(
            e,
            TransportError::Peer(PeerError::Rejected {
                reason: RejectReason::Undeliverable,
                ..
            })
        ));
        // Over the bound: refused on our side, nothing sent.
        let e = session
            .notify(&vec![0u8; wire::MAX_NOTIFY_BYTES as usize + 1])
            .await
            .unwrap_err();
        assert!(matches!(e, TransportError::Misuse(_)), "{e:?}");
        session.notify(b"still fine").await.unwrap();
        {
            let seen = seen.borrow();
            let got: Vec<&[u8]> = seen.iter().map(|(b, _)| &b[..]).collect();
            assert_eq!(
                got,
                vec![&b"after the write"[..], &big[..], b"refuse", b"still fine"]
            );
            assert!(seen[0].1, "the write before the notification had landed");
        }

        // Crafted: descriptors on a NOTIFY, or a payload over the bound,
        // break the framing: rejected and closed. Nothing reaches the handler.
        for (h, reason) in [
            (
                request(wire::OP_NOTIFY, &[(dst.addr(), 8)], 8, 1),
                RejectReason::TooLarge,
            ),
            (
                request(wire::OP_NOTIFY, &[], wire::MAX_NOTIFY_BYTES + 1, 2),
                RejectReason::TooLarge,
            ),
        ] {
            let mut s = TcpStream::connect(target.local_addr()).await.unwrap();
            s.write_all(&h).await.unwrap();
            let r = response(&mut s).await;
            assert_eq!(RejectReason::from_status(r.status), reason);
            assert!(is_closed(&mut s).await);
        }
        assert_eq!(seen.borrow().len(), 4);
        // A sound one on a raw connection is taken.
        let mut s = TcpStream::connect(target.local_addr()).await.unwrap();
        let mut f = request(wire::OP_NOTIFY, &[], 3, 9);
        f.extend_from_slice(b"raw");
        s.write_all(&f).await.unwrap();
        let r = response(&mut s).await;
        assert_eq!((r.opcode, r.status, r.req_id), (wire::OP_NOTIFY, 0, 9));
        assert_eq!(
            seen.borrow().last().map(|(b, _)| b.clone()),
            Some(b"raw".to_vec())
        );
        drop(initiator);
    })
}

/// NOTIFY_AFTER_WRITE: a trailer reaches the target's handler only behind
/// writes that landed in full (in the same send as the last frame, so the
/// target learns of the bytes with them), never behind a write that was
/// refused or fenced, and not at all when the batch needs several streams
/// (frames on different streams land in no order the target can see).
#[test]
fn a_trailer_is_delivered_only_behind_writes_that_landed() {
    use kvferry::transport::BlockFence;
    use std::cell::RefCell;
    use std::rc::Rc;
    block_on(async {
        let config = TcpConfig {
            frame_max_bytes: 1024,
            ..TcpConfig::default()
        };
        let (target, initiator, session) = pair(config).await;
        let mut dst = Buf::filled(4096, 0);
        dst.register(&target);
        let mut src = Buf::random(4096, 5);
        src.register(&initiator);
        let (src_addr, dst_addr) = (src.addr(), dst.addr());
        let desc = |off: u64, len: u64| Desc {
            local_addr: src_addr + off,
            remote_addr: dst_addr + off,
            len_bytes: len,
        };
        // What the handler got, and whether the bytes had landed by then.
        type Seen = Rc<RefCell<Vec<(Vec<u8>, bool)>>>;
        let seen: Seen = Rc::default();
        let base = dst_addr as usize;
        let want = src.bytes[1000];
        let log = seen.clone();
        target.set_notify_handler(Some(Rc::new(move |bytes: &[u8]| {
            // SAFETY: the region outlives the endpoint; one byte is read
            // on the target's own executor, between frames.
            let landed = unsafe { *(base as *const u8).add(1000) } == want;
            log.borrow_mut().push((bytes.to_vec(), landed));
            bytes != b"refuse"
        })));

        // One frame: delivered, after the bytes landed.
        let one = [desc(0, 1024)];
        assert!(session.write_then_notify(&one, b"landed").await.unwrap());
        assert_eq!(&dst.bytes[..1024], &src.bytes[..1024]);
        assert_eq!(seen.borrow().clone(), vec![(b"landed".to_vec(), true)]);

        // Four frames over two streams: the bytes move, the trailer does
        // not (the caller delivers it its own way).
        dst.bytes.fill(0);
        let four = [desc(0, 4096)];
        assert!(!session.write_then_notify(&four, b"several").await.unwrap());
        assert_eq!(dst.bytes, src.bytes);
        assert_eq!(seen.borrow().len(), 1);

        // The handler refuses: the write still landed, the answer says so.
        assert!(!session.write_then_notify(&one, b"refuse").await.unwrap());
        assert_eq!(seen.borrow().len(), 2);

        // A fenced write closes the connection: an error, no trailer.
        let fence = Rc::new(BlockFence::new(&[(dst_addr, 1024)], 4));
        target.set_fence(Some(fence.clone()));
        dst.bytes.fill(0);
        let e = session.write_then_notify(&one, b"fenced").await;
        assert!(e.is_err(), "{e:?}");
        assert_eq!(seen.borrow().len(), 2);
        assert!(dst.bytes[..1024].iter().all(|&b| b == 0));
        fence.open([0]);
        assert!(session.write_then_notify(&one, b"open").await.unwrap());
        assert_eq!(seen.borrow().last().unwrap(), &(b"open".to_vec(), true));
        target.set_fence(None);

        // Crafted: the trailer's condition, frame by frame.
        let trailer = |detail: u32, req_id: u64, body: &[u8]| {
            let h = Header {
                opcode: wire::OP_NOTIFY_AFTER_WRITE,
                detail,
                req_id,
                payload_len: body.len() as u64,
                ..Header::default()
            };
            let mut b = h.encode().to_vec();
            b.extend_from_slice(body);
            b
        };
        let good_write = |req_id: u64| {
            let mut f = request(wire::OP_WRITE, &[(dst_addr, 8)], 8, req_id);
            f.extend_from_slice(&[9u8; 8]);
            f
        };
        let mut s = TcpStream::connect(target.local_addr()).await.unwrap();
        // Behind a write outside the region: not delivered, connection kept.
        let mut f = request(wire::OP_WRITE, &[(8, 8)], 8, 1);
        f.extend_from_slice(&[0u8; 8]);
        f.extend(trailer(1, 2, b"bad write"));
        s.write_all(&f).await.unwrap();
        let r = response(&mut s).await;
        assert_eq!(
            RejectReason::from_status(r.status),
            RejectReason::OutOfRegion
        );
        let r = response(&mut s).await;
        assert_eq!(
            (r.opcode, RejectReason::from_status(r.status), r.req_id),
            (wire::OP_NOTIFY_AFTER_WRITE, RejectReason::Undeliverable, 2)
        );
        // Depending on more writes than landed before it, or on none.
        let mut f = good_write(3);
        f.extend(trailer(2, 4, b"two"));
        f.extend(good_write(5));
        f.extend(trailer(0, 6, b"none"));
        // A plain NOTIFY in between breaks the run.
        f.extend(good_write(7));
        f.extend(request(wire::OP_NOTIFY, &[], 0, 8));
        f.extend(trailer(1, 9, b"after notify"));
        // Two writes that landed, then a trailer on both: delivered.
        f.extend(good_write(10));
        f.extend(good_write(11));
        f.extend(trailer(2, 12, b"both"));
        s.write_all(&f).await.unwrap();
        let mut answers = Vec::new();
        for _ in 0..10 {
            let r = response(&mut s).await;
            answers.push((r.req_id, r.status));
        }
        let undeliverable = RejectReason::Undeliverable.to_status();
        assert_eq!(
            answers,
            vec![
                (3, 0),
                (4, undeliverable),
                (5, 0),
                (6, undeliverable),
                (7, 0),
                (8, 0),
                (9, undeliverable),
                (10, 0),
                (11, 0),
                (12, 0)
            ]
        );
        let got: Vec<Vec<u8>> = seen.borrow().iter().map(|(b, _)| b.clone()).collect();
        assert_eq!(got[got.len() - 2..], [b"".to_vec(), b"both".to_vec()]);
        drop(initiator);
    })
}

/// Notifications have a connection of their own: one sent while a batch
/// holds every data stream (here a peer that reads the batch but never
/// answers it) still reaches the peer and comes back at once, instead of
/// waiting for a stream behind bulk data.
#[test]
fn a_notification_does_not_wait_behind_a_batch_in_flight() {
    block_on(async {
        let initiator = TcpTransport::bind(
            any_port(),
            TcpConfig {
                streams: 1,
                // The fake target below speaks no shm hello.
                shm: ShmConfig {
                    mode: ShmMode::Off,
                    ..ShmConfig::default()
                },
                ..TcpConfig::default()
            },
        )
        .unwrap();
        let mut src = Buf::random(1 << 20, 9);
        src.register(&initiator);
        let remote = (1u64 << 40, 16u64 << 20);
        let listener = TcpListener::bind(any_port()).unwrap();
        let addr = listener.local_addr().unwrap();
        let (seen_tx, seen_rx) = futures::channel::oneshot::channel::<Vec<u8>>();
        glommio::spawn_local(async move {
            // The data stream: regions, then a batch that is never answered.
            let mut data = listener.accept().await.unwrap();
            answer_regions(&mut data, remote).await;
            // The notification stream.
            let mut note = listener.accept().await.unwrap();
            let mut hb = [0u8; wire::HEADER_LEN];
            note.read_exact(&mut hb).await.unwrap();
            let q = Header::decode(&hb).unwrap();
            assert_eq!(q.opcode, wire::OP_NOTIFY);
            let mut body = vec![0u8; q.payload_len as usize];
            note.read_exact(&mut body).await.unwrap();
            let ok = Header {
                opcode: wire::OP_NOTIFY,
                req_id: q.req_id,
                ..Header::default()
            };
            note.write_all(&ok.encode()).await.unwrap();
            let _ = seen_tx.send(body);
            // Hold the data stream (and its unanswered batch) open.
            glommio::timer::sleep(std::time::Duration::from_secs(30)).await;
            drop(data);
        })
        .detach();
        let session = initiator.open_tcp(addr).await.unwrap();
        let batch_session = session.clone();
        let d = [Desc {
            local_addr: src.addr(),
            remote_addr: remote.0,
            len_bytes: 1 << 20,
        }];
        let stuck =
            glommio::spawn_local(async move { batch_session.transfer(Op::Write, &d).await });
        // Let the batch take the only data stream first.
        for _ in 0..8 {
            futures_lite::future::yield_now().await;
        }
        let started = std::time::Instant::now();
        session.notify(b"overtakes").await.unwrap();
        assert!(
            started.elapsed() < std::time::Duration::from_secs(5),
            "the notification waited {:?}",
            started.elapsed()
        );
        assert_eq!(seen_rx.await.unwrap(), b"overtakes".to_vec());
        drop(stuck);
        drop(initiator);
    })
}

/// A served connection holds its answers back until the next request is not
/// there yet; a client that sends many requests at once must still get every
/// answer, in request order, with READ payloads and the REGIONS table in
/// their places.
#[test]
fn pipelined_requests_are_answered_in_order() {
    block_on(async {
        let config = TcpConfig::default();
        let target = TcpTransport::bind(any_port(), config).unwrap();
        let mut dst = Buf::filled(4096, 0);
        dst.register(&target);
        let region_addr = dst.addr();
        let written = vec![0x5Au8; 64];
        let frames = [
            request(wire::OP_WRITE, &[(region_addr, 64)], 64, 1),
            written.clone(),
            // Out of the region: refused, the connection keeps serving.
            request(wire::OP_WRITE, &[(region_addr + 4090, 64)], 64, 2),
            vec![0x11; 64],
            // No notification handler on this endpoint: undeliverable.
            Header {
                opcode: wire::OP_NOTIFY,
                req_id: 3,
                payload_len: 5,
                ..Header::default()
            }
            .encode()
            .to_vec(),
            b"hello".to_vec(),
            request(wire::OP_READ, &[(region_addr, 64)], 0, 4),
            request(wire::OP_REGIONS, &[], 0, 5),
            request(wire::OP_WRITE, &[(region_addr + 64, 64)], 64, 6),
            written.clone(),
        ]
        .concat();
        let mut s = TcpStream::connect(target.local_addr()).await.unwrap();
        s.write_all(&frames).await.unwrap();

        let h = response(&mut s).await;
        assert_eq!(
            (h.opcode, h.req_id, h.status),
            (wire::OP_WRITE, 1, wire::STATUS_OK)
        );
        let h = response(&mut s).await;
        assert_eq!((h.opcode, h.req_id), (wire::OP_WRITE, 2));
        assert_eq!(
            RejectReason::from_status(h.status),
            RejectReason::OutOfRegion
        );
        let h = response(&mut s).await;
        assert_eq!((h.opcode, h.req_id), (wire::OP_NOTIFY, 3));
        assert_eq!(
            RejectReason::from_status(h.status),
            RejectReason::Undeliverable
        );
        let h = response(&mut s).await;
        assert_eq!(
            (h.opcode, h.req_id, h.status),
            (wire::OP_READ, 4, wire::STATUS_OK)
        );
        let mut read_back = vec![0u8; h.payload_len as usize];
        s.read_exact(&mut read_back).await.unwrap();
        assert_eq!(read_back, written, "READ payload out of place");
        let h = response(&mut s).await;
        assert_eq!(
            (h.opcode, h.req_id, h.status),
            (wire::OP_REGIONS, 5, wire::STATUS_OK)
        );
        assert_eq!(h.payload_len, (h.count as usize * wire::ENTRY_LEN) as u64);
        let mut table = vec![0u8; h.payload_len as usize];
        s.read_exact(&mut table).await.unwrap();
        let regions: Vec<(u64, u64)> = (0..h.count as usize)
            .map(|i| wire::decode_entry(&table, i))
            .collect();
        assert!(regions.contains(&(region_addr, 4096)), "{regions:?}");
        let h = response(&mut s).await;
        assert_eq!(
            (h.opcode, h.req_id, h.status),
            (wire::OP_WRITE, 6, wire::STATUS_OK)
        );
        assert_eq!(&dst.bytes[..64], &written[..]);
        assert_eq!(&dst.bytes[64..128], &written[..]);
        assert!(dst.bytes[128..].iter().all(|&b| b == 0));
    });
}
