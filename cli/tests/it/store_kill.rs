//! `kvferry store serve` killed with SIGKILL while an engine loads from it
//! and while it saves to it: every request ends by its deadline, a block
//! is either loaded with exactly its bytes or named among the load errors
//! (and then untouched), and saves resume once a server is back. The
//! store demo outlives a store server or a Redis killed mid-run.

use std::io::BufReader;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::stores::{self, Redis, StoreServe};
use kvferry::machines::internal::common::{BlockId, TransferId};
use kvferry::machines::internal::store::events::Medium;
use kvferry::machines::internal::store::{BlockHash, StoreConfig};
use kvferry::machines::{RankLayout, Region, Stage};
use kvferry::transport::SharedMem;
use kvferry_store::{
    ConnectorConfig, ConnectorLimits, RemoteConfig, RemoteStore, StoreConnector, StoreLoadMeta,
    StoreRequest, StoreSaveMeta,
};
use kvferry_testkit::model::{self, ModelSpecExt};

const BLOCK_TOKENS: u32 = 16;
const HEADS: u32 = 8;
const HEAD_BYTES: u64 = 256;
const KV_BLOCK: u64 = HEADS as u64 * BLOCK_TOKENS as u64 * HEAD_BYTES;
const REGIONS: usize = 2;
const REQUESTS: u32 = 48;
const BLOCKS_PER_REQUEST: u32 = 8;
const NUM_BLOCKS: u64 = (REQUESTS * BLOCKS_PER_REQUEST) as u64;
const SENTINEL: u8 = 0xEE;
/// Bound on one store call, and so on how long a dead server is waited for.
const OP_BOUND: Duration = Duration::from_secs(3);

/// Engine memory: private, so the server moves bytes over tcp, or a
/// sealed `memfd`, so the server (on this host) copies straight into it.
enum Mem {
    Private(Vec<u8>),
    Shared(SharedMem),
}

impl std::ops::Deref for Mem {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Mem::Private(v) => v,
            // SAFETY: the test reads and writes blocks only while no save
            // or load holds them.
            Mem::Shared(m) => unsafe { std::slice::from_raw_parts(m.as_ptr(), m.len()) },
        }
    }
}

impl std::ops::DerefMut for Mem {
    fn deref_mut(&mut self) -> &mut [u8] {
        match self {
            Mem::Private(v) => v,
            // SAFETY: as for `deref`.
            Mem::Shared(m) => unsafe { std::slice::from_raw_parts_mut(m.as_ptr(), m.len()) },
        }
    }
}

struct Engine {
    regions: Vec<Mem>,
}

impl Engine {
    fn new(shared: bool) -> Engine {
        let len = (NUM_BLOCKS * KV_BLOCK) as usize;
        let mem = || {
            let mut m = if shared {
                Mem::Shared(SharedMem::new("kill-engine", len).unwrap())
            } else {
                Mem::Private(vec![0; len])
            };
            m.fill(SENTINEL);
            m
        };
        Engine {
            regions: (0..REGIONS).map(|_| mem()).collect(),
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
                    block_len: KV_BLOCK,
                    kv_block_len: KV_BLOCK,
                })
                .collect(),
            stage: Stage::SINGLE,
            pools: Vec::new(),
        }
    }

    fn block(&self, r: usize, b: u32) -> &[u8] {
        let s = (u64::from(b) * KV_BLOCK) as usize;
        &self.regions[r][s..s + KV_BLOCK as usize]
    }

    fn fill(&mut self, b: u32) {
        for r in 0..REGIONS {
            let s = (u64::from(b) * KV_BLOCK) as usize;
            for (i, x) in self.regions[r][s..s + KV_BLOCK as usize]
                .iter_mut()
                .enumerate()
            {
                *x = pattern(b, r, i);
            }
        }
    }

    fn holds_own(&self, b: u32) -> bool {
        (0..REGIONS)
            .all(|r| (self.block(r, b).iter().enumerate()).all(|(i, x)| *x == pattern(b, r, i)))
    }

    fn untouched(&self, b: u32) -> bool {
        (0..REGIONS).all(|r| self.block(r, b).iter().all(|x| *x == SENTINEL))
    }
}

