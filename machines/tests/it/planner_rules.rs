//! One test per planner rule, with expected descriptors worked out by hand
//! from the rule (not from the planner's output).

use kvferry_machines::internal::planner::{
    clip_to_window, plan, sliding_window_blocks, split_batches, Batch, Descriptor, PairLayout,
    Plan, PlanError, Share, TpPair,
};
use kvferry_machines::{BatchLimits, LayoutKind, ModelSpec, RankLayout, Region, Side};

use crate::model::ModelSpecExt;

const T: u32 = 4;
const B: u64 = 8;

fn model(layout: LayoutKind, heads: u32) -> ModelSpec {
    crate::model::small()
        .with_layout(layout)
        .with_heads(heads)
        .with_block_tokens(T)
        .with_head_bytes(B)
}

/// One separate tensor per region: block_len == kv_block_len.
fn rank(tp_size: u32, tp_rank: u32, num_blocks: u64, kv: u64, bases: &[u64]) -> RankLayout {
    RankLayout {
        tp_size,
        tp_rank,
        num_blocks,
        regions: bases
            .iter()
            .map(|&base| Region {
                base,
                block_len: kv,
                kv_block_len: kv,
            })
            .collect(),
        stage: kvferry_machines::Stage::SINGLE,
        pools: Vec::new(),
    }
}

fn d(src: u64, dst: u64, len: u64) -> Descriptor {
    Descriptor { src, dst, len }
}

fn big() -> BatchLimits {
    BatchLimits::default()
}

#[test]
fn homogeneous_contiguous_run_is_one_descriptor_per_region() {
    let m = model(LayoutKind::Hnd, 2);
    let kv = 2 * u64::from(T) * B; // 64
    let p = rank(1, 0, 16, kv, &[0x1000, 0x10000]);
    let dd = rank(1, 0, 16, kv, &[0x9000, 0x90000]);
    let out = plan(&m, &p, &dd, &[vec![2, 3, 4]], &[vec![7, 8, 9]], &big()).unwrap();
    assert!(out.is_transfer());
    assert_eq!(
        out.descriptors,
        vec![
            d(0x1000 + 2 * kv, 0x9000 + 7 * kv, 3 * kv),
            d(0x10000 + 2 * kv, 0x90000 + 7 * kv, 3 * kv),
        ]
    );
    assert_eq!(out.batches, vec![Batch { first: 0, count: 2 }]);
}

#[test]
fn runs_break_where_either_side_is_not_consecutive() {
    let m = model(LayoutKind::Hnd, 1);
    let kv = u64::from(T) * B; // 32
    let p = rank(1, 0, 16, kv, &[0]);
    let dd = rank(1, 0, 16, kv, &[1 << 20]);
    // Pairs: (1,5) (2,6) | (3,9) | (7,10) (8,11)
    let out = plan(
        &m,
        &p,
        &dd,
        &[vec![1, 2, 3, 7, 8]],
        &[vec![5, 6, 9, 10, 11]],
        &big(),
    )
    .unwrap();
    let dst = 1 << 20;
    assert_eq!(
        out.descriptors,
        vec![
            d(kv, dst + 5 * kv, 2 * kv),
            d(3 * kv, dst + 9 * kv, kv),
            d(7 * kv, dst + 10 * kv, 2 * kv),
        ]
    );
}

#[test]
fn padded_blocks_are_not_coalesced_across_blocks() {
    let m = model(LayoutKind::Hnd, 1);
    let kv = u64::from(T) * B;
    let region = |base| Region {
        base,
        block_len: kv + 16,
        kv_block_len: kv,
    };
    let p = RankLayout {
        tp_size: 1,
        tp_rank: 0,
        num_blocks: 4,
        regions: vec![region(0)],
        stage: kvferry_machines::Stage::SINGLE,
        pools: Vec::new(),
    };
    let dd = RankLayout {
        regions: vec![region(4096)],
        ..p.clone()
    };
    let out = plan(&m, &p, &dd, &[vec![0, 1]], &[vec![0, 1]], &big()).unwrap();
    assert_eq!(
        out.descriptors,
        vec![d(0, 4096, kv), d(kv + 16, 4096 + kv + 16, kv)]
    );
}

