//! Store offload on real memory: a synthetic engine's KV cache (heap
//! regions with slack after each block's KV bytes) saved to the in-process
//! store through the connector, dropped, looked up and loaded back.

use std::time::{Duration, Instant};

use crate::store_buffer::check_remove_prefix;
use kvferry_machines::internal::common::{AbortReason, BlockId, TransferId};
use kvferry_machines::internal::store::events::{KvEvent, Medium};
use kvferry_machines::internal::store::load::{LoadEnd, LoadKeyResult};
use kvferry_machines::internal::store::save::{SaveEnd, SaveKeyResult};
use kvferry_machines::internal::store::{BlockHash, ChunkKey, KeyspaceSpec, StoreConfig};
use kvferry_machines::{RankLayout, Region, Stage};
use kvferry_store::{
    Answers, CallError, ConnectorConfig, ConnectorLimits, GetItem, InprocConfig, InprocStore,
    PutItem, PutOutcome, StoreBackend, StoreConnector, StoreLoadMeta, StoreRequest, StoreSaveMeta,
};
use kvferry_testkit::model::{self, ModelSpecExt};

const BLOCK_TOKENS: u32 = 16;
const HEADS: u32 = 2;
const HEAD_BYTES: u64 = 8;
/// KV bytes of one block in one region.
const KV_BLOCK: u64 = HEADS as u64 * BLOCK_TOKENS as u64 * HEAD_BYTES;
/// Bytes after each block's KV that no store call may touch.
const SLACK: u64 = 24;
const REGIONS: usize = 2;
const NUM_BLOCKS: u64 = 64;
/// A value: the block's KV bytes in every region.
const VALUE: u64 = KV_BLOCK * REGIONS as u64;
/// What the slack and dropped blocks hold.
const SENTINEL: u8 = 0xEE;

/// The engine's KV cache: one heap buffer per region.
struct Engine {
    regions: Vec<Vec<u8>>,
}

impl Engine {
    fn new() -> Engine {
        let len = (NUM_BLOCKS * (KV_BLOCK + SLACK)) as usize;
        Engine {
            regions: (0..REGIONS).map(|_| vec![SENTINEL; len]).collect(),
        }
    }

    fn layout(&self) -> RankLayout {
        RankLayout {
            tp_size: 1,
            tp_rank: 0,
            num_blocks: NUM_BLOCKS,
            regions: (self.regions.iter())
                .map(|r| Region {
                    base: r.as_ptr() as u64,
                    block_len: KV_BLOCK + SLACK,
                    kv_block_len: KV_BLOCK,
                })
                .collect(),
            stage: Stage::SINGLE,
            pools: Vec::new(),
        }
    }

    fn kv(&self, region: usize, block: u32) -> &[u8] {
        let start = (u64::from(block) * (KV_BLOCK + SLACK)) as usize;
        &self.regions[region][start..start + KV_BLOCK as usize]
    }

    fn slack(&self, region: usize, block: u32) -> &[u8] {
        let start = (u64::from(block) * (KV_BLOCK + SLACK) + KV_BLOCK) as usize;
        &self.regions[region][start..start + SLACK as usize]
    }

    /// Writes the bytes a block of hash `hash` holds (same prefix, same
    /// bytes, as in a real engine).
    fn fill(&mut self, block: u32, hash: u64) {
        for r in 0..REGIONS {
            let start = (u64::from(block) * (KV_BLOCK + SLACK)) as usize;
            let kv = &mut self.regions[r][start..start + KV_BLOCK as usize];
            for (i, b) in kv.iter_mut().enumerate() {
                *b = pattern(hash, r, i);
            }
        }
    }

    /// The engine drops its copy: every byte back to the sentinel.
    fn drop_all(&mut self) {
        for r in &mut self.regions {
            r.fill(SENTINEL);
        }
    }

    /// True when `block` holds `hash`'s bytes and its slack is untouched.
    fn holds(&self, block: u32, hash: u64) -> bool {
        (0..REGIONS).all(|r| {
            let kv_ok =
                (self.kv(r, block).iter().enumerate()).all(|(i, b)| *b == pattern(hash, r, i));
            kv_ok && self.slack(r, block).iter().all(|b| *b == SENTINEL)
        })
    }

