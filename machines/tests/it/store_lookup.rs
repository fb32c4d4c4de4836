//! Prefix lookup: unit cases, a proptest against a naive model over random
//! stored sets, TP/PP/group shapes and windows, and a proptest that what
//! every rank's save stores is found again whole.

use std::collections::HashSet;

use proptest::prelude::*;

use kvferry_machines::internal::common::BlockId;
use kvferry_machines::internal::store::lookup::{
    blocks_needed, lcm_block_tokens, store_mask, Lookup,
};
use kvferry_machines::internal::store::save::plan_save;
use kvferry_machines::internal::store::{
    BlockHash, GroupBlocks, GroupSpec, Keyspace, RequestScope, StorePlanError,
};
use kvferry_machines::LayoutKind;

use crate::store_common;
use store_common::keyspace;

fn full(b: u32) -> GroupSpec {
    GroupSpec {
        block_tokens: b,
        window_tokens: None,
    }
}

fn window(b: u32, w: u32) -> GroupSpec {
    GroupSpec {
        block_tokens: b,
        window_tokens: Some(w),
    }
}

fn hashes(ks: &Keyspace, n: &[usize]) -> Vec<Vec<BlockHash>> {
    (0..ks.groups().len())
        .map(|g| {
            (0..n[g])
                .map(|i| BlockHash::from_u64((g as u64) << 32 | i as u64))
                .collect()
        })
        .collect()
}

#[test]
fn lcm_and_masks() {
    assert_eq!(lcm_block_tokens(&[full(16), full(24)]), Ok(48));
    assert_eq!(
        lcm_block_tokens(&[full(65521), full(65519), full(65497)]),
        Err(StorePlanError::BlockSizes)
    );
    // Window of 20 tokens, blocks of 8: at a hit of 32 tokens the next
    // token attends back to token 13, in block 1.
    assert_eq!(blocks_needed(&window(8, 20), 32), 1..4);
    assert_eq!(blocks_needed(&window(8, 1), 32), 4..4);
    assert_eq!(blocks_needed(&window(8, 100), 32), 0..4);
    assert_eq!(blocks_needed(&full(8), 32), 0..4);
    // Hits every 32 tokens need blocks 1..4 and 5..8; block 0 and 4 never.
    assert_eq!(
        store_mask(&window(8, 20), 32, 64),
        vec![false, true, true, true, false, true, true, true]
    );
}

#[test]
fn one_missing_shard_cuts_the_prefix() {
    // 2 heads on TP 4: two shards, each key asked about once.
    let ks = keyspace(LayoutKind::Hnd, 2, 4, 1, vec![full(4)]);
    let scope = ks.scope(None, &[]).unwrap();
    let l = Lookup::new(&ks, &scope, 17, &hashes(&ks, &[5]), 1000).unwrap();
    assert_eq!(l.keys().len(), 4 * 2);
    let mut exists = vec![true; 8];
    assert_eq!(l.resolve(&exists).unwrap().tokens, 16);
    exists[5] = false; // block 2, shard 1
    let hit = l.resolve(&exists).unwrap();
    assert_eq!(
        (hit.tokens, hit.load.len(), hit.load[0].clone()),
        (8, 1, 0..2)
    );
    assert_eq!(
        l.resolve(&exists[1..]),
        Err(StorePlanError::AnswerLength { got: 7, want: 8 })
    );
    assert!(matches!(
        Lookup::new(&ks, &scope, 17, &hashes(&ks, &[5]), 7),
        Err(StorePlanError::TooManyKeys { count: 8, max: 7 })
    ));
}

#[test]
fn a_sliding_window_group_needs_only_its_window() {
    let ks = keyspace(LayoutKind::Mla, 1, 2, 1, vec![full(4), window(4, 5)]);
    let scope = ks.scope(None, &[]).unwrap();
    let l = Lookup::new(&ks, &scope, 16, &hashes(&ks, &[4, 4]), 1000).unwrap();
    // Group 1 holds only its block 3 (tokens 12..16), group 0 everything.
    let exists: Vec<bool> = (0..8).map(|k| k < 4 || k == 7).collect();
    let hit = l.resolve(&exists).unwrap();
    assert_eq!((hit.tokens, hit.load), (16, vec![0..4, 3..4]));
}