#[test]
fn hetero_tp_4_to_2_hnd_sends_its_heads_into_the_right_slice() {
    // H = 8: prefill rank 1 of 4 holds heads 2..4, decode rank 0 of 2 holds 0..4.
    let m = model(LayoutKind::Hnd, 8);
    let head = u64::from(T) * B; // 32 bytes per head per block
    let p = rank(4, 1, 8, 2 * head, &[0]);
    let dd = rank(2, 0, 8, 4 * head, &[1 << 20]);
    let out = plan(&m, &p, &dd, &[vec![3, 4]], &[vec![5, 6]], &big()).unwrap();
    let dst = 1 << 20;
    // One copy per block (the head slice is not a whole decode block).
    assert_eq!(
        out.descriptors,
        vec![
            d(3 * 2 * head, dst + 5 * 4 * head + 2 * head, 2 * head),
            d(4 * 2 * head, dst + 6 * 4 * head + 2 * head, 2 * head),
        ]
    );
    // Decode rank 1 (heads 4..8) gets nothing from prefill rank 1.
    let dd1 = rank(2, 1, 8, 4 * head, &[1 << 20]);
    let none = plan(&m, &p, &dd1, &[vec![3]], &[vec![5]], &big()).unwrap();
    assert!(!none.is_transfer());
    assert!(none.batches.is_empty());
}

#[test]
fn hetero_tp_1_to_2_hnd_reads_a_slice_of_the_prefill_block() {
    // H = 4: prefill rank 0 of 1 holds 0..4, decode rank 1 of 2 holds 2..4.
    let m = model(LayoutKind::Hnd, 4);
    let head = u64::from(T) * B;
    let p = rank(1, 0, 8, 4 * head, &[0]);
    let dd = rank(2, 1, 8, 2 * head, &[1 << 20]);
    let out = plan(&m, &p, &dd, &[vec![1, 2]], &[vec![3, 4]], &big()).unwrap();
    let dst = 1 << 20;
    // Decode blocks are whole copies but the source is not, so no merge.
    assert_eq!(
        out.descriptors,
        vec![
            d(4 * head + 2 * head, dst + 3 * 2 * head, 2 * head),
            d(2 * 4 * head + 2 * head, dst + 4 * 2 * head, 2 * head),
        ]
    );
}

#[test]
fn replicated_heads_are_sent_by_one_replica_per_decode_rank() {
    // H = 2, Tp = 4: prefill ranks 0,1 hold head 0 and ranks 2,3 hold head 1.
    // Td = 2: decode rank rd holds head rd and is fed by h*2 + rd%2.
    let m = model(LayoutKind::Hnd, 2);
    let tp = TpPair::new(&m, 4, 2).unwrap();
    assert_eq!(tp.share(0, 0), Some(Share::Heads { first: 0, count: 1 }));
    assert_eq!(tp.share(1, 0), None);
    assert_eq!(tp.share(2, 1), None);
    assert_eq!(tp.share(3, 1), Some(Share::Heads { first: 1, count: 1 }));
    assert_eq!(
        tp.sources_of(1).collect::<Vec<_>>(),
        vec![(3, Share::Heads { first: 1, count: 1 })]
    );
    assert_eq!(tp.targets_of(1).count(), 0);
    // Both directions replicated: Tp = 4, Td = 8, H = 2. Decode rank 5 holds
    // head 5/4 = 1 and is fed by 1*2 + 5%2 = 3.
    let tp = TpPair::new(&m, 4, 8).unwrap();
    assert_eq!(
        tp.sources_of(5).map(|(r, _)| r).collect::<Vec<_>>(),
        vec![3]
    );
    assert_eq!(
        tp.targets_of(3).map(|(r, _)| r).collect::<Vec<_>>(),
        vec![5, 7]
    );
}

