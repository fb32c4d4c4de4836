//! Store keys: the documented format, its bounds and validation, that two
//! different qualifier tuples never share a key, and that exactly one rank
//! of each replica set stores each key.

use std::collections::{BTreeMap, BTreeSet};

use proptest::prelude::*;

use kvferry_machines::internal::store::key::{HeadSlice, KEY_BYTES_MAX, NAME_BYTES_MAX};
use kvferry_machines::internal::store::{
    BlockHash, GroupSpec, KeyError, Keyspace, KeyspaceSpec, Shard,
};
use kvferry_machines::{LayoutKind, ModelSpec};

use crate::model::{self, ModelSpecExt};

fn spec(name: &str, layout: LayoutKind, heads: u32, tp: u32, pp: u32) -> KeyspaceSpec {
    KeyspaceSpec {
        model_name: name.into(),
        model: model::large().with_layout(layout).with_heads(heads),
        dtype: "bf16".into(),
        tp_size: tp,
        pp_size: pp,
        groups: vec![
            GroupSpec {
                block_tokens: 16,
                window_tokens: None,
            },
            GroupSpec {
                block_tokens: 32,
                window_tokens: Some(128),
            },
        ],
    }
}

#[test]
fn the_documented_format() {
    let ks = Keyspace::new(&spec("meta-llama/Llama-3.1-8B", LayoutKind::Hnd, 8, 2, 1)).unwrap();
    let (shard, replica) = ks.shard_of(1, 0).unwrap();
    assert_eq!((replica.count, replica.index), (1, 0));
    let scope = ks.scope(None, &[]).unwrap();
    let key = ks
        .key(&shard, &scope, 0, &BlockHash::from_u64(0xab))
        .unwrap();
    assert_eq!(
        key.as_str(),
        "kvf1:meta-llama%2FLlama-3.1-8B:hnd:bf16:d256:h4+4:pp0of1::0:g0:b16:00000000000000ab"
    );
    let scope = ks.scope(Some("sql adapter"), &["salt:1", ""]).unwrap();
    let hash = BlockHash::from_bytes(&[0xde, 0xad]).unwrap();
    let key = ks.key(&shard, &scope, 1, &hash).unwrap();
    assert_eq!(
        key.as_str(),
        "kvf1:meta-llama%2FLlama-3.1-8B:hnd:bf16:d256:h4+4:pp0of1:sql%20adapter:2,salt%3A1,:g1:b32:dead"
    );
}

#[test]
fn mla_ranks_share_one_shard_and_stripe_its_keys() {
    let ks = Keyspace::new(&spec("m", LayoutKind::Mla, 1, 4, 2)).unwrap();
    assert_eq!(
        ks.shards(),
        vec![
            Shard {
                heads: HeadSlice::Latent,
                pp_rank: 0
            },
            Shard {
                heads: HeadSlice::Latent,
                pp_rank: 1
            },
        ]
    );
    let (s, r) = ks.shard_of(3, 1).unwrap();
    assert_eq!(s.heads, HeadSlice::Latent);
    assert_eq!((r.count, r.index), (4, 3));
    // Blocks 0..4 of group 0 go to replicas 0, 1, 2, 3; group 1 shifts by one.
    assert!(r.stores(0, 3) && r.stores(1, 2) && !r.stores(0, 0));
    let scope = ks.scope(None, &[]).unwrap();
    let key = ks.key(&s, &scope, 0, &BlockHash::from_u64(1)).unwrap();
    assert!(key.as_str().contains(":mla:bf16:d256:mla:pp1of2:"), "{key}");
}

#[test]
fn fewer_heads_than_ranks_make_replica_sets() {
    // 2 KV heads, TP 8: ranks 0-3 hold head 0, ranks 4-7 head 1.
    let ks = Keyspace::new(&spec("m", LayoutKind::Nhd, 2, 8, 1)).unwrap();
    let (s2, r2) = ks.shard_of(2, 0).unwrap();
    let (s5, r5) = ks.shard_of(5, 0).unwrap();
    assert_eq!(s2.heads, HeadSlice::Heads { first: 0, count: 1 });
    assert_eq!(s5.heads, HeadSlice::Heads { first: 1, count: 1 });
    assert_eq!((r2.count, r2.index, r5.index), (4, 2, 1));
    assert_eq!(ks.shards().len(), 2);
}

