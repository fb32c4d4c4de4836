//! The control protocol's codec (`kvferry_machines::internal::wire`): round trips for
//! every `Frame` and `Msg` variant, hostile and mutated input never panics
//! and gets the precise typed error, the `Limits` bounds are enforced
//! exactly and before allocation, the version rule (another version is
//! refused, a `Refuse` is read from every version) and notification packing.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::time::{Duration, Instant};

use kvferry_machines::internal::common::{BlockId, Mode, Msg, TransferId, REQUEST_ID_MAX_BYTES};
use kvferry_machines::internal::planner::REGIONS_MAX;
use kvferry_machines::internal::wire::{
    self, decode, decode_notify, encode, encode_notify, encode_versioned, Frame, Hello, Limits,
    Refuse, RefuseReason, WireError, HEADER_LEN, MAGIC, MAX_NOTIFY_FRAMES, VERSION,
};
use kvferry_machines::{LayoutKind, ModelSpec, RankLayout, Region};
use proptest::collection::vec;
use proptest::prelude::*;

use crate::model::{self, ModelSpecExt};

// ---------------------------------------------------------------------------
// Allocation accounting. The claim under test is that a frame cannot make
// `decode` allocate far beyond its own size, so the test binary counts the
// bytes live on the current thread (tests run on several threads at once,
// and a process-wide counter would mix their allocations).

struct CountingAlloc;

thread_local! {
    static LIVE_BYTES: Cell<usize> = const { Cell::new(0) };
    static PEAK_BYTES: Cell<usize> = const { Cell::new(0) };
}

fn note_alloc(size: usize) {
    // `try_with` because the allocator also runs while thread locals are
    // being torn down.
    let _ = LIVE_BYTES.try_with(|live| {
        let now = live.get().saturating_add(size);
        live.set(now);
        let _ = PEAK_BYTES.try_with(|peak| peak.set(peak.get().max(now)));
    });
}

fn note_dealloc(size: usize) {
    let _ = LIVE_BYTES.try_with(|live| live.set(live.get().saturating_sub(size)));
}

unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note_alloc(layout.size());
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        note_dealloc(layout.size());
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note_dealloc(layout.size());
        note_alloc(new_size);
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

/// Runs `f` and returns its result with the most bytes it had allocated at
/// once on this thread (above what was live when it started).
fn peak_alloc_bytes<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let base = LIVE_BYTES.with(Cell::get);
    PEAK_BYTES.with(|p| p.set(base));
    let out = f();
    let peak = PEAK_BYTES.with(Cell::get);
    (out, peak - base)
}

// ---------------------------------------------------------------------------
// Strategies.

/// Mostly arbitrary, but with the varint boundaries and extremes that a
/// postcard encoder handles specially weighted in.
fn edge_u64() -> impl Strategy<Value = u64> {
    prop_oneof![
        3 => any::<u64>(),
        1 => prop::sample::select(vec![0, 1, 127, 128, 16_383, 16_384, u64::MAX - 1, u64::MAX]),
    ]
}

fn edge_u32() -> impl Strategy<Value = u32> {
    prop_oneof![
        3 => any::<u32>(),
        1 => prop::sample::select(vec![0, 1, 127, 128, u32::MAX - 1, u32::MAX]),
    ]
}

fn edge_u16() -> impl Strategy<Value = u16> {
    prop_oneof![
        3 => any::<u16>(),
        1 => prop::sample::select(vec![0, 1, 127, 128, u16::MAX]),
    ]
}

/// Strings within the default 1024-byte limit, including empty ones,
/// multi-byte characters (limits count bytes, not chars) and strings of
/// exactly the limit.
fn string_within(max_bytes: usize) -> impl Strategy<Value = String> {
    prop_oneof![
        4 => "\\PC{0,40}",
        1 => Just(String::new()),
        1 => Just("x".repeat(max_bytes)),
        // Two-byte characters filling the limit exactly.
        1 => Just("é".repeat(max_bytes / 2)),
        1 => Just("tcp://10.0.0.1:5555".to_string()),
    ]
}

fn block_lists(max_groups: usize) -> impl Strategy<Value = Vec<Vec<BlockId>>> {
    let group = vec(any::<u32>().prop_map(BlockId), 0..12);
    prop_oneof![
        4 => vec(group.clone(), 0..4),
        1 => Just(Vec::new()),
        1 => Just(vec![Vec::new(); max_groups]),
        // Max groups, each with a few blocks at the u32 extremes.
        1 => vec(vec(prop::sample::select(vec![0, 1, u32::MAX]).prop_map(BlockId), 1..3), max_groups),
    ]
}

fn per_group_u32(max_groups: usize) -> impl Strategy<Value = Vec<u32>> {
    prop_oneof![
        3 => vec(edge_u32(), 0..4),
        1 => vec(edge_u32(), max_groups),
    ]
}

fn msg() -> impl Strategy<Value = Msg> {
    let l = Limits::default();
    prop_oneof![
        (
            edge_u16(),
            block_lists(l.max_groups),
            per_group_u32(l.max_groups),
            proptest::option::of(edge_u64())
        )
            .prop_map(
                |(receivers_expected, dst_blocks, prefix_blocks, lease_seq)| {
                    Msg::Pull {
                        receivers_expected,
                        dst_blocks,
                        prefix_blocks,
                        lease_seq,
                    }
                }
            ),
        (
            edge_u32(),
            per_group_u32(l.max_groups),
            block_lists(l.max_groups),
            any::<bool>()
        )
            .prop_map(|(chunk, start_blocks, src_blocks, is_last)| Msg::Ready {
                chunk,
                start_blocks,
                src_blocks,
                is_last,
            }),
        edge_u64().prop_map(|seq| Msg::LeaseRequest { seq }),
        (edge_u64(), edge_u64())
            .prop_map(|(seq, duration_ms)| Msg::LeaseGrant { seq, duration_ms }),
        any::<bool>().prop_map(|ok| Msg::Status { ok }),
        any::<bool>().prop_map(|ok| Msg::Done { ok }),
        Just(Msg::Abort),
        Just(Msg::AbortAck),
        Just(Msg::Unneeded),
        Just(Msg::NotPaired),
    ]
}

fn region() -> impl Strategy<Value = Region> {
    (edge_u64(), edge_u64(), edge_u64()).prop_map(|(base, block_len, kv_block_len)| Region {
        base,
        block_len,
        kv_block_len,
    })
}

/// Any model: the codec carries `head_bytes` explicitly and leaves the
/// shape checks to the planner, so every combination must survive.
fn model() -> impl Strategy<Value = ModelSpec> {
    (
        prop::sample::select(vec![LayoutKind::Hnd, LayoutKind::Nhd, LayoutKind::Mla]),
        edge_u32(),
        edge_u32(),
        edge_u64(),
    )
        .prop_map(
            |(layout, total_kv_heads, block_tokens, head_bytes)| ModelSpec {
                layout,
                total_kv_heads,
                block_tokens,
                head_bytes,
            },
        )
}

/// Hellos the codec accepts: at least one region; everything else is
/// arbitrary.
fn hello() -> impl Strategy<Value = Hello> {
    let max = Limits::default().max_string_bytes;
    (
        string_within(max),
        prop::sample::select(vec![Mode::Push, Mode::Pull]),
        model(),
        (edge_u32(), edge_u32(), edge_u64()),
        vec(region(), 1..6),
        string_within(max),
    )
        .prop_map(
            |(engine_id, mode, model, (tp_size, tp_rank, num_blocks), regions, endpoint)| Hello {
                engine_id,
                mode,
                model,
                layout: RankLayout {
                    tp_size,
                    tp_rank,
                    num_blocks,
                    regions,
                    stage: kvferry_machines::Stage::SINGLE,
                    pools: Vec::new(),
                },
                endpoint,
            },
        )
}

fn refuse(version: u16) -> Frame {
    Frame::Refuse(Refuse {
        version,
        reason: RefuseReason::UnsupportedVersion,
    })
}

/// Request ids of 1 to `REQUEST_ID_MAX_BYTES` bytes, exactly the limit
/// (in one- and two-byte characters) included.
fn request_id() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => "\\PC{1,40}",
        1 => Just("cmpl-6f2c0e1a9b7d4c3e8f2a1b0c9d8e7f6a-0".to_string()),
        1 => Just("x".repeat(REQUEST_ID_MAX_BYTES)),
        1 => Just("é".repeat(REQUEST_ID_MAX_BYTES / 2)),
    ]
}

/// A `Pull`: the only message a `NamedTransfer` carries.
fn pull_only() -> impl Strategy<Value = Msg> {
    msg().prop_filter("a pull", |m| matches!(m, Msg::Pull { .. }))
}