#[test]
fn a_128k_token_request_is_one_question_within_the_default_bound() {
    let ks = keyspace(LayoutKind::Hnd, 8, 8, 1, vec![full(16)]);
    let scope = ks.scope(None, &[]).unwrap();
    let max = kvferry_machines::internal::store::StoreConfig::default().max_lookup_keys;
    let l = Lookup::new(&ks, &scope, 131_072, &hashes(&ks, &[8192]), max).unwrap();
    assert_eq!(l.keys().len(), 8192 * 8);
    let mut exists = vec![true; l.keys().len()];
    assert_eq!(l.resolve(&exists).unwrap().tokens, 131_072);
    exists[8 * 4096 + 3] = false;
    assert_eq!(l.resolve(&exists).unwrap().tokens, 4096 * 16);
}

/// The naive model: the largest multiple of the block sizes' LCM whose
/// needed blocks have every rank's key in `stored`, checked block by block.
fn naive_hit(
    ks: &Keyspace,
    scope: &RequestScope,
    token_len: u32,
    hashes: &[Vec<BlockHash>],
    stored: &HashSet<String>,
) -> u32 {
    let groups = ks.groups();
    let lcm = groups.iter().fold(1u32, |a, g| num_lcm(a, g.block_tokens));
    let mut best = 0;
    for tokens in (0..=token_len).filter(|t| t % lcm == 0) {
        let fits = groups
            .iter()
            .zip(hashes)
            .all(|(g, h)| tokens / g.block_tokens <= h.len() as u32);
        if !fits {
            continue;
        }
        let all = (0..groups.len()).all(|g| {
            let bt = groups[g].block_tokens as i64;
            let reach = groups[g].window_tokens.map_or(i64::MAX, |w| w as i64 - 1);
            (0..tokens / groups[g].block_tokens).all(|i| {
                let needed = (i as i64 + 1) * bt > tokens as i64 - reach.min(tokens as i64);
                !needed || every_rank_has(ks, scope, g as u32, &hashes[g][i as usize], stored)
            })
        });
        if all {
            best = tokens;
        }
    }
    best
}

fn every_rank_has(
    ks: &Keyspace,
    scope: &RequestScope,
    g: u32,
    h: &BlockHash,
    stored: &HashSet<String>,
) -> bool {
    (0..ks.pp_size()).all(|p| {
        (0..ks.tp_size()).all(|r| {
            let (shard, _) = ks.shard_of(r, p).unwrap();
            stored.contains(ks.key(&shard, scope, g, h).unwrap().as_str())
        })
    })
}

fn num_lcm(a: u32, b: u32) -> u32 {
    let (mut x, mut y) = (a, b);
    while y != 0 {
        (x, y) = (y, x % y);
    }
    a / x * b
}

#[derive(Clone, Debug)]
struct Shape {
    layout: LayoutKind,
    heads: u32,
    tp: u32,
    pp: u32,
    groups: Vec<GroupSpec>,
    token_len: u32,
    extra_hashes: Vec<i32>,
}

fn shape() -> impl Strategy<Value = Shape> {
    let group = (
        prop::sample::select(vec![1u32, 2, 4, 8]),
        proptest::option::of(1u32..24),
    )
        .prop_map(|(b, w)| GroupSpec {
            block_tokens: b,
            window_tokens: w,
        });
    (
        prop::sample::select(vec![LayoutKind::Hnd, LayoutKind::Mla]),
        prop::sample::select(vec![1u32, 2, 4]),
        prop::sample::select(vec![1u32, 2, 4]),
        1u32..3,
        proptest::collection::vec(group, 1..4),
        0u32..70,
        proptest::collection::vec(-3i32..2, 3),
    )
        .prop_map(
            |(layout, heads, tp, pp, groups, token_len, extra_hashes)| Shape {
                layout,
                heads,
                tp,
                pp,
                groups,
                token_len,
                extra_hashes,
            },
        )
}