    /// True when `block` was not written at all.
    fn untouched(&self, block: u32) -> bool {
        (0..REGIONS).all(|r| {
            (self.kv(r, block).iter())
                .chain(self.slack(r, block))
                .all(|b| *b == SENTINEL)
        })
    }
}

fn pattern(hash: u64, region: usize, i: usize) -> u8 {
    let x = hash
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add((region as u64) << 32 | i as u64);
    (x ^ (x >> 29) ^ (x >> 47)) as u8
}

fn keyspace() -> KeyspaceSpec {
    let m = model::small()
        .with_heads(HEADS)
        .with_block_tokens(BLOCK_TOKENS)
        .with_head_bytes(HEAD_BYTES);
    model::keyspace("test/model", m)
}

fn config(store: StoreConfig) -> ConnectorConfig {
    ConnectorConfig {
        store,
        keyspace: keyspace(),
        medium: Medium::Cpu,
        limits: ConnectorLimits::default(),
    }
}

fn connector<B: StoreBackend>(store: StoreConfig, backend: B, engine: &Engine) -> StoreConnector {
    let mut c = StoreConnector::new(config(store), backend).unwrap();
    // SAFETY: the engine's buffers outlive the connector in every test,
    // and are not touched while a save or load holds their blocks.
    unsafe { c.register_kv_caches(engine.layout()).unwrap() };
    c
}

fn request(id: u64, hashes: &[u64], blocks: &[u32]) -> StoreRequest {
    StoreRequest {
        id: TransferId(id),
        block_hashes: vec![hashes.iter().map(|&h| BlockHash::from_u64(h)).collect()],
        block_ids: vec![blocks.iter().map(|&b| BlockId(b)).collect()],
        lora: None,
        extra_keys: Vec::new(),
    }
}

fn save(c: &mut StoreConnector, id: u64, hashes: &[u64], blocks: &[u32]) {
    let meta = StoreSaveMeta {
        request: request(id, hashes, blocks),
        token_len: hashes.len() as u32 * BLOCK_TOKENS,
        token_ids: None,
    };
    c.start_save(Instant::now(), meta).unwrap();
    c.wait_for_save();
}

fn hashes_of(c: &StoreConnector, hashes: &[u64]) -> Vec<Vec<BlockHash>> {
    let _ = c;
    vec![hashes.iter().map(|&h| BlockHash::from_u64(h)).collect()]
}

fn key(c: &StoreConnector, hash: u64) -> ChunkKey {
    let ks = c.keyspace();
    let shard = ks.shards()[0];
    let scope = ks.scope(None, &[]).unwrap();
    ks.key(&shard, &scope, 0, &BlockHash::from_u64(hash))
        .unwrap()
}

/// Requests `r` = 0..4 share blocks of hashes 100..104 and then have
/// three of their own, `r * 10 .. r * 10 + 3` (plus 1000).
fn workload() -> Vec<Vec<u64>> {
    (0..4u64)
        .map(|r| {
            (100..104)
                .chain((0..3).map(|i| 1000 + r * 10 + i))
                .collect()
        })
        .collect()
}