fn frame() -> impl Strategy<Value = Frame> {
    prop_oneof![
        1 => edge_u16().prop_map(refuse),
        1 => hello().prop_map(Frame::Hello),
        4 => (edge_u64(), msg()).prop_map(|(id, msg)| Frame::Transfer { transfer_id: TransferId(id), msg }),
        1 => edge_u64().prop_map(|seq| Frame::Heartbeat { seq }),
        1 => edge_u64().prop_map(|seq| Frame::HeartbeatAck { seq }),
        1 => (edge_u64(), request_id(), pull_only()).prop_map(|(id, request_id, msg)| {
            Frame::NamedTransfer { transfer_id: TransferId(id), request_id, msg }
        }),
        1 => edge_u64().prop_map(|id| Frame::IdCollision { transfer_id: TransferId(id) }),
    ]
}

// ---------------------------------------------------------------------------
// An oracle for `decode`, stated from the format in the module docs rather
// than from the decoder's code.

/// What the header alone decides.
#[derive(Debug)]
enum Verdict {
    /// `decode` must answer exactly this, whatever follows.
    Reject(WireError),
    /// A well-formed header naming another version: only a `Refuse` body
    /// is read.
    OtherVersion(u16),
    /// A header of this version: the body decides.
    Current,
}

fn header_verdict(bytes: &[u8], limits: &Limits) -> Verdict {
    if bytes.len() > limits.max_frame_bytes {
        return Verdict::Reject(WireError::FrameTooLarge {
            len_bytes: bytes.len(),
            max_bytes: limits.max_frame_bytes,
        });
    }
    // Two bytes are enough to tell garbage from a truncated frame.
    if bytes.len() >= 2 && bytes[..2] != MAGIC {
        return Verdict::Reject(WireError::BadMagic([bytes[0], bytes[1]]));
    }
    if bytes.len() < HEADER_LEN {
        return Verdict::Reject(WireError::Truncated);
    }
    match u16::from_le_bytes([bytes[2], bytes[3]]) {
        VERSION => Verdict::Current,
        other => Verdict::OtherVersion(other),
    }
}

/// postcard's varint of an integer of `bits` bits: at most
/// `ceil(bits / 7)` bytes (overlong forms included), the last one holding
/// only the bits left.
fn take_varint(bytes: &[u8], bits: u32) -> Option<(u64, &[u8])> {
    let max_len = bits.div_ceil(7) as usize;
    let max_last = (1u8 << (bits % 7)) - 1;
    let mut value = 0u64;
    for (i, &b) in bytes.iter().enumerate().take(max_len) {
        value |= u64::from(b & 0x7f) << (7 * i);
        if b & 0x80 == 0 {
            if i == max_len - 1 && !bits.is_multiple_of(7) && b > max_last {
                return None;
            }
            return Some((value, &bytes[i + 1..]));
        }
    }
    None
}

/// The frozen `Refuse` body: variant byte 0, the version (a `u16` varint),
/// the reason (an enum tag varint, only 0 exists), and nothing after it.
fn frozen_refuse(body: &[u8]) -> Option<Refuse> {
    let (&0, rest) = body.split_first()? else {
        return None;
    };
    let (version, rest) = take_varint(rest, 16)?;
    let (0, []) = take_varint(rest, 32)? else {
        return None;
    };
    Some(Refuse {
        version: version as u16,
        reason: RefuseReason::UnsupportedVersion,
    })
}

/// What every decode result must satisfy, whatever the input: a bad header
/// gives exactly its error; another version gives `UnsupportedVersion`
/// unless the body is a frozen `Refuse`, which decodes; a current one
/// either decodes to a frame that survives its own round trip under the
/// same limits (so it is also within them: `decode` enforces them) or
/// fails with a body error or the one range check, `regions`.
fn check_outcome(bytes: &[u8], limits: &Limits, got: &Result<Frame, WireError>) {
    match header_verdict(bytes, limits) {
        Verdict::Reject(want) => assert_eq!(got.as_ref(), Err(&want), "input {bytes:02x?}"),
        Verdict::OtherVersion(theirs) => {
            let want = match frozen_refuse(&bytes[HEADER_LEN..]) {
                Some(r) => Ok(Frame::Refuse(r)),
                None => Err(WireError::UnsupportedVersion {
                    theirs,
                    ours: VERSION,
                }),
            };
            assert_eq!(got, &want, "input {bytes:02x?}");
        }
        Verdict::Current => match got {
            Ok(f) => assert_eq!(decode(&encode(f), limits).as_ref(), Ok(f)),
            Err(e) => {
                assert!(
                    matches!(
                        e,
                        WireError::Truncated
                            | WireError::TrailingBytes { .. }
                            | WireError::Malformed(_)
                            | WireError::LimitExceeded { .. }
                            | WireError::Invalid {
                                field: "regions",
                                ..
                            }
                    ),
                    "header is valid, yet {e:?} for {bytes:02x?}"
                );
                assert!(!e.to_string().is_empty());
            }
        },
    }
}

/// Every variant's name: the frame's, or for a transfer its message's.
fn variant(f: &Frame) -> &'static str {
    match f {
        Frame::Refuse(_) => "Refuse",
        Frame::Hello(_) => "Hello",
        Frame::Transfer { msg, .. } => match msg {
            Msg::Pull { .. } => "Pull",
            Msg::Ready { .. } => "Ready",
            Msg::LeaseRequest { .. } => "LeaseRequest",
            Msg::LeaseGrant { .. } => "LeaseGrant",
            Msg::Status { .. } => "Status",
            Msg::Done { .. } => "Done",
            Msg::Abort => "Abort",
            Msg::AbortAck => "AbortAck",
            Msg::Unneeded => "Unneeded",
            Msg::NotPaired => "NotPaired",
        },
        Frame::Heartbeat { .. } => "Heartbeat",
        Frame::HeartbeatAck { .. } => "HeartbeatAck",
        Frame::NamedTransfer { .. } => "NamedTransfer",
        Frame::IdCollision { .. } => "IdCollision",
    }
}

const EVERY_VARIANT: [&str; 16] = [
    "Refuse",
    "Hello",
    "Pull",
    "Ready",
    "LeaseRequest",
    "LeaseGrant",
    "Status",
    "Done",
    "Abort",
    "AbortAck",
    "Unneeded",
    "NotPaired",
    "Heartbeat",
    "HeartbeatAck",
    "NamedTransfer",
    "IdCollision",
];

// ---------------------------------------------------------------------------
// 1. Round trips.

proptest! {
    #![proptest_config(ProptestConfig { cases: 3000, ..ProptestConfig::default() })]

    #[test]
    fn round_trip_every_variant(f in frame()) {
        let l = Limits::default();
        let bytes = encode(&f);
        prop_assert_eq!(&bytes[..2], &MAGIC[..]);
        prop_assert_eq!(&bytes[2..4], &VERSION.to_le_bytes()[..]);
        prop_assert_eq!(decode(&bytes, &l), Ok(f.clone()));
        // What the generator makes is within the default limits, and the
        // sender-side check says so too.
        prop_assert_eq!(f.check_limits(&l), Ok(()));
        // `encode_into` appends, leaving what was there.
        let mut buf = vec![0xAA, 0xBB];
        wire::encode_into(&f, &mut buf);
        prop_assert_eq!(&buf[..2], &[0xAA, 0xBB][..]);
        prop_assert_eq!(&buf[2..], &bytes[..]);
    }
}

/// The generator reaches every variant (otherwise the round trip above
/// would silently skip one).
#[test]
fn strategy_covers_every_variant() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    let mut runner = TestRunner::deterministic();
    let strategy = frame();
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..2000 {
        seen.insert(variant(&strategy.new_tree(&mut runner).unwrap().current()));
    }
    assert_eq!(seen, EVERY_VARIANT.into_iter().collect());
}