#[test]
fn pairing_helpers_agree_with_share_on_every_small_config() {
    for layout in [LayoutKind::Hnd, LayoutKind::Nhd, LayoutKind::Mla] {
        for heads in [1u32, 2, 4, 8] {
            for tp_p in [1u32, 2, 4, 8, 16] {
                for tp_d in [1u32, 2, 4, 8, 16] {
                    let m = model(layout, heads);
                    let tp = TpPair::new(&m, tp_p, tp_d).unwrap();
                    for rd in 0..tp_d {
                        let want: Vec<_> = (0..tp_p)
                            .filter_map(|rp| tp.share(rp, rd).map(|s| (rp, s)))
                            .collect();
                        let got: Vec<_> = tp.sources_of(rd).collect();
                        assert_eq!(got, want, "{layout:?} H={heads} {tp_p}->{tp_d} rd={rd}");
                        // Every head of the decode rank comes from exactly one P rank.
                        let received: u32 = got
                            .iter()
                            .map(|(_, s)| match s {
                                Share::Heads { count, .. } => *count,
                                Share::Latent => 1,
                            })
                            .sum();
                        let expected = match layout {
                            LayoutKind::Mla => 1,
                            LayoutKind::Hnd | LayoutKind::Nhd => m.heads_per_rank(tp_d),
                        };
                        assert_eq!(received, expected);
                    }
                    for rp in 0..tp_p {
                        let want: Vec<_> = (0..tp_d)
                            .filter_map(|rd| tp.share(rp, rd).map(|s| (rd, s)))
                            .collect();
                        assert_eq!(tp.targets_of(rp).collect::<Vec<_>>(), want);
                    }
                }
            }
        }
    }
}

#[test]
fn mla_sender_is_decode_rank_mod_prefill_tp() {
    let m = model(LayoutKind::Mla, 1);
    let kv = 100;
    let dd = rank(4, 3, 8, kv, &[1 << 20]);
    for rp in 0..2 {
        let p = rank(2, rp, 8, kv, &[0]);
        let out = plan(&m, &p, &dd, &[vec![2, 3]], &[vec![0, 1]], &big()).unwrap();
        if rp == 3 % 2 {
            assert_eq!(out.descriptors, vec![d(2 * kv, 1 << 20, 2 * kv)]);
        } else {
            assert!(!out.is_transfer());
        }
    }
}

#[test]
fn nhd_hetero_uses_one_slice_per_token() {
    // H = 4, Tp = 2, Td = 1: prefill rank 1 holds heads 2,3; decode holds 0..4.
    let m = model(LayoutKind::Nhd, 4);
    let p = rank(2, 1, 4, 2 * u64::from(T) * B, &[0]);
    let dd = rank(1, 0, 4, 4 * u64::from(T) * B, &[1 << 20]);
    let out = plan(&m, &p, &dd, &[vec![1]], &[vec![2]], &big()).unwrap();
    let src_block = 2 * u64::from(T) * B;
    let dst_block = (1 << 20) + 2 * 4 * u64::from(T) * B;
    let want: Vec<_> = (0..u64::from(T))
        .map(|t| d(src_block + t * 2 * B, dst_block + t * 4 * B + 2 * B, 2 * B))
        .collect();
    assert_eq!(out.descriptors, want);
}

#[test]
fn nhd_token_slices_coalesce_when_they_abut() {
    // Decode holds fewer heads than prefill (Tp = 1, Td = 2, H = 2): each
    // source token row is split, so slices do not abut on the source side...
    let m = model(LayoutKind::Nhd, 2);
    let p = rank(1, 0, 4, 2 * u64::from(T) * B, &[0]);
    let dd = rank(2, 0, 4, u64::from(T) * B, &[1 << 20]);
    let out = plan(&m, &p, &dd, &[vec![0]], &[vec![0]], &big()).unwrap();
    assert_eq!(out.descriptors.len(), T as usize);
    // ...while homogeneous NHD copies whole blocks, and a run as one copy.
    let kv = u64::from(T) * B;
    let p = rank(2, 1, 4, kv, &[0]);
    let dd = rank(2, 1, 4, kv, &[1 << 20]);
    let out = plan(&m, &p, &dd, &[vec![0, 1, 2]], &[vec![1, 2, 3]], &big()).unwrap();
    assert_eq!(out.descriptors, vec![d(0, (1 << 20) + kv, 3 * kv)]);
}