#[test]
fn prefixes_saved_with_dedup_load_back_byte_for_byte() {
    let mut engine = Engine::new();
    let store = InprocStore::new(InprocConfig::default()).unwrap();
    let mut c = connector(StoreConfig::default(), store.clone(), &engine);
    for (r, hashes) in workload().iter().enumerate() {
        let blocks: Vec<u32> = (0..hashes.len() as u32).map(|i| r as u32 * 8 + i).collect();
        for (b, h) in blocks.iter().zip(hashes) {
            engine.fill(*b, *h);
        }
        save(&mut c, r as u64, hashes, &blocks);
    }
    let (saved, loaded) = c.get_finished();
    assert_eq!(saved.len(), 4);
    assert!(loaded.is_empty());
    let stats = c.stats();
    // 4 shared + 4 × 3 own stored once; the shared ones skipped 3 times.
    assert_eq!(stats.saved_keys, 16);
    assert_eq!(stats.dedup_skipped, 12);
    assert_eq!(store.stats().stored, 16);
    assert_eq!(store.stats().put_keys, 16, "stored keys are not put again");
    let stored_events: usize = (c.get_kv_events().iter())
        .map(|e| match e {
            KvEvent::BlockStored(s) => s.block_hashes.len(),
            _ => 0,
        })
        .sum();
    assert_eq!(stored_events, 16);

    engine.drop_all();
    // Shared prefix, request 1's own blocks, then two blocks never saved.
    let mut ask: Vec<u64> = workload()[1].clone();
    ask.extend([7777, 7778]);
    let before = store.stats().exists_calls;
    let hit = {
        let scope = c.keyspace().scope(None, &[]).unwrap();
        c.lookup_hit(
            &scope,
            ask.len() as u32 * BLOCK_TOKENS,
            &hashes_of(&c, &ask),
        )
        .unwrap()
    };
    assert_eq!(hit.tokens, 7 * BLOCK_TOKENS, "a partial hit: 7 of 9 blocks");
    assert_eq!(store.stats().exists_calls, before + 1, "one round trip");
    assert_eq!(c.stats().lookup_calls, 1);
    // A gap stops the hit at the gap.
    let gap: Vec<u64> = vec![100, 101, 5555, 103];
    let tokens = c.lookup(4 * BLOCK_TOKENS, &hashes_of(&c, &gap)).unwrap();
    assert_eq!(tokens, 2 * BLOCK_TOKENS);

    let blocks: Vec<u32> = (40..49).collect();
    let meta = StoreLoadMeta {
        request: request(9, &ask, &blocks),
        hit,
        local_tokens: 0,
    };
    c.start_load_kv(Instant::now(), meta).unwrap();
    c.wait_for_load();
    let (_, loaded) = c.get_finished();
    assert_eq!(loaded, vec![TransferId(9)]);
    assert!(c.block_ids_with_load_errors().is_empty());
    for (b, h) in blocks.iter().zip(&ask).take(7) {
        assert!(engine.holds(*b, *h), "block {b} holds hash {h}'s bytes");
    }
    assert!(engine.untouched(47) && engine.untouched(48));
    assert_eq!(c.stats().loaded_keys, 7);
}

#[test]
fn a_store_smaller_than_the_workload_takes_pressure_until_a_save_succeeds() {
    let mut engine = Engine::new();
    let store = InprocStore::new(InprocConfig {
        capacity_bytes: 5 * VALUE,
        evict: false,
        ..InprocConfig::default()
    })
    .unwrap();
    let cfg = StoreConfig {
        max_keys_per_batch: 2,
        max_batches_in_flight: 1,
        ..StoreConfig::default()
    };
    let mut c = connector(cfg, store.clone(), &engine);
    let a: Vec<u64> = (1..=8).collect();
    let a_blocks: Vec<u32> = (0..8).collect();
    for (b, h) in a_blocks.iter().zip(&a) {
        engine.fill(*b, *h);
    }
    save(&mut c, 1, &a, &a_blocks);
    let (saved, _) = c.get_finished_reports();
    let report = &saved[0].1;
    assert_eq!(report.end, SaveEnd::StoreFull);
    assert_eq!(report.stored(), 5);
    // Batches stop at the full answer: 3 puts, the 4th never posted.
    assert_eq!(store.stats().put_calls, 3);
    assert_eq!(store.stats().full, 1);
    let not_attempted = (report.results.iter())
        .filter(|r| **r == SaveKeyResult::NotAttempted)
        .count();
    assert_eq!(not_attempted, 2);
    assert_eq!(c.stats().pressure.full_saves, 1);

    // The same request again: skipped, nothing asked of the store.
    let calls = store.stats();
    save(&mut c, 1, &a, &a_blocks);
    let (saved, _) = c.get_finished_reports();
    assert_eq!(saved[0].1.end, SaveEnd::Skipped);
    assert_eq!(c.stats().pressure.skipped_saves, 1);
    assert_eq!(store.stats().put_calls, calls.put_calls);
    assert_eq!(store.stats().exists_calls, calls.exists_calls);

    // Room is made; another request's save succeeds and clears it.
    let mut handle = store.clone();
    let gone: Vec<ChunkKey> = (1..=3).map(|h| key(&c, h)).collect();
    let far = Instant::now() + Duration::from_secs(60);
    assert!(handle.remove(&gone, far).unwrap().iter().all(Result::is_ok));
    engine.fill(20, 50);
    save(&mut c, 2, &[50], &[20]);
    assert_eq!(c.stats().pressure.clears, 1);
    save(&mut c, 1, &a, &a_blocks);
    let (saved, _) = c.get_finished_reports();
    assert_eq!(saved.len(), 2);
    assert_ne!(saved[1].1.end, SaveEnd::Skipped, "admitted again");
    let stats = c.stats();
    assert_eq!((stats.calls_in_flight, stats.saves_running), (0, 0));
}

