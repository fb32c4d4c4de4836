//! Aux and state pools in the planner: the rules worked out by hand, the
//! refusals, and a property test against a byte model.

use kvferry_machines::internal::planner::{plan, Descriptor, PairLayout, Plan, PlanError};
use kvferry_machines::{
    BatchLimits, LayoutKind, ModelSpec, Pool, PoolKind, PoolRegion, RankLayout, Region, Side, Stage,
};
use proptest::prelude::*;

use crate::model::ModelSpecExt;

const T: u32 = 4;
const B: u64 = 8;
const HEADS: u32 = 4;
const BLOCKS: u64 = 16;

fn model(layout: LayoutKind) -> ModelSpec {
    crate::model::small()
        .with_layout(layout)
        .with_heads(HEADS)
        .with_block_tokens(T)
        .with_head_bytes(B)
}

fn kv_len(m: &ModelSpec, tp: u32) -> u64 {
    match m.layout {
        LayoutKind::Mla => u64::from(T) * B,
        LayoutKind::Hnd | LayoutKind::Nhd => u64::from(m.heads_per_rank(tp)) * u64::from(T) * B,
    }
}

/// A pool as `(kind, items, [(base, item_len)])`.
type PoolSpec<'a> = (PoolKind, u64, &'a [(u64, u64)]);

/// One KV region at `base`, then the pools.
fn rank(m: &ModelSpec, tp: u32, r: u32, base: u64, pools: &[PoolSpec]) -> RankLayout {
    let kv = kv_len(m, tp);
    RankLayout {
        tp_size: tp,
        tp_rank: r,
        num_blocks: BLOCKS,
        regions: vec![Region {
            base,
            block_len: kv,
            kv_block_len: kv,
        }],
        stage: Stage::SINGLE,
        pools: pools
            .iter()
            .map(|&(kind, items, bufs)| Pool {
                kind,
                items,
                regions: bufs
                    .iter()
                    .map(|&(base, item_len)| PoolRegion { base, item_len })
                    .collect(),
            })
            .collect(),
    }
}

fn d(src: u64, dst: u64, len: u64) -> Descriptor {
    Descriptor { src, dst, len }
}

const AUX: PoolKind = PoolKind::Aux;
const STATE: PoolKind = PoolKind::State;

#[test]
fn aux_and_state_items_follow_the_kv_equal_tp() {
    let m = model(LayoutKind::Hnd);
    let kv = kv_len(&m, 1);
    // Aux: two buffers (24 and 8 bytes per item); state: one of 100.
    let p = rank(
        &m,
        1,
        0,
        0x1000,
        &[
            (AUX, 8, &[(0x10_000, 24), (0x11_000, 8)]),
            (STATE, 4, &[(0x20_000, 100)]),
        ],
    );
    let dd = rank(
        &m,
        1,
        0,
        0x9000,
        &[
            (AUX, 8, &[(0x90_000, 24), (0x91_000, 8)]),
            (STATE, 4, &[(0xa0_000, 100)]),
        ],
    );
    let out = plan(
        &m,
        &p,
        &dd,
        &[vec![2, 3], vec![5], vec![1, 2]],
        &[vec![7, 8], vec![0], vec![3, 0]],
        &BatchLimits::default(),
    )
    .unwrap();
    assert_eq!(
        out.descriptors,
        vec![
            d(0x1000 + 2 * kv, 0x9000 + 7 * kv, 2 * kv),
            // Aux index 5 → 0, in each buffer.
            d(0x10_000 + 5 * 24, 0x90_000, 24),
            d(0x11_000 + 5 * 8, 0x91_000, 8),
            // State indices 1, 2 → 3, 0: not consecutive on decode.
            d(0x20_000 + 100, 0xa0_000 + 300, 100),
            d(0x20_000 + 200, 0xa0_000, 100),
        ]
    );
}

