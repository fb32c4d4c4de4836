//! Property tests: the planner against a naive byte-by-byte model written
//! straight from the rules, on random layouts (HND, NHD, MLA; TP in both
//! directions; replication when TP > heads; padded and K/V-interleaved
//! blocks; partial prefix hits; tiny and large batch limits), plus the
//! structural invariants of every plan and hostile inputs that must not panic.

use kvferry_machines::internal::planner::{
    plan, split_batches, Descriptor, Plan, PlanError, TpPair,
};
use kvferry_machines::{BatchLimits, LayoutKind, ModelSpec, RankLayout, Region, Side};
use proptest::prelude::*;

use crate::model::ModelSpecExt;

/// Deterministic xorshift so block lists derive from one proptest value.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
    fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next() % n
        }
    }
}

#[derive(Clone, Debug)]
struct Case {
    model: ModelSpec,
    prefill: RankLayout,
    decode: RankLayout,
    prefill_blocks: Vec<Vec<u64>>,
    decode_blocks: Vec<Vec<u64>>,
    limits: BatchLimits,
}

/// The heads `(first, count)` a rank holds, written from the rule text.
fn rank_heads(heads: u32, tp: u32, rank: u32) -> (u32, u32) {
    if tp <= heads {
        (rank * heads / tp, heads / tp)
    } else {
        (rank / (tp / heads), 1)
    }
}

/// The prefill rank that sends head `h` to decode rank `rd`, from the rule text.
fn sender(heads: u32, tp_p: u32, h: u32, rd: u32) -> u32 {
    if tp_p <= heads {
        h / (heads / tp_p)
    } else {
        h * (tp_p / heads) + rd % (tp_p / heads)
    }
}

/// Offset in a block of byte `k` of head slot `slot` (0-based on this rank)
/// of token `t`.
fn offset(layout: LayoutKind, t: u64, slot: u64, k: u64, tokens: u64, hp: u64, b: u64) -> u64 {
    match layout {
        LayoutKind::Hnd => (slot * tokens + t) * b + k,
        LayoutKind::Nhd => (t * hp + slot) * b + k,
        LayoutKind::Mla => unreachable!("MLA has no heads"),
    }
}

/// Every `(src byte, dst byte)` the rules say this pair must copy, sorted.
fn naive(c: &Case) -> Vec<(u64, u64)> {
    let m = &c.model;
    let (tp_p, rp) = (c.prefill.tp_size, c.prefill.tp_rank);
    let (tp_d, rd) = (c.decode.tp_size, c.decode.tp_rank);
    let mut bytes = Vec::new();
    for (pg, dg) in c.prefill_blocks.iter().zip(&c.decode_blocks) {
        let pg = &pg[pg.len() - dg.len()..];
        for (&pb, &db) in pg.iter().zip(dg) {
            for (p, d) in c.prefill.regions.iter().zip(&c.decode.regions) {
                let src_block = p.base + pb * p.block_len;
                let dst_block = d.base + db * d.block_len;
                if m.layout == LayoutKind::Mla {
                    if rp == rd % tp_p {
                        for x in 0..p.kv_block_len {
                            bytes.push((src_block + x, dst_block + x));
                        }
                    }
                    continue;
                }
                let (pf, pn) = rank_heads(m.total_kv_heads, tp_p, rp);
                let (df, dn) = rank_heads(m.total_kv_heads, tp_d, rd);
                for h in df..df + dn {
                    if sender(m.total_kv_heads, tp_p, h, rd) != rp {
                        continue;
                    }
                    assert!(pf <= h && h < pf + pn, "the sender holds the head");
                    let tokens = u64::from(m.block_tokens);
                    for t in 0..tokens {
                        for k in 0..m.head_bytes {
                            let so = offset(
                                m.layout,
                                t,
                                u64::from(h - pf),
                                k,
                                tokens,
                                u64::from(pn),
                                m.head_bytes,
                            );
                            let dof = offset(
                                m.layout,
                                t,
                                u64::from(h - df),
                                k,
                                tokens,
                                u64::from(dn),
                                m.head_bytes,
                            );
                            bytes.push((src_block + so, dst_block + dof));
                        }
                    }
                }
            }
        }
    }
    bytes.sort_unstable();
    bytes
}