#[test]
fn partial_prefix_hit_sends_only_the_last_blocks() {
    let m = model(LayoutKind::Hnd, 1);
    let kv = u64::from(T) * B;
    let p = rank(1, 0, 16, kv, &[0]);
    let dd = rank(1, 0, 16, kv, &[1 << 20]);
    let out = plan(&m, &p, &dd, &[vec![9, 1, 5, 6]], &[vec![3, 4]], &big()).unwrap();
    assert_eq!(out.descriptors, vec![d(5 * kv, (1 << 20) + 3 * kv, 2 * kv)]);
    // Groups pair by index and are trimmed independently.
    let out = plan(
        &m,
        &p,
        &dd,
        &[vec![1, 2], vec![10, 11, 12]],
        &[vec![2], vec![13]],
        &big(),
    )
    .unwrap();
    assert_eq!(
        out.descriptors,
        vec![
            d(2 * kv, (1 << 20) + 2 * kv, kv),
            d(12 * kv, (1 << 20) + 13 * kv, kv)
        ]
    );
}

#[test]
fn kv_pair_in_one_block_is_two_interleaved_regions() {
    let m = model(LayoutKind::Hnd, 1);
    let kv = u64::from(T) * B;
    let side = |base: u64| RankLayout {
        tp_size: 1,
        tp_rank: 0,
        num_blocks: 4,
        regions: vec![
            Region {
                base,
                block_len: 2 * kv,
                kv_block_len: kv,
            },
            Region {
                base: base + kv,
                block_len: 2 * kv,
                kv_block_len: kv,
            },
        ],
        stage: kvferry_machines::Stage::SINGLE,
        pools: Vec::new(),
    };
    let out = plan(
        &m,
        &side(0),
        &side(4096),
        &[vec![1, 2]],
        &[vec![1, 2]],
        &big(),
    )
    .unwrap();
    // Regions never merge with each other, and a block's K is not adjacent
    // to the next block's K, so: one copy per region per block.
    assert_eq!(
        out.descriptors,
        vec![
            d(2 * kv, 4096 + 2 * kv, kv),
            d(4 * kv, 4096 + 4 * kv, kv),
            d(3 * kv, 4096 + 3 * kv, kv),
            d(5 * kv, 4096 + 5 * kv, kv),
        ]
    );
}

#[test]
fn adjacent_regions_do_not_merge() {
    // Two separately registered regions that happen to abut in memory must
    // still be separate descriptors: one descriptor, one registration.
    let m = model(LayoutKind::Hnd, 1);
    let kv = u64::from(T) * B;
    let p = rank(1, 0, 2, kv, &[0, 2 * kv]);
    let dd = rank(1, 0, 2, kv, &[4096, 4096 + 2 * kv]);
    let out = plan(&m, &p, &dd, &[vec![0, 1]], &[vec![0, 1]], &big()).unwrap();
    assert_eq!(
        out.descriptors,
        vec![d(0, 4096, 2 * kv), d(2 * kv, 4096 + 2 * kv, 2 * kv)]
    );
}