#[test]
fn a_rank_layout_names_its_shard_and_value_size() {
    use kvferry_machines::internal::store::value_bytes;
    use kvferry_machines::{RankLayout, Region, Stage};
    let ks = Keyspace::new(&spec("m", LayoutKind::Hnd, 8, 2, 2)).unwrap();
    let region = Region {
        base: 0,
        block_len: 8192,
        kv_block_len: 4096,
    };
    let mut layout = RankLayout {
        tp_size: 2,
        tp_rank: 1,
        num_blocks: 10,
        regions: vec![region; 3],
        stage: Stage {
            pp_size: 2,
            pp_rank: 1,
            first_region: 3,
        },
        pools: Vec::new(),
    };
    assert_eq!(ks.shard_of_layout(&layout), ks.shard_of(1, 1));
    assert_eq!(value_bytes(&layout), 3 * 4096);
    layout.tp_size = 4;
    assert!(matches!(
        ks.shard_of_layout(&layout),
        Err(KeyError::BadShape(_))
    ));
}

#[test]
fn bad_qualifiers_are_typed_errors() {
    let long = "x".repeat(NAME_BYTES_MAX + 1);
    assert!(matches!(
        Keyspace::new(&spec(&long, LayoutKind::Hnd, 8, 2, 1)),
        Err(KeyError::BadName { .. })
    ));
    assert!(matches!(
        Keyspace::new(&spec("", LayoutKind::Hnd, 8, 2, 1)),
        Err(KeyError::BadName { .. })
    ));
    assert!(matches!(
        Keyspace::new(&spec("m", LayoutKind::Hnd, 6, 4, 1)),
        Err(KeyError::BadShape(_))
    ));
    assert!(matches!(
        Keyspace::new(&spec("m", LayoutKind::Hnd, 8, 0, 1)),
        Err(KeyError::BadShape(_))
    ));
    let mut s = spec("m", LayoutKind::Hnd, 8, 2, 1);
    s.dtype = "BF16".into();
    assert_eq!(Keyspace::new(&s), Err(KeyError::BadDtype));
    s.dtype = "bf16".into();
    s.groups[1].window_tokens = Some(0);
    assert_eq!(Keyspace::new(&s), Err(KeyError::BadGroups));
    s.groups.clear();
    assert_eq!(Keyspace::new(&s), Err(KeyError::BadGroups));
    let ks = Keyspace::new(&spec("m", LayoutKind::Hnd, 8, 2, 1)).unwrap();
    assert!(matches!(ks.shard_of(2, 0), Err(KeyError::BadShape(_))));
    assert_eq!(
        ks.scope(None, &[&"e".repeat(65)]),
        Err(KeyError::BadExtraKeys)
    );
    assert_eq!(ks.scope(None, &["e"; 9]), Err(KeyError::BadExtraKeys));
    assert!(matches!(
        BlockHash::from_bytes(&[]),
        Err(KeyError::BadHash { .. })
    ));
    assert!(matches!(
        BlockHash::from_bytes(&[0; 33]),
        Err(KeyError::BadHash { .. })
    ));
    let (shard, _) = ks.shard_of(0, 0).unwrap();
    let scope = ks.scope(None, &[]).unwrap();
    assert_eq!(
        ks.key(&shard, &scope, 2, &BlockHash::from_u64(1)),
        Err(KeyError::UnknownGroup { group: 2 })
    );
}

#[test]
fn the_longest_key_fits_the_bound_and_a_longer_scope_is_refused() {
    // A model name of bytes that all escape triples in length.
    let name = "/".repeat(NAME_BYTES_MAX);
    let ks = Keyspace::new(&spec(&name, LayoutKind::Hnd, 8, 2, 1)).unwrap();
    let lora = "/".repeat(32);
    let extra = "/".repeat(64);
    let scope = ks.scope(Some(&lora), &[&extra]).unwrap();
    let (shard, _) = ks.shard_of(1, 0).unwrap();
    let key = ks
        .key(
            &shard,
            &scope,
            1,
            &BlockHash::from_bytes(&[0xff; 32]).unwrap(),
        )
        .unwrap();
    assert!(key.as_str().len() <= KEY_BYTES_MAX);
    let eight = [extra.as_str(); 8];
    assert!(matches!(
        ks.scope(Some(&lora), &eight),
        Err(KeyError::TooLong { .. })
    ));
}