fn expand(descriptors: &[Descriptor]) -> Vec<(u64, u64)> {
    let mut bytes: Vec<(u64, u64)> = descriptors
        .iter()
        .flat_map(|d| (0..d.len).map(move |i| (d.src + i, d.dst + i)))
        .collect();
    bytes.sort_unstable();
    bytes
}

/// Index of the region holding `[addr, addr + len)`, if exactly one does.
fn region_of(layout: &RankLayout, addr: u64, len: u64) -> Option<usize> {
    let mut found = None;
    for (i, r) in layout.regions.iter().enumerate() {
        let Some(last) = (layout.num_blocks - 1)
            .checked_mul(r.block_len)
            .and_then(|x| x.checked_add(r.kv_block_len - 1))
            .and_then(|x| x.checked_add(r.base))
        else {
            continue;
        };
        if addr >= r.base && len >= 1 && addr.checked_add(len - 1).is_some_and(|end| end <= last) {
            // Every byte must be KV of some block, not padding.
            let all_kv = (0..len).all(|i| (addr + i - r.base) % r.block_len < r.kv_block_len);
            if all_kv {
                assert!(found.is_none(), "regions overlap");
                found = Some(i);
            }
        }
    }
    found
}

/// Checks everything a plan must satisfy, whatever the rules produced.
fn check_invariants(c: &Case, out: &Plan) -> Result<(), TestCaseError> {
    let limits = &c.limits;
    prop_assert_eq!(out.is_transfer(), !out.descriptors.is_empty());
    let mut regions = Vec::with_capacity(out.descriptors.len());
    for d in &out.descriptors {
        prop_assert!(d.len > 0 && d.len <= limits.batch_bytes_max, "{:?}", d);
        let rs = region_of(&c.prefill, d.src, d.len);
        let rd = region_of(&c.decode, d.dst, d.len);
        prop_assert!(rs.is_some(), "src outside prefill regions: {:?}", d);
        prop_assert_eq!(rs, rd, "src and dst in different region pairs: {:?}", d);
        regions.push(rs);
    }
    // Maximal coalescing: two consecutive copies of one region that continue
    // each other on both sides exist only because the first is full.
    for (i, w) in out.descriptors.windows(2).enumerate() {
        let (a, b) = (w[0], w[1]);
        if regions[i] == regions[i + 1]
            && a.src.checked_add(a.len) == Some(b.src)
            && a.dst.checked_add(a.len) == Some(b.dst)
        {
            prop_assert_eq!(
                a.len,
                limits.batch_bytes_max,
                "mergeable pair {:?} {:?}",
                a,
                b
            );
        }
    }
    // Batches cover the descriptors in order, within both limits.
    let mut next = 0;
    for b in &out.batches {
        prop_assert_eq!(b.first, next);
        prop_assert!(b.count >= 1 && b.count <= limits.batch_descriptors_max);
        let bytes: u64 = out.descriptors[b.range()].iter().map(|d| d.len).sum();
        prop_assert!(bytes <= limits.batch_bytes_max);
        next += b.count;
    }
    prop_assert_eq!(next, out.descriptors.len());
    // Batches cut while planning equal batches cut afterwards.
    let mut separate = Vec::new();
    split_batches(&out.descriptors, limits, &mut separate);
    prop_assert_eq!(&separate, &out.batches);
    Ok(())
}

