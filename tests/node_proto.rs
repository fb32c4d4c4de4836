//! The node's side-channel frames (`kvferry::node::proto`): round trips for
//! every `Frame` and `Msg` variant, hostile and mutated input never panics
//! and gets the precise typed error, and the `FrameLimits` bounds are
//! enforced (issue 5, "Fuzzing").

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::time::{Duration, Instant};

use kvferry::node::proto::{
    check_limits, decode, encode, Frame, FrameError, FrameLimits, Hello, MAGIC, VERSION,
};
use kvferry_machines::common::{BlockId, Mode, Msg};
use kvferry_machines::layout::{LayoutKind, ModelSpec, RankLayout, Region};
use kvferry_machines::planner::REGIONS_MAX;
use proptest::collection::vec;
use proptest::prelude::*;

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
    let l = FrameLimits::default();
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
    ]
}

fn region() -> impl Strategy<Value = Region> {
    (edge_u64(), edge_u64(), edge_u64()).prop_map(|(base, block_len, kv_block_len)| Region {
        base,
        block_len,
        kv_block_len,
    })
}

fn hello() -> impl Strategy<Value = Hello> {
    let max = FrameLimits::default().max_string_bytes;
    let model = (
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
        );
    let layout = (edge_u32(), edge_u32(), edge_u64(), vec(region(), 0..6)).prop_map(
        |(tp_size, tp_rank, num_blocks, regions)| RankLayout {
            tp_size,
            tp_rank,
            num_blocks,
            regions,
        },
    );
    (
        string_within(max),
        prop::sample::select(vec![Mode::Push, Mode::Pull]),
        model,
        layout,
        string_within(max),
        any::<bool>(),
    )
        .prop_map(
            |(engine_id, mode, model, layout, endpoint, is_reply)| Hello {
                engine_id,
                mode,
                model,
                layout,
                endpoint,
                is_reply,
            },
        )
}

fn frame() -> impl Strategy<Value = Frame> {
    prop_oneof![
        1 => hello().prop_map(Frame::Hello),
        4 => (edge_u64(), msg()).prop_map(|(transfer_id, msg)| Frame::Transfer { transfer_id, msg }),
        1 => edge_u64().prop_map(|seq| Frame::Heartbeat { seq }),
        1 => edge_u64().prop_map(|seq| Frame::HeartbeatAck { seq }),
    ]
}

/// The header checks, stated from the format in the module docs: what
/// `decode` must answer for `bytes` whatever follows the header, or `None`
/// when the header is valid.
fn header_error(bytes: &[u8], limits: &FrameLimits) -> Option<FrameError> {
    if bytes.len() > limits.max_frame_bytes {
        return Some(FrameError::TooLarge {
            len_bytes: bytes.len(),
            max_bytes: limits.max_frame_bytes,
        });
    }
    if bytes.len() < 4 {
        return Some(FrameError::Truncated);
    }
    if bytes[..2] != MAGIC {
        return Some(FrameError::BadMagic([bytes[0], bytes[1]]));
    }
    let version = u16::from_le_bytes([bytes[2], bytes[3]]);
    if version != VERSION {
        return Some(FrameError::UnsupportedVersion(version));
    }
    None
}

/// What every decode result must satisfy, whatever the input: an accepted
/// frame is within the limits and survives its own round trip; a rejected
/// one carries a header error exactly when the header is bad.
fn check_outcome(bytes: &[u8], limits: &FrameLimits, got: &Result<Frame, FrameError>) {
    match (header_error(bytes, limits), got) {
        (Some(want), got) => assert_eq!(got.as_ref(), Err(&want), "input {bytes:02x?}"),
        (None, Ok(f)) => {
            assert_eq!(check_limits(f, limits), Ok(()));
            assert_eq!(decode(&encode(f), limits).as_ref(), Ok(f));
        }
        (None, Err(e)) => {
            assert!(
                matches!(
                    e,
                    FrameError::Truncated
                        | FrameError::TrailingBytes(_)
                        | FrameError::Malformed(_)
                        | FrameError::LimitExceeded { .. }
                ),
                "header is valid, yet {e:?} for {bytes:02x?}"
            );
            assert!(!e.to_string().is_empty());
        }
    }
}

fn msg_variant(m: &Msg) -> &'static str {
    match m {
        Msg::Pull { .. } => "Pull",
        Msg::Ready { .. } => "Ready",
        Msg::LeaseRequest { .. } => "LeaseRequest",
        Msg::LeaseGrant { .. } => "LeaseGrant",
        Msg::Status { .. } => "Status",
        Msg::Done { .. } => "Done",
        Msg::Abort => "Abort",
        Msg::AbortAck => "AbortAck",
    }
}