/// Fixed edge cases at the limits, each variant at least once.
#[test]
fn round_trip_edge_cases() {
    let l = Limits::default();
    let big_groups = vec![vec![BlockId(u32::MAX); 3]; l.max_groups];
    let transfer = |id, msg| Frame::Transfer {
        transfer_id: TransferId(id),
        msg,
    };
    let frames = vec![
        refuse(0),
        refuse(u16::MAX),
        Frame::Hello(Hello {
            engine_id: "é".repeat(l.max_string_bytes / 2),
            mode: Mode::Pull,
            model: ModelSpec {
                layout: LayoutKind::Mla,
                total_kv_heads: u32::MAX,
                block_tokens: u32::MAX,
                head_bytes: u64::MAX,
            },
            layout: RankLayout {
                tp_size: u32::MAX,
                tp_rank: u32::MAX,
                num_blocks: u64::MAX,
                regions: vec![
                    Region {
                        base: u64::MAX,
                        block_len: u64::MAX,
                        kv_block_len: u64::MAX,
                    };
                    REGIONS_MAX
                ],
                stage: kvferry_machines::Stage::SINGLE,
                pools: Vec::new(),
            },
            endpoint: "x".repeat(l.max_string_bytes),
        }),
        // The smallest: one empty region, every number zero.
        Frame::Hello(Hello {
            engine_id: String::new(),
            mode: Mode::Push,
            model: ModelSpec {
                layout: LayoutKind::Hnd,
                total_kv_heads: 0,
                block_tokens: 0,
                head_bytes: 0,
            },
            layout: RankLayout {
                tp_size: 0,
                tp_rank: 0,
                num_blocks: 0,
                regions: vec![Region {
                    base: 0,
                    block_len: 0,
                    kv_block_len: 0,
                }],
                stage: kvferry_machines::Stage::SINGLE,
                pools: Vec::new(),
            },
            endpoint: String::new(),
        }),
        transfer(
            u64::MAX,
            Msg::Pull {
                receivers_expected: u16::MAX,
                dst_blocks: big_groups.clone(),
                prefix_blocks: vec![u32::MAX; l.max_groups],
                lease_seq: Some(u64::MAX),
            },
        ),
        transfer(
            0,
            Msg::Pull {
                receivers_expected: 0,
                dst_blocks: Vec::new(),
                prefix_blocks: Vec::new(),
                lease_seq: None,
            },
        ),
        transfer(
            1,
            Msg::Ready {
                chunk: u32::MAX,
                start_blocks: vec![u32::MAX; l.max_groups],
                src_blocks: big_groups.clone(),
                is_last: true,
            },
        ),
        transfer(
            2,
            Msg::Ready {
                chunk: 0,
                start_blocks: Vec::new(),
                src_blocks: vec![Vec::new()],
                is_last: false,
            },
        ),
        transfer(3, Msg::LeaseRequest { seq: u64::MAX }),
        transfer(
            4,
            Msg::LeaseGrant {
                seq: u64::MAX,
                duration_ms: u64::MAX,
            },
        ),
        transfer(5, Msg::Status { ok: false }),
        transfer(6, Msg::Done { ok: true }),
        transfer(7, Msg::Abort),
        transfer(8, Msg::AbortAck),
        transfer(9, Msg::Unneeded),
        transfer(10, Msg::NotPaired),
        Frame::Heartbeat { seq: u64::MAX },
        Frame::HeartbeatAck { seq: 0 },
        Frame::NamedTransfer {
            transfer_id: TransferId(u64::MAX),
            request_id: "é".repeat(REQUEST_ID_MAX_BYTES / 2),
            msg: Msg::Pull {
                receivers_expected: u16::MAX,
                dst_blocks: big_groups.clone(),
                prefix_blocks: vec![u32::MAX; l.max_groups],
                lease_seq: Some(u64::MAX),
            },
        },
        Frame::IdCollision {
            transfer_id: TransferId(0),
        },
    ];
    let seen: std::collections::BTreeSet<_> = frames.iter().map(variant).collect();
    assert_eq!(seen, EVERY_VARIANT.into_iter().collect());
    for f in frames {
        let bytes = encode(&f);
        assert_eq!(decode(&bytes, &l), Ok(f));
    }
}

#[test]
fn transfer_id_and_kind_cover_every_variant() {
    let hello = hello_with("p".into(), "tcp://p:1".into(), 1);
    let mut frames = vec![
        (refuse(VERSION), None, "refuse"),
        (hello, None, "hello"),
        (Frame::Heartbeat { seq: 1 }, None, "heartbeat"),
        (Frame::HeartbeatAck { seq: 1 }, None, "heartbeat_ack"),
        (
            Frame::NamedTransfer {
                transfer_id: TransferId(9),
                request_id: "cmpl-a".into(),
                msg: pull_msg(vec![]),
            },
            Some(TransferId(9)),
            "pull",
        ),
        (
            Frame::IdCollision {
                transfer_id: TransferId(8),
            },
            Some(TransferId(8)),
            "id_collision",
        ),
    ];
    let msgs = [
        (pull_msg(vec![]), "pull"),
        (
            Msg::Ready {
                chunk: 0,
                start_blocks: vec![],
                src_blocks: vec![],
                is_last: true,
            },
            "ready",
        ),
        (Msg::LeaseRequest { seq: 1 }, "lease_request"),
        (
            Msg::LeaseGrant {
                seq: 1,
                duration_ms: 1,
            },
            "lease_grant",
        ),
        (Msg::Status { ok: true }, "status"),
        (Msg::Done { ok: false }, "done"),
        (Msg::Abort, "abort"),
        (Msg::AbortAck, "abort_ack"),
        (Msg::Unneeded, "unneeded"),
        (Msg::NotPaired, "not_paired"),
    ];
    for (i, (msg, kind)) in msgs.into_iter().enumerate() {
        let id = TransferId(100 + i as u64);
        frames.push((
            Frame::Transfer {
                transfer_id: id,
                msg,
            },
            Some(id),
            kind,
        ));
    }
    let seen: std::collections::BTreeSet<_> = frames.iter().map(|(f, ..)| variant(f)).collect();
    assert_eq!(seen, EVERY_VARIANT.into_iter().collect());
    for (f, id, kind) in frames {
        assert_eq!(f.transfer_id(), id, "{f:?}");
        assert_eq!(f.kind(), kind, "{f:?}");
    }
}

// ---------------------------------------------------------------------------
// 2. Arbitrary bytes.

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_get_a_typed_error(bytes in vec(any::<u8>(), 0..256)) {
        let l = Limits::default();
        let got = decode(&bytes, &l);
        check_outcome(&bytes, &l, &got);
    }

    /// Random bodies behind a valid header reach the postcard decoder
    /// instead of stopping at the magic check.
    #[test]
    fn arbitrary_bodies_behind_a_valid_header(
        // A valid frame tag first (`Frame` has 5 variants) and, for a
        // transfer, often a valid message tag (`Msg` has 8), so most bodies
        // reach the inner decoders.
        tag in 0u8..5,
        msg_tag in 0u8..8,
        body in vec(any::<u8>(), 0..256),
    ) {
        let l = Limits::default();
        let mut bytes = header();
        bytes.push(tag);
        if tag == 2 && body.first().is_some_and(|b| b & 0x80 == 0) {
            bytes.push(body[0]);
            bytes.push(msg_tag);
            bytes.extend_from_slice(&body[1..]);
        } else {
            bytes.extend_from_slice(&body);
        }
        let got = decode(&bytes, &l);
        check_outcome(&bytes, &l, &got);
    }

    /// Random bodies behind a header of another version: only a frozen
    /// `Refuse` body is read.
    #[test]
    fn arbitrary_bodies_of_another_version(
        version in any::<u16>().prop_filter("another version", |v| *v != VERSION),
        body in prop_oneof![
            vec(any::<u8>(), 0..64),
            // Mostly a Refuse body, possibly overlong or with extra bytes.
            (vec(any::<u8>(), 0..6)).prop_map(|mut b| { b.insert(0, 0); b }),
        ],
    ) {
        let l = Limits::default();
        let mut bytes = MAGIC.to_vec();
        bytes.extend_from_slice(&version.to_le_bytes());
        bytes.extend_from_slice(&body);
        let got = decode(&bytes, &l);
        check_outcome(&bytes, &l, &got);
    }
}

// ---------------------------------------------------------------------------
// 3. Mutated valid frames.

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn truncation_at_every_position_is_truncated(f in frame()) {
        let l = Limits::default();
        let bytes = encode(&f);
        for cut in 0..bytes.len() {
            prop_assert_eq!(decode(&bytes[..cut], &l), Err(WireError::Truncated), "cut at {}", cut);
        }
    }

    #[test]
    fn appended_bytes_are_trailing(f in frame(), tail in vec(any::<u8>(), 1..64)) {
        let l = Limits::default();
        let mut bytes = encode(&f);
        bytes.extend_from_slice(&tail);
        prop_assert_eq!(decode(&bytes, &l), Err(WireError::TrailingBytes { count: tail.len() }));
    }

    #[test]
    fn bad_magic_and_version_are_named(f in frame(), magic in any::<[u8; 2]>(), version in any::<u16>()) {
        let l = Limits::default();
        let good = encode(&f);

        let mut bytes = good.clone();
        bytes[..2].copy_from_slice(&magic);
        let want = if magic == MAGIC { Ok(f.clone()) } else { Err(WireError::BadMagic(magic)) };
        prop_assert_eq!(decode(&bytes, &l), want);

        let mut bytes = good.clone();
        bytes[2..4].copy_from_slice(&version.to_le_bytes());
        // A Refuse is read whatever the version; nothing else is.
        let want = if version == VERSION || matches!(f, Frame::Refuse(_)) {
            Ok(f.clone())
        } else {
            Err(WireError::UnsupportedVersion { theirs: version, ours: VERSION })
        };
        prop_assert_eq!(decode(&bytes, &l), want);

        // Both wrong: the magic is checked first.
        if magic != MAGIC {
            bytes[..2].copy_from_slice(&magic);
            prop_assert_eq!(decode(&bytes, &l), Err(WireError::BadMagic(magic)));
        }
    }

    #[test]
    fn bit_flips_never_panic(f in frame(), flips in vec(any::<prop::sample::Index>(), 1..4), bits in vec(0u8..8, 3)) {
        let l = Limits::default();
        let mut bytes = encode(&f);
        for (i, flip) in flips.iter().enumerate() {
            let at = flip.index(bytes.len());
            bytes[at] ^= 1 << bits[i];
        }
        let got = decode(&bytes, &l);
        check_outcome(&bytes, &l, &got);
    }

    /// Whole bytes replaced rather than single bits flipped.
    #[test]
    fn byte_mutations_never_panic(f in frame(), mutations in vec((any::<prop::sample::Index>(), any::<u8>()), 1..6)) {
        let l = Limits::default();
        let mut bytes = encode(&f);
        for (at, byte) in &mutations {
            let i = at.index(bytes.len());
            bytes[i] ^= byte | 1;
        }
        let got = decode(&bytes, &l);
        check_outcome(&bytes, &l, &got);
    }

    #[test]
    fn frame_size_limit_is_exact(f in frame()) {
        let bytes = encode(&f);
        let exact = Limits { max_frame_bytes: bytes.len(), ..Limits::default() };
        prop_assert_eq!(decode(&bytes, &exact), Ok(f));
        let under = Limits { max_frame_bytes: bytes.len() - 1, ..exact };
        prop_assert_eq!(
            decode(&bytes, &under),
            Err(WireError::FrameTooLarge { len_bytes: bytes.len(), max_bytes: bytes.len() - 1 })
        );
    }
}