/// A side's regions: separate tensors (optionally padded), or K and V
/// interleaved in one block as two regions.
fn regions(
    rng: &mut Rng,
    count: usize,
    kv_of: &dyn Fn(usize) -> u64,
    num_blocks: u64,
    interleaved: bool,
    top: bool,
) -> Vec<Region> {
    let mut out = Vec::new();
    let mut lens = Vec::new();
    for i in 0..count {
        let kv = kv_of(i);
        let pad = if rng.below(3) == 0 { rng.below(5) } else { 0 };
        lens.push((kv, pad));
    }
    // Lay regions out one after another with a random gap.
    let mut cursor = rng.below(1 << 20);
    let mut spans = Vec::new();
    let mut i = 0;
    while i < count {
        let (kv, pad) = lens[i];
        if interleaved && i + 1 < count && lens[i + 1].0 == kv {
            let block_len = 2 * kv + pad;
            spans.push((cursor, block_len, kv));
            spans.push((cursor + kv, block_len, kv));
            cursor += num_blocks * block_len + rng.below(64);
            i += 2;
        } else {
            let block_len = kv + pad;
            spans.push((cursor, block_len, kv));
            cursor += num_blocks * block_len + rng.below(64);
            i += 1;
        }
    }
    // Optionally push everything to the top of the address space, so the
    // last region ends at u64::MAX and address arithmetic is at its limit.
    let shift = if top { u64::MAX - cursor + 1 } else { 0 };
    for (base, block_len, kv) in spans {
        out.push(Region {
            base: base + shift,
            block_len,
            kv_block_len: kv,
        });
    }
    out
}

/// Distinct block ids for `groups`, consecutive runs mixed with random ids.
fn block_lists(rng: &mut Rng, num_blocks: u64, counts: &[usize], runny: bool) -> Vec<Vec<u64>> {
    let mut ids: Vec<u64> = (0..num_blocks).collect();
    if !runny {
        for i in (1..ids.len()).rev() {
            let j = rng.below(i as u64 + 1) as usize;
            ids.swap(i, j);
        }
    } else {
        // Rotate and swap a few, so there are runs with breaks between.
        let r = rng.below(num_blocks) as usize;
        ids.rotate_left(r);
        for _ in 0..2 {
            let (i, j) = (
                rng.below(num_blocks) as usize,
                rng.below(num_blocks) as usize,
            );
            ids.swap(i, j);
        }
    }
    let mut out = Vec::new();
    let mut at = 0;
    for &n in counts {
        out.push(ids[at..at + n].to_vec());
        at += n;
    }
    out
}