#[test]
fn batches_respect_count_and_byte_limits_and_split_large_copies() {
    let m = model(LayoutKind::Hnd, 1);
    let kv = u64::from(T) * B; // 32
    let p = rank(1, 0, 16, kv, &[0]);
    let dd = rank(1, 0, 16, kv, &[1 << 20]);
    let limits = BatchLimits {
        batch_descriptors_max: 2,
        batch_bytes_max: 40,
        descriptors_max: 100,
    };
    // One run of 3 blocks = 96 bytes, cut at 40: 40 + 40 + 16.
    let out = plan(
        &m,
        &p,
        &dd,
        &[vec![0, 1, 2, 8]],
        &[vec![0, 1, 2, 9]],
        &limits,
    )
    .unwrap();
    let dst = 1 << 20;
    assert_eq!(
        out.descriptors,
        vec![
            d(0, dst, 40),
            d(40, dst + 40, 40),
            d(80, dst + 80, 16),
            d(8 * kv, dst + 9 * kv, 32),
        ]
    );
    // 40 | 40 | 16 (+32 would exceed 40 bytes) | 32.
    assert_eq!(
        out.batches,
        vec![
            Batch { first: 0, count: 1 },
            Batch { first: 1, count: 1 },
            Batch { first: 2, count: 1 },
            Batch { first: 3, count: 1 },
        ]
    );
    // A descriptor over the byte limit (never planned, but accepted) gets a
    // batch of its own, and the next one starts a new batch.
    let mut batches = Vec::new();
    split_batches(&[d(0, 0, 100), d(100, 100, 1)], &limits, &mut batches);
    assert_eq!(
        batches,
        vec![Batch { first: 0, count: 1 }, Batch { first: 1, count: 1 }]
    );
    let small = vec![d(0, 0, 1); 5];
    let mut batches = Vec::new();
    split_batches(&small, &limits, &mut batches);
    assert_eq!(
        batches,
        vec![
            Batch { first: 0, count: 2 },
            Batch { first: 2, count: 2 },
            Batch { first: 4, count: 1 },
        ]
    );
}

#[test]
fn plan_into_reuses_the_plan_and_clears_it_on_error() {
    let m = model(LayoutKind::Hnd, 1);
    let kv = u64::from(T) * B;
    let pair = PairLayout::new(&m, &rank(1, 0, 8, kv, &[0]), &rank(1, 0, 8, kv, &[4096])).unwrap();
    let mut out = Plan::default();
    pair.plan_into(&[vec![0, 2]], &[vec![0, 2]], &big(), &mut out)
        .unwrap();
    assert_eq!(out.descriptors.len(), 2);
    pair.plan_into(&[vec![1]], &[vec![1]], &big(), &mut out)
        .unwrap();
    assert_eq!(out.descriptors, vec![d(kv, 4096 + kv, kv)]);
    let err = pair
        .plan_into(&[vec![9]], &[vec![1]], &big(), &mut out)
        .unwrap_err();
    assert!(matches!(
        err,
        PlanError::BlockOutOfRange {
            side: Side::Prefill,
            block: 9,
            ..
        }
    ));
    assert!(out.descriptors.is_empty() && out.batches.is_empty());
}

#[test]
fn sliding_window_clips_to_the_last_blocks() {
    assert_eq!(sliding_window_blocks(0, 16), 0);
    assert_eq!(sliding_window_blocks(32, 16), 3);
    assert_eq!(sliding_window_blocks(33, 16), 4);
    let blocks = [1, 2, 3, 4, 5];
    assert_eq!(clip_to_window(&blocks, 0), &blocks);
    assert_eq!(clip_to_window(&blocks, 3), &[3, 4, 5]);
    assert_eq!(clip_to_window(&blocks, 9), &blocks);
}

fn err_of(
    m: &ModelSpec,
    p: &RankLayout,
    dd: &RankLayout,
    pb: &[Vec<u64>],
    db: &[Vec<u64>],
    limits: &BatchLimits,
) -> PlanError {
    plan(m, p, dd, pb, db, limits).unwrap_err()
}