/// Everything a key is qualified by, as plain values.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Tuple {
    model_name: String,
    layout: u8,
    dtype: String,
    head_bytes: u64,
    shard: (Option<(u32, u32)>, u32),
    pp_size: u32,
    lora: Option<String>,
    extra: Vec<String>,
    group: u32,
    block_tokens: u32,
    hash: Vec<u8>,
}

fn text() -> impl Strategy<Value = String> {
    // Few symbols, many of them special to the format, so that different
    // values whose naive concatenations agree are likely.
    proptest::collection::vec(
        prop::sample::select(vec!["a", ":", "%", "3A", ",", "/", "_", "%3A", "-"]),
        0..4,
    )
    .prop_map(|v| v.concat())
}

#[derive(Clone, Debug)]
struct Input {
    name: String,
    layout: LayoutKind,
    heads: u32,
    tp: u32,
    tp_rank: u32,
    pp: u32,
    pp_rank: u32,
    dtype: String,
    head_bytes: u64,
    lora: Option<String>,
    extra: Vec<String>,
    block_tokens: Vec<u32>,
    group: u32,
    hash: Vec<u8>,
}

fn input() -> impl Strategy<Value = Input> {
    let shape = (
        prop::sample::select(vec![LayoutKind::Hnd, LayoutKind::Nhd, LayoutKind::Mla]),
        prop::sample::select(vec![1u32, 2, 4]),
        prop::sample::select(vec![1u32, 2, 4]),
        0u32..4,
        1u32..3,
        0u32..3,
    );
    let rest = (
        text().prop_map(|s| format!("m{s}")),
        prop::sample::select(vec!["bf16", "fp8", "b_f16"]),
        prop::sample::select(vec![128u64, 256]),
        proptest::option::of(text().prop_map(|s| format!("l{s}"))),
        proptest::collection::vec(text(), 0..3),
        proptest::collection::vec(prop::sample::select(vec![1u32, 16, 161]), 1..3),
        0u32..3,
        proptest::collection::vec(prop::sample::select(vec![0u8, 1, 0x10]), 1..3),
    );
    (shape, rest).prop_map(
        |((layout, heads, tp, tr, pp, pr), (name, dtype, hb, lora, extra, bt, g, hash))| Input {
            name,
            layout,
            heads,
            tp,
            tp_rank: tr % tp,
            pp,
            pp_rank: pr % pp,
            dtype: dtype.into(),
            head_bytes: hb,
            lora,
            extra,
            group: g % bt.len() as u32,
            block_tokens: bt,
            hash,
        },
    )
}

/// One field of an input changed.
#[derive(Clone, Debug)]
enum Edit {
    Model(String),
    Lora(Option<String>),
    Extra(Vec<String>),
    Group(u32),
    Hash(Vec<u8>),
    Ranks(u32, u32),
}

fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        text().prop_map(|s| Edit::Model(format!("m{s}"))),
        proptest::option::of(text().prop_map(|s| format!("l{s}"))).prop_map(Edit::Lora),
        proptest::collection::vec(text(), 0..3).prop_map(Edit::Extra),
        (0u32..3).prop_map(Edit::Group),
        proptest::collection::vec(prop::sample::select(vec![0u8, 1, 0x10]), 1..3)
            .prop_map(Edit::Hash),
        (0u32..4, 0u32..3).prop_map(|(t, p)| Edit::Ranks(t, p)),
    ]
}

impl Edit {
    fn apply(self, base: &Input) -> Input {
        let mut i = base.clone();
        match self {
            Edit::Model(m) => i.name = m,
            Edit::Lora(l) => i.lora = l,
            Edit::Extra(e) => i.extra = e,
            Edit::Group(g) => i.group = g % i.block_tokens.len() as u32,
            Edit::Hash(h) => i.hash = h,
            Edit::Ranks(t, p) => {
                i.tp_rank = t % i.tp;
                i.pp_rank = p % i.pp;
            }
        }
        i
    }
}