// ---------------------------------------------------------------------------
// 1. Round trips.

proptest! {
    #![proptest_config(ProptestConfig { cases: 3000, ..ProptestConfig::default() })]

    #[test]
    fn round_trip_every_variant(f in frame()) {
        let bytes = encode(&f);
        prop_assert_eq!(&bytes[..2], &MAGIC[..]);
        prop_assert_eq!(&bytes[2..4], &VERSION.to_le_bytes()[..]);
        prop_assert_eq!(decode(&bytes, &FrameLimits::default()), Ok(f));
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
        let f = strategy.new_tree(&mut runner).unwrap().current();
        seen.insert(match &f {
            Frame::Hello(_) => "Hello",
            Frame::Transfer { msg, .. } => msg_variant(msg),
            Frame::Heartbeat { .. } => "Heartbeat",
            Frame::HeartbeatAck { .. } => "HeartbeatAck",
        });
    }
    let want = [
        "Hello",
        "Pull",
        "Ready",
        "LeaseRequest",
        "LeaseGrant",
        "Status",
        "Done",
        "Abort",
        "AbortAck",
        "Heartbeat",
        "HeartbeatAck",
    ];
    assert_eq!(seen, want.into_iter().collect());
}

/// Fixed edge cases at the limits, each variant at least once.
#[test]
fn round_trip_edge_cases() {
    let l = FrameLimits::default();
    let big_groups = vec![vec![BlockId(u32::MAX); 3]; l.max_groups];
    let frames = vec![
        Frame::Hello(Hello {
            engine_id: "é".repeat(l.max_string_bytes / 2),
            mode: Mode::Pull,
            model: ModelSpec {
                layout: LayoutKind::Mla,
                total_kv_heads: u32::MAX,
                block_tokens: 0,
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
                        kv_block_len: 0,
                    };
                    REGIONS_MAX
                ],
            },
            endpoint: "x".repeat(l.max_string_bytes),
            is_reply: true,
        }),
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
                regions: Vec::new(),
            },
            endpoint: String::new(),
            is_reply: false,
        }),
        Frame::Transfer {
            transfer_id: u64::MAX,
            msg: Msg::Pull {
                receivers_expected: u16::MAX,
                dst_blocks: big_groups.clone(),
                prefix_blocks: vec![u32::MAX; l.max_groups],
                lease_seq: Some(u64::MAX),
            },
        },
        Frame::Transfer {
            transfer_id: 0,
            msg: Msg::Pull {
                receivers_expected: 0,
                dst_blocks: Vec::new(),
                prefix_blocks: Vec::new(),
                lease_seq: None,
            },
        },
        Frame::Transfer {
            transfer_id: 1,
            msg: Msg::Ready {
                chunk: u32::MAX,
                start_blocks: vec![u32::MAX; l.max_groups],
                src_blocks: big_groups,
                is_last: true,
            },
        },
        Frame::Transfer {
            transfer_id: 2,
            msg: Msg::Ready {
                chunk: 0,
                start_blocks: Vec::new(),
                src_blocks: vec![Vec::new()],
                is_last: false,
            },
        },
        Frame::Transfer {
            transfer_id: 3,
            msg: Msg::LeaseRequest { seq: u64::MAX },
        },
        Frame::Transfer {
            transfer_id: 4,
            msg: Msg::LeaseGrant {
                seq: u64::MAX,
                duration_ms: u64::MAX,
            },
        },
        Frame::Transfer {
            transfer_id: 5,
            msg: Msg::Status { ok: false },
        },
        Frame::Transfer {
            transfer_id: 6,
            msg: Msg::Done { ok: true },
        },
        Frame::Transfer {
            transfer_id: 7,
            msg: Msg::Abort,
        },
        Frame::Transfer {
            transfer_id: 8,
            msg: Msg::AbortAck,
        },
        Frame::Heartbeat { seq: u64::MAX },
        Frame::HeartbeatAck { seq: 0 },
    ];
    for f in frames {
        let bytes = encode(&f);
        assert_eq!(decode(&bytes, &l), Ok(f));
    }
}

