//! The scheduler side of store offload against real memory: a
//! `StoreScheduler` plans from lookups a `LookupClient` gets from the
//! rank-0 worker's `LookupServer`, its metas travel as bytes, and the
//! worker's `StoreConnector` over the in-process store carries them out.
//! Every byte a load writes is checked.

use std::time::{Duration, Instant};

use kvferry_machines::internal::common::BlockId;
use kvferry_machines::internal::store::events::Medium;
use kvferry_machines::internal::store::{BlockHash, GroupSpec, StoreConfig};
use kvferry_machines::{RankLayout, Region, Stage};
use kvferry_store::internal::scheduler::{Scheduled, StoreReq};
use kvferry_store::{
    ConnectorConfig, ConnectorLimits, InprocConfig, InprocStore, LookupClient, LookupServer,
    StoreConnector, StoreMeta, StoreScheduler, StoreSchedulerConfig,
};
use kvferry_testkit::model::{self, ModelSpecExt};

const BT: u32 = 16;
const HEADS: u32 = 2;
const HEAD_BYTES: u64 = 8;
const KV_BLOCK: u64 = HEADS as u64 * BT as u64 * HEAD_BYTES;
/// Bytes after each block's KV that no store call may touch.
const SLACK: u64 = 16;
const NUM_BLOCKS: u32 = 32;
const SENTINEL: u8 = 0xEE;

/// One engine's KV cache: one region of `NUM_BLOCKS` blocks.
struct Engine {
    kv: Vec<u8>,
}

impl Engine {
    fn new() -> Engine {
        Engine {
            kv: vec![SENTINEL; (u64::from(NUM_BLOCKS) * (KV_BLOCK + SLACK)) as usize],
        }
    }

    fn layout(&self) -> RankLayout {
        RankLayout {
            tp_size: 1,
            tp_rank: 0,
            num_blocks: u64::from(NUM_BLOCKS),
            regions: vec![Region {
                base: self.kv.as_ptr() as u64,
                block_len: KV_BLOCK + SLACK,
                kv_block_len: KV_BLOCK,
            }],
            stage: Stage::SINGLE,
            pools: Vec::new(),
        }
    }

    fn block(&mut self, b: u32) -> &mut [u8] {
        let start = (u64::from(b) * (KV_BLOCK + SLACK)) as usize;
        &mut self.kv[start..start + (KV_BLOCK + SLACK) as usize]
    }

    /// The forward pass: block `b` gets the bytes of hash `h`.
    fn compute(&mut self, b: u32, h: u64) {
        for (i, x) in self.block(b)[..KV_BLOCK as usize].iter_mut().enumerate() {
            *x = pattern(h, i);
        }
    }

    /// Block `b` holds hash `h`'s bytes, its slack untouched.
    fn holds(&mut self, b: u32, h: u64) -> bool {
        let block = self.block(b);
        let (kv, slack) = block.split_at(KV_BLOCK as usize);
        kv.iter().enumerate().all(|(i, x)| *x == pattern(h, i))
            && slack.iter().all(|x| *x == SENTINEL)
    }

    fn untouched(&mut self, b: u32) -> bool {
        self.block(b).iter().all(|x| *x == SENTINEL)
    }
}

fn pattern(h: u64, i: usize) -> u8 {
    let x = h.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(i as u64);
    (x ^ (x >> 29) ^ (x >> 47)) as u8
}

fn config() -> ConnectorConfig {
    ConnectorConfig {
        store: StoreConfig::default(),
        keyspace: model::keyspace(
            "test/model",
            model::small()
                .with_heads(HEADS)
                .with_block_tokens(BT)
                .with_head_bytes(HEAD_BYTES),
        ),
        medium: Medium::Cpu,
        limits: ConnectorLimits::default(),
    }
}

fn group() -> GroupSpec {
    GroupSpec {
        block_tokens: BT,
        window_tokens: None,
    }
}