/// Block `b`'s bytes: its hash is `b` itself, so a block holds its own.
fn pattern(b: u32, region: usize, i: usize) -> u8 {
    let x = u64::from(b).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ ((region as u64) << 40 | i as u64);
    (x ^ (x >> 31)) as u8
}

fn connector(server: &str, engine: &Engine) -> StoreConnector {
    let cfg = ConnectorConfig {
        store: StoreConfig {
            max_keys_per_batch: 4,
            op_bound: OP_BOUND,
            request_timeout: Duration::from_secs(20),
            ..StoreConfig::default()
        },
        keyspace: model::keyspace(
            "kill/model",
            model::small()
                .with_heads(HEADS)
                .with_block_tokens(BLOCK_TOKENS)
                .with_head_bytes(HEAD_BYTES),
        ),
        medium: Medium::Cpu,
        limits: ConnectorLimits::default(),
    };
    let remote = RemoteStore::connect(RemoteConfig::from_url(server)).unwrap();
    let mut c = StoreConnector::new(cfg, remote).unwrap();
    // SAFETY: the engine outlives the connector in each test and touches
    // no block while a save or load holds it.
    unsafe { c.register_kv_caches(engine.layout()).unwrap() };
    c
}

fn blocks(r: u32) -> Vec<u32> {
    (r * BLOCKS_PER_REQUEST..(r + 1) * BLOCKS_PER_REQUEST).collect()
}

fn request(r: u32, offset: u64) -> StoreRequest {
    let ids = blocks(r);
    StoreRequest {
        id: TransferId(u64::from(r) + offset),
        block_hashes: vec![ids.iter().map(|&b| BlockHash::from_u64(b.into())).collect()],
        block_ids: vec![ids.into_iter().map(BlockId).collect()],
        lora: None,
        extra_keys: Vec::new(),
    }
}

fn save_meta(r: u32, offset: u64) -> StoreSaveMeta {
    StoreSaveMeta {
        request: request(r, offset),
        token_len: BLOCKS_PER_REQUEST * BLOCK_TOKENS,
        token_ids: None,
    }
}

/// What `get_finished` answers: the saved, then the loaded.
type Finished = (Vec<TransferId>, Vec<TransferId>);

/// Drives `c` until `want` requests are finished (saved or loaded, as
/// `pick` chooses), calling `on_first` once the first one is; returns them
/// and the time the last one took after `on_first`.
fn drive(
    c: &mut StoreConnector,
    want: usize,
    pick: fn(Finished) -> Vec<TransferId>,
    mut on_first: impl FnMut(),
) -> (Vec<TransferId>, Duration) {
    let mut done = Vec::new();
    let mut fired_at = None;
    let give_up = Instant::now() + Duration::from_secs(60);
    while done.len() < want {
        assert!(
            Instant::now() < give_up,
            "requests hang: {} of {want} ended",
            done.len()
        );
        c.poll_wait(Instant::now() + Duration::from_millis(50));
        done.extend(pick(c.get_finished()));
        if !done.is_empty() && fired_at.is_none() {
            on_first();
            fired_at = Some(Instant::now());
        }
    }
    (done, fired_at.map_or(Duration::ZERO, |t| t.elapsed()))
}

#[test]
fn a_server_killed_during_loads_ends_every_load_naming_the_blocks_it_missed() {
    killed_during_loads(false);
}

/// The server copies straight into the engine's shared memory and dies
/// mid-copy: the engine's fence closes without waiting on it, and no
/// block is half-written or wrong.
#[test]
fn a_server_killed_while_copying_into_shared_memory_ends_every_load() {
    killed_during_loads(true);
}