#[test]
fn consecutive_pool_indices_coalesce_and_a_last_chunk_may_carry_only_pools() {
    let m = model(LayoutKind::Hnd);
    let p = rank(&m, 1, 0, 0x1000, &[(STATE, 8, &[(0x20_000, 16)])]);
    let dd = rank(&m, 1, 0, 0x9000, &[(STATE, 8, &[(0xa0_000, 16)])]);
    let none: Vec<u64> = Vec::new();
    let out = plan(
        &m,
        &p,
        &dd,
        &[none.clone(), vec![1, 2, 3]],
        &[none, vec![4, 5, 6]],
        &BatchLimits::default(),
    )
    .unwrap();
    assert_eq!(out.descriptors, vec![d(0x20_000 + 16, 0xa0_000 + 64, 48)]);
    assert_eq!(out.batches.len(), 1);
}

#[test]
fn aux_comes_from_the_first_prefill_source_of_each_decode_rank() {
    let m = model(LayoutKind::Hnd);
    let aux_p = [(AUX, 4, &[(0x10_000u64, 24u64)][..])];
    let aux_d = [(AUX, 4, &[(0x90_000u64, 24u64)][..])];
    let request = |p: &RankLayout, dd: &RankLayout| {
        plan(
            &m,
            p,
            dd,
            &[vec![1], vec![2]],
            &[vec![3], vec![1]],
            &BatchLimits::default(),
        )
        .unwrap()
        .descriptors
    };
    // TP 2 → 1: decode rank 0 reads heads from both, aux from rank 0 only.
    let d0 = rank(&m, 1, 0, 0x9000, &aux_d);
    let from_0 = request(&rank(&m, 2, 0, 0x1000, &aux_p), &d0);
    let from_1 = request(&rank(&m, 2, 1, 0x1000, &aux_p), &d0);
    assert!(
        from_0.contains(&d(0x10_000 + 48, 0x90_000 + 24, 24)),
        "{from_0:?}"
    );
    assert!(
        from_1.iter().all(|x| x.src < 0x10_000),
        "rank 1 sends KV only: {from_1:?}"
    );
    // TP 1 → 2: both decode ranks take the aux from the one prefill rank.
    for r in 0..2 {
        let out = request(
            &rank(&m, 1, 0, 0x1000, &aux_p),
            &rank(&m, 2, r, 0x9000, &aux_d),
        );
        assert!(
            out.contains(&d(0x10_000 + 48, 0x90_000 + 24, 24)),
            "decode rank {r}: {out:?}"
        );
    }
}

#[test]
fn state_between_different_tp_sizes_is_unsupported_for_every_layout_kind() {
    for kind in [LayoutKind::Hnd, LayoutKind::Nhd, LayoutKind::Mla] {
        let m = model(kind);
        let state = [(STATE, 4, &[(0x20_000u64, 64u64)][..])];
        for (p_tp, d_tp) in [(2, 1), (1, 2), (4, 2)] {
            let err = PairLayout::new(
                &m,
                &rank(&m, p_tp, 0, 0x1000, &state),
                &rank(&m, d_tp, 0, 0x9000, &state),
            )
            .unwrap_err();
            assert!(err.is_unsupported(), "{kind:?} {p_tp}->{d_tp}: {err}");
            assert_eq!(err, PlanError::Unsupported { pool: 0, why: "a state pool between different TP sizes (TP slicing of state is not implemented)" });
        }
        // Equal TP sizes pair rank to rank.
        let pair = PairLayout::new(
            &m,
            &rank(&m, 2, 1, 0x1000, &state),
            &rank(&m, 2, 1, 0x9000, &state),
        );
        assert!(pair.is_ok(), "{kind:?}");
    }
}