#[test]
fn short_inputs_are_truncated_unless_the_magic_is_already_wrong() {
    let l = Limits::default();
    let truncated = Err(WireError::Truncated);
    for bytes in [&b""[..], b"K", b"KF", b"KF\x02"] {
        assert_eq!(decode(bytes, &l), truncated, "{bytes:?}");
    }
    // Two bytes are enough to see that the magic is wrong.
    for bytes in [&b"KN"[..], b"XX\x02", b"XY\x02\x00"] {
        assert_eq!(
            decode(bytes, &l),
            Err(WireError::BadMagic([bytes[0], bytes[1]])),
            "{bytes:?}"
        );
    }
    // A bare header carries no frame.
    assert_eq!(decode(&header(), &l), truncated);
}

#[test]
fn header_errors_are_precise() {
    let l = Limits::default();
    let ok = encode(&Frame::Transfer {
        transfer_id: TransferId(9),
        msg: Msg::AbortAck,
    });

    assert_eq!(decode(&[], &l), Err(WireError::Truncated));
    assert_eq!(decode(&ok[..3], &l), Err(WireError::Truncated));
    assert_eq!(decode(b"XY", &l), Err(WireError::BadMagic(*b"XY")));

    let mut bad_magic = ok.clone();
    bad_magic[0] = b'k';
    assert_eq!(
        decode(&bad_magic, &l),
        Err(WireError::BadMagic([b'k', b'F']))
    );

    let mut future = ok.clone();
    future[2..4].copy_from_slice(&(VERSION + 1).to_le_bytes());
    assert_eq!(
        decode(&future, &l),
        Err(WireError::UnsupportedVersion {
            theirs: VERSION + 1,
            ours: VERSION
        })
    );

    // Unknown frame variant (beyond the last one).
    let mut unknown = header();
    unknown.extend_from_slice(&[7, 0]);
    assert!(matches!(decode(&unknown, &l), Err(WireError::Malformed(_))));
    // Unknown message variant inside a transfer.
    let mut unknown = header();
    unknown.extend_from_slice(&[2, 0, 10]);
    assert!(matches!(decode(&unknown, &l), Err(WireError::Malformed(_))));
}

#[test]
fn frame_size_limit_is_checked_first() {
    let limits = Limits {
        max_frame_bytes: 16,
        ..Limits::default()
    };
    let big = pull(vec![(1..=10).map(BlockId).collect()]);
    let bytes = encode(&big);
    assert!(bytes.len() > 16);
    assert_eq!(
        decode(&bytes, &limits),
        Err(WireError::FrameTooLarge {
            len_bytes: bytes.len(),
            max_bytes: 16
        })
    );
    // Even garbage is rejected by size before it is looked at.
    assert_eq!(
        decode(&[0u8; 17], &limits),
        Err(WireError::FrameTooLarge {
            len_bytes: 17,
            max_bytes: 16
        })
    );
}

// ---------------------------------------------------------------------------
// 4. The version rule.

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    /// A frame of the next version is refused before its body is read,
    /// whatever it is, unless it is a `Refuse`.
    #[test]
    fn the_next_version_is_unsupported(f in frame()) {
        let mut bytes = Vec::new();
        encode_versioned(&f, VERSION + 1, &mut bytes);
        let want = match f {
            Frame::Refuse(_) => Ok(f),
            _ => Err(WireError::UnsupportedVersion { theirs: VERSION + 1, ours: VERSION }),
        };
        prop_assert_eq!(decode(&bytes, &Limits::default()), want);
    }

    /// A `Refuse` is read whatever version its header names.
    #[test]
    fn a_refuse_of_any_version_decodes(
        header_version in prop_oneof![Just(0), Just(1), Just(VERSION), Just(VERSION + 1), Just(u16::MAX), any::<u16>()],
        refuser in edge_u16(),
    ) {
        let f = refuse(refuser);
        let mut bytes = Vec::new();
        encode_versioned(&f, header_version, &mut bytes);
        prop_assert_eq!(decode(&bytes, &Limits::default()), Ok(f));
    }
}

#[test]
fn a_refuse_decodes_under_every_listed_version() {
    for header_version in [0, 1, VERSION, VERSION + 1, u16::MAX] {
        for refuser in [0, 1, VERSION, VERSION + 1, u16::MAX] {
            let f = refuse(refuser);
            let mut bytes = Vec::new();
            encode_versioned(&f, header_version, &mut bytes);
            assert_eq!(
                decode(&bytes, &Limits::default()),
                Ok(f),
                "header version {header_version}"
            );
        }
    }
}

/// The `Refuse` encoding, written out: a change to it breaks every older
/// and newer build's view of this one, so it must fail here first.
#[test]
fn the_refuse_encoding_is_frozen() {
    let frozen: &[u8] = &[
        b'K', b'F', // magic
        0x07, 0x00, // version 7, little-endian
        0x00, // Frame::Refuse
        0x02, // Refuse::version = 2 (varint)
        0x00, // RefuseReason::UnsupportedVersion
    ];
    let f = Frame::Refuse(Refuse {
        version: 2,
        reason: RefuseReason::UnsupportedVersion,
    });
    let mut bytes = Vec::new();
    encode_versioned(&f, 7, &mut bytes);
    assert_eq!(bytes, frozen);
    assert_eq!(decode(frozen, &Limits::default()), Ok(f));
    // A version needing a multi-byte varint: 300 = 0b10_0101100.
    let mut bytes = Vec::new();
    encode_versioned(&refuse(300), 7, &mut bytes);
    assert_eq!(bytes, [b'K', b'F', 0x07, 0x00, 0x00, 0xac, 0x02, 0x00]);
}

#[test]
fn a_refuse_of_another_version_with_more_bytes_is_unsupported() {
    // Not a frozen Refuse body: something else of a version not spoken here.
    let l = Limits::default();
    let unsupported = Err(WireError::UnsupportedVersion {
        theirs: 7,
        ours: VERSION,
    });
    let refuse_v7 = [b'K', b'F', 0x07, 0x00, 0x00, 0x02, 0x00];
    let mut longer = refuse_v7.to_vec();
    longer.push(0);
    assert_eq!(decode(&longer, &l), unsupported);
    assert_eq!(decode(&refuse_v7[..6], &l), unsupported);
    let mut other_reason = refuse_v7;
    other_reason[6] = 1;
    assert_eq!(decode(&other_reason, &l), unsupported);
    let mut other_variant = refuse_v7;
    other_variant[4] = 1;
    assert_eq!(decode(&other_variant, &l), unsupported);
    // The same bytes of this version are held to the ordinary rules.
    let mut current = longer.clone();
    current[2..4].copy_from_slice(&VERSION.to_le_bytes());
    assert_eq!(
        decode(&current, &l),
        Err(WireError::TrailingBytes { count: 1 })
    );
}

// ---------------------------------------------------------------------------
// 5. Limits.

/// Small limits so that frames over them stay small. The total bound
/// leaves room for a full group in every group, and no more.
const SMALL: Limits = Limits {
    max_frame_bytes: 1 << 20,
    max_groups: 3,
    max_blocks_per_group: 4,
    max_total_blocks: 3 * 4,
    max_regions: 2,
    max_string_bytes: 8,
};

fn groups_within() -> impl Strategy<Value = Vec<Vec<BlockId>>> {
    vec(
        vec(
            any::<u32>().prop_map(BlockId),
            0..=SMALL.max_blocks_per_group,
        ),
        0..=SMALL.max_groups,
    )
}