fn killed_during_loads(shared: bool) {
    let mut server = StoreServe::start(256 << 20);
    let mut engine = Engine::new(shared);
    (0..NUM_BLOCKS as u32).for_each(|b| engine.fill(b));
    let mut c = connector(&server.url, &engine);
    for r in 0..REQUESTS {
        c.start_save(Instant::now(), save_meta(r, 0)).unwrap();
    }
    c.wait_for_save();
    let (saved, _) = c.get_finished();
    assert_eq!(saved.len(), REQUESTS as usize);
    assert_eq!(c.stats().saved_keys, NUM_BLOCKS);
    let shm = server.metric("kvferry_store_shm_batches_total");
    assert_eq!(shm > 0, shared, "{shm} batches through shared memory");
    for r in &mut engine.regions {
        r.fill(SENTINEL);
    }
    for r in 0..REQUESTS {
        let req = request(r, 1000);
        let scope = c.keyspace().scope(None, &[]).unwrap();
        let tokens = BLOCKS_PER_REQUEST * BLOCK_TOKENS;
        let hit = c.lookup_hit(&scope, tokens, &req.block_hashes).unwrap();
        assert_eq!(hit.tokens, tokens);
        let meta = StoreLoadMeta {
            request: req,
            hit,
            local_tokens: 0,
        };
        c.start_load_kv(Instant::now(), meta).unwrap();
    }
    // Killed once the first load finished: the rest are queued or moving.
    let (loaded, after_kill) = drive(&mut c, REQUESTS as usize, |f| f.1, || server.kill());
    assert_eq!(loaded.len(), REQUESTS as usize, "every load ends once");
    assert!(
        after_kill < OP_BOUND * 2,
        "ended {after_kill:?} after the kill"
    );
    let errors = c.block_ids_with_load_errors();
    for b in 0..NUM_BLOCKS as u32 {
        if errors.contains(&BlockId(b)) {
            assert!(
                engine.untouched(b) || engine.holds_own(b),
                "block {b} half-written"
            );
        } else {
            assert!(engine.holds_own(b), "block {b} reported loaded but wrong");
        }
    }
    let stats = c.stats();
    assert!(stats.loaded_keys > 0, "some loads landed before the kill");
    assert!(!errors.is_empty(), "the kill cut some loads");
    assert_eq!(stats.loaded_keys + errors.len() as u64, NUM_BLOCKS);
}

#[test]
fn a_server_killed_during_saves_ends_them_and_saves_resume_on_a_new_one() {
    killed_during_saves(false);
}

/// As above, the server reading the engine's shared memory.
#[test]
fn a_server_killed_while_copying_out_of_shared_memory_ends_every_save() {
    killed_during_saves(true);
}

fn killed_during_saves(shared: bool) {
    // Started again on the same port below.
    let port = kvferry_testkit::server_port();
    let mut server = StoreServe::start_on(&format!("127.0.0.1:{port}"), 256 << 20);
    let addr = server.addr().to_string();
    let mut engine = Engine::new(shared);
    (0..NUM_BLOCKS as u32).for_each(|b| engine.fill(b));
    let mut c = connector(&addr, &engine);
    for r in 0..REQUESTS {
        c.start_save(Instant::now(), save_meta(r, 0)).unwrap();
    }
    let (saved, after_kill) = drive(&mut c, REQUESTS as usize, |f| f.0, || server.kill());
    assert_eq!(saved.len(), REQUESTS as usize, "every save ends once");
    assert!(
        after_kill < OP_BOUND * 2,
        "ended {after_kill:?} after the kill"
    );
    let cut = c.stats().save_failed_keys;
    assert!(cut > 0, "the kill cut some saves");
    assert!(
        (0..NUM_BLOCKS as u32).all(|b| engine.holds_own(b)),
        "saves never write blocks"
    );
    // A new server on the same address: the same connector saves again.
    let again = StoreServe::start_on(&addr, 256 << 20);
    let before = c.stats().saved_keys;
    for r in 0..REQUESTS {
        c.start_save(Instant::now(), save_meta(r, 1000)).unwrap();
    }
    c.wait_for_save();
    let (saved, _) = c.get_finished();
    assert_eq!(saved.len(), REQUESTS as usize);
    let stored = c.stats().saved_keys - before;
    assert_eq!(stored, NUM_BLOCKS, "the new server took every block");
    let shm = again.metric("kvferry_store_shm_batches_total");
    assert_eq!(shm > 0, shared, "{shm} batches through shared memory");
}