#[test]
fn invalid_block_lists_are_errors() {
    let m = model(LayoutKind::Hnd, 1);
    let kv = u64::from(T) * B;
    let p = rank(1, 0, 8, kv, &[0]);
    let dd = rank(1, 0, 4, kv, &[4096]);
    let e = err_of(&m, &p, &dd, &[vec![1], vec![2]], &[vec![1]], &big());
    assert_eq!(
        e,
        PlanError::GroupCount {
            prefill: 2,
            decode: 1
        }
    );
    let e = err_of(&m, &p, &dd, &[vec![1]], &[vec![1, 2]], &big());
    assert_eq!(
        e,
        PlanError::FewerPrefillBlocks {
            group: 0,
            prefill: 1,
            decode: 2
        }
    );
    let e = err_of(&m, &p, &dd, &[vec![1]], &[vec![4]], &big());
    assert_eq!(
        e,
        PlanError::BlockOutOfRange {
            side: Side::Decode,
            group: 0,
            block: 4,
            num_blocks: 4
        }
    );
    let e = err_of(&m, &p, &dd, &[vec![1, 5, 2]], &[vec![0, 1, 1]], &big());
    assert_eq!(
        e,
        PlanError::DuplicateBlock {
            side: Side::Decode,
            block: 1
        }
    );
    let e = err_of(
        &m,
        &p,
        &dd,
        &[vec![3], vec![3]],
        &[vec![0], vec![1]],
        &big(),
    );
    assert_eq!(
        e,
        PlanError::DuplicateBlock {
            side: Side::Prefill,
            block: 3
        }
    );
    // Pools too large for a bitmap are checked by sorting.
    let huge_p = rank(1, 0, 1 << 40, kv, &[0]);
    let huge_d = rank(1, 0, 1 << 40, kv, &[1 << 50]);
    let e = err_of(
        &m,
        &huge_p,
        &huge_d,
        &[vec![1 << 39, 5, 6]],
        &[vec![7, 1 << 30, 7]],
        &big(),
    );
    assert_eq!(
        e,
        PlanError::DuplicateBlock {
            side: Side::Decode,
            block: 7
        }
    );
    assert!(plan(
        &m,
        &huge_p,
        &huge_d,
        &[vec![1 << 39, 5]],
        &[vec![7, 8]],
        &big()
    )
    .is_ok());
    // The duplicate check leaves no trace: the same pair plans again.
    let pair = PairLayout::new(&m, &p, &dd).unwrap();
    let mut out = Plan::default();
    assert!(pair
        .plan_into(&[vec![1, 2, 1]], &[vec![0, 1, 2]], &big(), &mut out)
        .is_err());
    pair.plan_into(&[vec![1, 2, 7]], &[vec![0, 1, 2]], &big(), &mut out)
        .unwrap();
    assert_eq!(out.descriptors.len(), 2);
    // A prefix block that is not sent may repeat a sent one: it is trimmed.
    assert!(plan(&m, &p, &dd, &[vec![3, 3]], &[vec![1]], &big()).is_ok());
    let zero = BatchLimits {
        batch_bytes_max: 0,
        ..big()
    };
    assert_eq!(
        err_of(&m, &p, &dd, &[vec![1]], &[vec![1]], &zero),
        PlanError::ZeroBatchLimit
    );
    let tiny = BatchLimits {
        batch_bytes_max: 1,
        descriptors_max: 10,
        ..big()
    };
    assert_eq!(
        err_of(&m, &p, &dd, &[vec![1]], &[vec![1]], &tiny),
        PlanError::TooManyDescriptors { max: 10 }
    );
}

#[test]
fn long_runs_are_range_checked_to_their_last_block() {
    let m = model(LayoutKind::Hnd, 1);
    let kv = u64::from(T) * B;
    let p = rank(1, 0, 31, kv, &[0]);
    let dd = rank(1, 0, 64, kv, &[4096]);
    // Consecutive ids are checked 16 at a time; the last one is out of range.
    let e = err_of(
        &m,
        &p,
        &dd,
        &[(0..32).collect()],
        &[(0..32).collect()],
        &big(),
    );
    assert_eq!(
        e,
        PlanError::BlockOutOfRange {
            side: Side::Prefill,
            group: 0,
            block: 31,
            num_blocks: 31
        }
    );
    let ok = plan(
        &m,
        &p,
        &dd,
        &[(0..31).collect::<Vec<u64>>()],
        &[(1..32).collect::<Vec<u64>>()],
        &big(),
    )
    .unwrap();
    assert_eq!(ok.descriptors, vec![d(0, 4096 + kv, 31 * kv)]);
    // A break inside a chunk ends the run there.
    let mut ids: Vec<u64> = (0..30).collect();
    ids[20] = 30;
    let out = plan(
        &m,
        &p,
        &dd,
        &[ids],
        &[(0..30).collect::<Vec<u64>>()],
        &big(),
    )
    .unwrap();
    assert_eq!(
        out.descriptors,
        vec![
            d(0, 4096, 20 * kv),
            d(30 * kv, 4096 + 20 * kv, kv),
            d(21 * kv, 4096 + 21 * kv, 9 * kv),
        ]
    );
}