/// The worker's side of one step: the meta arrives as bytes, loads
/// start, the forward pass computes `computed` (block, hash) pairs, the
/// saves start and are waited for (vLLM's `wait_for_save`), then what
/// finished is collected (`get_finished`): `(saved, loaded)` requests.
fn worker_step(
    c: &mut StoreConnector,
    engine: &mut Engine,
    bytes: &[u8],
    computed: &[(u32, u64)],
) -> (usize, usize) {
    let meta = StoreMeta::decode(bytes).unwrap();
    for load in &meta.loads {
        c.start_load_kv(Instant::now(), load.load_meta()).unwrap();
    }
    c.wait_for_load();
    for &(b, h) in computed {
        engine.compute(b, h);
    }
    for save in &meta.saves {
        c.start_save(Instant::now(), save.save_meta()).unwrap();
    }
    c.wait_for_save();
    let (saved, loaded) = c.get_finished();
    (saved.len(), loaded.len())
}

fn hashes(h: &[u64]) -> Vec<Vec<BlockHash>> {
    vec![h.iter().map(|&h| BlockHash::from_u64(h)).collect()]
}

fn ids(b: std::ops::Range<u32>) -> Vec<Vec<BlockId>> {
    vec![b.map(BlockId).collect()]
}

#[test]
fn a_chunked_prefill_saved_by_one_engine_is_looked_up_over_zmq_and_loaded_by_another() {
    let store = InprocStore::new(InprocConfig::default()).unwrap();
    let server =
        LookupServer::spawn_for_store("tcp://127.0.0.1:0", config(), store.clone()).unwrap();
    let mut client = LookupClient::connect(server.endpoint(), Duration::from_secs(30)).unwrap();
    let sched_cfg = StoreSchedulerConfig::new(vec![group()]);

    // Engine A: a 100-token prompt, 7 blocks (the last one partial),
    // prefilled in chunks of 40 tokens.
    let mut a = Engine::new();
    let mut ca = StoreConnector::new(config(), store.clone()).unwrap();
    // SAFETY: `a` outlives `ca`, and no block is touched while a save or
    // load holds it (each step waits for them).
    unsafe { ca.register_kv_caches(a.layout()).unwrap() };
    let prompt_a: Vec<u64> = (100..107).collect();
    let h = hashes(&prompt_a);
    let req = StoreReq {
        request_id: "a",
        prompt_len_tokens: 100,
        block_hashes: &h,
        lora: None,
        extra_keys: &[],
    };
    let mut sa = StoreScheduler::new(sched_cfg.clone()).unwrap();
    assert_eq!(
        sa.get_num_new_matched_tokens(&req, 0, &mut client).unwrap(),
        (0, false)
    );
    sa.update_state_after_alloc("a", &ids(0..3), 0).unwrap();
    let chunks: [(u32, std::ops::Range<u32>); 3] = [(40, 0..0), (40, 3..5), (20, 5..7)];
    let mut done_blocks = 0u32;
    let mut saved = 0;
    for (tokens, new) in chunks {
        let new = ids(new);
        let step = [Scheduled {
            request_id: "a",
            num_scheduled_tokens: tokens,
            new_block_ids: &new,
        }];
        let meta = sa.build_connector_meta(&step).unwrap();
        let upto = ((done_blocks * BT + tokens).div_ceil(BT)).min(7);
        let computed: Vec<(u32, u64)> = (done_blocks..upto)
            .map(|b| (b, prompt_a[b as usize]))
            .collect();
        done_blocks = (done_blocks * BT + tokens) / BT;
        saved += worker_step(&mut ca, &mut a, &meta.encode(), &computed).0;
    }
    // 2, then 5, then 6 whole blocks saved: each block put once.
    assert_eq!(sa.stats().saves_planned, 3);
    assert_eq!(store.stats().put_keys, 6);
    assert!(sa.request_finished("a", &ids(0..7)).unwrap());
    let meta = sa.build_connector_meta(&[]).unwrap();
    assert_eq!(meta.delayed_free[0].request_id, "a");
    assert_eq!(saved, 3);

    // Engine B: the first 4 blocks of A's prompt, then its own; 80 tokens.
    let mut b = Engine::new();
    let mut cb = StoreConnector::new(config(), store.clone()).unwrap();
    // SAFETY: as for `a`.
    unsafe { cb.register_kv_caches(b.layout()).unwrap() };
    let prompt_b: Vec<u64> = (100..104).chain([900]).collect();
    let h = hashes(&prompt_b);
    let req = StoreReq {
        request_id: "b",
        prompt_len_tokens: 80,
        block_hashes: &h,
        lora: None,
        extra_keys: &[],
    };
    let mut sb = StoreScheduler::new(sched_cfg).unwrap();
    // One block held locally (block 10, computed by B itself), three
    // found in the store.
    b.compute(10, 100);
    assert_eq!(
        sb.get_num_new_matched_tokens(&req, 16, &mut client)
            .unwrap(),
        (48, true)
    );
    sb.update_state_after_alloc("b", &ids(10..15), 48).unwrap();
    let meta = sb.build_connector_meta(&[]).unwrap();
    assert_eq!(meta.loads.len(), 1);
    assert_eq!(worker_step(&mut cb, &mut b, &meta.encode(), &[]), (0, 1));
    assert!(cb.block_ids_with_load_errors().is_empty());
    for (blk, h) in (10..14).zip(&prompt_b) {
        assert!(b.holds(blk, *h), "block {blk} does not hold hash {h}");
    }
    assert!(b.untouched(14), "a block past the hit was written");
    assert_eq!(cb.stats().loaded_keys, 3, "the local block was loaded too");

    // The load reported, the rest computed: only B's own block is put.
    sb.loads_finished(&["b"]);
    sb.update_state_after_alloc("b", &ids(10..15), 0).unwrap();
    let none = ids(0..0);
    let step = [Scheduled {
        request_id: "b",
        num_scheduled_tokens: 16,
        new_block_ids: &none,
    }];
    let meta = sb.build_connector_meta(&step).unwrap();
    assert_eq!(meta.saves[0].token_len, 80);
    assert_eq!(
        worker_step(&mut cb, &mut b, &meta.encode(), &[(14, 900)]),
        (1, 0)
    );
    assert_eq!(store.stats().put_keys, 7);

    // One round trip per lookup; the server's own connector answered.
    assert_eq!(client.stats().round_trips, 2);
    assert_eq!(server.stats().answered, 2);
}

