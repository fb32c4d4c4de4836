//! `LoadMachine`: bounded batches under a staging budget, a value over the
//! budget, load errors, timeouts and aborts; proptests that the reported
//! load errors are exactly the blocks not loaded (and every torn block is
//! among them) under random answers, timeouts and aborts, and that what
//! every rank saves loads back byte for byte on every rank.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};

use proptest::prelude::*;

use kvferry_machines::internal::common::BlockId;
use kvferry_machines::internal::store::load::{
    plan_load, Action, Event, GetResult, LoadEnd, LoadKeyResult, LoadMachine, LoadReport,
};
use kvferry_machines::internal::store::lookup::Lookup;
use kvferry_machines::internal::store::save::{self, plan_save, PutResult, SaveMachine};
use kvferry_machines::internal::store::{
    BlockHash, ChunkKey, GroupBlocks, GroupSpec, Pressure, StoreConfig, StoreFault, StoreItem,
};
use kvferry_machines::LayoutKind;
use kvferry_machines::{AbortReason, FailReason, Machine, Phase, TransferId};

use crate::store_common;
use store_common::keyspace;

fn cfg(budget: Option<u64>) -> StoreConfig {
    StoreConfig {
        max_keys_per_batch: 3,
        max_batches_in_flight: 2,
        op_bound: Duration::from_secs(10),
        request_timeout: Duration::from_secs(60),
        staging_budget_bytes: budget,
        ..StoreConfig::default()
    }
}

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

/// `n` items, alternating between a group of 1000-byte and one of
/// 3000-byte values; block ids 100 + i.
fn items(n: u32) -> Vec<StoreItem> {
    let g = GroupSpec {
        block_tokens: 16,
        window_tokens: None,
    };
    let ks = keyspace(LayoutKind::Hnd, 8, 1, 1, vec![g, g]);
    let scope = ks.scope(None, &[]).unwrap();
    let (shard, _) = ks.shard_of(0, 0).unwrap();
    (0..n)
        .map(|i| StoreItem {
            key: ks
                .key(&shard, &scope, i % 2, &BlockHash::from_u64(u64::from(i)))
                .unwrap(),
            group: i % 2,
            index: i / 2,
            block: BlockId(100 + i),
            hash: BlockHash::from_u64(u64::from(i)),
            value_bytes: if i % 2 == 0 { 1000 } else { 3000 },
        })
        .collect()
}

fn drain(m: &mut LoadMachine) -> Vec<Action> {
    std::iter::from_fn(|| m.poll_action()).collect()
}

fn ev(
    m: &mut LoadMachine,
    now: Instant,
    batch: u32,
    answer: Result<Vec<GetResult>, StoreFault>,
) -> Vec<Action> {
    m.handle_event(now, Event::GetDone { batch, answer })
        .expect("answer accepted");
    drain(m)
}

fn gets(actions: &[Action]) -> Vec<(u32, Vec<u32>, u64)> {
    (actions.iter())
        .filter_map(|a| match a {
            Action::Get {
                batch,
                items,
                bytes,
            } => Some((
                *batch,
                items.iter().map(|i| i.block.0 - 100).collect(),
                *bytes,
            )),
            Action::Finished { .. } => None,
        })
        .collect()
}

fn report(actions: &[Action]) -> Option<LoadReport> {
    actions.iter().find_map(|a| match a {
        Action::Finished { report } => Some(report.clone()),
        Action::Get { .. } => None,
    })
}

fn loaded(n: usize) -> Result<Vec<GetResult>, StoreFault> {
    Ok(vec![GetResult::Loaded; n])
}

fn blocks(ids: &[u32]) -> Vec<BlockId> {
    ids.iter().map(|&i| BlockId(100 + i)).collect()
}

#[test]
fn batches_keep_to_the_keys_and_staging_bounds() {
    let t0 = Instant::now();
    // Budget 4500: items 0 and 1 (4000 bytes) fit together, then 2 and 3.
    // Both batches at once would need 8000: one at a time.
    let mut m = LoadMachine::new(t0, &cfg(Some(4500)), items(5)).unwrap();
    assert_eq!(gets(&drain(&mut m)), vec![(0, vec![0, 1], 4000)]);
    assert_eq!(m.phase(), Phase::Transferring);
    assert_eq!(
        gets(&ev(&mut m, t0, 0, loaded(2))),
        vec![(1, vec![2, 3], 4000)]
    );
    assert_eq!(
        gets(&ev(&mut m, t0, 1, loaded(2))),
        vec![(2, vec![4], 1000)]
    );
    let r = report(&ev(&mut m, t0, 2, loaded(1))).unwrap();
    assert_eq!(
        (&r.end, r.loaded(), r.error_blocks()),
        (&LoadEnd::Loaded, 5, vec![])
    );
    assert_eq!(m.phase(), Phase::Success);
    // Without a budget: three keys per batch, two batches in flight.
    let mut m = LoadMachine::new(t0, &cfg(None), items(7)).unwrap();
    let g = gets(&drain(&mut m));
    assert_eq!(
        g.iter().map(|b| b.1.clone()).collect::<Vec<_>>(),
        vec![vec![0, 1, 2], vec![3, 4, 5]]
    );
}

