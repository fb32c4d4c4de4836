//! The node's side-channel frames (`kvferry::node::proto`): round trips for
//! every `Frame` and `Msg` variant, hostile and mutated input never panics
//! and gets the precise typed error, and the `FrameLimits` bounds are
//! enforced (issue 5, "Fuzzing").

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::time::{Duration, Instant};

use kvferry::node::proto::{decode, encode, Frame, FrameError, FrameLimits, Hello};
use kvferry::wire::{self, WireError, HEADER_LEN, MAGIC, VERSION};
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

/// Rows (head x token) of one block on one rank, as the decoder derives
/// `head_bytes` from the first region: `kv_block_len / rows`.
fn rows_per_block(model: &ModelSpec, tp_size: u32) -> u64 {
    let heads = match model.layout {
        LayoutKind::Mla => 1,
        LayoutKind::Hnd | LayoutKind::Nhd => u64::from(model.heads_per_rank(tp_size)),
    };
    heads * u64::from(model.block_tokens)
}

/// Hellos the node accepts: the wire carries no `head_bytes`, so the first
/// region's `kv_block_len` must be exactly `head_bytes` rows' worth, a block
/// holds at least one row (`block_tokens > 0`, and `tp_size > 0` for
/// per-head layouts), at least one region is announced and `num_blocks`
/// fits the wire's `u32`. Everything else is arbitrary.
fn hello() -> impl Strategy<Value = Hello> {
    let max = FrameLimits::default().max_string_bytes;
    let shape = (
        prop::sample::select(vec![LayoutKind::Hnd, LayoutKind::Nhd, LayoutKind::Mla]),
        edge_u32(),
        edge_u32().prop_map(|t| t.max(1)),
        edge_u32(),
    )
        .prop_filter(
            "a per-head layout needs a TP size",
            |(layout, _, _, tp_size)| *layout == LayoutKind::Mla || *tp_size > 0,
        )
        .prop_flat_map(|(layout, total_kv_heads, block_tokens, tp_size)| {
            let model = ModelSpec {
                layout,
                total_kv_heads,
                block_tokens,
                head_bytes: 0,
            };
            let max_head_bytes = u64::MAX / rows_per_block(&model, tp_size);
            (
                Just(model),
                Just(tp_size),
                prop_oneof![
                    3 => 0..=max_head_bytes,
                    1 => Just(0),
                    1 => Just(max_head_bytes),
                ],
            )
        });
    (
        shape,
        edge_u32(),
        edge_u32(),
        vec(region(), 1..6),
        string_within(max),
        prop::sample::select(vec![Mode::Push, Mode::Pull]),
        string_within(max),
    )
        .prop_map(
            |(
                (mut model, tp_size, head_bytes),
                tp_rank,
                num_blocks,
                mut regions,
                engine_id,
                mode,
                endpoint,
            )| {
                model.head_bytes = head_bytes;
                regions[0].kv_block_len = head_bytes * rows_per_block(&model, tp_size);
                Hello {
                    engine_id,
                    mode,
                    model,
                    layout: RankLayout {
                        tp_size,
                        tp_rank,
                        num_blocks: u64::from(num_blocks),
                        regions,
                    },
                    endpoint,
                }
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

/// The header checks, stated from the format in `kvferry::wire`'s docs:
/// what `decode` must answer for `bytes` whatever follows the header, or
/// `None` when the header is valid.
fn header_error(bytes: &[u8], limits: &FrameLimits) -> Option<FrameError> {
    if bytes.len() > limits.max_frame_bytes {
        return Some(FrameError::Wire(WireError::FrameTooLarge {
            len_bytes: bytes.len(),
            max_bytes: limits.max_frame_bytes,
        }));
    }
    // Two bytes are enough to tell garbage from a truncated frame.
    if bytes.len() >= 2 && bytes[..2] != MAGIC {
        return Some(FrameError::Wire(WireError::BadMagic([bytes[0], bytes[1]])));
    }
    if bytes.len() < HEADER_LEN {
        return Some(FrameError::Wire(WireError::Truncated));
    }
    let version = u16::from_le_bytes([bytes[2], bytes[3]]);
    if version != VERSION {
        return Some(FrameError::Wire(WireError::UnsupportedVersion(version)));
    }
    None
}

/// What every decode result must satisfy, whatever the input: an accepted
/// frame survives its own round trip under the same limits (so it is also
/// within them: `decode` enforces them); a rejected one carries a header
/// error exactly when the header is bad, and otherwise a body error or one
/// of the node's range checks.
fn check_outcome(bytes: &[u8], limits: &FrameLimits, got: &Result<Frame, FrameError>) {
    match (header_error(bytes, limits), got) {
        (Some(want), got) => assert_eq!(got.as_ref(), Err(&want), "input {bytes:02x?}"),
        (None, Ok(f)) => {
            assert_eq!(decode(&encode(f), limits).as_ref(), Ok(f));
        }
        (None, Err(e)) => {
            assert!(
                matches!(
                    e,
                    FrameError::Wire(
                        WireError::Truncated
                            | WireError::TrailingBytes { .. }
                            | WireError::Malformed(_)
                            | WireError::LimitExceeded { .. }
                    ) | FrameError::Invalid {
                        field: "regions" | "receivers_expected",
                        ..
                    }
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
        // The largest block the wire can describe: (2^32 - 1) rows of
        // (2^32 + 1) bytes is exactly u64::MAX.
        Frame::Hello(Hello {
            engine_id: "é".repeat(l.max_string_bytes / 2),
            mode: Mode::Pull,
            model: ModelSpec {
                layout: LayoutKind::Mla,
                total_kv_heads: u32::MAX,
                block_tokens: u32::MAX,
                head_bytes: (1 << 32) + 1,
            },
            layout: RankLayout {
                tp_size: u32::MAX,
                tp_rank: u32::MAX,
                num_blocks: u64::from(u32::MAX),
                regions: vec![
                    Region {
                        base: u64::MAX,
                        block_len: u64::MAX,
                        kv_block_len: u64::MAX,
                    };
                    REGIONS_MAX
                ],
            },
            endpoint: "x".repeat(l.max_string_bytes),
        }),
        // The smallest: one zero-byte row, no heads (a per-head layout with
        // fewer heads than ranks still holds one head per rank).
        Frame::Hello(Hello {
            engine_id: String::new(),
            mode: Mode::Push,
            model: ModelSpec {
                layout: LayoutKind::Hnd,
                total_kv_heads: 0,
                block_tokens: 1,
                head_bytes: 0,
            },
            layout: RankLayout {
                tp_size: 1,
                tp_rank: 0,
                num_blocks: 0,
                regions: vec![Region {
                    base: 0,
                    block_len: 0,
                    kv_block_len: 0,
                }],
            },
            endpoint: String::new(),
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
        // A valid message tag first (`wire::Message` has 11 variants), so
        // most bodies reach the inner decoders.
        tag in 0u8..11,
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
            prop_assert_eq!(decode(&bytes[..cut], &l), Err(FrameError::Wire(WireError::Truncated)), "cut at {}", cut);
        }
    }

    #[test]
    fn appended_bytes_are_trailing(f in frame(), tail in vec(any::<u8>(), 1..64)) {
        let l = FrameLimits::default();
        let mut bytes = encode(&f);
        bytes.extend_from_slice(&tail);
        prop_assert_eq!(decode(&bytes, &l), Err(FrameError::Wire(WireError::TrailingBytes { count: tail.len() })));
    }

    #[test]
    fn bad_magic_and_version_are_named(f in frame(), magic in any::<[u8; 2]>(), version in any::<u16>()) {
        let l = FrameLimits::default();
        let good = encode(&f);

        let mut bytes = good.clone();
        bytes[..2].copy_from_slice(&magic);
        let want = if magic == MAGIC { Ok(f.clone()) } else { Err(FrameError::Wire(WireError::BadMagic(magic))) };
        prop_assert_eq!(decode(&bytes, &l), want);

        let mut bytes = good.clone();
        bytes[2..4].copy_from_slice(&version.to_le_bytes());
        let want = if version == VERSION { Ok(f.clone()) } else { Err(FrameError::Wire(WireError::UnsupportedVersion(version))) };
        prop_assert_eq!(decode(&bytes, &l), want);

        // Both wrong: the magic is checked first.
        if magic != MAGIC {
            bytes[..2].copy_from_slice(&magic);
            prop_assert_eq!(decode(&bytes, &l), Err(FrameError::Wire(WireError::BadMagic(magic))));
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
            Err(FrameError::Wire(WireError::FrameTooLarge { len_bytes: bytes.len(), max_bytes: bytes.len() - 1 }))
        );
    }
}

#[test]
fn short_inputs_are_truncated_unless_the_magic_is_already_wrong() {
    let l = FrameLimits::default();
    let truncated = Err(FrameError::Wire(WireError::Truncated));
    for bytes in [&b""[..], b"K", b"KF", b"KF\x01"] {
        assert_eq!(decode(bytes, &l), truncated, "{bytes:?}");
    }
    // Two bytes are enough to see that the magic is wrong.
    for bytes in [&b"KN"[..], b"XX\x01", b"XY\x01\x00"] {
        assert_eq!(
            decode(bytes, &l),
            Err(FrameError::Wire(WireError::BadMagic([bytes[0], bytes[1]]))),
            "{bytes:?}"
        );
    }
    // A bare header carries no message.
    assert_eq!(decode(&header(), &l), truncated);
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

/// The node passes the wire a bound on the blocks of a whole message too:
/// a full group in every group, and no more.
const SMALL_TOTAL_BLOCKS: usize = SMALL.max_groups * SMALL.max_blocks_per_group;

/// Block lists that break exactly one bound, with the error they must give.
fn groups_over() -> impl Strategy<Value = (Vec<Vec<BlockId>>, FrameError)> {
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
                let room = SMALL_TOTAL_BLOCKS - before;
                let want = if n > room {
                    limit_error("total blocks", before + n, SMALL_TOTAL_BLOCKS)
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

fn limit_error(field: &'static str, len: usize, max: usize) -> FrameError {
    FrameError::Wire(WireError::LimitExceeded {
        field,
        len: len as u64,
        max,
    })
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
                    // 4 heads per rank x 16 tokens x 256 bytes, K and V.
                    block_len: 2 * 16_384,
                    kv_block_len: 16_384,
                };
                regions
            ],
        },
        endpoint,
    })
}

/// Checks that `f` is rejected by `SMALL` with exactly `want`, and that
/// the limit is the only reason: the same bytes pass the default limits.
fn assert_only_limit(f: &Frame, want: FrameError) -> Result<(), TestCaseError> {
    let bytes = encode(f);
    prop_assert_eq!(decode(&bytes, &SMALL), Err(want.clone()));
    prop_assert_eq!(decode(&bytes, &FrameLimits::default()), Ok(f.clone()));
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn pull_over_limits_is_rejected((dst, want) in groups_over(), prefix_ok in per_group_within(), prefix_over in per_group_over(), within in groups_within()) {
        let pull = |dst_blocks, prefix_blocks| Frame::Transfer {
            transfer_id: 1,
            msg: Msg::Pull { receivers_expected: 1, dst_blocks, prefix_blocks, lease_seq: Some(2) },
        };
        assert_only_limit(&pull(dst, prefix_ok.clone()), want)?;
        let n = prefix_over.len();
        assert_only_limit(&pull(within.clone(), prefix_over), limit_error("per-group values", n, SMALL.max_groups))?;
        // Within every bound: accepted.
        let ok = pull(within, prefix_ok);
        prop_assert_eq!(decode(&encode(&ok), &SMALL), Ok(ok));
    }

    #[test]
    fn ready_over_limits_is_rejected((src, want) in groups_over(), start_ok in per_group_within(), start_over in per_group_over(), within in groups_within()) {
        let ready = |start_blocks, src_blocks| Frame::Transfer {
            transfer_id: 1,
            msg: Msg::Ready { chunk: 0, start_blocks, src_blocks, is_last: true },
        };
        assert_only_limit(&ready(start_ok.clone(), src), want)?;
        let n = start_over.len();
        assert_only_limit(&ready(start_over, within.clone()), limit_error("per-group values", n, SMALL.max_groups))?;
        let ok = ready(start_ok, within);
        prop_assert_eq!(decode(&encode(&ok), &SMALL), Ok(ok));
    }

    #[test]
    fn hello_strings_over_limits_are_rejected(ok in "\\PC{0,2}", over in "\\PC{3,40}") {
        // `\PC{0,2}` is at most 8 bytes (4 per char); pad `over` past 8 bytes.
        let over = format!("{over}123456789");
        let n = over.len();
        assert_only_limit(&hello_with(over.clone(), ok.clone(), 1), limit_error("string", n, SMALL.max_string_bytes))?;
        assert_only_limit(&hello_with(ok.clone(), over, 1), limit_error("string", n, SMALL.max_string_bytes))?;
        let fine = hello_with(ok.clone(), ok, 1);
        prop_assert_eq!(decode(&encode(&fine), &SMALL), Ok(fine));
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
/// per length-prefixed field kind. `wire::Message` tags: Hello 0, Pull 1,
/// Ready 2, ..., Heartbeat 7.
fn huge_claims() -> Vec<(&'static str, Vec<u8>)> {
    const HUGE: u64 = 1 << 60;
    let mut out = Vec::new();

    // Pull(1) { transfer_id: 0, dst_blocks: len 2^60 }
    let mut pull = header();
    pull.extend_from_slice(&[1, 0]);
    pull.extend(varint(HUGE));
    out.push(("Pull.dst_blocks", pull.clone()));

    // The same with one (empty) group present, then the frame ends.
    let mut pull_some = pull;
    pull_some.push(0);
    out.push(("Pull.dst_blocks, one group", pull_some));

    // Pull { transfer_id: 0, dst_blocks: [[2^60 blocks]] }
    let mut inner = header();
    inner.extend_from_slice(&[1, 0, 1]);
    inner.extend(varint(HUGE));
    out.push(("Pull.dst_blocks[0]", inner));

    // Ready(2) { transfer_id: 0, chunk: 0, start_blocks: len 2^60 }
    let mut ready = header();
    ready.extend_from_slice(&[2, 0, 0]);
    ready.extend(varint(HUGE));
    out.push(("Ready.start_blocks", ready));

    // Hello(0) { engine_id: len 2^60 }
    let mut hello = header();
    hello.push(0);
    hello.extend(varint(HUGE));
    out.push(("Hello.engine_id", hello));

    // Hello { engine_id: "", dp 0, tp 0, pp 0, tp_size 1, heads 1,
    // block_tokens 1, num_blocks 1, Hnd, Push, regions: len 2^60 }
    let mut regions = header();
    regions.extend_from_slice(&[0, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0]);
    regions.extend(varint(HUGE));
    out.push(("Hello.regions", regions));

    // Heartbeat(7) { seq: 0, renew: len 2^60 }
    let mut heartbeat = header();
    heartbeat.extend_from_slice(&[7, 0]);
    heartbeat.extend(varint(HUGE));
    out.push(("Heartbeat.renew", heartbeat));
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
        assert_eq!(got, Err(FrameError::Wire(WireError::Truncated)), "{what}");
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

/// `Pull { transfer_id: 0, dst_blocks: [[0; blocks]; groups], rest zero }`
/// written by hand, so that it can break limits `encode` would not check.
fn pull_bytes(groups: usize, blocks: usize) -> Vec<u8> {
    let mut bytes = header();
    bytes.extend_from_slice(&[1, 0]);
    bytes.extend(varint(groups as u64));
    for _ in 0..groups {
        bytes.extend(varint(blocks as u64));
        bytes.extend(std::iter::repeat_n(0, blocks));
    }
    // prefix_blocks [], expected_senders, receivers_expected, lease_seq
    // None, deadline_ms, lease_ms.
    bytes.extend_from_slice(&[0, 0, 0, 0, 0, 0]);
    bytes
}

/// What `decode` allocates stays proportional to the frame: an over-limit
/// frame is rejected on its claimed lengths before its elements are built,
/// and an accepted one costs a few bytes per wire byte (a one-byte block id
/// becomes a four-byte `BlockId`). The factor of 32 catches a regression to
/// trusting claimed lengths, or a costlier representation.
#[test]
fn frames_allocate_in_proportion_to_their_size() {
    let l = FrameLimits::default();

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
        transfer_id: 0,
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

/// The node's own range checks, behind a valid wire message: each gives
/// `Invalid` naming the field.
#[test]
fn out_of_range_fields_are_invalid() {
    let l = FrameLimits::default();
    let pull = |receivers_expected| {
        wire::encode(&wire::Message::Pull(wire::Pull {
            transfer_id: 1,
            dst_blocks: Vec::new(),
            prefix_blocks: Vec::new(),
            expected_senders: 0,
            receivers_expected,
            lease_seq: None,
            deadline_ms: 0,
            lease_ms: 0,
        }))
    };
    assert!(decode(&pull(u32::from(u16::MAX)), &l).is_ok());
    assert_eq!(
        decode(&pull(u32::from(u16::MAX) + 1), &l),
        Err(FrameError::Invalid {
            field: "receivers_expected",
            why: "above 65535"
        })
    );

    let hello = |f: &dyn Fn(&mut Hello)| {
        let Frame::Hello(mut h) = hello_with("p".into(), "tcp://p:1".into(), 2) else {
            unreachable!()
        };
        f(&mut h);
        encode(&Frame::Hello(h))
    };
    assert!(decode(&hello(&|_| {}), &l).is_ok());
    assert_eq!(
        decode(&hello(&|h| h.layout.regions.clear()), &l),
        Err(FrameError::Invalid {
            field: "regions",
            why: "no region"
        })
    );
    let not_rows = Err(FrameError::Invalid {
        field: "regions",
        why: "kv_block_len is not a whole number of rows",
    });
    assert_eq!(
        decode(&hello(&|h| h.layout.regions[0].kv_block_len += 1), &l),
        not_rows
    );
    assert_eq!(decode(&hello(&|h| h.model.block_tokens = 0), &l), not_rows);
    assert_eq!(decode(&hello(&|h| h.layout.tp_size = 0), &l), not_rows);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    /// A valid hello stripped of its regions, or with a first region that
    /// is not a whole number of rows, is refused rather than guessed at.
    #[test]
    fn hellos_without_a_row_shape_are_invalid(h in hello(), extra in 1u64..1 << 20) {
        let l = FrameLimits::default();
        let mut none = h.clone();
        none.layout.regions.clear();
        prop_assert_eq!(
            decode(&encode(&Frame::Hello(none)), &l),
            Err(FrameError::Invalid { field: "regions", why: "no region" })
        );
        let rows = rows_per_block(&h.model, h.layout.tp_size);
        let mut ragged = h;
        let kv = &mut ragged.layout.regions[0].kv_block_len;
        *kv = kv.wrapping_add(extra);
        let want = if *kv % rows == 0 {
            // The shift is itself whole rows: a different, valid head size.
            let mut model = ragged.model;
            model.head_bytes = *kv / rows;
            Ok(Frame::Hello(Hello { model, ..ragged.clone() }))
        } else {
            Err(FrameError::Invalid {
                field: "regions",
                why: "kv_block_len is not a whole number of rows",
            })
        };
        prop_assert_eq!(decode(&encode(&Frame::Hello(ragged)), &l), want);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    /// A data-plane notification unpacks to exactly what was packed, and
    /// every strict prefix of it that cuts a frame is refused, typed.
    #[test]
    fn notifications_round_trip_and_truncations_are_refused(
        endpoint in string_within(64),
        frames in vec(frame(), 0..8),
    ) {
        use kvferry::node::proto::{decode_notify, encode_notify};
        let l = FrameLimits::default();
        let encoded: Vec<Vec<u8>> = frames.iter().map(encode).collect();
        let bytes = encode_notify(&endpoint, encoded.iter().map(|f| &f[..]));
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
            let r = decode_notify(&bytes[..cut], &l);
            prop_assert_eq!(r.is_ok(), boundaries.contains(&cut), "cut at {}", cut);
        }
    }

    /// Arbitrary bytes never panic the notification decoder, and what it
    /// accepts stays within the limits.
    #[test]
    fn arbitrary_notifications_get_a_typed_error(bytes in vec(any::<u8>(), 0..512)) {
        use kvferry::node::proto::{decode_notify, MAX_NOTIFY_FRAMES};
        let l = FrameLimits { max_frame_bytes: 64, max_string_bytes: 16, ..FrameLimits::default() };
        if let Ok((e, frames)) = decode_notify(&bytes, &l) {
            prop_assert!(e.len() <= 16);
            prop_assert!(frames.len() <= MAX_NOTIFY_FRAMES);
            prop_assert!(frames.iter().all(|f| f.len() <= 64));
        }
    }
}