// ---------------------------------------------------------------------------
// 2. Arbitrary bytes.

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_get_a_typed_error(bytes in vec(any::<u8>(), 0..256)) {
        let l = FrameLimits::default();
        let got = decode(&bytes, &l);
        check_outcome(&bytes, &l, &got);
    }

    /// Random bodies behind a valid header reach the postcard decoder
    /// instead of stopping at the magic check.
    #[test]
    fn arbitrary_bodies_behind_a_valid_header(
        // A valid frame-kind tag first, so most bodies reach the inner decoders.
        tag in 0u8..5,
        body in vec(any::<u8>(), 0..256),
    ) {
        let l = FrameLimits::default();
        let mut bytes = MAGIC.to_vec();
        bytes.extend_from_slice(&VERSION.to_le_bytes());
        bytes.push(tag);
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
        let l = FrameLimits::default();
        let bytes = encode(&f);
        for cut in 0..bytes.len() {
            prop_assert_eq!(decode(&bytes[..cut], &l), Err(FrameError::Truncated), "cut at {}", cut);
        }
    }

    #[test]
    fn appended_bytes_are_trailing(f in frame(), tail in vec(any::<u8>(), 1..64)) {
        let l = FrameLimits::default();
        let mut bytes = encode(&f);
        bytes.extend_from_slice(&tail);
        prop_assert_eq!(decode(&bytes, &l), Err(FrameError::TrailingBytes(tail.len())));
    }

    #[test]
    fn bad_magic_and_version_are_named(f in frame(), magic in any::<[u8; 2]>(), version in any::<u16>()) {
        let l = FrameLimits::default();
        let good = encode(&f);

        let mut bytes = good.clone();
        bytes[..2].copy_from_slice(&magic);
        let want = if magic == MAGIC { Ok(f.clone()) } else { Err(FrameError::BadMagic(magic)) };
        prop_assert_eq!(decode(&bytes, &l), want);

        let mut bytes = good.clone();
        bytes[2..4].copy_from_slice(&version.to_le_bytes());
        let want = if version == VERSION { Ok(f.clone()) } else { Err(FrameError::UnsupportedVersion(version)) };
        prop_assert_eq!(decode(&bytes, &l), want);

        // Both wrong: the magic is checked first.
        if magic != MAGIC {
            bytes[..2].copy_from_slice(&magic);
            prop_assert_eq!(decode(&bytes, &l), Err(FrameError::BadMagic(magic)));
        }
    }

    #[test]
    fn bit_flips_never_panic(f in frame(), flips in vec(any::<prop::sample::Index>(), 1..4), bits in vec(0u8..8, 3)) {
        let l = FrameLimits::default();
        let mut bytes = encode(&f);
        for (i, flip) in flips.iter().enumerate() {
            let at = flip.index(bytes.len());
            bytes[at] ^= 1 << bits[i];
        }
        let got = decode(&bytes, &l);
        check_outcome(&bytes, &l, &got);
    }

    #[test]
    fn frame_size_limit_is_exact(f in frame()) {
        let bytes = encode(&f);
        let exact = FrameLimits { max_frame_bytes: bytes.len(), ..FrameLimits::default() };
        prop_assert_eq!(decode(&bytes, &exact), Ok(f));
        let under = FrameLimits { max_frame_bytes: bytes.len() - 1, ..exact };
        prop_assert_eq!(
            decode(&bytes, &under),
            Err(FrameError::TooLarge { len_bytes: bytes.len(), max_bytes: bytes.len() - 1 })
        );
    }
}

#[test]
fn short_inputs_are_truncated_before_the_magic_is_read() {
    let l = FrameLimits::default();
    for bytes in [&b""[..], b"K", b"KN", b"XX\x01"] {
        assert_eq!(decode(bytes, &l), Err(FrameError::Truncated), "{bytes:?}");
    }
    assert_eq!(decode(b"XY\x01\x00", &l), Err(FrameError::BadMagic(*b"XY")));
    // A bare header carries no frame.
    assert_eq!(decode(b"KN\x01\x00", &l), Err(FrameError::Truncated));
}

// ---------------------------------------------------------------------------
// 4. Limits.

/// Small limits so that frames over them stay small.
const SMALL: FrameLimits = FrameLimits {
    max_frame_bytes: 1 << 20,
    max_groups: 3,
    max_blocks_per_group: 4,
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

/// Block lists that break exactly one bound, with the error it must give
/// (`field` filled in by the caller).
fn groups_over() -> impl Strategy<Value = (Vec<Vec<BlockId>>, usize, usize)> {
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
            (g, n, SMALL.max_groups)
        }),
        // Within the group count, one group too long.
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
                (g, n, SMALL.max_blocks_per_group)
            }),
    ]
}

fn per_group_within() -> impl Strategy<Value = Vec<u32>> {
    vec(any::<u32>(), 0..=SMALL.max_groups)
}