/// Block lists that break exactly one bound, with the error they must give.
fn groups_over() -> impl Strategy<Value = (Vec<Vec<BlockId>>, WireError)> {
    prop_oneof![
        // Too many groups, each within its bound.
        vec(
            vec(
                any::<u32>().prop_map(BlockId),
                0..=SMALL.max_blocks_per_group
            ),
            SMALL.max_groups + 1..12
        )
        .prop_map(|g| {
            let n = g.len();
            (g, limit_error("groups", n, SMALL.max_groups))
        }),
        // Within the group count, one group too long. The other groups are
        // within their bound, so the total bound leaves room for at least
        // one full group; a long group that also exceeds that room is
        // reported as breaking the total (it is checked first, on the
        // group's claimed length, before anything is read).
        (
            groups_within().prop_filter("at least one group", |g| !g.is_empty()),
            any::<prop::sample::Index>(),
            vec(
                any::<u32>().prop_map(BlockId),
                SMALL.max_blocks_per_group + 1..40
            ),
        )
            .prop_map(|(mut g, at, long)| {
                let n = long.len();
                let i = at.index(g.len());
                g[i] = long;
                let before: usize = g[..i].iter().map(Vec::len).sum();
                let room = SMALL.max_total_blocks - before;
                let want = if n > room {
                    limit_error("total blocks", before + n, SMALL.max_total_blocks)
                } else {
                    limit_error("blocks per group", n, SMALL.max_blocks_per_group)
                };
                (g, want)
            }),
    ]
}

fn per_group_within() -> impl Strategy<Value = Vec<u32>> {
    vec(any::<u32>(), 0..=SMALL.max_groups)
}

fn per_group_over() -> impl Strategy<Value = Vec<u32>> {
    vec(any::<u32>(), SMALL.max_groups + 1..20)
}

fn limit_error(field: &'static str, len: usize, max: usize) -> WireError {
    WireError::LimitExceeded {
        field,
        len: len as u64,
        max,
    }
}

fn hello_with(engine_id: String, endpoint: String, regions: usize) -> Frame {
    Frame::Hello(Hello {
        engine_id,
        mode: Mode::Push,
        model: model::large().with_layout(LayoutKind::Nhd),
        layout: RankLayout {
            tp_size: 2,
            tp_rank: 1,
            num_blocks: 1000,
            regions: vec![
                Region {
                    base: 0x7f00_0000_0000,
                    // 4 heads per rank x 16 tokens x 256 bytes, K and V.
                    block_len: 2 * 16_384,
                    kv_block_len: 16_384,
                };
                regions
            ],
            stage: kvferry_machines::Stage::SINGLE,
            pools: Vec::new(),
        },
        endpoint,
    })
}

fn pull_msg(dst_blocks: Vec<Vec<BlockId>>) -> Msg {
    Msg::Pull {
        receivers_expected: 1,
        dst_blocks,
        prefix_blocks: vec![],
        lease_seq: None,
    }
}

fn pull(dst_blocks: Vec<Vec<BlockId>>) -> Frame {
    Frame::Transfer {
        transfer_id: TransferId(1),
        msg: pull_msg(dst_blocks),
    }
}

/// Checks that `f` is rejected by `SMALL` with exactly `want`, that the
/// sender-side check refuses it too, and that the limit is the only
/// reason: the same bytes pass the default limits.
fn assert_only_limit(f: &Frame, want: WireError) -> Result<(), TestCaseError> {
    let bytes = encode(f);
    prop_assert_eq!(decode(&bytes, &SMALL), Err(want));
    // Not always the same field: for a group over both its own bound and
    // the room left in the total, the decoder names the total (judged on
    // the claimed length first) and `check_limits` the group.
    let sender = f.check_limits(&SMALL);
    prop_assert!(
        matches!(sender, Err(WireError::LimitExceeded { .. })),
        "{:?}",
        sender
    );
    prop_assert_eq!(decode(&bytes, &Limits::default()), Ok(f.clone()));
    Ok(())
}

/// `f` passes `SMALL`, by the decoder and by the sender-side check.
fn assert_within(f: &Frame) -> Result<(), TestCaseError> {
    prop_assert_eq!(decode(&encode(f), &SMALL), Ok(f.clone()));
    prop_assert_eq!(f.check_limits(&SMALL), Ok(()));
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn pull_over_limits_is_rejected((dst, want) in groups_over(), prefix_ok in per_group_within(), prefix_over in per_group_over(), within in groups_within()) {
        let pull = |dst_blocks, prefix_blocks| Frame::Transfer {
            transfer_id: TransferId(1),
            msg: Msg::Pull { receivers_expected: 1, dst_blocks, prefix_blocks, lease_seq: Some(2) },
        };
        assert_only_limit(&pull(dst, prefix_ok.clone()), want)?;
        let n = prefix_over.len();
        assert_only_limit(&pull(within.clone(), prefix_over), limit_error("per-group values", n, SMALL.max_groups))?;
        // Within every bound: accepted.
        assert_within(&pull(within, prefix_ok))?;
    }

    #[test]
    fn ready_over_limits_is_rejected((src, want) in groups_over(), start_ok in per_group_within(), start_over in per_group_over(), within in groups_within()) {
        let ready = |start_blocks, src_blocks| Frame::Transfer {
            transfer_id: TransferId(1),
            msg: Msg::Ready { chunk: 0, start_blocks, src_blocks, is_last: true },
        };
        assert_only_limit(&ready(start_ok.clone(), src), want)?;
        let n = start_over.len();
        assert_only_limit(&ready(start_over, within.clone()), limit_error("per-group values", n, SMALL.max_groups))?;
        assert_within(&ready(start_ok, within))?;
    }

    #[test]
    fn hello_strings_over_limits_are_rejected(ok in "\\PC{0,2}", over in "\\PC{3,40}") {
        // `\PC{0,2}` is at most 8 bytes (4 per char); pad `over` past 8 bytes.
        let over = format!("{over}123456789");
        let n = over.len();
        assert_only_limit(&hello_with(over.clone(), ok.clone(), 1), limit_error("string", n, SMALL.max_string_bytes))?;
        assert_only_limit(&hello_with(ok.clone(), over, 1), limit_error("string", n, SMALL.max_string_bytes))?;
        assert_within(&hello_with(ok.clone(), ok, 1))?;
    }

    #[test]
    fn hello_regions_over_limits_are_rejected(n in SMALL.max_regions + 1..40) {
        assert_only_limit(&hello_with("p".into(), "e".into(), n), limit_error("regions", n, SMALL.max_regions))?;
        assert_within(&hello_with("p".into(), "e".into(), SMALL.max_regions))?;
    }

    /// The sender-side check agrees with the decoder on every frame: what
    /// decodes under `SMALL` passes `check_limits(SMALL)`, and what fails
    /// it with a limit fails `check_limits` (or the frame size) too.
    #[test]
    fn check_limits_agrees_with_decode(f in frame()) {
        let bytes = encode(&f);
        let sendable = f.check_limits(&SMALL).is_ok() && bytes.len() <= SMALL.max_frame_bytes;
        match decode(&bytes, &SMALL) {
            Ok(got) => {
                prop_assert_eq!(got, f);
                prop_assert!(sendable);
            }
            Err(WireError::LimitExceeded { .. } | WireError::FrameTooLarge { .. }) => prop_assert!(!sendable),
            Err(other) => prop_assert!(false, "{:?} for a frame valid under default limits", other),
        }
    }
}

#[test]
fn limits_count_bytes_not_chars() {
    // Four two-byte characters are exactly the 8-byte limit; five are over.
    let at = hello_with("éééé".into(), "x".into(), 1);
    assert_eq!(decode(&encode(&at), &SMALL), Ok(at));
    let over = hello_with("ééééé".into(), "x".into(), 1);
    assert_eq!(
        decode(&encode(&over), &SMALL),
        Err(limit_error("string", 10, 8))
    );
}

#[test]
fn regions_over_the_planner_bound_are_rejected() {
    let l = Limits::default();
    assert_eq!(l.max_regions, REGIONS_MAX);
    let at = hello_with("p0".into(), "tcp://p0:1".into(), REGIONS_MAX);
    assert_eq!(decode(&encode(&at), &l), Ok(at));
    let over = hello_with("p0".into(), "tcp://p0:1".into(), REGIONS_MAX + 1);
    assert_eq!(
        decode(&encode(&over), &l),
        Err(limit_error("regions", REGIONS_MAX + 1, REGIONS_MAX))
    );
}