#[test]
fn a_value_of_the_wrong_length_is_a_load_error_for_its_block_only() {
    let mut engine = Engine::new();
    let store = InprocStore::new(InprocConfig::default()).unwrap();
    let mut c = connector(StoreConfig::default(), store.clone(), &engine);
    let hashes: Vec<u64> = (1..=4).collect();
    let blocks: Vec<u32> = (0..4).collect();
    for (b, h) in blocks.iter().zip(&hashes) {
        engine.fill(*b, *h);
    }
    save(&mut c, 1, &hashes, &blocks);
    // Block 1's value is longer than a block, block 2's shorter.
    let mut handle = store.clone();
    let far = Instant::now() + Duration::from_secs(60);
    let bad = [key(&c, 2), key(&c, 3)];
    assert!(handle.remove(&bad, far).unwrap().iter().all(Result::is_ok));
    store
        .insert(bad[0].clone(), &vec![0x11; 2 * VALUE as usize])
        .unwrap();
    store
        .insert(bad[1].clone(), &vec![0x22; VALUE as usize - 1])
        .unwrap();
    engine.drop_all();

    let hit = {
        let scope = c.keyspace().scope(None, &[]).unwrap();
        c.lookup_hit(&scope, 4 * BLOCK_TOKENS, &hashes_of(&c, &hashes))
            .unwrap()
    };
    assert_eq!(hit.tokens, 4 * BLOCK_TOKENS);
    let into: Vec<u32> = (10..14).collect();
    let meta = StoreLoadMeta {
        request: request(2, &hashes, &into),
        hit,
        local_tokens: 0,
    };
    c.start_load_kv(Instant::now(), meta).unwrap();
    c.wait_for_load();
    let (_, loaded) = c.get_finished_reports();
    let report = &loaded[0].1;
    assert_eq!(report.end, LoadEnd::KeyFailed);
    assert_eq!(
        report.results[1],
        LoadKeyResult::WrongSize {
            got_bytes: 2 * VALUE
        }
    );
    assert_eq!(
        c.block_ids_with_load_errors(),
        vec![BlockId(11), BlockId(12)]
    );
    assert!(engine.holds(10, 1) && engine.holds(13, 4));
    assert!(
        engine.untouched(11) && engine.untouched(12),
        "nothing written"
    );
    assert!((14..NUM_BLOCKS as u32).all(|b| engine.untouched(b)));
}