fn per_group_over() -> impl Strategy<Value = Vec<u32>> {
    vec(any::<u32>(), SMALL.max_groups + 1..20)
}

fn limit_error(field: &'static str, len: usize, max: usize) -> FrameError {
    FrameError::LimitExceeded { field, len, max }
}

fn hello_with(engine_id: String, endpoint: String, regions: usize) -> Frame {
    Frame::Hello(Hello {
        engine_id,
        mode: Mode::Push,
        model: ModelSpec {
            layout: LayoutKind::Nhd,
            total_kv_heads: 8,
            block_tokens: 16,
            head_bytes: 256,
        },
        layout: RankLayout {
            tp_size: 2,
            tp_rank: 1,
            num_blocks: 1000,
            regions: vec![
                Region {
                    base: 0x7f00_0000_0000,
                    block_len: 4096,
                    kv_block_len: 2048,
                };
                regions
            ],
        },
        endpoint,
        is_reply: false,
    })
}

/// Checks that `f` is rejected by `SMALL` with exactly `want`, and that
/// the limit is the only reason: the same bytes pass the default limits.
fn assert_only_limit(f: &Frame, want: FrameError) -> Result<(), TestCaseError> {
    let bytes = encode(f);
    prop_assert_eq!(decode(&bytes, &SMALL), Err(want.clone()));
    prop_assert_eq!(check_limits(f, &SMALL), Err(want));
    prop_assert_eq!(decode(&bytes, &FrameLimits::default()), Ok(f.clone()));
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn pull_over_limits_is_rejected((dst, len, max) in groups_over(), prefix_ok in per_group_within(), prefix_over in per_group_over(), within in groups_within()) {
        let pull = |dst_blocks, prefix_blocks| Frame::Transfer {
            transfer_id: 1,
            msg: Msg::Pull { receivers_expected: 1, dst_blocks, prefix_blocks, lease_seq: Some(2) },
        };
        assert_only_limit(&pull(dst, prefix_ok.clone()), limit_error("dst_blocks", len, max))?;
        let n = prefix_over.len();
        assert_only_limit(&pull(within.clone(), prefix_over), limit_error("prefix_blocks", n, SMALL.max_groups))?;
        // Within every bound: accepted.
        let ok = pull(within, prefix_ok);
        prop_assert_eq!(decode(&encode(&ok), &SMALL), Ok(ok));
    }

    #[test]
    fn ready_over_limits_is_rejected((src, len, max) in groups_over(), start_ok in per_group_within(), start_over in per_group_over(), within in groups_within()) {
        let ready = |start_blocks, src_blocks| Frame::Transfer {
            transfer_id: 1,
            msg: Msg::Ready { chunk: 0, start_blocks, src_blocks, is_last: true },
        };
        assert_only_limit(&ready(start_ok.clone(), src), limit_error("src_blocks", len, max))?;
        let n = start_over.len();
        assert_only_limit(&ready(start_over, within.clone()), limit_error("start_blocks", n, SMALL.max_groups))?;
        let ok = ready(start_ok, within);
        prop_assert_eq!(decode(&encode(&ok), &SMALL), Ok(ok));
    }

    #[test]
    fn hello_strings_over_limits_are_rejected(ok in "\\PC{0,2}", over in "\\PC{3,40}") {
        // `\PC{0,2}` is at most 8 bytes (4 per char); pad `over` past 8 bytes.
        let over = format!("{over}123456789");
        let n = over.len();
        assert_only_limit(&hello_with(over.clone(), ok.clone(), 1), limit_error("engine_id", n, SMALL.max_string_bytes))?;
        assert_only_limit(&hello_with(ok.clone(), over, 1), limit_error("endpoint", n, SMALL.max_string_bytes))?;
        let fine = hello_with(ok.clone(), ok, 1);
        prop_assert_eq!(decode(&encode(&fine), &SMALL), Ok(fine));
    }
}

#[test]
fn limits_count_bytes_not_chars() {
    // Four two-byte characters are exactly the 8-byte limit; five are over.
    let at = hello_with("éééé".into(), "x".into(), 0);
    assert_eq!(decode(&encode(&at), &SMALL), Ok(at));
    let over = hello_with("ééééé".into(), "x".into(), 0);
    assert_eq!(
        decode(&encode(&over), &SMALL),
        Err(limit_error("engine_id", 10, 8))
    );
}