fn case() -> impl Strategy<Value = Case> {
    (
        prop_oneof![
            Just(LayoutKind::Hnd),
            Just(LayoutKind::Nhd),
            Just(LayoutKind::Mla)
        ],
        prop_oneof![Just(1u32), Just(2), Just(4), Just(8)],
        (0u32..4, 0u32..4),
        (1u32..=3, 1u64..=3),
        (1usize..=4, any::<bool>(), any::<bool>()),
        prop_oneof![(1u64..=10, 1u64..=10), (16u64..=64, 16u64..=64)],
        (1usize..=2, any::<u64>(), any::<bool>(), any::<bool>()),
        prop_oneof![Just((128usize, 1u64 << 30)), (1usize..=4, 1u64..=48)],
    )
        .prop_map(
            |(
                layout,
                heads,
                (tp_p_log, tp_d_log),
                (tokens, head_bytes),
                (nregions, inter_p, inter_d),
                (nb_p, nb_d),
                (groups, seed, runny, top),
                (dmax, bmax),
            )| {
                let mut rng = Rng(seed | 1);
                let tp_p = 1u32 << tp_p_log;
                let tp_d = 1u32 << tp_d_log;
                let rp = rng.below(u64::from(tp_p)) as u32;
                let rd = rng.below(u64::from(tp_d)) as u32;
                let model = ModelSpec {
                    layout,
                    total_kv_heads: heads,
                    block_tokens: tokens,
                    head_bytes,
                };
                let mla_lens: Vec<u64> = (0..nregions).map(|_| 1 + rng.below(12)).collect();
                let kv_p = move |i: usize| match layout {
                    LayoutKind::Mla => mla_lens[i],
                    LayoutKind::Hnd | LayoutKind::Nhd => {
                        u64::from(model.heads_per_rank(tp_p)) * u64::from(tokens) * head_bytes
                    }
                };
                let mla_lens2: Vec<u64> = (0..nregions).map(&kv_p).collect();
                let kv_d = move |i: usize| match layout {
                    LayoutKind::Mla => mla_lens2[i],
                    LayoutKind::Hnd | LayoutKind::Nhd => {
                        u64::from(model.heads_per_rank(tp_d)) * u64::from(tokens) * head_bytes
                    }
                };
                let prefill = RankLayout {
                    tp_size: tp_p,
                    tp_rank: rp,
                    num_blocks: nb_p,
                    regions: regions(&mut rng, nregions, &kv_p, nb_p, inter_p, top),
                    stage: kvferry_machines::Stage::SINGLE,
                    pools: Vec::new(),
                };
                let decode = RankLayout {
                    tp_size: tp_d,
                    tp_rank: rd,
                    num_blocks: nb_d,
                    regions: regions(&mut rng, nregions, &kv_d, nb_d, inter_d, false),
                    stage: kvferry_machines::Stage::SINGLE,
                    pools: Vec::new(),
                };
                // Decode asks for up to all its blocks; prefill has those
                // plus a prefix decode already holds (a partial hit).
                let total_d = rng.below(nb_d.min(nb_p) + 1);
                let extra = rng.below(nb_p - total_d + 1);
                let mut d_counts = vec![0usize; groups];
                let mut p_counts = vec![0usize; groups];
                for _ in 0..total_d {
                    let g = rng.below(groups as u64) as usize;
                    d_counts[g] += 1;
                    p_counts[g] += 1;
                }
                for _ in 0..extra {
                    p_counts[rng.below(groups as u64) as usize] += 1;
                }
                let prefill_blocks = block_lists(&mut rng, nb_p, &p_counts, runny);
                let decode_blocks = block_lists(&mut rng, nb_d, &d_counts, runny);
                Case {
                    model,
                    prefill,
                    decode,
                    prefill_blocks,
                    decode_blocks,
                    limits: BatchLimits {
                        batch_descriptors_max: dmax,
                        batch_bytes_max: bmax,
                        descriptors_max: 1 << 20,
                    },
                }
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2048, ..ProptestConfig::default() })]

    #[test]
    fn planner_matches_the_byte_model(c in case()) {
        let out = plan(&c.model, &c.prefill, &c.decode, &c.prefill_blocks, &c.decode_blocks, &c.limits)
            .map_err(|e| TestCaseError::fail(format!("valid case rejected: {e}")))?;
        check_invariants(&c, &out)?;
        let got = expand(&out.descriptors);
        // No source byte is read twice and no destination byte written twice.
        let mut srcs: Vec<u64> = got.iter().map(|b| b.0).collect();
        srcs.dedup();
        prop_assert_eq!(srcs.len(), got.len(), "overlapping sources");
        let mut dsts: Vec<u64> = got.iter().map(|b| b.1).collect();
        dsts.sort_unstable();
        dsts.dedup();
        prop_assert_eq!(dsts.len(), got.len(), "overlapping destinations");
        prop_assert_eq!(got, naive(&c));
    }

    /// All prefill ranks together fill every KV byte of the decode blocks
    /// exactly once: each head comes from exactly one P rank.
    #[test]
    fn prefill_ranks_together_fill_decode_exactly_once(c in case()) {
        let tp = TpPair::new(&c.model, c.prefill.tp_size, c.decode.tp_size).unwrap();
        let mut all = Vec::new();
        for rp in 0..c.prefill.tp_size {
            let prefill = RankLayout { tp_rank: rp, ..c.prefill.clone() };
            let out = plan(&c.model, &prefill, &c.decode, &c.prefill_blocks, &c.decode_blocks, &c.limits)
                .map_err(|e| TestCaseError::fail(format!("valid case rejected: {e}")))?;
            let sends = tp.sources_of(c.decode.tp_rank).any(|(r, _)| r == rp);
            let blocks: usize = c.decode_blocks.iter().map(Vec::len).sum();
            prop_assert_eq!(out.is_transfer(), sends && blocks > 0);
            all.extend(expand(&out.descriptors).into_iter().map(|b| b.1));
        }
        all.sort_unstable();
        let mut want = Vec::new();
        for g in &c.decode_blocks {
            for &db in g {
                for r in &c.decode.regions {
                    let start = r.base + db * r.block_len;
                    want.extend(start..start + r.kv_block_len);
                }
            }
        }
        want.sort_unstable();
        prop_assert_eq!(all, want);
    }

    /// Every prefill rank no decode rank reads from is told so by exactly
    /// one decode rank, and no prefill rank that sends is told.
    #[test]
    fn each_unpaired_prefill_rank_is_told_by_one_decode_rank(c in case()) {
        let tp = TpPair::new(&c.model, c.prefill.tp_size, c.decode.tp_size).unwrap();
        let mut told = vec![0u32; c.prefill.tp_size as usize];
        for rd in 0..c.decode.tp_size {
            for u in tp.unpaired_told_by(rd) {
                told[u as usize] += 1;
            }
        }
        for rp in 0..c.prefill.tp_size {
            let sends = (0..c.decode.tp_size).any(|rd| tp.sources_of(rd).any(|(r, _)| r == rp));
            prop_assert_eq!(told[rp as usize], u32::from(!sends), "prefill rank {}", rp);
        }
    }

    /// Contiguous block ids on both sides with whole-block copies give
    /// exactly one descriptor per region (before byte splitting).
    #[test]
    fn contiguous_whole_blocks_coalesce_to_one_copy_per_region(
        regions in 1usize..8, n in 1u64..64, p0 in 0u64..64, d0 in 0u64..64, kv in 1u64..4096,
    ) {
        let model = crate::model::flat(1).with_layout(LayoutKind::Mla);
        let side = |base: u64, nb: u64| RankLayout {
            tp_size: 1, tp_rank: 0, num_blocks: nb,
            regions: (0..regions as u64)
                .map(|i| Region { base: base + i * (1 << 32), block_len: kv, kv_block_len: kv })
                .collect(),
            stage: kvferry_machines::Stage::SINGLE,
            pools: Vec::new(),
        };
        let p = side(0, p0 + n);
        let d = side(1 << 48, d0 + n);
        let out = plan(&model, &p, &d, &[(p0..p0 + n).collect::<Vec<_>>()], &[(d0..d0 + n).collect::<Vec<_>>()], &BatchLimits::default()).unwrap();
        prop_assert_eq!(out.descriptors.len(), regions);
        for (i, desc) in out.descriptors.iter().enumerate() {
            prop_assert_eq!(desc.src, i as u64 * (1 << 32) + p0 * kv);
            prop_assert_eq!(desc.dst, (1 << 48) + i as u64 * (1 << 32) + d0 * kv);
            prop_assert_eq!(desc.len, n * kv);
        }
    }

    /// A repeated block id among the blocks sent is rejected, naming a
    /// repeated id, and a list without repeats is accepted.
    #[test]
    fn repeated_blocks_are_rejected(
        groups in proptest::collection::vec(
            (proptest::collection::vec(0u64..40, 0..24), proptest::collection::vec(0u64..40, 0..24)),
            1..3,
        ),
        num_blocks in prop_oneof![Just(40u64), Just(1u64 << 40)],
    ) {
        let model = crate::model::flat(1).with_layout(LayoutKind::Mla);
        let side = |base: u64| RankLayout {
            tp_size: 1, tp_rank: 0, num_blocks,
            regions: vec![Region { base, block_len: 8, kv_block_len: 8 }],
            stage: kvferry_machines::Stage::SINGLE,
            pools: Vec::new(),
        };
        // Prefill gets decode's length plus a prefix, so trimming happens.
        let pb: Vec<Vec<u64>> = groups.iter().map(|(p, d)| {
            let mut p = p.clone();
            p.truncate(d.len());
            while p.len() < d.len() { p.push(39 - p.len() as u64); }
            let mut with_prefix = vec![0, 0];
            with_prefix.extend(p);
            with_prefix
        }).collect();
        let db: Vec<Vec<u64>> = groups.iter().map(|(_, d)| d.clone()).collect();
        let repeated = |lists: &[Vec<u64>], trim: bool| -> Vec<u64> {
            let mut all: Vec<u64> = lists.iter().flat_map(|l| if trim { l[2..].to_vec() } else { l.clone() }).collect();
            all.sort_unstable();
            all.windows(2).filter(|w| w[0] == w[1]).map(|w| w[0]).collect()
        };
        let dup_p = repeated(&pb, true);
        let dup_d = repeated(&db, false);
        let result = plan(&model, &side(0), &side(1 << 50), &pb, &db, &BatchLimits::default());
        match result {
            Ok(_) => prop_assert!(dup_p.is_empty() && dup_d.is_empty()),
            Err(PlanError::DuplicateBlock { side: Side::Prefill, block }) => prop_assert!(dup_p.contains(&block)),
            Err(PlanError::DuplicateBlock { side: Side::Decode, block }) => {
                prop_assert!(dup_p.is_empty());
                prop_assert!(dup_d.contains(&block));
            }
            Err(e) => prop_assert!(false, "unexpected {e}"),
        }
    }

    /// Hostile layouts and block lists: any result is fine, a panic is not.
    #[test]
    fn hostile_input_never_panics(
        layout in prop_oneof![Just(LayoutKind::Hnd), Just(LayoutKind::Nhd), Just(LayoutKind::Mla)],
        heads in prop_oneof![Just(0u32), Just(1), Just(3), any::<u32>()],
        tokens in prop_oneof![Just(0u32), Just(1), any::<u32>()],
        head_bytes in prop_oneof![Just(0u64), Just(1), any::<u64>()],
        tps in (prop_oneof![Just(0u32), 1u32..5, any::<u32>()], any::<u32>(), prop_oneof![Just(0u32), 1u32..5, any::<u32>()], any::<u32>()),
        nbs in (prop_oneof![Just(0u64), 1u64..8, any::<u64>()], prop_oneof![Just(0u64), 1u64..8, any::<u64>()]),
        rs in proptest::collection::vec((any::<u64>(), prop_oneof![1u64..64, any::<u64>()], prop_oneof![1u64..64, any::<u64>()]), 0..4),
        blocks in proptest::collection::vec((proptest::collection::vec(prop_oneof![0u64..8, any::<u64>()], 0..6), proptest::collection::vec(prop_oneof![0u64..8, any::<u64>()], 0..6)), 0..3),
        limits in (0usize..4, prop_oneof![Just(0u64), 1u64..16, any::<u64>()]),
    ) {
        let model = ModelSpec { layout, total_kv_heads: heads, block_tokens: tokens, head_bytes };
        let mk = |tp_size, tp_rank, num_blocks| RankLayout {
            tp_size, tp_rank: tp_rank % tp_size.max(1).saturating_add(1), num_blocks,
            regions: rs.iter().map(|&(base, block_len, kv_block_len)| Region { base, block_len, kv_block_len }).collect(),
            stage: kvferry_machines::Stage::SINGLE,
            pools: Vec::new(),
        };
        let p = mk(tps.0, tps.1, nbs.0);
        let d = mk(tps.2, tps.3, nbs.1);
        let pb: Vec<Vec<u64>> = blocks.iter().map(|b| b.0.clone()).collect();
        let db: Vec<Vec<u64>> = blocks.iter().map(|b| b.1.clone()).collect();
        let limits = BatchLimits { batch_descriptors_max: limits.0, batch_bytes_max: limits.1, descriptors_max: 1 << 16 };
        if let Ok(out) = plan(&model, &p, &d, &pb, &db, &limits) {
            // Whatever was accepted must still be a sound plan.
            let c = Case { model, prefill: p, decode: d, prefill_blocks: pb, decode_blocks: db, limits };
            for desc in &out.descriptors {
                prop_assert!(region_of(&c.prefill, desc.src, desc.len.min(64)).is_some());
                prop_assert!(region_of(&c.decode, desc.dst, desc.len.min(64)).is_some());
            }
        }
    }
}
