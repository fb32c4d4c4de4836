//! Wire codec: round trips for every message type, hostile input never
//! panics, and the limits are enforced before allocation.

use kvferry::wire::{
    self, Abort, AbortAck, AbortCode, Done, ErrorCode, Heartbeat, HeartbeatAck, Hello, LayoutKind,
    LeaseGrant, LeaseRequest, Limits, Message, Pull, Ready, RegionInfo, Status, TransferMode,
    WireError, HEADER_LEN, MAGIC, VERSION,
};
use proptest::collection::vec;
use proptest::prelude::*;

fn small_string() -> impl Strategy<Value = String> {
    // Unicode included: lengths are bytes, not chars.
    "\\PC{0,40}"
}

fn groups() -> impl Strategy<Value = Vec<Vec<u32>>> {
    vec(vec(any::<u32>(), 0..40), 0..5)
}

fn region() -> impl Strategy<Value = RegionInfo> {
    (
        any::<u64>(),
        any::<u64>(),
        any::<u64>(),
        any::<u64>(),
        any::<u32>(),
        any::<u32>(),
    )
        .prop_map(
            |(base, len_bytes, block_len_bytes, kv_block_len_bytes, group, layer)| RegionInfo {
                base,
                len_bytes,
                block_len_bytes,
                kv_block_len_bytes,
                group,
                layer,
            },
        )
}

fn hello() -> impl Strategy<Value = Hello> {
    (
        small_string(),
        any::<[u32; 7]>(),
        prop_oneof![
            Just(LayoutKind::Hnd),
            Just(LayoutKind::Nhd),
            Just(LayoutKind::Mla)
        ],
        prop_oneof![Just(TransferMode::Push), Just(TransferMode::Pull)],
        vec(region(), 0..8),
        small_string(),
    )
        .prop_map(
            |(engine_id, r, layout, mode, regions, transport_endpoint)| Hello {
                engine_id,
                dp_rank: r[0],
                tp_rank: r[1],
                pp_rank: r[2],
                tp_size: r[3],
                total_kv_heads: r[4],
                block_tokens: r[5],
                num_blocks: r[6],
                layout,
                mode,
                regions,
                transport_endpoint,
            },
        )
}

fn error_code() -> impl Strategy<Value = ErrorCode> {
    prop_oneof![
        Just(ErrorCode::Transport),
        Just(ErrorCode::BadMetadata),
        Just(ErrorCode::UnknownTransfer),
        Just(ErrorCode::Expired),
        Just(ErrorCode::Aborted),
        Just(ErrorCode::Overloaded),
        Just(ErrorCode::Shutdown),
    ]
}

fn abort_code() -> impl Strategy<Value = AbortCode> {
    prop_oneof![
        Just(AbortCode::Engine),
        Just(AbortCode::ClientDisconnect),
        Just(AbortCode::Shutdown),
        Just(AbortCode::Expired),
        Just(AbortCode::PeerDead),
    ]
}