#[test]
fn regions_over_the_planner_bound_are_rejected() {
    let l = FrameLimits::default();
    let at = hello_with("p0".into(), "tcp://p0:1".into(), REGIONS_MAX);
    assert_eq!(decode(&encode(&at), &l), Ok(at));
    let over = hello_with("p0".into(), "tcp://p0:1".into(), REGIONS_MAX + 1);
    assert_eq!(
        decode(&encode(&over), &l),
        Err(limit_error("regions", REGIONS_MAX + 1, REGIONS_MAX))
    );
}

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

/// Frames a few bytes long whose length prefixes claim 2^60 elements, one
/// per length-prefixed field kind.
fn huge_claims() -> Vec<(&'static str, Vec<u8>)> {
    const HUGE: u64 = 1 << 60;
    let mut out = Vec::new();

    // Transfer(1) { transfer_id: 0, Pull(0) { receivers_expected: 1, dst_blocks: len 2^60 } }
    let mut pull = header();
    pull.extend_from_slice(&[1, 0, 0, 1]);
    pull.extend(varint(HUGE));
    out.push(("Pull.dst_blocks", pull.clone()));

    // The same with one (empty) group present, then the frame ends.
    let mut pull_some = pull;
    pull_some.push(0);
    out.push(("Pull.dst_blocks, one group", pull_some));

    // Pull { dst_blocks: [[2^60 blocks]] }
    let mut inner = header();
    inner.extend_from_slice(&[1, 0, 0, 1, 1]);
    inner.extend(varint(HUGE));
    out.push(("Pull.dst_blocks[0]", inner));

    // Transfer { Ready(1) { chunk: 0, start_blocks: len 2^60 } }
    let mut ready = header();
    ready.extend_from_slice(&[1, 0, 1, 0]);
    ready.extend(varint(HUGE));
    out.push(("Ready.start_blocks", ready));

    // Hello(0) { engine_id: len 2^60 }
    let mut hello = header();
    hello.push(0);
    hello.extend(varint(HUGE));
    out.push(("Hello.engine_id", hello));

    // Hello { engine_id: "", mode: Push, model: {Hnd, 1, 1, 1}, layout: {1, 0, 1, regions: len 2^60} }
    let mut regions = header();
    regions.extend_from_slice(&[0, 0, 0, 0, 1, 1, 1, 1, 0, 1]);
    regions.extend(varint(HUGE));
    out.push(("Hello.layout.regions", regions));
    out
}

#[test]
fn huge_length_prefixes_fail_fast_without_big_allocations() {
    let l = FrameLimits::default();
    for (what, bytes) in huge_claims() {
        assert!(bytes.len() <= 24, "{what}: {} bytes", bytes.len());
        let started = Instant::now();
        let (got, peak_bytes) = peak_alloc_bytes(|| decode(&bytes, &l));
        let took = started.elapsed();
        assert_eq!(got, Err(FrameError::Truncated), "{what}");
        // postcard caps a sequence's pre-allocation at the bytes left in
        // the frame (measured: at most 96 bytes here); a decoder that
        // trusted the claim would ask for 2^60 elements and abort here.
        assert!(
            peak_bytes <= 1024,
            "{what}: a {}-byte frame made decode allocate {peak_bytes} bytes",
            bytes.len()
        );
        assert!(took < Duration::from_secs(1), "{what}: took {took:?}");
    }
}

/// Limits are checked after postcard has built the frame, so an over-limit
/// frame is fully materialised first. postcard caps each pre-allocation at
/// the bytes left in the frame, so the cost stays proportional to the frame
/// (about 17x for one-block groups, each a 24-byte `Vec` plus its heap
/// block); this bounds that factor so a regression to trusting claimed
/// lengths, or a costlier representation, shows up here.
#[test]
fn over_limit_frames_allocate_in_proportion_to_their_size() {
    let groups: usize = 1 << 16;
    let mut bytes = header();
    // Transfer { 0, Pull { 1, dst_blocks: [[BlockId(0)]; groups], prefix_blocks: [], lease_seq: None } }
    bytes.extend_from_slice(&[1, 0, 0, 1]);
    bytes.extend(varint(groups as u64));
    for _ in 0..groups {
        bytes.extend_from_slice(&[1, 0]);
    }
    bytes.extend_from_slice(&[0, 0]);
    let l = FrameLimits::default();
    let (got, peak_bytes) = peak_alloc_bytes(|| decode(&bytes, &l));
    assert_eq!(got, Err(limit_error("dst_blocks", groups, l.max_groups)));
    assert!(
        peak_bytes <= 32 * bytes.len(),
        "a {}-byte frame made decode allocate {peak_bytes} bytes",
        bytes.len()
    );
}