#[test]
fn a_lookup_served_over_ipc_matches_the_direct_lookup() {
    let store = InprocStore::new(InprocConfig::default()).unwrap();
    let mut e = Engine::new();
    let mut c = StoreConnector::new(config(), store.clone()).unwrap();
    // SAFETY: `e` outlives `c`; the save is waited for.
    unsafe { c.register_kv_caches(e.layout()).unwrap() };
    let hs: Vec<u64> = (1..=5).collect();
    for (blk, h) in hs.iter().enumerate() {
        e.compute(blk as u32, *h);
    }
    let h = hashes(&hs);
    let mut s = StoreScheduler::new(StoreSchedulerConfig::new(vec![group()])).unwrap();
    let req = StoreReq {
        request_id: "r",
        prompt_len_tokens: 80,
        block_hashes: &h,
        lora: None,
        extra_keys: &[],
    };
    s.get_num_new_matched_tokens(&req, 0, &mut c).unwrap();
    s.update_state_after_alloc("r", &ids(0..5), 0).unwrap();
    let none = ids(0..0);
    let step = [Scheduled {
        request_id: "r",
        num_scheduled_tokens: 80,
        new_block_ids: &none,
    }];
    let meta = s.build_connector_meta(&step).unwrap();
    worker_step(&mut c, &mut e, &meta.encode(), &[]);

    let path =
        std::env::temp_dir().join(format!("kvferry-store-sched-{}.sock", std::process::id()));
    let endpoint = format!("ipc://{}", path.display());
    let _server = LookupServer::spawn_for_store(&endpoint, config(), store.clone()).unwrap();
    let mut client = LookupClient::connect(&endpoint, Duration::from_secs(30)).unwrap();
    let h2 = hashes(&[1, 2, 3, 77, 78]);
    for (name, h, tokens) in [("x", &h, 64), ("y", &h2, 48)] {
        let q = StoreReq {
            request_id: name,
            prompt_len_tokens: 80,
            block_hashes: h,
            ..req
        };
        let mut direct = StoreScheduler::new(StoreSchedulerConfig::new(vec![group()])).unwrap();
        let mut remote = StoreScheduler::new(StoreSchedulerConfig::new(vec![group()])).unwrap();
        let want = direct.get_num_new_matched_tokens(&q, 0, &mut c).unwrap();
        let got = remote
            .get_num_new_matched_tokens(&q, 0, &mut client)
            .unwrap();
        assert_eq!(want, (tokens, true), "{name}");
        assert_eq!(got, want, "{name}");
    }
    assert_eq!(client.stats().round_trips, 2);
    // The server's connector takes no removed keys and stores nothing.
    assert_eq!(store.stats().put_keys, 5);
}