/// The key of `i` and the tuple it is qualified by.
fn key_of(i: &Input) -> (String, Tuple) {
    let ks = Keyspace::new(&KeyspaceSpec {
        model_name: i.name.clone(),
        model: ModelSpec {
            layout: i.layout,
            total_kv_heads: i.heads,
            block_tokens: 16,
            head_bytes: i.head_bytes,
        },
        dtype: i.dtype.clone(),
        tp_size: i.tp,
        pp_size: i.pp,
        groups: (i.block_tokens.iter())
            .map(|&b| GroupSpec {
                block_tokens: b,
                window_tokens: None,
            })
            .collect(),
    })
    .expect("valid keyspace");
    let extra: Vec<&str> = i.extra.iter().map(String::as_str).collect();
    let scope = ks.scope(i.lora.as_deref(), &extra).expect("valid scope");
    let (shard, _) = ks.shard_of(i.tp_rank, i.pp_rank).expect("rank in range");
    let hash = BlockHash::from_bytes(&i.hash).unwrap();
    let key = ks.key(&shard, &scope, i.group, &hash).unwrap();
    let heads = match shard.heads {
        HeadSlice::Heads { first, count } => Some((first, count)),
        HeadSlice::Latent => None,
    };
    let tuple = Tuple {
        model_name: i.name.clone(),
        layout: i.layout as u8,
        dtype: i.dtype.clone(),
        head_bytes: i.head_bytes,
        shard: (heads, shard.pp_rank),
        pp_size: i.pp,
        lora: i.lora.clone(),
        extra: i.extra.clone(),
        group: i.group,
        block_tokens: i.block_tokens[i.group as usize],
        hash: i.hash.clone(),
    };
    (key.as_str().to_owned(), tuple)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Two inputs share a key exactly when they share every qualifier:
    /// over random inputs, and over variants of one input that differ in
    /// one field (so near misses, `:` against `%3A` say, are common).
    #[test]
    fn keys_are_injective(
        random in proptest::collection::vec(input(), 1..8),
        base in input(),
        edits in proptest::collection::vec(edit(), 1..24),
    ) {
        let mut inputs = random;
        inputs.push(base.clone());
        inputs.extend(edits.into_iter().map(|e| e.apply(&base)));
        let mut by_key: BTreeMap<String, Tuple> = BTreeMap::new();
        let mut tuples = BTreeSet::new();
        for i in &inputs {
            let (key, tuple) = key_of(i);
            prop_assert!(key.len() <= KEY_BYTES_MAX);
            prop_assert!(!key.contains(' '));
            if let Some(t) = by_key.get(&key) {
                prop_assert_eq!(t, &tuple, "two tuples share key {}", key);
            }
            by_key.insert(key, tuple.clone());
            tuples.insert(tuple);
        }
        prop_assert_eq!(by_key.len(), tuples.len());
    }

    /// Every key of every shard is stored by exactly one rank of the ranks
    /// holding that shard, and `shards()` lists each shard once.
    #[test]
    fn exactly_one_replica_stores_each_key(
        layout in prop::sample::select(vec![LayoutKind::Hnd, LayoutKind::Nhd, LayoutKind::Mla]),
        heads in prop::sample::select(vec![1u32, 2, 3, 4, 8, 16]),
        tp in prop::sample::select(vec![1u32, 2, 3, 4, 6, 8, 16]),
        pp in 1u32..4,
    ) {
        let Ok(ks) = Keyspace::new(&spec("m", layout, heads, tp, pp)) else {
            prop_assume!(false);
            unreachable!()
        };
        let listed: Vec<Shard> = ks.shards();
        let distinct: BTreeSet<Shard> = listed.iter().copied().collect();
        prop_assert_eq!(listed.len(), distinct.len());
        let mut seen = BTreeSet::new();
        for p in 0..pp {
            for g in 0..2u32 {
                for i in 0..40u32 {
                    let mut storers: BTreeMap<Shard, Vec<u32>> = BTreeMap::new();
                    for r in 0..tp {
                        let (s, rep) = ks.shard_of(r, p).unwrap();
                        seen.insert(s);
                        prop_assert!(rep.index < rep.count);
                        let e = storers.entry(s).or_default();
                        if rep.stores(g, i) {
                            e.push(r);
                        }
                    }
                    for (s, ranks) in &storers {
                        prop_assert_eq!(ranks.len(), 1, "shard {:?} block {} group {}: {:?}", s, i, g, ranks);
                    }
                }
            }
        }
        prop_assert_eq!(seen, distinct);
    }
}