/// A rank of `regions` KV regions (one per layer here) from `first` on,
/// as pipeline stage `pp_rank` of `pp_size`.
fn staged(rank: RankLayout, regions: usize, pp_size: u32, pp_rank: u32, first: u32) -> RankLayout {
    let one = rank.regions[0];
    let regions = (0..regions as u64)
        .map(|i| Region {
            base: one.base + i * 0x1000,
            ..one
        })
        .collect();
    RankLayout {
        regions,
        stage: Stage {
            pp_size,
            pp_rank,
            first_region: first,
        },
        ..rank
    }
}

#[test]
fn aux_moves_from_the_last_prefill_stage_and_state_not_at_all_under_pipelines() {
    let m = model(LayoutKind::Hnd);
    let kv = kv_len(&m, 1);
    let aux_p = [(AUX, 4, &[(0x10_000u64, 24u64)][..])];
    let aux_d = [(AUX, 4, &[(0x90_000u64, 24u64)][..])];
    // Decode holds both layers; prefill stage s holds layer s.
    let dd = staged(rank(&m, 1, 0, 0x9000, &aux_d), 2, 1, 0, 0);
    let stage = |s: u32| staged(rank(&m, 1, 0, 0x1000, &aux_p), 1, 2, s, s);
    let lists = (&[vec![3], vec![1]], &[vec![5], vec![2]]);
    let run = |p: &RankLayout, d: &RankLayout| {
        plan(&m, p, d, lists.0, lists.1, &BatchLimits::default())
            .unwrap()
            .descriptors
    };
    assert_eq!(
        run(&stage(0), &dd),
        vec![d(0x1000 + 3 * kv, 0x9000 + 5 * kv, kv)]
    );
    assert_eq!(
        run(&stage(1), &dd),
        vec![
            d(0x1000 + 3 * kv, 0xa000 + 5 * kv, kv),
            d(0x10_000 + 24, 0x90_000 + 2 * 24, 24),
        ]
    );
    // Equal pipelines: each stage's own aux, and nothing across stages.
    let d_stage = |s: u32| staged(rank(&m, 1, 0, 0x9000, &aux_d), 1, 2, s, s);
    assert_eq!(
        run(&stage(0), &d_stage(0)),
        vec![
            d(0x1000 + 3 * kv, 0x9000 + 5 * kv, kv),
            d(0x10_000 + 24, 0x90_000 + 2 * 24, 24),
        ]
    );
    assert_eq!(run(&stage(0), &d_stage(1)), vec![]);
    // State is per layer and not split by stage: refused.
    let state = [(STATE, 4, &[(0x20_000u64, 100u64)][..])];
    let p = staged(rank(&m, 1, 0, 0x1000, &state), 1, 2, 1, 1);
    let ds = staged(rank(&m, 1, 0, 0x9000, &state), 2, 1, 0, 0);
    let err = PairLayout::new(&m, &p, &ds).unwrap_err();
    assert!(err.is_unsupported(), "{err}");
    // The same layout paired with itself (what registration checks).
    assert!(PairLayout::new(&m, &p, &p).unwrap_err().is_unsupported());
}

#[test]
fn pools_that_do_not_pair_are_bad_metadata() {
    let m = model(LayoutKind::Hnd);
    let mk = |pools: &[PoolSpec]| rank(&m, 1, 0, 0x1000, pools);
    let mk_d = |pools: &[PoolSpec]| rank(&m, 1, 0, 0x9000, pools);
    let a24 = [(0x10_000u64, 24u64)];
    let a32 = [(0x90_000u64, 32u64)];
    let a24d = [(0x90_000u64, 24u64)];
    let two = [(0x90_000u64, 24u64), (0x91_000, 24)];
    let cases: Vec<(RankLayout, RankLayout, PlanError)> = vec![
        (
            mk(&[(AUX, 4, &a24)]),
            mk_d(&[(AUX, 4, &a32)]),
            PlanError::PoolItemLen {
                pool: 0,
                region: 0,
                prefill: 24,
                decode: 32,
            },
        ),
        (
            mk(&[(AUX, 4, &a24)]),
            mk_d(&[(STATE, 4, &a24d)]),
            PlanError::PoolMismatch {
                pool: 0,
                why: "the kind",
            },
        ),
        (
            mk(&[(AUX, 4, &a24)]),
            mk_d(&[(AUX, 4, &two)]),
            PlanError::PoolMismatch {
                pool: 0,
                why: "the buffer count",
            },
        ),
        (
            mk(&[(AUX, 4, &a24)]),
            mk_d(&[]),
            PlanError::PoolMismatch {
                pool: 0,
                why: "the pool count",
            },
        ),
    ];
    for (p, dd, want) in cases {
        let err = PairLayout::new(&m, &p, &dd).unwrap_err();
        assert_eq!(err, want);
        assert!(!err.is_unsupported());
    }
}