#[test]
fn a_value_over_the_budget_fails_the_whole_load_at_once() {
    let mut m = LoadMachine::new(Instant::now(), &cfg(Some(2000)), items(4)).unwrap();
    let a = drain(&mut m);
    assert!(gets(&a).is_empty());
    let r = report(&a).unwrap();
    assert_eq!(r.error_blocks(), blocks(&[0, 1, 2, 3]));
    let LoadEnd::ValueTooLarge {
        key,
        value_bytes,
        budget_bytes,
    } = &r.end
    else {
        panic!("{:?}", r.end)
    };
    assert_eq!((*value_bytes, *budget_bytes), (3000, 2000));
    assert_eq!(*key, items(4)[1].key);
    let msg = r.end.to_string();
    assert!(
        msg.contains("3000 bytes") && msg.contains("2000 bytes") && msg.contains(key.as_str()),
        "{msg}"
    );
    assert_eq!(m.phase(), Phase::Failed(FailReason::BadMetadata));
}

#[test]
fn a_key_that_does_not_load_stops_the_load_and_names_exactly_the_blocks() {
    let t0 = Instant::now();
    let mut m = LoadMachine::new(t0, &cfg(None), items(9)).unwrap();
    assert_eq!(gets(&drain(&mut m)).len(), 2);
    let answer = Ok(vec![
        GetResult::Loaded,
        GetResult::NotFound,
        GetResult::WrongSize { got_bytes: 5 },
    ]);
    // Batch 1 is still writing blocks 3..6: no report yet, no new batch.
    assert!(ev(&mut m, t0, 0, answer).is_empty());
    let r = report(&ev(&mut m, t0, 1, loaded(3))).unwrap();
    assert_eq!(r.end, LoadEnd::KeyFailed);
    assert_eq!(r.error_blocks(), blocks(&[1, 2, 6, 7, 8]));
    assert_eq!(r.results[2], LoadKeyResult::WrongSize { got_bytes: 5 });
    assert_eq!(r.results[8], LoadKeyResult::NotAttempted);
}

#[test]
fn a_get_past_its_bound_is_a_load_error_and_its_late_answer_is_absorbed() {
    let t0 = Instant::now();
    let mut m = LoadMachine::new(t0, &cfg(None), items(6)).unwrap();
    drain(&mut m);
    ev(&mut m, t0 + secs(3), 1, loaded(3));
    assert_eq!(m.poll_timeout(), Some(t0 + secs(10)));
    m.handle_timeout(t0 + secs(10));
    let r = report(&drain(&mut m)).unwrap();
    assert_eq!(r.end, LoadEnd::Fault(StoreFault::Timeout));
    assert_eq!(r.error_blocks(), blocks(&[0, 1, 2]));
    assert!(ev(&mut m, t0 + secs(11), 0, loaded(3)).is_empty());
    assert_eq!(m.poll_timeout(), None);
}

#[test]
fn an_abort_waits_for_the_gets_in_flight() {
    let t0 = Instant::now();
    let mut m = LoadMachine::new(t0, &cfg(None), items(9)).unwrap();
    drain(&mut m);
    m.abort(t0, AbortReason::ClientDisconnect);
    assert!(drain(&mut m).is_empty() && !m.is_finished());
    ev(&mut m, t0, 0, Err(StoreFault::Transport));
    let r = report(&ev(&mut m, t0, 1, loaded(3))).unwrap();
    assert_eq!(r.end, LoadEnd::Aborted(AbortReason::ClientDisconnect));
    assert_eq!(r.error_blocks(), blocks(&[0, 1, 2, 6, 7, 8]));
    assert_eq!(
        m.phase(),
        Phase::Failed(FailReason::Aborted(AbortReason::ClientDisconnect))
    );
}