#[test]
fn a_staging_budget_below_one_value_fails_the_load_with_its_blocks() {
    let mut engine = Engine::new();
    let store = InprocStore::new(InprocConfig::default()).unwrap();
    let cfg = StoreConfig {
        staging_budget_bytes: Some(VALUE - 1),
        ..StoreConfig::default()
    };
    let mut c = connector(cfg, store.clone(), &engine);
    let hashes: Vec<u64> = (1..=3).collect();
    for (b, h) in (0..3).zip(&hashes) {
        engine.fill(b, *h);
    }
    save(&mut c, 1, &hashes, &[0, 1, 2]);
    engine.drop_all();
    let scope = c.keyspace().scope(None, &[]).unwrap();
    let hit = (c.lookup_hit(&scope, 3 * BLOCK_TOKENS, &hashes_of(&c, &hashes))).unwrap();
    let gets = store.stats().get_calls;
    let meta = StoreLoadMeta {
        request: request(2, &hashes, &[5, 6, 7]),
        hit,
        local_tokens: 0,
    };
    c.start_load_kv(Instant::now(), meta).unwrap();
    c.wait_for_load();
    let (_, loaded) = c.get_finished_reports();
    assert!(matches!(
        loaded[0].1.end,
        LoadEnd::ValueTooLarge { value_bytes, budget_bytes, .. }
            if value_bytes == VALUE && budget_bytes == VALUE - 1
    ));
    assert_eq!(
        c.block_ids_with_load_errors(),
        vec![BlockId(5), BlockId(6), BlockId(7)]
    );
    assert_eq!(store.stats().get_calls, gets, "no get posted");
    assert!((5..8).all(|b| engine.untouched(b)));
}

#[test]
fn lru_evictions_become_block_removed_events() {
    let mut engine = Engine::new();
    let store = InprocStore::new(InprocConfig {
        capacity_bytes: 3 * VALUE,
        ..InprocConfig::default()
    })
    .unwrap();
    let mut c = connector(StoreConfig::default(), store.clone(), &engine);
    let hashes: Vec<u64> = (1..=5).collect();
    for (b, h) in (0..5).zip(&hashes) {
        engine.fill(b, *h);
    }
    save(&mut c, 1, &hashes, &[0, 1, 2, 3, 4]);
    assert_eq!(store.stats().evictions, 2);
    let removed: Vec<BlockHash> = (c.get_kv_events().into_iter())
        .flat_map(|e| match e {
            KvEvent::BlockRemoved { block_hashes, .. } => block_hashes,
            _ => Vec::new(),
        })
        .collect();
    assert_eq!(
        removed,
        vec![BlockHash::from_u64(1), BlockHash::from_u64(2)]
    );
    assert_eq!(c.stats().removed_keys, 2);
}

/// An in-process store whose puts wait for the test's go, one per put.
struct GatedStore {
    inner: InprocStore,
    entered: flume::Sender<usize>,
    go: flume::Receiver<()>,
}

impl StoreBackend for GatedStore {
    fn name(&self) -> &'static str {
        "gated"
    }
    fn exists(&mut self, keys: &[ChunkKey], d: Instant) -> Result<Vec<bool>, CallError> {
        self.inner.exists(keys, d)
    }
    fn put(&mut self, items: &[PutItem], d: Instant) -> Answers<PutOutcome> {
        self.entered.send(items.len()).unwrap();
        self.go.recv().map_err(|_| CallError::Transport)?;
        self.inner.put(items, d)
    }
    fn get(&mut self, items: &[GetItem], d: Instant) -> Answers<()> {
        self.inner.get(items, d)
    }
    fn remove(&mut self, keys: &[ChunkKey], d: Instant) -> Answers<()> {
        self.inner.remove(keys, d)
    }
}