#[test]
fn unusable_pools_are_refused_naming_the_side() {
    let m = model(LayoutKind::Hnd);
    let kv_end = 0x1000 + BLOCKS * kv_len(&m, 1);
    let good = rank(&m, 1, 0, 0x9000, &[(AUX, 4, &[(0x90_000, 24)])]);
    let bad = |pools: &[PoolSpec], why: &'static str| {
        let p = rank(&m, 1, 0, 0x1000, pools);
        let err = PairLayout::new(&m, &p, &good).unwrap_err();
        assert_eq!(
            err,
            PlanError::BadPool {
                side: Side::Prefill,
                pool: 0,
                why
            },
            "{pools:?}"
        );
        assert_eq!(err.side(), Some(Side::Prefill));
    };
    bad(&[(AUX, 0, &[(0x10_000, 24)])], "no items");
    bad(&[(AUX, 4, &[])], "no buffer, or more than REGIONS_MAX");
    bad(&[(AUX, 4, &[(0x10_000, 0)])], "a buffer's item_len is zero");
    bad(
        &[(AUX, 4, &[(u64::MAX - 40, 24)])],
        "a buffer overflows a 64-bit address",
    );
    bad(
        &[(AUX, 4, &[(0x10_000, 24), (0x10_000 + 95, 24)])],
        "buffers share bytes",
    );
    bad(
        &[(AUX, 4, &[(kv_end - 1, 24)])],
        "a buffer shares bytes with a KV region",
    );
    // Abutting buffers and a buffer right after the KV are fine.
    let p = rank(&m, 1, 0, 0x1000, &[(AUX, 4, &[(kv_end, 24)])]);
    assert!(PairLayout::new(&m, &p, &good).is_ok());
}

#[test]
fn bad_pool_index_lists_are_refused() {
    let m = model(LayoutKind::Hnd);
    let p = rank(&m, 1, 0, 0x1000, &[(STATE, 4, &[(0x20_000, 16)])]);
    let dd = rank(&m, 1, 0, 0x9000, &[(STATE, 6, &[(0xa0_000, 16)])]);
    let pair = PairLayout::new(&m, &p, &dd).unwrap();
    let mut out = Plan::default();
    let limits = BatchLimits::default();
    let mut try_plan = |pl: &[Vec<u64>], dl: &[Vec<u64>]| pair.plan_into(pl, dl, &limits, &mut out);
    assert_eq!(
        try_plan(&[vec![1], vec![4]], &[vec![1], vec![0]]),
        Err(PlanError::PoolIndexOutOfRange {
            side: Side::Prefill,
            pool: 0,
            index: 4,
            items: 4
        })
    );
    assert_eq!(
        try_plan(&[vec![1], vec![3]], &[vec![1], vec![6]]),
        Err(PlanError::PoolIndexOutOfRange {
            side: Side::Decode,
            pool: 0,
            index: 6,
            items: 6
        })
    );
    assert_eq!(
        try_plan(&[vec![1], vec![2, 2]], &[vec![1], vec![0, 1]]),
        Err(PlanError::DuplicatePoolIndex {
            side: Side::Prefill,
            pool: 0,
            index: 2
        })
    );
    assert_eq!(
        try_plan(&[vec![1], vec![2]], &[vec![1], vec![0, 1]]),
        Err(PlanError::FewerPrefillBlocks {
            group: 1,
            prefill: 1,
            decode: 2
        })
    );
    assert_eq!(
        try_plan(&[], &[]),
        Err(PlanError::MissingPoolLists { lists: 0, pools: 1 })
    );
    assert_eq!(
        try_plan(&[vec![1], vec![2]], &[vec![1]]),
        Err(PlanError::GroupCount {
            prefill: 2,
            decode: 1
        })
    );
    // Prefill's last indices pair with decode's, as in a KV group.
    try_plan(&[vec![1], vec![0, 3]], &[vec![1], vec![5]]).unwrap();
    assert_eq!(
        out.descriptors.last(),
        Some(&d(0x20_000 + 48, 0xa0_000 + 80, 16))
    );
}