#[test]
fn misuse_and_empty_loads() {
    let t0 = Instant::now();
    let mut m = LoadMachine::new(t0, &cfg(None), Vec::new()).unwrap();
    assert_eq!(report(&drain(&mut m)).unwrap().end, LoadEnd::Loaded);
    let c = StoreConfig {
        max_keys_per_request: 2,
        ..cfg(None)
    };
    assert!(LoadMachine::new(t0, &c, items(3)).is_err());
    let mut m = LoadMachine::new(t0, &cfg(None), items(3)).unwrap();
    drain(&mut m);
    let get = |batch, n| Event::GetDone {
        batch,
        answer: loaded(n),
    };
    assert!(m.handle_event(t0, get(0, 2)).is_err());
    assert!(m.handle_event(t0, get(3, 3)).is_err());
    assert!(drain(&mut m).is_empty());
    assert!(report(&ev(&mut m, t0, 0, loaded(3)))
        .unwrap()
        .error_blocks()
        .is_empty());
}

#[test]
fn a_load_plan_skips_the_blocks_the_engine_holds() {
    let ks = keyspace(
        LayoutKind::Hnd,
        8,
        1,
        1,
        vec![GroupSpec {
            block_tokens: 4,
            window_tokens: None,
        }],
    );
    let scope = ks.scope(None, &[]).unwrap();
    let (shard, _) = ks.shard_of(0, 0).unwrap();
    let hashes: Vec<BlockHash> = (0..4).map(BlockHash::from_u64).collect();
    let groups = vec![GroupBlocks {
        hashes: hashes.clone(),
        block_ids: (0..4).map(BlockId).collect(),
        value_bytes: 8,
    }];
    let lookup = Lookup::new(&ks, &scope, 16, &[hashes], 100).unwrap();
    let hit = lookup.resolve(&[true; 4]).unwrap();
    let plan = plan_load(&ks, &shard, &scope, &groups, &hit, 9).unwrap();
    assert_eq!(plan.iter().map(|i| i.index).collect::<Vec<_>>(), vec![2, 3]);
}

// ---- proptests ----

#[derive(Clone, Copy, Debug)]
enum Reply {
    Honest,
    NotFound,
    WrongSize,
    Failed,
    Fault,
}

#[derive(Clone, Debug)]
enum Step {
    Answer(usize, Reply),
    Advance(u64),
    Abort,
}

fn step() -> impl Strategy<Value = Step> {
    let reply = prop_oneof![
        8 => Just(Reply::Honest),
        1 => Just(Reply::NotFound),
        1 => Just(Reply::WrongSize),
        1 => Just(Reply::Failed),
        1 => Just(Reply::Fault),
    ];
    prop_oneof![
        8 => (any::<usize>(), reply).prop_map(|(i, r)| Step::Answer(i, r)),
        2 => (1u64..8).prop_map(Step::Advance),
        1 => Just(Step::Abort),
    ]
}

/// What the harness knows of an engine block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Block {
    Untouched,
    /// The whole value landed.
    Loaded,
    /// Partly written by a failed, broken or unanswered get.
    Torn,
}

struct Get {
    batch: u32,
    items: Vec<StoreItem>,
    posted: Instant,
}

struct Harness {
    m: LoadMachine,
    cfg: StoreConfig,
    now: Instant,
    gets: Vec<Get>,
    engine: BTreeMap<BlockId, Block>,
    asked: BTreeSet<ChunkKey>,
    report: Option<LoadReport>,
}

impl Harness {
    fn collect(&mut self) -> Result<(), TestCaseError> {
        while let Some(a) = self.m.poll_action() {
            prop_assert!(self.report.is_none(), "an action after the report: {:?}", a);
            match a {
                Action::Get {
                    batch,
                    items,
                    bytes,
                } => {
                    prop_assert!(items.len() <= self.cfg.max_keys_per_batch);
                    prop_assert_eq!(bytes, items.iter().map(|i| i.value_bytes).sum::<u64>());
                    for it in &items {
                        prop_assert!(
                            self.asked.insert(it.key.clone()),
                            "asked for {} twice",
                            it.key
                        );
                    }
                    self.gets.push(Get {
                        batch,
                        items,
                        posted: self.now,
                    });
                }
                Action::Finished { report } => {
                    // A get unanswered past its bound may have torn its blocks.
                    for g in self.gets.drain(..) {
                        prop_assert!(
                            self.now >= g.posted + self.cfg.op_bound,
                            "finished under a live get"
                        );
                        for it in g.items {
                            self.engine.insert(it.block, Block::Torn);
                        }
                    }
                    self.report = Some(report);
                }
            }
        }
        let live: Vec<&Get> = self
            .gets
            .iter()
            .filter(|g| self.now < g.posted + self.cfg.op_bound)
            .collect();
        prop_assert!(live.len() <= self.cfg.max_batches_in_flight);
        if let Some(budget) = self.cfg.staging_budget_bytes {
            let bytes: u64 = live
                .iter()
                .flat_map(|g| &g.items)
                .map(|i| i.value_bytes)
                .sum();
            prop_assert!(bytes <= budget, "{} staging bytes in flight", bytes);
        }
        prop_assert_eq!(self.m.phase().is_terminal(), self.report.is_some());
        Ok(())
    }