#[test]
fn invalid_layouts_are_errors() {
    let hnd = model(LayoutKind::Hnd, 4);
    let head = u64::from(T) * B;
    let good = |tp: u32, r| rank(tp, r, 8, u64::from(4 / tp) * head, &[0, 1 << 20]);
    assert!(PairLayout::new(&hnd, &good(2, 0), &good(4, 3)).is_ok());
    let e = PairLayout::new(&hnd, &rank(3, 0, 8, head, &[0]), &good(1, 0)).unwrap_err();
    assert_eq!(
        e,
        PlanError::TpSize {
            side: Side::Prefill,
            tp_size: 3,
            heads: 4
        }
    );
    let e = PairLayout::new(&hnd, &good(1, 0), &rank(6, 0, 8, head, &[0])).unwrap_err();
    assert_eq!(
        e,
        PlanError::TpSize {
            side: Side::Decode,
            tp_size: 6,
            heads: 4
        }
    );
    let e = PairLayout::new(&hnd, &good(2, 2), &good(1, 0)).unwrap_err();
    assert_eq!(
        e,
        PlanError::TpRank {
            side: Side::Prefill,
            tp_rank: 2,
            tp_size: 2
        }
    );
    let e = PairLayout::new(&hnd, &good(2, 0), &rank(1, 0, 8, 4 * head, &[0])).unwrap_err();
    assert_eq!(
        e,
        PlanError::RegionCount {
            prefill: 2,
            decode: 1
        }
    );
    // kv_block_len must match the TP ratio: 2 heads per rank at TP 2.
    let e =
        PairLayout::new(&hnd, &rank(2, 0, 8, 4 * head, &[0, 1 << 20]), &good(1, 0)).unwrap_err();
    assert_eq!(
        e,
        PlanError::RegionKvLen {
            side: Side::Prefill,
            region: 0,
            kv_block_len: 4 * head,
            expected: 2 * head
        }
    );
    let mut short = good(1, 0);
    short.regions[1].block_len = head;
    let e = PairLayout::new(&hnd, &good(1, 0), &short).unwrap_err();
    assert!(matches!(
        e,
        PlanError::RegionBlockLen {
            side: Side::Decode,
            region: 1,
            ..
        }
    ));
    let mut top = good(1, 0);
    top.regions[1].base = u64::MAX - 100;
    let e = PairLayout::new(&hnd, &top, &good(1, 0)).unwrap_err();
    assert_eq!(
        e,
        PlanError::RegionOverflow {
            side: Side::Prefill,
            region: 1
        }
    );
    let mut overlap = good(1, 0);
    overlap.regions[1].base = 3 * 4 * head;
    let e = PairLayout::new(&hnd, &good(1, 0), &overlap).unwrap_err();
    assert_eq!(
        e,
        PlanError::RegionsOverlap {
            side: Side::Decode,
            first: 0,
            second: 1
        }
    );
    let mla = model(LayoutKind::Mla, 1);
    let e = PairLayout::new(&mla, &rank(1, 0, 8, 10, &[0]), &rank(1, 0, 8, 12, &[0])).unwrap_err();
    assert_eq!(
        e,
        PlanError::MlaKvLen {
            region: 0,
            prefill: 10,
            decode: 12
        }
    );
    let zero_heads = model(LayoutKind::Nhd, 0);
    assert!(matches!(
        PairLayout::new(&zero_heads, &good(1, 0), &good(1, 0)),
        Err(PlanError::Model(_))
    ));
    // A region whose last byte is the last byte of the address space is fine.
    let kv = 4 * head;
    let last = rank(1, 0, 8, kv, &[u64::MAX - 8 * kv + 1]);
    let out = plan(&hnd, &last, &last, &[vec![6, 7]], &[vec![6, 7]], &big()).unwrap();
    assert_eq!(
        out.descriptors,
        vec![d(u64::MAX - 2 * kv + 1, u64::MAX - 2 * kv + 1, 2 * kv)]
    );
}