/// Each bound at its value is accepted and one past it refused, naming the
/// bound, by the decoder and by `check_limits` alike.
#[test]
fn configured_limits_are_enforced_exactly() {
    let limits = Limits {
        max_groups: 2,
        max_blocks_per_group: 3,
        max_total_blocks: 5,
        max_regions: 1,
        max_string_bytes: 4,
        ..Limits::default()
    };
    let check = |f: &Frame| {
        let decoded = decode(&encode(f), &limits);
        // The sender-side check agrees with the decoder, error included.
        assert_eq!(
            decoded.as_ref().map(|_| ()).map_err(Clone::clone),
            f.check_limits(&limits),
            "{f:?}"
        );
        decoded.map(|got| assert_eq!(&got, f))
    };
    let b = |ids: &[u32]| ids.iter().copied().map(BlockId).collect::<Vec<_>>();

    // At the limits: accepted.
    assert_eq!(check(&pull(vec![b(&[1, 2, 3]), b(&[4, 5])])), Ok(()));
    // One group too many.
    assert_eq!(
        check(&pull(vec![vec![], vec![], vec![]])),
        Err(limit_error("groups", 3, 2))
    );
    // More per-group values (prefix lengths) than groups allowed.
    let with_prefix = Frame::Transfer {
        transfer_id: TransferId(1),
        msg: Msg::Pull {
            receivers_expected: 1,
            dst_blocks: vec![b(&[1])],
            prefix_blocks: vec![0, 0, 0],
            lease_seq: None,
        },
    };
    assert_eq!(
        check(&with_prefix),
        Err(limit_error("per-group values", 3, 2))
    );
    // One block too many in a group.
    assert_eq!(
        check(&pull(vec![b(&[1, 2, 3, 4])])),
        Err(limit_error("blocks per group", 4, 3))
    );
    // Within per-group limits but over the total.
    assert_eq!(
        check(&pull(vec![b(&[1, 2, 3]), b(&[4, 5, 6])])),
        Err(limit_error("total blocks", 6, 5))
    );

    let hello =
        |engine_id: &str, regions: usize| hello_with(engine_id.into(), "h:1".into(), regions);
    assert_eq!(check(&hello("abcd", 1)), Ok(()));
    assert_eq!(check(&hello("abcde", 1)), Err(limit_error("string", 5, 4)));
    // "é" is two bytes: the limit counts bytes.
    assert_eq!(check(&hello("abé", 1)), Ok(()));
    assert_eq!(check(&hello("abéé", 1)), Err(limit_error("string", 6, 4)));
    assert_eq!(check(&hello("a", 2)), Err(limit_error("regions", 2, 1)));
    let endpoint = hello_with("a".into(), "h:123".into(), 1);
    assert_eq!(check(&endpoint), Err(limit_error("string", 5, 4)));
}

#[test]
fn decode_restores_previous_limits() {
    // A decode with tight limits must not leak them into the next decode
    // on the same thread, whether it failed or succeeded.
    let tight = Limits {
        max_groups: 0,
        ..Limits::default()
    };
    let f = pull(vec![vec![BlockId(1)]]);
    let bytes = encode(&f);
    assert_eq!(decode(&bytes, &tight), Err(limit_error("groups", 1, 0)));
    assert_eq!(decode(&bytes, &Limits::default()), Ok(f.clone()));
    let empty = pull(vec![]);
    assert_eq!(decode(&encode(&empty), &tight), Ok(empty));
    assert_eq!(decode(&bytes, &Limits::default()), Ok(f));
}

// ---------------------------------------------------------------------------
// 6. Hostile length prefixes, written by hand.

/// postcard's varint for `v`.
fn varint(mut v: u64) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let byte = (v & 0x7f) as u8;
        v >>= 7;
        if v == 0 {
            out.push(byte);
            return out;
        }
        out.push(byte | 0x80);
    }
}

fn header() -> Vec<u8> {
    let mut out = MAGIC.to_vec();
    out.extend_from_slice(&VERSION.to_le_bytes());
    out
}

/// `fields` behind the header, checked to be how `encode` writes `empty`
/// up to the length prefix that follows them (`empty` has a zero there).
/// Keeps the hand-written prefixes below honest if the encoding changes.
fn prefix_of(empty: &Frame, fields: &[u8]) -> Vec<u8> {
    let mut out = header();
    out.extend_from_slice(fields);
    let real = encode(empty);
    assert_eq!(&real[..out.len() + 1], &[&out[..], &[0]].concat()[..]);
    out
}

/// Frames a few bytes long whose length prefixes claim 2^60 elements, one
/// per length-prefixed field. Frame tags: Refuse 0, Hello 1, Transfer 2;
/// Msg tags: Pull 0, Ready 1.
fn huge_claims() -> Vec<(&'static str, Vec<u8>)> {
    const HUGE: u64 = 1 << 60;
    let claim = |mut prefix: Vec<u8>| {
        prefix.extend(varint(HUGE));
        prefix
    };
    let transfer = |msg| Frame::Transfer {
        transfer_id: TransferId(0),
        msg,
    };
    let pull = |dst_blocks| {
        transfer(Msg::Pull {
            receivers_expected: 0,
            dst_blocks,
            prefix_blocks: vec![],
            lease_seq: None,
        })
    };
    let ready = |src_blocks| {
        transfer(Msg::Ready {
            chunk: 0,
            start_blocks: vec![],
            src_blocks,
            is_last: false,
        })
    };
    let hello = |engine_id: &str, regions| {
        let Frame::Hello(mut h) = hello_with(engine_id.into(), String::new(), regions) else {
            unreachable!()
        };
        h.model = model::flat(1);
        h.layout = RankLayout {
            tp_size: 1,
            tp_rank: 0,
            num_blocks: 1,
            regions: vec![
                Region {
                    base: 0,
                    block_len: 0,
                    kv_block_len: 0
                };
                regions
            ],
            stage: kvferry_machines::Stage::SINGLE,
            pools: Vec::new(),
        };
        Frame::Hello(h)
    };
    // Transfer { id 0, Pull { receivers_expected 0, dst_blocks: len 2^60 } }
    let dst = prefix_of(&pull(vec![]), &[2, 0, 0, 0]);
    // The same with one (empty) group present, then the frame ends.
    let mut dst_some = claim(dst.clone());
    dst_some.push(0);
    vec![
        ("Pull.dst_blocks", claim(dst)),
        ("Pull.dst_blocks, one group", dst_some),
        (
            "Pull.dst_blocks[0]",
            claim(prefix_of(&pull(vec![vec![]]), &[2, 0, 0, 0, 1])),
        ),
        (
            "Pull.prefix_blocks",
            claim(prefix_of(&pull(vec![]), &[2, 0, 0, 0, 0])),
        ),
        (
            "Ready.start_blocks",
            claim(prefix_of(&ready(vec![]), &[2, 0, 1, 0])),
        ),
        (
            "Ready.src_blocks",
            claim(prefix_of(&ready(vec![]), &[2, 0, 1, 0, 0])),
        ),
        (
            "Ready.src_blocks[0]",
            claim(prefix_of(&ready(vec![vec![]]), &[2, 0, 1, 0, 0, 1])),
        ),
        ("Hello.engine_id", claim(prefix_of(&hello("", 1), &[1]))),
        // engine_id "", Push, Hnd, 1 head, 1 token, 1 byte, tp 1, rank 0,
        // 1 block, regions: len 2^60.
        (
            "Hello.regions",
            claim(prefix_of(&hello("", 0), &[1, 0, 0, 0, 1, 1, 1, 1, 0, 1])),
        ),
        // ... one zero region, stage (PP 1, rank 0, first region 0),
        // endpoint: len 2^60.
        (
            "Hello.endpoint",
            claim(prefix_of(
                &hello("", 1),
                &[1, 0, 0, 0, 1, 1, 1, 1, 0, 1, 1, 0, 0, 0, 1, 0, 0],
            )),
        ),
    ]
}

#[test]
fn huge_length_prefixes_fail_fast_without_big_allocations() {
    let l = Limits::default();
    for (what, bytes) in huge_claims() {
        assert!(bytes.len() <= 32, "{what}: {} bytes", bytes.len());
        let started = Instant::now();
        let (got, peak_bytes) = peak_alloc_bytes(|| decode(&bytes, &l));
        let took = started.elapsed();
        assert_eq!(got, Err(WireError::Truncated), "{what}");
        // A claim beyond the bytes left reserves nothing (the elements are
        // counted as they are read); a decoder that trusted the claim would
        // ask for 2^60 elements and abort here.
        assert!(
            peak_bytes <= 1024,
            "{what}: a {}-byte frame made decode allocate {peak_bytes} bytes",
            bytes.len()
        );
        assert!(took < Duration::from_secs(1), "{what}: took {took:?}");
    }
}

/// A claim the bytes could back but the limit forbids is reported as such,
/// from the length prefix alone; one the bytes cannot back is truncated.
#[test]
fn claimed_block_lengths_are_judged_before_the_elements() {
    let l = Limits::default();
    let pull_prefix = || {
        let mut b = header();
        b.extend_from_slice(&[2, 1, 0, 1]); // Transfer 1, Pull, 1 receiver
        b
    };

    // 2^32 - 1 groups in a 10-byte frame: nothing reserved, truncated.
    let mut bytes = pull_prefix();
    bytes.extend(varint(u64::from(u32::MAX)));
    assert_eq!(decode(&bytes, &l), Err(WireError::Truncated));

    // One group too many, each an empty group actually present.
    let mut bytes = pull_prefix();
    bytes.extend(varint(l.max_groups as u64 + 1));
    bytes.extend(std::iter::repeat_n(0u8, l.max_groups + 1 + 2));
    assert_eq!(
        decode(&bytes, &l),
        Err(limit_error("groups", l.max_groups + 1, l.max_groups))
    );

    // One group that claims 2^40 blocks: truncated, nothing reserved.
    let mut bytes = pull_prefix();
    bytes.extend(varint(1));
    bytes.extend(varint(1 << 40));
    assert_eq!(decode(&bytes, &l), Err(WireError::Truncated));

    // Total blocks over the limit across groups, each group within its own.
    let small = Limits {
        max_blocks_per_group: 4,
        max_total_blocks: 6,
        ..l
    };
    let mut bytes = pull_prefix();
    bytes.extend(varint(2));
    for _ in 0..2 {
        bytes.extend(varint(4));
        bytes.extend_from_slice(&[1, 2, 3, 4]);
    }
    bytes.extend_from_slice(&[0, 0]);
    assert_eq!(
        decode(&bytes, &small),
        Err(limit_error("total blocks", 8, 6))
    );
}