/// A pool case: equal TP, random pools and index lists.
#[derive(Clone, Debug)]
struct Case {
    pools: Vec<(PoolKind, u64, Vec<u64>)>,
    kv: (Vec<u64>, Vec<u64>),
    lists: Vec<(Vec<u64>, Vec<u64>)>,
    batch: (usize, u64),
}

fn distinct(items: u64, n: usize) -> impl Strategy<Value = Vec<u64>> {
    Just((0..items).collect::<Vec<u64>>())
        .prop_shuffle()
        .prop_map(move |v| v.into_iter().take(n).collect())
}

fn case() -> impl Strategy<Value = Case> {
    let pool = (
        prop_oneof![Just(AUX), Just(STATE)],
        1u64..12,
        prop::collection::vec(1u64..70, 1..3),
    );
    let pools = prop::collection::vec(pool, 0..4);
    let kv = (0usize..5).prop_flat_map(|n| (distinct(BLOCKS, n), distinct(BLOCKS, n)));
    (pools, kv, (1usize..6, 1u64..300))
        .prop_flat_map(|(pools, kv, batch)| {
            let lists: Vec<_> = pools
                .iter()
                .map(|(_, items, _)| {
                    let items = *items;
                    (0..=items.min(4) as usize)
                        .prop_flat_map(move |n| (distinct(items, n), distinct(items, n)))
                })
                .collect();
            (Just(pools), Just(kv), lists, Just(batch))
        })
        .prop_map(|(pools, kv, lists, batch)| Case {
            pools,
            kv,
            lists,
            batch,
        })
}

/// Lays out the case's pools from `base`, each buffer on its own page.
fn layout_of(c: &Case, m: &ModelSpec, base: u64) -> RankLayout {
    let mut next = base + 0x10_0000;
    let mut pools = Vec::new();
    for (kind, items, lens) in &c.pools {
        let mut regions = Vec::new();
        for &item_len in lens {
            regions.push(PoolRegion {
                base: next,
                item_len,
            });
            next += 0x1_0000;
        }
        pools.push(Pool {
            kind: *kind,
            items: *items,
            regions,
        });
    }
    RankLayout {
        pools,
        ..rank(m, 1, 0, base, &[])
    }
}