/// An engine worker's settings: the named in-process store `store`, its
/// lookups at `endpoint`.
fn worker_settings(store: &str, endpoint: &str) -> kvferry_store::StoreSettings {
    let json = format!(
        r#"{{"store": "{store}", "lookup_endpoint": "{endpoint}", "model_name": "test/model",
            "dtype": "bf16", "groups": [{{"block_tokens": {BT}}}]}}"#
    );
    kvferry_store::StoreSettings::parse(&json).unwrap()
}

#[test]
fn an_engine_worker_saves_the_scheduled_blocks_and_serves_their_lookup() {
    use kvferry_store::{AnyStore, EngineWorker, WorkerError};
    let path = std::env::temp_dir().join(format!("kvferry-worker-{}.sock", std::process::id()));
    let endpoint = format!("ipc://{}", path.display());
    let settings = worker_settings("inproc://engine-worker", &endpoint);
    let store = AnyStore::open(&settings.store).unwrap();
    let mut w = EngineWorker::new(settings, store);
    let model = config().keyspace.model;
    let mut e = Engine::new();
    let mut s = StoreScheduler::new(StoreSchedulerConfig::new(vec![group()])).unwrap();
    let empty = s.build_connector_meta(&[]).unwrap().encode();
    assert!(matches!(
        w.start_saves(&empty),
        Err(WorkerError::NotRegistered)
    ));
    // SAFETY: `e` outlives `w`; every save is waited for below.
    unsafe { w.register(model, e.layout()).unwrap() };
    assert!(matches!(
        unsafe { w.register(model, e.layout()) },
        Err(WorkerError::RegisteredTwice)
    ));
    assert!(matches!(
        w.start_loads(&[0xFF; 3]),
        Err(WorkerError::Meta(_))
    ));

    // The scheduler asks rank 0's lookup server, as `StoreSched` does.
    let mut lookups = LookupClient::connect(&endpoint, Duration::from_secs(30)).unwrap();
    let hs: Vec<u64> = (1..=5).collect();
    let h = hashes(&hs);
    let req = StoreReq {
        request_id: "r",
        prompt_len_tokens: 80,
        block_hashes: &h,
        lora: None,
        extra_keys: &[],
    };
    assert_eq!(
        s.get_num_new_matched_tokens(&req, 0, &mut lookups)
            .unwrap()
            .0,
        0
    );
    s.update_state_after_alloc("r", &ids(0..5), 0).unwrap();
    let none = ids(0..0);
    let step = [Scheduled {
        request_id: "r",
        num_scheduled_tokens: 80,
        new_block_ids: &none,
    }];
    let meta = s.build_connector_meta(&step).unwrap().encode();
    w.start_loads(&meta).unwrap();
    for (blk, h) in hs.iter().enumerate() {
        e.compute(blk as u32, *h);
    }
    w.start_saves(&meta).unwrap();
    let until = Instant::now() + Duration::from_secs(30);
    while !w.is_idle() {
        assert!(
            Instant::now() < until,
            "saves still running: {:?}",
            w.stats()
        );
        w.collect();
        std::thread::yield_now();
    }
    let stat = |w: &EngineWorker, name| w.stats().into_iter().find(|(n, _)| *n == name).unwrap().1;
    assert_eq!(stat(&w, "saved_keys"), 5);
    assert_eq!(w.take_results(), (vec![], vec![], vec![]));
    // A second engine's scheduler now finds the prefix there.
    let mut other = StoreScheduler::new(StoreSchedulerConfig::new(vec![group()])).unwrap();
    let again = StoreReq {
        request_id: "r2",
        ..req
    };
    assert_eq!(
        other
            .get_num_new_matched_tokens(&again, 0, &mut lookups)
            .unwrap()
            .0,
        64
    );
    drop(w.close_lookups());
    assert!(!path.exists(), "the lookup socket stays behind");
}