impl Shape {
    fn keyspace(&self) -> Keyspace {
        keyspace(
            self.layout,
            self.heads,
            self.tp,
            self.pp,
            self.groups.clone(),
        )
    }

    /// Per group, about as many hashes as the tokens have full blocks
    /// (sometimes fewer, sometimes more).
    fn hash_counts(&self) -> Vec<usize> {
        (self.groups.iter().enumerate())
            .map(|(g, s)| {
                ((self.token_len / s.block_tokens) as i32 + self.extra_hashes[g]).max(0) as usize
            })
            .collect()
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// The lookup agrees with the naive model over random stored sets.
    #[test]
    fn lookup_matches_the_naive_model(s in shape(), seed in any::<u64>(), density in 0u32..4) {
        let ks = s.keyspace();
        let scope = ks.scope(None, &[]).unwrap();
        let hashes = hashes(&ks, &s.hash_counts());
        let lookup = Lookup::new(&ks, &scope, s.token_len, &hashes, 1 << 20).unwrap();
        // A random stored set: each key of the request present with
        // probability 1 - 2^-(density + 1), plus keys of other requests.
        let mut rng = seed | 1;
        let mut stored = HashSet::new();
        for k in lookup.keys() {
            rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
            if rng.trailing_ones() <= density {
                stored.insert(k.as_str().to_owned());
            }
        }
        let other = ks.scope(Some("other"), &[]).unwrap();
        let (shard, _) = ks.shard_of(0, 0).unwrap();
        stored.insert(ks.key(&shard, &other, 0, &hashes[0].first().copied().unwrap_or(BlockHash::from_u64(0))).unwrap().as_str().to_owned());
        let exists: Vec<bool> = lookup.keys().iter().map(|k| stored.contains(k.as_str())).collect();
        let hit = lookup.resolve(&exists).unwrap();
        prop_assert_eq!(hit.tokens, naive_hit(&ks, &scope, s.token_len, &hashes, &stored));
        for (g, spec) in ks.groups().iter().enumerate() {
            prop_assert_eq!(&hit.load[g], &blocks_needed(spec, hit.tokens));
        }
    }

    /// When every rank saves the request, the lookup finds all of it.
    #[test]
    fn what_every_rank_saves_is_found(s in shape()) {
        let ks = s.keyspace();
        let scope = ks.scope(Some("lora"), &["salt"]).unwrap();
        let hashes = hashes(&ks, &s.hash_counts());
        let groups: Vec<GroupBlocks> = hashes.iter().map(|h| GroupBlocks {
            hashes: h.clone(),
            block_ids: (0..h.len() as u32).map(BlockId).collect(),
            value_bytes: 64,
        }).collect();
        let mut stored = HashSet::new();
        let mut puts = 0;
        for p in 0..s.pp {
            for r in 0..s.tp {
                let (shard, replica) = ks.shard_of(r, p).unwrap();
                for it in plan_save(&ks, &shard, &replica, &scope, s.token_len, &groups).unwrap() {
                    puts += 1;
                    prop_assert!(stored.insert(it.key.as_str().to_owned()), "two ranks put {}", it.key);
                }
            }
        }
        prop_assert_eq!(puts, stored.len());
        let lookup = Lookup::new(&ks, &scope, s.token_len, &hashes, 1 << 20).unwrap();
        let exists: Vec<bool> = lookup.keys().iter().map(|k| stored.contains(k.as_str())).collect();
        let hit = lookup.resolve(&exists).unwrap();
        let lcm = lcm_block_tokens(ks.groups()).unwrap();
        let covered = (ks.groups().iter().zip(&hashes))
            .map(|(g, h)| g.block_tokens * h.len() as u32)
            .fold(s.token_len, u32::min);
        prop_assert_eq!(hit.tokens, covered / lcm * lcm);
    }
}