/// The same for a hello's strings and regions.
#[test]
fn claimed_hello_lengths_are_judged_before_the_elements() {
    let l = Limits::default();

    // An engine id claiming 1 GiB: postcard sees the bytes are not there
    // before the bounded visitor runs.
    let mut bytes = header();
    bytes.push(1);
    bytes.extend(varint(1 << 30));
    bytes.extend_from_slice(b"abc");
    assert_eq!(decode(&bytes, &l), Err(WireError::Truncated));

    // An engine id over the limit with its bytes present.
    let n = l.max_string_bytes + 1;
    let mut bytes = header();
    bytes.push(1);
    bytes.extend(varint(n as u64));
    bytes.extend(std::iter::repeat_n(b'a', n));
    assert_eq!(
        decode(&bytes, &l),
        Err(limit_error("string", n, l.max_string_bytes))
    );

    // More regions than allowed, with the bytes to back the claim (three
    // zero varints per region).
    let small = Limits {
        max_regions: 2,
        ..l
    };
    let mut bytes = header();
    bytes.extend_from_slice(&[1, 0, 0, 0, 1, 1, 1, 1, 0, 1]);
    bytes.extend(varint(3));
    bytes.extend(std::iter::repeat_n(0u8, 3 * 3 + 1));
    assert_eq!(decode(&bytes, &small), Err(limit_error("regions", 3, 2)));
}

/// `Transfer { 0, Pull { receivers_expected 0, dst_blocks: [[0; blocks];
/// groups], prefix_blocks [], lease_seq None } }` written by hand, so that
/// it can break limits `encode` would not check.
fn pull_bytes(groups: usize, blocks: usize) -> Vec<u8> {
    let mut bytes = header();
    bytes.extend_from_slice(&[2, 0, 0, 0]);
    bytes.extend(varint(groups as u64));
    for _ in 0..groups {
        bytes.extend(varint(blocks as u64));
        bytes.extend(std::iter::repeat_n(0, blocks));
    }
    bytes.extend_from_slice(&[0, 0]);
    bytes
}

/// What `decode` allocates stays proportional to the frame: an over-limit
/// frame is rejected on its claimed lengths before its elements are built,
/// and an accepted one costs a few bytes per wire byte (a one-byte block id
/// becomes a four-byte `BlockId`). The factor of 32 catches a regression to
/// trusting claimed lengths, or a costlier representation.
#[test]
fn frames_allocate_in_proportion_to_their_size() {
    let l = Limits::default();

    let over = pull_bytes(1 << 16, 1);
    let (got, peak_bytes) = peak_alloc_bytes(|| decode(&over, &l));
    assert_eq!(got, Err(limit_error("groups", 1 << 16, l.max_groups)));
    assert!(
        peak_bytes <= 32 * over.len(),
        "a {}-byte over-limit frame made decode allocate {peak_bytes} bytes",
        over.len()
    );

    let within = pull_bytes(l.max_groups, 1024);
    let (got, peak_bytes) = peak_alloc_bytes(|| decode(&within, &l));
    let want = Frame::Transfer {
        transfer_id: TransferId(0),
        msg: Msg::Pull {
            receivers_expected: 0,
            dst_blocks: vec![vec![BlockId(0); 1024]; l.max_groups],
            prefix_blocks: Vec::new(),
            lease_seq: None,
        },
    };
    assert_eq!(got, Ok(want));
    assert!(
        peak_bytes <= 32 * within.len(),
        "a {}-byte frame made decode allocate {peak_bytes} bytes",
        within.len()
    );
}

// ---------------------------------------------------------------------------
// 7. Range checks.

/// Fields out of the range the protocol allows: `receivers_expected` is a
/// `u16` on the wire, so a larger varint is malformed; a hello must
/// announce a region.
#[test]
fn out_of_range_fields_are_refused() {
    let l = Limits::default();
    let pull = |receivers_expected: u64| {
        let mut bytes = header();
        bytes.extend_from_slice(&[2, 1, 0]);
        bytes.extend(varint(receivers_expected));
        bytes.extend_from_slice(&[0, 0, 0]);
        bytes
    };
    assert_eq!(
        decode(&pull(u64::from(u16::MAX)), &l),
        Ok(Frame::Transfer {
            transfer_id: TransferId(1),
            msg: Msg::Pull {
                receivers_expected: u16::MAX,
                dst_blocks: vec![],
                prefix_blocks: vec![],
                lease_seq: None,
            },
        })
    );
    for above in [u64::from(u16::MAX) + 1, u64::from(u32::MAX)] {
        assert!(
            matches!(decode(&pull(above), &l), Err(WireError::Malformed(_))),
            "{above}"
        );
    }

    let Frame::Hello(mut h) = hello_with("p".into(), "tcp://p:1".into(), 2) else {
        unreachable!()
    };
    assert!(decode(&encode(&Frame::Hello(h.clone())), &l).is_ok());
    h.layout.regions.clear();
    assert_eq!(
        decode(&encode(&Frame::Hello(h)), &l),
        Err(WireError::Invalid {
            field: "regions",
            why: "no region"
        })
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    /// A valid hello stripped of its regions is refused rather than
    /// guessed at; any shape of its model and regions is carried as is
    /// (`head_bytes` travels explicitly; the planner judges the shape).
    #[test]
    fn hellos_without_regions_are_invalid(h in hello(), kv_shift in 1u64..1 << 20) {
        let l = Limits::default();
        let mut none = h.clone();
        none.layout.regions.clear();
        prop_assert_eq!(
            decode(&encode(&Frame::Hello(none)), &l),
            Err(WireError::Invalid { field: "regions", why: "no region" })
        );
        let mut ragged = h;
        ragged.layout.regions[0].kv_block_len = ragged.layout.regions[0].kv_block_len.wrapping_add(kv_shift);
        let ragged = Frame::Hello(ragged);
        prop_assert_eq!(decode(&encode(&ragged), &l), Ok(ragged));
    }
}

// ---------------------------------------------------------------------------
// 8. Notifications.

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    /// A data-plane notification unpacks to exactly what was packed, and
    /// every strict prefix of it that cuts a frame is refused, typed.
    #[test]
    fn notifications_round_trip_and_truncations_are_refused(
        endpoint in string_within(64),
        frames in vec(frame(), 0..8),
    ) {
        let l = Limits::default();
        let encoded: Vec<Vec<u8>> = frames.iter().map(encode).collect();
        let bytes = encode_notify(&endpoint, encoded.iter().map(|f| &f[..]));
        let lens = wire::notify_endpoint_len(&endpoint)
            + encoded.iter().map(|f| wire::notify_frame_len(f)).sum::<u64>();
        prop_assert_eq!(bytes.len() as u64, lens);
        let (e, got) = decode_notify(&bytes, &l).expect("own notification decodes");
        prop_assert_eq!(e, endpoint.as_str());
        let got: Vec<Frame> = got.iter().map(|f| decode(f, &l).expect("frame")).collect();
        prop_assert_eq!(&got, &frames);
        // Cutting inside the header or inside a frame is refused; cutting
        // exactly between frames is a shorter, valid notification.
        let mut boundaries = vec![2 + endpoint.len()];
        for f in &encoded {
            let last = *boundaries.last().unwrap();
            boundaries.push(last + 4 + f.len());
        }
        for cut in 0..bytes.len() {
            match decode_notify(&bytes[..cut], &l) {
                Ok(_) => prop_assert!(boundaries.contains(&cut), "cut at {}", cut),
                Err(e) => {
                    prop_assert!(!boundaries.contains(&cut), "cut at {}", cut);
                    prop_assert!(matches!(e, WireError::Invalid { field: "notification", .. }), "{:?}", e);
                }
            }
        }
    }

    /// Arbitrary bytes never panic the notification decoder, and what it
    /// accepts stays within the limits and re-packs to the same bytes.
    #[test]
    fn arbitrary_notifications_get_a_typed_error(bytes in vec(any::<u8>(), 0..512)) {
        let l = Limits { max_frame_bytes: 64, max_string_bytes: 16, ..Limits::default() };
        match decode_notify(&bytes, &l) {
            Ok((e, frames)) => {
                prop_assert!(e.len() <= 16);
                prop_assert!(frames.len() <= MAX_NOTIFY_FRAMES);
                prop_assert!(frames.iter().all(|f| f.len() <= 64));
                prop_assert_eq!(encode_notify(e, frames.iter().copied()), bytes);
            }
            Err(e) => prop_assert!(matches!(e, WireError::Invalid { field: "notification", .. }), "{:?}", e),
        }
    }
}

