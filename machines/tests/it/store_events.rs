//! KV events of the store: `BlockStored` runs with their parent hashes
//! from the request's chain, only for blocks the save stored, and the
//! bounded per-step log.

use proptest::prelude::*;

use kvferry_machines::internal::common::BlockId;
use kvferry_machines::internal::store::events::{
    stored_events, EventLog, EventSource, KvEvent, Medium,
};
use kvferry_machines::internal::store::save::{SaveEnd, SaveKeyResult, SaveReport};
use kvferry_machines::internal::store::{BlockHash, GroupSpec, Keyspace, KeyspaceSpec, StoreItem};

use crate::model::{self, ModelSpecExt};

fn groups() -> Vec<GroupSpec> {
    vec![
        GroupSpec {
            block_tokens: 2,
            window_tokens: None,
        },
        GroupSpec {
            block_tokens: 4,
            window_tokens: Some(8),
        },
    ]
}

fn hashes() -> Vec<Vec<BlockHash>> {
    (0..2u64)
        .map(|g| {
            (0..8u64)
                .map(|i| BlockHash::from_u64(g * 100 + i))
                .collect()
        })
        .collect()
}

/// A report of the blocks `(group, index, result)`.
fn report(blocks: &[(u32, u32, SaveKeyResult)]) -> SaveReport {
    let m = model::mla().with_block_tokens(2);
    let ks = Keyspace::new(&KeyspaceSpec {
        groups: groups(),
        ..model::keyspace("m", m)
    })
    .unwrap();
    let scope = ks.scope(None, &[]).unwrap();
    let (shard, _) = ks.shard_of(0, 0).unwrap();
    let h = hashes();
    let items = (blocks.iter())
        .map(|&(g, i, _)| {
            let hash = h[g as usize][i as usize];
            StoreItem {
                key: ks.key(&shard, &scope, g, &hash).unwrap(),
                group: g,
                index: i,
                block: BlockId(i),
                hash,
                value_bytes: 1,
            }
        })
        .collect();
    SaveReport {
        end: SaveEnd::Done,
        items,
        results: blocks.iter().map(|b| b.2).collect(),
    }
}

fn source<'a>(
    g: &'a [GroupSpec],
    h: &'a [Vec<BlockHash>],
    tokens: Option<&'a [u32]>,
) -> EventSource<'a> {
    EventSource {
        groups: g,
        hashes: h,
        token_ids: tokens,
        lora_name: Some("ad"),
        medium: Medium::Cpu,
    }
}

#[test]
fn runs_of_stored_blocks_chain_to_their_real_parents() {
    use SaveKeyResult::*;
    let (g, h) = (groups(), hashes());
    let tokens: Vec<u32> = (0..16).collect();
    // Group 0: 1 and 2 stored (one run), 3 deduped, 4 stored; group 1: 0 stored.
    let r = report(&[
        (0, 2, Stored),
        (0, 1, Stored),
        (0, 3, Deduped),
        (0, 4, Stored),
        (1, 0, Stored),
        (0, 5, Full),
    ]);
    let ev = stored_events(&r, &source(&g, &h, Some(&tokens)));
    let runs: Vec<_> = ev
        .iter()
        .map(|e| match e {
            KvEvent::BlockStored(b) => (
                b.group,
                b.block_hashes.clone(),
                b.parent_block_hash,
                b.token_ids.clone(),
                b.block_size,
            ),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(
        runs,
        vec![
            (
                0,
                vec![h[0][1], h[0][2]],
                Some(h[0][0]),
                vec![2, 3, 4, 5],
                2
            ),
            (0, vec![h[0][4]], Some(h[0][3]), vec![8, 9], 2),
            (1, vec![h[1][0]], None, vec![0, 1, 2, 3], 4),
        ]
    );
    let KvEvent::BlockStored(b) = &ev[0] else {
        unreachable!()
    };
    assert_eq!(
        (b.medium.as_str(), b.lora_name.as_deref()),
        ("CPU", Some("ad"))
    );
    // Without token ids the events carry none.
    let ev = stored_events(&r, &source(&g, &h, None));
    assert!(ev
        .iter()
        .all(|e| matches!(e, KvEvent::BlockStored(b) if b.token_ids.is_empty())));
}

#[test]
fn the_log_is_bounded_and_taken_per_step() {
    let mut log = EventLog::new(2);
    log.extend([
        KvEvent::AllBlocksCleared,
        KvEvent::AllBlocksCleared,
        KvEvent::AllBlocksCleared,
    ]);
    assert_eq!((log.take().len(), log.dropped()), (2, 1));
    assert!(log.take().is_empty());
    log.extend([KvEvent::BlockRemoved {
        block_hashes: vec![BlockHash::from_u64(1)],
        medium: Medium::Storage,
        group: None,
    }]);
    assert_eq!(log.take().len(), 1);
}

proptest! {
    /// The events name every stored block exactly once, in chain order,
    /// and nothing else; each run's parent is its first block's parent.
    #[test]
    fn events_cover_exactly_the_stored_blocks(picks in proptest::collection::btree_map((0u32..2, 0u32..8), any::<bool>(), 0..12)) {
        let blocks: Vec<_> = picks.iter().map(|(&(g, i), &s)| (g, i, if s { SaveKeyResult::Stored } else { SaveKeyResult::Deduped })).collect();
        let (g, h) = (groups(), hashes());
        let ev = stored_events(&report(&blocks), &source(&g, &h, None));
        let mut named = Vec::new();
        for e in &ev {
            let KvEvent::BlockStored(b) = e else { panic!("{e:?}") };
            let first = h[b.group as usize].iter().position(|x| *x == b.block_hashes[0]).unwrap();
            prop_assert_eq!(b.parent_block_hash, first.checked_sub(1).map(|p| h[b.group as usize][p]));
            for (k, bh) in b.block_hashes.iter().enumerate() {
                prop_assert_eq!(*bh, h[b.group as usize][first + k]);
                named.push((b.group, (first + k) as u32));
            }
        }
        let want: Vec<(u32, u32)> = blocks.iter().filter(|b| b.2 == SaveKeyResult::Stored).map(|b| (b.0, b.1)).collect();
        prop_assert_eq!(named, want);
    }
}