    fn answer(&mut self, i: usize, reply: Reply) -> Result<(), TestCaseError> {
        if self.gets.is_empty() {
            return Ok(());
        }
        let g = self.gets.remove(i % self.gets.len());
        // Past its bound a get touches nothing more (the backend's
        // contract): what it did before, the harness counts as torn.
        let expired = self.now >= g.posted + self.cfg.op_bound;
        let reply = if expired { Reply::Fault } else { reply };
        let answer = match reply {
            Reply::Fault => {
                for it in &g.items {
                    self.engine.insert(it.block, Block::Torn);
                }
                Err(StoreFault::Transport)
            }
            _ => Ok((g.items.iter().enumerate())
                .map(|(j, it)| {
                    let (r, b) = match reply {
                        Reply::NotFound if j == 0 => (GetResult::NotFound, Block::Untouched),
                        Reply::WrongSize if j == 0 => {
                            (GetResult::WrongSize { got_bytes: 1 }, Block::Untouched)
                        }
                        Reply::Failed if j == 0 => (GetResult::Failed, Block::Torn),
                        _ => (GetResult::Loaded, Block::Loaded),
                    };
                    self.engine.insert(it.block, b);
                    r
                })
                .collect()),
        };
        self.m
            .handle_event(
                self.now,
                Event::GetDone {
                    batch: g.batch,
                    answer,
                },
            )
            .map_err(|e| TestCaseError::fail(format!("refused: {e}")))?;
        self.collect()
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Random answers, faults, time and aborts: one report, never under a
    /// live get, within the staging budget; its load errors are exactly the
    /// blocks not loaded, torn ones included.
    #[test]
    fn load_errors_name_exactly_the_blocks_not_loaded(
        n in 0u32..12,
        budget in proptest::option::of(prop::sample::select(vec![2500u64, 3000, 5000, 9000])),
        steps in proptest::collection::vec(step(), 0..40),
    ) {
        let t0 = Instant::now();
        let its = items(n);
        let engine = its.iter().map(|i| (i.block, Block::Untouched)).collect();
        let m = LoadMachine::new(t0, &cfg(budget), its.clone()).unwrap();
        let mut h = Harness { m, cfg: cfg(budget), now: t0, gets: Vec::new(), engine, asked: BTreeSet::new(), report: None };
        h.collect()?;
        for s in steps {
            match s {
                Step::Answer(i, r) => h.answer(i, r)?,
                Step::Advance(d) => {
                    h.now += secs(d);
                    h.m.handle_timeout(h.now);
                    h.collect()?;
                }
                Step::Abort => {
                    h.m.abort(h.now, AbortReason::Engine);
                    h.collect()?;
                }
            }
        }
        for _ in 0..3 {
            h.now += secs(61);
            h.m.handle_timeout(h.now);
            h.collect()?;
        }
        let report = h.report.take().expect("every load ends");
        let not_loaded: Vec<BlockId> = (h.engine.iter())
            .filter(|(_, b)| **b != Block::Loaded)
            .map(|(id, _)| *id)
            .collect();
        prop_assert_eq!(report.error_blocks(), not_loaded);
        // An aborted load whose gets all landed has no error; a loaded one never has.
        prop_assert!(report.end != LoadEnd::Loaded || report.error_blocks().is_empty());
    }

    /// Every rank of random TP/PP shapes saves a request through its save
    /// machine; then every rank of a fresh engine looks it up and loads
    /// it into other blocks: each block holds exactly the bytes its rank
    /// had (a replica's value is the rank's own bytes).
    #[test]
    fn every_saved_block_loads_back_identical(
        layout in prop::sample::select(vec![LayoutKind::Hnd, LayoutKind::Nhd, LayoutKind::Mla]),
        heads in prop::sample::select(vec![1u32, 2, 4]),
        tp in prop::sample::select(vec![1u32, 2, 4]),
        pp in 1u32..3,
        sizes in proptest::collection::vec((prop::sample::select(vec![2u32, 4]), proptest::option::of(1u32..12)), 1..3),
        token_len in 0u32..40,
    ) {
        let groups: Vec<GroupSpec> = sizes.iter().map(|&(b, w)| GroupSpec { block_tokens: b, window_tokens: w }).collect();
        let ks = keyspace(layout, heads, tp, pp, groups.clone());
        let scope = ks.scope(None, &["salt"]).unwrap();
        let hashes: Vec<Vec<BlockHash>> = (0..groups.len())
            .map(|g| (0..token_len / groups[g].block_tokens).map(|i| BlockHash::from_u64((g as u64) << 32 | u64::from(i))).collect())
            .collect();
        // What rank (tp, pp) holds in block `i` of group `g`: its shard's bytes.
        let content = |r: u32, p: u32, g: usize, i: usize| -> Vec<u8> {
            let (shard, _) = ks.shard_of(r, p).unwrap();
            format!("{shard:?}/{g}/{:?}", hashes[g][i]).into_bytes()
        };
        let mut store: HashMap<ChunkKey, Vec<u8>> = HashMap::new();
        let t0 = Instant::now();
        let c = cfg(None);
        let mut pressure = Pressure::new(4);
        for p in 0..pp {
            for r in 0..tp {
                let (shard, replica) = ks.shard_of(r, p).unwrap();
                let gb = engine_groups(&hashes, 0);
                let plan = plan_save(&ks, &shard, &replica, &scope, token_len, &gb).unwrap();
                let mut m = SaveMachine::new(t0, &c, TransferId(1), plan, &mut pressure).unwrap();
                let mut queue: Vec<save::Action> = std::iter::from_fn(|| m.poll_action()).collect();
                while let Some(a) = queue.pop() {
                    let e = match a {
                        save::Action::Exists { keys } => save::Event::ExistsDone { answer: Ok(keys.iter().map(|k| store.contains_key(k)).collect()) },
                        save::Action::Put { batch, items } => {
                            for it in &items {
                                let v = content(r, p, it.group as usize, it.index as usize);
                                prop_assert!(store.insert(it.key.clone(), v).is_none());
                            }
                            save::Event::PutDone { batch, answer: Ok(vec![PutResult::Stored; items.len()]) }
                        }
                        save::Action::Release { report } => {
                            prop_assert!(report.is_complete());
                            continue;
                        }
                    };
                    m.handle_event(t0, e).unwrap();
                    queue.extend(std::iter::from_fn(|| m.poll_action()));
                }
            }
        }
        let lookup = Lookup::new(&ks, &scope, token_len, &hashes, 1 << 20).unwrap();
        let exists: Vec<bool> = lookup.keys().iter().map(|k| store.contains_key(k)).collect();
        let hit = lookup.resolve(&exists).unwrap();
        for p in 0..pp {
            for r in 0..tp {
                let (shard, _) = ks.shard_of(r, p).unwrap();
                // The fresh engine's blocks: 1000 + position.
                let gb = engine_groups(&hashes, 1000);
                let plan = plan_load(&ks, &shard, &scope, &gb, &hit, 0).unwrap();
                let mut blocks: HashMap<BlockId, Vec<u8>> = HashMap::new();
                let mut m = LoadMachine::new(t0, &c, plan).unwrap();
                let mut queue: Vec<Action> = drain(&mut m);
                let mut finished = None;
                while let Some(a) = queue.pop() {
                    match a {
                        Action::Get { batch, items, .. } => {
                            for it in &items {
                                blocks.insert(it.block, store[&it.key].clone());
                            }
                            m.handle_event(t0, Event::GetDone { batch, answer: loaded(items.len()) }).unwrap();
                            queue.extend(drain(&mut m));
                        }
                        Action::Finished { report } => finished = Some(report),
                    }
                }
                let report = finished.expect("finished");
                prop_assert!(report.error_blocks().is_empty());
                for (g, range) in hit.load.iter().enumerate() {
                    for i in range.clone() {
                        let got = &blocks[&BlockId(1000 + (g as u32) * 100 + i)];
                        prop_assert_eq!(got, &content(r, p, g, i as usize));
                    }
                }
            }
        }
    }
}

/// The engine's view of a request: block `i` of group `g` in block
/// `base + 100 g + i`.
fn engine_groups(hashes: &[Vec<BlockHash>], base: u32) -> Vec<GroupBlocks> {
    (hashes.iter().enumerate())
        .map(|(g, h)| GroupBlocks {
            hashes: h.clone(),
            block_ids: (0..h.len() as u32)
                .map(|i| BlockId(base + 100 * g as u32 + i))
                .collect(),
            value_bytes: 64,
        })
        .collect()
}