#[test]
fn notification_bounds_are_exact() {
    let l = Limits {
        max_frame_bytes: 8,
        max_string_bytes: 4,
        ..Limits::default()
    };
    let bad = |why| {
        Err::<(), _>(WireError::Invalid {
            field: "notification",
            why,
        })
    };
    let unpack = |bytes: &[u8]| decode_notify(bytes, &l).map(|_| ());
    assert_eq!(unpack(&encode_notify("abcd", [&[0u8; 8][..]])), Ok(()));
    assert_eq!(
        unpack(&encode_notify("abcde", [&[0u8; 8][..]])),
        bad("endpoint too long")
    );
    assert_eq!(
        unpack(&encode_notify("abcd", [&[0u8; 9][..]])),
        bad("frame too long")
    );
    assert_eq!(unpack(&[0xff, 0xfe]), bad("endpoint too long"));
    assert_eq!(unpack(&[2, 0, 0xff, 0xfe]), bad("endpoint is not UTF-8"));
    assert_eq!(unpack(&[1]), bad("truncated endpoint length"));
    let empty: [&[u8]; MAX_NOTIFY_FRAMES] = [&[]; MAX_NOTIFY_FRAMES];
    assert_eq!(unpack(&encode_notify("e", empty)), Ok(()));
    let over = vec![&[][..]; MAX_NOTIFY_FRAMES + 1];
    assert_eq!(unpack(&encode_notify("e", over)), bad("too many frames"));
}

/// A group whose claimed length is longer than the frame (so postcard
/// claims nothing) and that runs past the room left in the total is
/// reported as breaking the total, not its own bound.
#[test]
fn an_unclaimed_group_past_the_total_names_the_total() {
    let limits = Limits {
        max_groups: 3,
        max_blocks_per_group: 5,
        max_total_blocks: 8,
        ..Limits::default()
    };
    let ones = |n| vec![BlockId(1); n];
    let frame = Frame::Transfer {
        transfer_id: TransferId(9),
        msg: Msg::Pull {
            receivers_expected: 1,
            dst_blocks: vec![ones(5), ones(4)],
            prefix_blocks: vec![0, 0],
            lease_seq: None,
        },
    };
    let mut bytes = encode(&frame);
    // header, Transfer, id 9, Pull, 1 receiver, 2 groups, 5, five ids: the
    // second group's length prefix.
    let at = 4 + 6 + 5;
    assert_eq!(bytes[at], 4);
    let mut claim = Vec::new();
    let mut v: u64 = 1 << 60;
    while v >= 0x80 {
        claim.push((v as u8) | 0x80);
        v >>= 7;
    }
    claim.push(v as u8);
    bytes.splice(at..=at, claim);
    assert_eq!(
        decode(&bytes, &limits),
        Err(WireError::LimitExceeded {
            field: "total blocks",
            len: 9,
            max: 8
        })
    );
}

// ---------------------------------------------------------------------------
// String request ids.

fn named(request_id: String, msg: Msg) -> Frame {
    Frame::NamedTransfer {
        transfer_id: TransferId(5),
        request_id,
        msg,
    }
}

/// A request id one byte over `REQUEST_ID_MAX_BYTES` is refused from its
/// length prefix, before the string is copied; the configured
/// `max_string_bytes` does not move the bound (both sides hash the ids).
#[test]
fn a_request_id_over_its_limit_is_refused_before_allocation() {
    let want = limit_error("request id", REQUEST_ID_MAX_BYTES + 1, REQUEST_ID_MAX_BYTES);
    for limits in [
        Limits::default(),
        Limits {
            max_string_bytes: 1 << 20,
            ..Limits::default()
        },
    ] {
        for over in [
            "x".repeat(REQUEST_ID_MAX_BYTES + 1),
            format!("{}é", "x".repeat(255)),
        ] {
            let f = named(over, pull_msg(vec![]));
            let bytes = encode(&f);
            let (got, peak_bytes) = peak_alloc_bytes(|| decode(&bytes, &limits));
            assert_eq!(got, Err(want.clone()));
            assert!(
                peak_bytes < REQUEST_ID_MAX_BYTES,
                "allocated {peak_bytes} bytes"
            );
            assert_eq!(f.check_limits(&limits), Err(want.clone()));
        }
    }
    let at = named("é".repeat(REQUEST_ID_MAX_BYTES / 2), pull_msg(vec![]));
    assert_eq!(decode(&encode(&at), &Limits::default()), Ok(at.clone()));
    assert_eq!(at.check_limits(&Limits::default()), Ok(()));
}

/// A length prefix claiming 2^60 bytes of request id is truncated at once.
#[test]
fn a_huge_request_id_claim_fails_fast() {
    let mut bytes = header();
    // NamedTransfer is frame variant 5, then its transfer id (5).
    bytes.extend_from_slice(&[5, 5]);
    bytes.extend(varint(1 << 60));
    let empty = encode(&named(String::new(), pull_msg(vec![])));
    assert_eq!(
        &empty[..HEADER_LEN + 3],
        &[&bytes[..HEADER_LEN + 2], &[0]].concat()[..]
    );
    let (got, peak_bytes) = peak_alloc_bytes(|| decode(&bytes, &Limits::default()));
    assert_eq!(got, Err(WireError::Truncated));
    assert!(peak_bytes <= 1024, "allocated {peak_bytes} bytes");
}

/// A named transfer carries a `Pull` with a request id of at least one
/// byte; anything else is refused after decoding, and by the sender's check.
#[test]
fn a_named_transfer_is_a_pull_with_a_request_id() {
    let l = Limits::default();
    let cases = [
        (
            named(String::new(), pull_msg(vec![])),
            WireError::Invalid {
                field: "request id",
                why: "empty",
            },
        ),
        (
            named("cmpl-a".into(), Msg::Abort),
            WireError::Invalid {
                field: "named transfer",
                why: "only a Pull names its request",
            },
        ),
    ];
    for (f, want) in cases {
        assert_eq!(decode(&encode(&f), &l), Err(want.clone()), "{f:?}");
        assert_eq!(f.check_limits(&l), Err(want), "{f:?}");
    }
}

/// The request id hash is the 64-bit FNV-1a of the id's bytes: the
/// published test vectors, and one collision a test hash would need.
#[test]
fn the_request_id_hash_is_fnv1a_64() {
    for (id, h) in [
        ("", 0xcbf2_9ce4_8422_2325),
        ("a", 0xaf63_dc4c_8601_ec8c),
        ("foobar", 0x8594_4171_f739_67e8),
    ] {
        assert_eq!(TransferId::of_request_id(id), TransferId(h), "{id:?}");
    }
    assert_ne!(
        TransferId::of_request_id("cmpl-a"),
        TransferId::of_request_id("cmpl-b")
    );
}

/// `hello_with(.., 1)` declaring `pools` aux pools of `buffers` buffers.
fn hello_with_pools(pools: usize, buffers: usize) -> Frame {
    let Frame::Hello(mut h) = hello_with("p".into(), "e".into(), 1) else {
        unreachable!()
    };
    let pool = kvferry_machines::Pool {
        kind: kvferry_machines::PoolKind::Aux,
        items: 64,
        regions: vec![
            kvferry_machines::PoolRegion {
                base: 0x7e00_0000_0000,
                item_len: 24,
            };
            buffers
        ],
    };
    h.layout.pools = vec![pool; pools];
    Frame::Hello(h)
}

/// A hello's pools round-trip; more than `POOLS_MAX` pools, or a pool of
/// more buffers than `max_regions`, are refused from their length
/// prefixes, by the decoder and by `check_limits` alike.
#[test]
fn hello_pools_are_bounded_exactly() {
    use kvferry_machines::POOLS_MAX;
    let l = Limits::default();
    let at = hello_with_pools(POOLS_MAX, 3);
    assert_eq!(decode(&encode(&at), &l), Ok(at.clone()));
    assert_eq!(at.check_limits(&l), Ok(()));
    let over = hello_with_pools(POOLS_MAX + 1, 1);
    let want = limit_error("pools", POOLS_MAX + 1, POOLS_MAX);
    assert_eq!(decode(&encode(&over), &l), Err(want.clone()));
    assert_eq!(over.check_limits(&l), Err(want));
    let small = Limits {
        max_regions: 2,
        ..l
    };
    let within = hello_with_pools(1, 2);
    assert_eq!(decode(&encode(&within), &small), Ok(within));
    let over = hello_with_pools(1, 3);
    let want = limit_error("pool regions", 3, 2);
    assert_eq!(decode(&encode(&over), &small), Err(want.clone()));
    assert_eq!(over.check_limits(&small), Err(want));
}