#[test]
fn errors_print_one_line_and_name_the_side() {
    let e = PlanError::RegionsOverlap {
        side: Side::Decode,
        first: 0,
        second: 1,
    };
    assert_eq!(e.side(), Some(Side::Decode));
    assert_eq!(e.to_string(), "decode: regions 0 and 1 overlap");
    assert_eq!(PlanError::ZeroBatchLimit.side(), None);
}

// ---- pipeline stages ----

fn staged(mut r: RankLayout, pp_size: u32, pp_rank: u32, first_region: u32) -> RankLayout {
    r.stage = kvferry_machines::Stage {
        pp_size,
        pp_rank,
        first_region,
    };
    r
}

#[test]
fn a_prefill_stage_maps_onto_its_layers_of_an_unstaged_decode_rank() {
    let m = model(LayoutKind::Hnd, 2);
    let kv = 2 * u64::from(T) * B;
    // Decode holds four regions; prefill stage 1 of 2 holds the last two.
    let dd = rank(1, 0, 16, kv, &[0x1000, 0x2000, 0x3000, 0x4000]);
    let p = staged(rank(1, 0, 16, kv, &[0x9000, 0xa000]), 2, 1, 2);
    let out = plan(&m, &p, &dd, &[vec![1]], &[vec![5]], &big()).unwrap();
    assert_eq!(
        out.descriptors,
        vec![
            d(0x9000 + kv, 0x3000 + 5 * kv, kv),
            d(0xa000 + kv, 0x4000 + 5 * kv, kv),
        ]
    );
}

#[test]
fn stages_of_equal_pipelines_pair_stage_to_stage_only() {
    let m = model(LayoutKind::Hnd, 2);
    let kv = 2 * u64::from(T) * B;
    let p0 = staged(rank(1, 0, 16, kv, &[0x9000, 0xa000]), 2, 0, 0);
    let d0 = staged(rank(1, 0, 16, kv, &[0x1000, 0x2000]), 2, 0, 0);
    let d1 = staged(rank(1, 0, 16, kv, &[0x3000, 0x4000]), 2, 1, 2);
    let same = PairLayout::new(&m, &p0, &d0).unwrap();
    assert!(same.share().is_some());
    // Another stage's layers: nothing to move between the two.
    let other = PairLayout::new(&m, &p0, &d1).unwrap();
    assert_eq!(other.share(), None);
}

#[test]
fn stages_that_do_not_fit_are_refused() {
    let m = model(LayoutKind::Hnd, 2);
    let kv = 2 * u64::from(T) * B;
    let dd = rank(1, 0, 16, kv, &[0x1000, 0x2000, 0x3000, 0x4000]);
    let refused = |p: RankLayout, d: &RankLayout| {
        matches!(
            PairLayout::new(&m, &p, d),
            Err(PlanError::StageMismatch { .. })
        )
    };
    // The last stage ends before decode's last region: layers would be missing.
    assert!(refused(staged(rank(1, 0, 16, kv, &[0x9000]), 2, 1, 2), &dd));
    // A stage running past decode's regions.
    assert!(refused(
        staged(rank(1, 0, 16, kv, &[0x9000, 0xa000]), 2, 1, 3),
        &dd
    ));
    // The first stage not starting at decode's first region.
    assert!(refused(
        staged(rank(1, 0, 16, kv, &[0x9000, 0xa000]), 2, 0, 1),
        &dd
    ));
    // A stage outside its PP size.
    assert!(refused(
        staged(rank(1, 0, 16, kv, &[0x9000, 0xa000]), 2, 2, 2),
        &dd
    ));
    // A staged decode fed by an unstaged prefill engine (not supported).
    let p = rank(1, 0, 16, kv, &[0x9000, 0xa000, 0xb000, 0xc000]);
    let d_staged = staged(rank(1, 0, 16, kv, &[0x1000, 0x2000]), 2, 0, 0);
    assert!(refused(p, &d_staged));
}