#[test]
fn an_abort_mid_save_releases_once_after_the_put_in_flight_lands() {
    let mut engine = Engine::new();
    let store = InprocStore::new(InprocConfig::default()).unwrap();
    let (entered_tx, entered) = flume::unbounded();
    let (go, go_rx) = flume::unbounded();
    let gated = GatedStore {
        inner: store.clone(),
        entered: entered_tx,
        go: go_rx,
    };
    let cfg = StoreConfig {
        max_keys_per_batch: 2,
        max_batches_in_flight: 1,
        ..StoreConfig::default()
    };
    let mut c = connector(cfg, gated, &engine);
    let hashes: Vec<u64> = (1..=6).collect();
    for (b, h) in (0..6).zip(&hashes) {
        engine.fill(b, *h);
    }
    let meta = StoreSaveMeta {
        request: request(1, &hashes, &[0, 1, 2, 3, 4, 5]),
        token_len: 6 * BLOCK_TOKENS,
        token_ids: None,
    };
    c.start_save(Instant::now(), meta).unwrap();
    // The existence answer comes in; the first put is posted and waits.
    c.poll_wait(Instant::now() + Duration::from_secs(60));
    assert_eq!(entered.recv().unwrap(), 2);
    c.abort(Instant::now(), TransferId(1), AbortReason::Engine);
    c.poll(Instant::now());
    assert!(c.get_finished().0.is_empty(), "not released: a put reads");
    go.send(()).unwrap();
    c.wait_for_save();
    let (saved, _) = c.get_finished_reports();
    assert_eq!(saved.len(), 1, "released once");
    let report = &saved[0].1;
    assert_eq!(report.end, SaveEnd::Aborted(AbortReason::Engine));
    assert_eq!(report.stored(), 2, "the put in flight landed");
    c.poll(Instant::now());
    assert_eq!(c.get_finished(), (vec![], vec![]));
    assert!(entered.try_recv().is_err(), "no put after the abort");
    assert_eq!(store.stats().put_calls, 1);
}

#[test]
fn calls_past_their_deadline_touch_no_memory_and_fail_their_requests() {
    let mut engine = Engine::new();
    let store = InprocStore::new(InprocConfig::default()).unwrap();
    let cfg = StoreConfig {
        op_bound: Duration::from_secs(1),
        ..StoreConfig::default()
    };
    let mut c = connector(cfg, store.clone(), &engine);
    let hashes: Vec<u64> = (1..=3).collect();
    for (b, h) in (0..3).zip(&hashes) {
        engine.fill(b, *h);
    }
    save(&mut c, 1, &hashes, &[0, 1, 2]);
    let _ = c.get_finished();
    engine.drop_all();
    let scope = c.keyspace().scope(None, &[]).unwrap();
    let hit = (c.lookup_hit(&scope, 3 * BLOCK_TOKENS, &hashes_of(&c, &hashes))).unwrap();
    let before = store.stats();
    // Posted "five seconds ago": every call is past its bound on arrival.
    let long_ago = Instant::now().checked_sub(Duration::from_secs(5)).unwrap();
    let meta = StoreLoadMeta {
        request: request(2, &hashes, &[5, 6, 7]),
        hit,
        local_tokens: 0,
    };
    c.start_load_kv(long_ago, meta).unwrap();
    let save_meta = StoreSaveMeta {
        request: request(3, &[9], &[9]),
        token_len: BLOCK_TOKENS,
        token_ids: None,
    };
    c.start_save(long_ago, save_meta).unwrap();
    c.wait_for_load();
    c.wait_for_save();
    let (saved, loaded) = c.get_finished_reports();
    assert!(matches!(
        saved[0].1.end,
        SaveEnd::Fault(kvferry_machines::internal::store::StoreFault::Timeout)
    ));
    assert!(matches!(
        loaded[0].1.end,
        LoadEnd::Fault(kvferry_machines::internal::store::StoreFault::Timeout)
    ));
    assert_eq!(
        c.block_ids_with_load_errors(),
        vec![BlockId(5), BlockId(6), BlockId(7)]
    );
    assert!((5..8).all(|b| engine.untouched(b)));
    let after = store.stats();
    assert_eq!(
        after.get_calls, before.get_calls,
        "the backend was not called"
    );
    assert_eq!(after.exists_calls, before.exists_calls);
}

#[test]
fn a_prefix_removes_its_keys_and_no_others() {
    let kv = crate::store_buffer::Buffer::new(4, 64, 0);
    check_remove_prefix(&mut InprocStore::new(InprocConfig::default()).unwrap(), &kv);
}

#[test]
fn opening_an_inproc_store_whose_room_cannot_be_had_is_an_open_error() {
    let too_big = InprocConfig {
        capacity_bytes: u64::MAX,
        ..InprocConfig::default()
    };
    let opened = kvferry_store::AnyStore::open_with("inproc", too_big);
    assert!(
        matches!(opened, Err(kvferry_store::OpenError::Inproc(_))),
        "{opened:?}"
    );
}