/// Every message type, with arbitrary field values.
fn message() -> impl Strategy<Value = Message> {
    prop_oneof![
        hello().prop_map(Message::Hello),
        (
            any::<u64>(),
            groups(),
            vec(any::<u32>(), 0..5),
            any::<[u32; 2]>(),
            proptest::option::of(any::<u64>()),
            any::<[u64; 2]>()
        )
            .prop_map(
                |(transfer_id, dst_blocks, prefix_blocks, n, lease_seq, t)| {
                    Message::Pull(Pull {
                        transfer_id,
                        dst_blocks,
                        prefix_blocks,
                        expected_senders: n[0],
                        receivers_expected: n[1],
                        lease_seq,
                        deadline_ms: t[0],
                        lease_ms: t[1],
                    })
                }
            ),
        (
            any::<u64>(),
            any::<u32>(),
            vec(any::<u32>(), 0..5),
            groups(),
            any::<bool>()
        )
            .prop_map(|(transfer_id, chunk, start_blocks, src_blocks, is_last)| {
                Message::Ready(Ready {
                    transfer_id,
                    chunk,
                    start_blocks,
                    src_blocks,
                    is_last,
                })
            }),
        (any::<u64>(), any::<u64>()).prop_map(|(transfer_id, seq)| Message::LeaseRequest(
            LeaseRequest { transfer_id, seq }
        )),
        (any::<u64>(), any::<u64>(), any::<u64>()).prop_map(|(transfer_id, seq, duration_ms)| {
            Message::LeaseGrant(LeaseGrant {
                transfer_id,
                seq,
                duration_ms,
            })
        }),
        (any::<u64>(), any::<bool>())
            .prop_map(|(transfer_id, ok)| Message::Done(Done { transfer_id, ok })),
        (any::<u64>(), proptest::option::of(error_code())).prop_map(|(transfer_id, err)| {
            Message::Status(Status {
                transfer_id,
                result: match err {
                    None => Ok(()),
                    Some(code) => Err(code),
                },
            })
        }),
        (any::<u64>(), abort_code()).prop_map(|(transfer_id, reason)| Message::Abort(Abort {
            transfer_id,
            reason
        })),
        any::<u64>().prop_map(|transfer_id| Message::AbortAck(AbortAck { transfer_id })),
        (any::<u64>(), vec(any::<u64>(), 0..50), any::<u64>()).prop_map(
            |(seq, renew, lease_ms)| Message::Heartbeat(Heartbeat {
                seq,
                renew,
                lease_ms
            })
        ),
        (any::<u64>(), vec(any::<u64>(), 0..50))
            .prop_map(|(seq, unknown)| Message::HeartbeatAck(HeartbeatAck { seq, unknown })),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn roundtrip_every_message(msg in message()) {
        let frame = wire::encode(&msg);
        prop_assert_eq!(&frame[..2], &MAGIC[..]);
        prop_assert_eq!(wire::decode(&frame, &Limits::default()), Ok(msg.clone()));
        prop_assert_eq!(msg.check_limits(&Limits::default()), Ok(()));
        // encode_into appends, leaving what was there.
        let mut buf = vec![0xAA, 0xBB];
        wire::encode_into(&msg, &mut buf);
        prop_assert_eq!(&buf[2..], &frame[..]);
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in vec(any::<u8>(), 0..512)) {
        // Only "does not panic" and "errors are typed" can be asserted for
        // random bytes; the header cases are checked exactly below.
        let result = wire::decode(&bytes, &Limits::default());
        if bytes.len() >= 2 && bytes[..2] != MAGIC {
            prop_assert!(matches!(result, Err(WireError::BadMagic(_))), "{:?}", result);
        }
    }

    #[test]
    fn arbitrary_body_behind_valid_header_never_panics(body in vec(any::<u8>(), 0..512)) {
        let mut frame = MAGIC.to_vec();
        frame.extend_from_slice(&VERSION.to_le_bytes());
        frame.extend_from_slice(&body);
        match wire::decode(&frame, &Limits::default()) {
            // Whatever decodes must survive a round trip (postcard accepts
            // overlong varints, so the bytes themselves may differ).
            Ok(msg) => prop_assert_eq!(wire::decode(&wire::encode(&msg), &Limits::default()), Ok(msg)),
            Err(err) => prop_assert!(!matches!(err, WireError::BadMagic(_) | WireError::UnsupportedVersion(_))),
        }
    }

    #[test]
    fn mutated_valid_frames_never_panic(
        msg in message(),
        flips in vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
        cut in any::<prop::sample::Index>(),
    ) {
        let frame = wire::encode(&msg);
        let mut mutated = frame.clone();
        for (idx, byte) in &flips {
            let i = idx.index(mutated.len());
            mutated[i] ^= byte | 1;
        }
        let _ = wire::decode(&mutated, &Limits::default());
        // Every strict prefix of a valid frame is rejected as truncated
        // (or, for prefixes cut inside the header, as truncated too).
        let cut = cut.index(frame.len());
        prop_assert_eq!(wire::decode(&frame[..cut], &Limits::default()), Err(WireError::Truncated));
    }

    #[test]
    fn trailing_bytes_rejected(msg in message(), extra in vec(any::<u8>(), 1..16)) {
        let mut frame = wire::encode(&msg);
        frame.extend_from_slice(&extra);
        prop_assert_eq!(
            wire::decode(&frame, &Limits::default()),
            Err(WireError::TrailingBytes { count: extra.len() })
        );
    }
}

fn header() -> Vec<u8> {
    let mut f = MAGIC.to_vec();
    f.extend_from_slice(&VERSION.to_le_bytes());
    f
}

fn varint(mut v: u64, out: &mut Vec<u8>) {
    loop {
        let byte = (v & 0x7f) as u8;
        v >>= 7;
        if v == 0 {
            out.push(byte);
            return;
        }
        out.push(byte | 0x80);
    }
}

/// Index of a variant in `Message`, as postcard encodes it.
fn variant_of(msg: &Message) -> u8 {
    wire::encode(msg)[HEADER_LEN]
}

fn pull(dst_blocks: Vec<Vec<u32>>) -> Message {
    Message::Pull(Pull {
        transfer_id: 1,
        dst_blocks,
        prefix_blocks: vec![],
        expected_senders: 1,
        receivers_expected: 1,
        lease_seq: None,
        deadline_ms: 1000,
        lease_ms: 100,
    })
}

#[test]
fn header_errors_are_precise() {
    let limits = Limits::default();
    let ok = wire::encode(&Message::AbortAck(AbortAck { transfer_id: 9 }));

    assert_eq!(wire::decode(&[], &limits), Err(WireError::Truncated));
    assert_eq!(wire::decode(&ok[..3], &limits), Err(WireError::Truncated));
    assert_eq!(
        wire::decode(b"XY", &limits),
        Err(WireError::BadMagic(*b"XY"))
    );

    let mut bad_magic = ok.clone();
    bad_magic[0] = b'k';
    assert_eq!(
        wire::decode(&bad_magic, &limits),
        Err(WireError::BadMagic([b'k', b'F']))
    );

    let mut future = ok.clone();
    future[2..4].copy_from_slice(&2u16.to_le_bytes());
    assert_eq!(
        wire::decode(&future, &limits),
        Err(WireError::UnsupportedVersion(2))
    );

    // Unknown message variant (beyond the last one).
    let mut unknown = header();
    unknown.push(200);
    unknown.push(0);
    assert!(matches!(
        wire::decode(&unknown, &limits),
        Err(WireError::Malformed(_))
    ));
}

#[test]
fn frame_size_limit_is_checked_first() {
    let limits = Limits {
        max_frame_bytes: 16,
        ..Limits::default()
    };
    let big = pull(vec![vec![1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]);
    let frame = wire::encode(&big);
    assert!(frame.len() > 16);
    assert_eq!(
        wire::decode(&frame, &limits),
        Err(WireError::FrameTooLarge {
            len_bytes: frame.len(),
            max_bytes: 16
        })
    );
    // Even garbage is rejected by size before it is looked at.
    assert!(matches!(
        wire::decode(&[0u8; 17], &limits),
        Err(WireError::FrameTooLarge { .. })
    ));
}

#[test]
fn huge_claimed_lengths_are_rejected_without_allocating() {
    let limits = Limits::default();
    let pull_tag = variant_of(&pull(vec![]));

    // Pull { transfer_id: 1, dst_blocks: <claims 2^32-1 groups> } in a
    // 10-byte frame: nothing is reserved for the claim, and the frame is
    // rejected when its bytes run out.
    let mut frame = header();
    frame.push(pull_tag);
    varint(1, &mut frame);
    varint(u32::MAX as u64, &mut frame);
    assert_eq!(wire::decode(&frame, &limits), Err(WireError::Truncated));

    // A claim the bytes could back but the limit forbids is reported as
    // such, from the length prefix alone.
    let mut frame = header();
    frame.push(pull_tag);
    varint(1, &mut frame);
    varint(limits.max_groups as u64 + 1, &mut frame);
    frame.extend(std::iter::repeat_n(0u8, limits.max_groups + 1));
    assert_eq!(
        wire::decode(&frame, &limits),
        Err(WireError::LimitExceeded {
            field: "groups",
            len: limits.max_groups as u64 + 1,
            max: limits.max_groups
        })
    );

    // One group that claims 2^40 blocks: truncated, nothing reserved.
    let mut frame = header();
    frame.push(pull_tag);
    varint(1, &mut frame);
    varint(1, &mut frame);
    varint(1 << 40, &mut frame);
    assert_eq!(wire::decode(&frame, &limits), Err(WireError::Truncated));

    // Total blocks over the limit across groups, each group within its own.
    let small = Limits {
        max_blocks_per_group: 4,
        max_total_blocks: 6,
        ..limits
    };
    let mut frame = header();
    frame.push(pull_tag);
    varint(1, &mut frame);
    varint(2, &mut frame);
    for _ in 0..2 {
        varint(4, &mut frame);
        frame.extend_from_slice(&[1, 2, 3, 4]);
    }
    assert_eq!(
        wire::decode(&frame, &small),
        Err(WireError::LimitExceeded {
            field: "total blocks",
            len: 8,
            max: 6
        })
    );

    // A Hello whose engine id claims 1 GiB.
    let hello_tag = variant_of(&Message::Hello(Hello {
        engine_id: String::new(),
        dp_rank: 0,
        tp_rank: 0,
        pp_rank: 0,
        tp_size: 1,
        total_kv_heads: 1,
        block_tokens: 16,
        num_blocks: 1,
        layout: LayoutKind::Hnd,
        mode: TransferMode::Push,
        regions: vec![],
        transport_endpoint: String::new(),
    }));
    let mut frame = header();
    frame.push(hello_tag);
    varint(1 << 30, &mut frame);
    frame.extend_from_slice(b"abc");
    // postcard sees the claimed bytes are not there before our visitor runs.
    assert_eq!(wire::decode(&frame, &limits), Err(WireError::Truncated));

    // A heartbeat claiming more ids than allowed.
    let hb_tag = variant_of(&Message::Heartbeat(Heartbeat {
        seq: 0,
        renew: vec![],
        lease_ms: 0,
    }));
    let mut frame = header();
    frame.push(hb_tag);
    varint(7, &mut frame);
    varint(limits.max_ids as u64 + 1, &mut frame);
    frame.extend(std::iter::repeat_n(0u8, limits.max_ids + 2));
    assert_eq!(
        wire::decode(&frame, &limits),
        Err(WireError::LimitExceeded {
            field: "transfer ids",
            len: limits.max_ids as u64 + 1,
            max: limits.max_ids
        })
    );
}

#[test]
fn configured_limits_are_enforced_exactly() {
    let limits = Limits {
        max_groups: 2,
        max_blocks_per_group: 3,
        max_total_blocks: 5,
        max_regions: 1,
        max_string_bytes: 4,
        max_ids: 2,
        ..Limits::default()
    };
    let check = |msg: &Message| {
        let decoded = wire::decode(&wire::encode(msg), &limits);
        // The sender-side check agrees with the decoder.
        assert_eq!(
            decoded.as_ref().map(|_| ()),
            msg.check_limits(&limits).map(|_| ()).as_ref().map(|_| ()),
            "{msg:?}"
        );
        decoded
    };

    // At the limits: accepted.
    assert!(check(&pull(vec![vec![1, 2, 3], vec![4, 5]])).is_ok());
    // One group too many.
    assert!(matches!(
        check(&pull(vec![vec![], vec![], vec![]])),
        Err(WireError::LimitExceeded {
            field: "groups",
            len: 3,
            max: 2
        })
    ));
    // More per-group values (prefix lengths) than groups allowed.
    let mut with_prefix = pull(vec![vec![1]]);
    if let Message::Pull(p) = &mut with_prefix {
        p.prefix_blocks = vec![0, 0, 0];
    }
    assert!(matches!(
        check(&with_prefix),
        Err(WireError::LimitExceeded {
            field: "per-group values",
            len: 3,
            max: 2
        })
    ));
    // One block too many in a group.
    assert!(matches!(
        check(&pull(vec![vec![1, 2, 3, 4]])),
        Err(WireError::LimitExceeded { .. })
    ));
    // Within per-group limits but over the total.
    assert!(matches!(
        check(&pull(vec![vec![1, 2, 3], vec![4, 5, 6]])),
        Err(WireError::LimitExceeded { .. })
    ));

    let hello = |engine_id: &str, regions: usize| {
        Message::Hello(Hello {
            engine_id: engine_id.into(),
            dp_rank: 0,
            tp_rank: 0,
            pp_rank: 0,
            tp_size: 1,
            total_kv_heads: 8,
            block_tokens: 16,
            num_blocks: 10,
            layout: LayoutKind::Nhd,
            mode: TransferMode::Pull,
            regions: vec![
                RegionInfo {
                    base: 0,
                    len_bytes: 4096,
                    block_len_bytes: 64,
                    kv_block_len_bytes: 32,
                    group: 0,
                    layer: 0
                };
                regions
            ],
            transport_endpoint: "h:1".into(),
        })
    };
    assert!(check(&hello("abcd", 1)).is_ok());
    assert!(matches!(
        check(&hello("abcde", 1)),
        Err(WireError::LimitExceeded { len: 5, max: 4, .. })
    ));
    // "é" is two bytes: the limit counts bytes.
    assert!(check(&hello("abé", 1)).is_ok());
    assert!(matches!(
        check(&hello("abéé", 1)),
        Err(WireError::LimitExceeded { len: 6, max: 4, .. })
    ));
    assert!(matches!(
        check(&hello("a", 2)),
        Err(WireError::LimitExceeded {
            field: "regions",
            len: 2,
            max: 1
        })
    ));

    let ack = |n: u64| {
        Message::HeartbeatAck(HeartbeatAck {
            seq: 1,
            unknown: (0..n).collect(),
        })
    };
    assert!(check(&ack(2)).is_ok());
    assert!(matches!(
        check(&ack(3)),
        Err(WireError::LimitExceeded { len: 3, max: 2, .. })
    ));
}

#[test]
fn decode_restores_previous_limits() {
    // A decode with tight limits must not leak them into the next decode
    // on the same thread.
    let tight = Limits {
        max_groups: 0,
        ..Limits::default()
    };
    let msg = pull(vec![vec![1]]);
    let frame = wire::encode(&msg);
    assert!(wire::decode(&frame, &tight).is_err());
    assert_eq!(wire::decode(&frame, &Limits::default()), Ok(msg));
}

#[test]
fn transfer_id_and_kind_cover_every_variant() {
    let msgs = [
        (pull(vec![]), Some(1), "pull"),
        (
            Message::Done(Done {
                transfer_id: 3,
                ok: false,
            }),
            Some(3),
            "done",
        ),
        (
            Message::Heartbeat(Heartbeat {
                seq: 1,
                renew: vec![],
                lease_ms: 1,
            }),
            None,
            "heartbeat",
        ),
    ];
    for (msg, id, kind) in msgs {
        assert_eq!(msg.transfer_id(), id);
        assert_eq!(msg.kind(), kind);
    }
}