proptest! {
    /// With pools, the KV descriptors are those of the same request without
    /// them, and every item of every buffer of decode's lists gets exactly
    /// its item's bytes from prefill's item at the same position, in
    /// batches within the limits.
    #[test]
    fn pool_items_land_whole_and_the_kv_plan_is_unchanged(c in case()) {
        let m = model(LayoutKind::Hnd);
        let (p, dd) = (layout_of(&c, &m, 0x100_0000), layout_of(&c, &m, 0x900_0000));
        let limits = BatchLimits { batch_descriptors_max: c.batch.0, batch_bytes_max: c.batch.1, ..BatchLimits::default() };
        let mut pl = vec![c.kv.0.clone()];
        let mut dl = vec![c.kv.1.clone()];
        pl.extend(c.lists.iter().map(|l| l.0.clone()));
        dl.extend(c.lists.iter().map(|l| l.1.clone()));
        let out = plan(&m, &p, &dd, &pl, &dl, &limits).unwrap();
        let kv_only = plan(&m, &RankLayout { pools: vec![], ..p.clone() }, &RankLayout { pools: vec![], ..dd.clone() }, &pl[..1], &dl[..1], &limits).unwrap();
        let n_kv = kv_only.descriptors.len();
        prop_assert_eq!(&out.descriptors[..n_kv], &kv_only.descriptors[..]);
        // The byte model of the pools: (dst byte) -> src byte.
        let mut want = std::collections::BTreeMap::new();
        for (k, (pool_p, pool_d)) in p.pools.iter().zip(&dd.pools).enumerate() {
            for (rp, rd) in pool_p.regions.iter().zip(&pool_d.regions) {
                for (&ip, &id) in c.lists[k].0.iter().zip(&c.lists[k].1) {
                    for b in 0..rp.item_len {
                        want.insert(rd.base + id * rd.item_len + b, rp.base + ip * rp.item_len + b);
                    }
                }
            }
        }
        let mut got = std::collections::BTreeMap::new();
        for x in &out.descriptors[n_kv..] {
            prop_assert!(x.len > 0 && x.len <= limits.batch_bytes_max);
            for b in 0..x.len {
                prop_assert!(got.insert(x.dst + b, x.src + b).is_none(), "byte written twice");
            }
        }
        prop_assert_eq!(got, want);
        let covered: usize = out.batches.iter().map(|b| b.count).sum();
        prop_assert_eq!(covered, out.descriptors.len());
        for b in 0..out.batches.len() {
            let batch = out.batch(b).unwrap();
            prop_assert!(batch.len() <= limits.batch_descriptors_max);
            prop_assert!(batch.iter().map(|x| x.len).sum::<u64>() <= limits.batch_bytes_max);
        }
    }
}

/// One plan (and its scratch) serves every pair of a node: a request of a
/// pair without pools after one with pools plans its KV only, and a
/// failed plan leaves nothing behind.
#[test]
fn one_plan_serves_pairs_with_and_without_pools() {
    let m = model(LayoutKind::Hnd);
    let state = [(STATE, 4, &[(0x20_000u64, 16u64)][..])];
    let with = PairLayout::new(
        &m,
        &rank(&m, 1, 0, 0x1000, &state),
        &rank(&m, 1, 0, 0x9000, &state),
    )
    .unwrap();
    let without = PairLayout::new(
        &m,
        &rank(&m, 1, 0, 0x1000, &[]),
        &rank(&m, 1, 0, 0x9000, &[]),
    )
    .unwrap();
    let limits = BatchLimits::default();
    let mut out = Plan::default();
    with.plan_into(&[vec![1], vec![2]], &[vec![3], vec![0]], &limits, &mut out)
        .unwrap();
    assert_eq!(out.descriptors.len(), 2);
    let err = with.plan_into(
        &[vec![1], vec![2, 3]],
        &[vec![3], vec![0, 9]],
        &limits,
        &mut out,
    );
    assert!(
        matches!(err, Err(PlanError::PoolIndexOutOfRange { .. })),
        "{err:?}"
    );
    assert!(out.descriptors.is_empty() && out.batches.is_empty());
    with.plan_into(&[vec![1], vec![2]], &[vec![3], vec![0]], &limits, &mut out)
        .unwrap();
    without
        .plan_into(&[vec![1]], &[vec![3]], &limits, &mut out)
        .unwrap();
    let kv = kv_len(&m, 1);
    assert_eq!(out.descriptors, vec![d(0x1000 + kv, 0x9000 + 3 * kv, kv)]);
}