/// Requests of a demo run whose store is killed mid-run.
const DEMO_REQUESTS: u64 = 4000;

/// Runs `kvferry demo --store URL` over 4 000 requests, SIGKILLs its store
/// with `kill` once `mid_run` holds, and checks the run: it ends within
/// 60 s of the kill, exit status 1, no byte wrong, and the failures counted
/// in the `*_errors` fields. Returns the report.
fn demo_outlives_its_store(
    url: &str,
    mid_run: impl Fn() -> bool,
    kill: impl FnOnce(),
) -> serde_json::Value {
    let mut demo = Command::new(env!("CARGO_BIN_EXE_kvferry"))
        .args(["demo", "--store", url, "--json"])
        .args(["--requests", &DEMO_REQUESTS.to_string()])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn kvferry demo");
    let pid = demo.id() as i32;
    let stdout = demo.stdout.take().expect("piped stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut out = String::new();
        let _ = std::io::Read::read_to_string(&mut BufReader::new(stdout), &mut out);
        let _ = tx.send((demo.wait().expect("the demo is reaped"), out));
    });
    let give_up = Instant::now() + Duration::from_secs(120);
    while !mid_run() {
        assert!(Instant::now() < give_up, "the run never got mid-way");
        assert!(rx.try_recv().is_err(), "the run ended before the kill");
        // Between looks at the store's own counters.
        std::thread::sleep(Duration::from_millis(20));
    }
    kill();
    let Ok((status, out)) = rx.recv_timeout(Duration::from_secs(60)) else {
        // SAFETY: our own child, not yet reaped (its reaper is waiting).
        unsafe { libc::kill(pid, libc::SIGKILL) };
        panic!("the demo did not end within 60 s of the kill");
    };
    let r: serde_json::Value = serde_json::from_str(&out).unwrap_or_default();
    assert_eq!(status.code(), Some(1), "errors counted: {out}");
    assert_eq!(r["requests"], DEMO_REQUESTS, "{r}");
    assert_eq!(r["verify_errors"], 0, "no wrong byte: {r}");
    assert!(r["loaded_blocks"].as_u64().unwrap() > 0, "{r}");
    let errors: u64 = ["save_errors", "lookup_errors", "load_errors"]
        .iter()
        .map(|f| r[f].as_u64().unwrap())
        .sum();
    assert!(errors > 0, "the kill failed calls, counted: {r}");
    r
}

#[test]
fn the_store_demo_outlives_a_store_server_killed_mid_run() {
    let mut server = StoreServe::start(256 << 20);
    let (url, metrics) = (server.url.clone(), server.metrics.clone());
    // 2 000 puts committed: about a fifth of the run's.
    let mid_run = || stores::metric(&metrics, "kvferry_store_commits_total") >= 2000;
    let r = demo_outlives_its_store(&url, mid_run, || server.kill());
    assert!(r["lookup_errors"].as_u64().unwrap() > 0, "{r}");
}

#[test]
fn the_store_demo_outlives_a_redis_killed_mid_run() {
    let mut redis = Redis::start(&["--maxmemory", "256mb", "--maxmemory-policy", "allkeys-lru"]);
    let (url, port) = (redis.url(), redis.port.clone());
    // 500 values stored: about a fifth of the run's that fit.
    let mid_run = || {
        stores::redis_cli(&port, "dbsize")
            .parse::<u64>()
            .unwrap_or(0)
            >= 500
    };
    demo_outlives_its_store(&url, mid_run, || redis.kill());
}
