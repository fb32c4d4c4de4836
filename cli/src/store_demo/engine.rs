//! A synthetic engine over a store: what `kvferry demo --store` runs.
//!
//! It is shaped like an engine: a fixed pool of KV blocks
//! (`concurrency × blocks per request`) and `concurrency` requests in
//! flight. Each request takes its blocks from the free list and computes
//! them (a pattern of its block hashes), saves them, and once the save has
//! released them drops its KV (the blocks are poisoned); it then looks its
//! prefix up again, loads the hit back, verifies it byte for byte and
//! returns its blocks. A request holds one request's worth of blocks, so
//! the pool never runs dry and memory is the pool plus the store's own
//! bound, whatever `requests` is.
//!
//! Requests share their leading blocks (dedup and concurrent writers of one
//! key are exercised). A block the lookup found but the store evicted
//! before the load is a miss, counted apart from errors; a store that
//! fails or dies fails the calls it is in, counted in the `*_errors`
//! fields, and the run goes on to its end.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kvferry::machines::store::events::Medium;
use kvferry::machines::store::load::{LoadEnd, LoadKeyResult, LoadReport};
use kvferry::machines::store::save::{SaveEnd, SaveKeyResult, SaveReport};
use kvferry::machines::store::{BlockHash, GroupSpec, KeyspaceSpec, RequestScope, StoreConfig};
use kvferry::machines::{BlockId, TransferId};
use kvferry::machines::{LayoutKind, ModelSpec, RankLayout, Region, Stage};
use kvferry::Latency;
use kvferry_store::{
    ConnectorConfig, ConnectorError, ConnectorLimits, StoreBackend, StoreConnector, StoreLoadMeta,
    StoreRequest, StoreSaveMeta,
};

use crate::figures::ms;

/// The synthetic workload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct StoreDemo {
    /// Requests saved, then loaded.
    pub requests: u32,
    /// Requests in flight at once; the pool holds this many requests'
    /// blocks.
    pub concurrency: u32,
    /// Leading blocks every request shares (dedup exercised).
    pub shared_blocks: u32,
    /// Blocks of each request after the shared ones.
    pub own_blocks: u32,
    /// Layers of the model (two regions each, K and V).
    pub layers: u32,
    /// KV heads of the model.
    pub kv_heads: u32,
    /// Tokens per block.
    pub block_tokens: u32,
    /// Bytes of one head of one token.
    pub head_bytes: u64,
    /// Bounds of the machines.
    pub store: StoreConfig,
}

impl Default for StoreDemo {
    fn default() -> Self {
        StoreDemo {
            requests: 1000,
            concurrency: 16,
            shared_blocks: 16,
            own_blocks: 8,
            layers: 4,
            kv_heads: 8,
            block_tokens: 16,
            head_bytes: 256,
            store: StoreConfig::default(),
        }
    }
}

/// How far a [`StoreDemo::run_observed`] is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct DemoProgress {
    /// Requests whose save ended.
    pub saved: u32,
    /// Requests looked up, loaded and verified.
    pub loaded: u32,
    /// Requests in all.
    pub of: u32,
}

/// What the demo found; field names as `kvferry demo --json` prints them.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub(crate) struct StoreDemoReport {
    /// Requests saved and loaded.
    pub requests: u32,
    /// Requests in flight at once.
    pub concurrency: u32,
    /// Bytes of the engine's KV pool.
    pub pool_bytes: u64,
    /// Blocks the saves stored.
    pub saved_blocks: u64,
    /// Blocks the saves found stored already.
    pub dedup_skipped: u64,
    /// Blocks of saves the store refused for want of room (full, or a
    /// value too large): store pressure, not an error.
    pub save_refused_blocks: u64,
    /// Blocks of saves that a failed or unanswered store call did not
    /// store.
    pub save_errors: u64,
    /// Lookups whose store call failed (the request then loads nothing).
    pub lookup_errors: u64,
    /// Tokens the lookups found, summed.
    pub lookup_hit_tokens: u64,
    /// Blocks the lookups did not find (evicted, or never stored).
    pub lookup_miss_blocks: u64,
    /// Blocks loaded.
    pub loaded_blocks: u64,
    /// Blocks the lookup found but the store evicted before the load.
    pub evicted_blocks: u64,
    /// Blocks a failed, unanswered or wrong-sized get did not load.
    pub load_errors: u64,
    /// Loaded blocks whose bytes differ from what was saved.
    pub verify_errors: u64,
    /// Wall time of the run, s.
    pub elapsed_s: f64,
    /// Stored bytes over the run's wall time, GB/s.
    pub put_gbps: f64,
    /// Loaded bytes over the run's wall time, GB/s.
    pub get_gbps: f64,
    /// Median lookup-and-load time of one request, ms.
    pub p50_ms: f64,
    /// 99th percentile of the same, ms.
    pub p99_ms: f64,
}

impl StoreDemoReport {
    /// True when a block was lost or wrong: any `*_errors` field non-zero.
    pub(crate) fn has_errors(&self) -> bool {
        self.save_errors + self.lookup_errors + self.load_errors + self.verify_errors > 0
    }
}

/// The engine's memory: one buffer per region, and the free list of its
/// blocks.
struct Memory {
    regions: Vec<Vec<u64>>,
    /// Words of one block in one region.
    block_words: usize,
    num_blocks: u64,
    free: Vec<u32>,
}

/// Poison written into a block before a load, so that a block the load
/// did not write never passes for one it wrote.
const POISON: u64 = 0xDEAD_BEEF_DEAD_BEEF;

impl Memory {
    fn new(regions: u32, block_words: usize, num_blocks: u32) -> Memory {
        let len = block_words * num_blocks as usize;
        Memory {
            regions: (0..regions).map(|_| vec![0u64; len]).collect(),
            block_words,
            num_blocks: u64::from(num_blocks),
            free: (0..num_blocks).rev().collect(),
        }
    }

    fn bytes(&self) -> u64 {
        (self.regions.len() * self.regions.first().map_or(0, Vec::len) * 8) as u64
    }

    fn layout(&self) -> RankLayout {
        let kv_block = (self.block_words * 8) as u64;
        RankLayout {
            tp_size: 1,
            tp_rank: 0,
            num_blocks: self.num_blocks,
            regions: (self.regions.iter())
                .map(|r| Region {
                    base: r.as_ptr() as u64,
                    block_len: kv_block,
                    kv_block_len: kv_block,
                })
                .collect(),
            stage: Stage::SINGLE,
            pools: Vec::new(),
        }
    }

    /// `n` blocks off the free list; the pool is sized so that it holds
    /// every request in flight.
    fn take(&mut self, n: u32) -> Vec<u32> {
        let at = self.free.len().checked_sub(n as usize);
        let at = at.expect("the pool holds `concurrency` requests' blocks");
        self.free.split_off(at)
    }

    fn give(&mut self, blocks: Vec<u32>) {
        self.free.extend(blocks);
    }

    fn words(&mut self, region: usize, block: u32) -> &mut [u64] {
        let start = block as usize * self.block_words;
        &mut self.regions[region][start..start + self.block_words]
    }

    fn fill(&mut self, block: u32, hash: u64) {
        for r in 0..self.regions.len() {
            for (i, w) in self.words(r, block).iter_mut().enumerate() {
                *w = pattern(hash, r, i);
            }
        }
    }

    fn poison(&mut self, block: u32) {
        for r in 0..self.regions.len() {
            self.words(r, block).fill(POISON);
        }
    }

    fn holds(&mut self, block: u32, hash: u64) -> bool {
        (0..self.regions.len()).all(|r| {
            (self.words(r, block).iter().enumerate()).all(|(i, w)| *w == pattern(hash, r, i))
        })
    }
}

/// The word at `i` of region `region` of a block of hash `hash`: unique to
/// the three, so a block loaded into the wrong place or region, or with a
/// shifted word, fails verification.
fn pattern(hash: u64, region: usize, i: usize) -> u64 {
    let x = hash.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ ((region as u64) << 48 | i as u64);
    x ^ (x >> 29)
}

impl StoreDemo {
    fn hashes(&self, r: u32) -> Vec<u64> {
        let own = (0..self.own_blocks).map(|i| (1 + u64::from(r)) << 32 | u64::from(i));
        (0..u64::from(self.shared_blocks)).chain(own).collect()
    }

    /// Requests in flight at most: `concurrency`, or fewer when the run
    /// has fewer requests; the pool holds this many requests' blocks.
    fn slots(&self) -> u32 {
        self.concurrency.min(self.requests).max(1)
    }

    fn blocks_per_request(&self) -> u32 {
        self.shared_blocks + self.own_blocks
    }

    fn config(&self) -> ConnectorConfig {
        ConnectorConfig {
            store: self.store,
            keyspace: KeyspaceSpec {
                model_name: "kvferry/demo".into(),
                model: ModelSpec {
                    layout: LayoutKind::Hnd,
                    total_kv_heads: self.kv_heads,
                    block_tokens: self.block_tokens,
                    head_bytes: self.head_bytes,
                },
                dtype: "bf16".into(),
                tp_size: 1,
                pp_size: 1,
                groups: vec![GroupSpec {
                    block_tokens: self.block_tokens,
                    window_tokens: None,
                }],
            },
            medium: Medium::Cpu,
            limits: ConnectorLimits {
                max_saves: self.slots() as usize,
                max_loads: self.slots() as usize,
                ..ConnectorLimits::default()
            },
        }
    }

    /// Runs the demo against `backend`, telling `progress` each time a
    /// request's save or load ends (for a progress bar). Errors only when
    /// the connector cannot start: a store failing midway is counted in
    /// the report.
    pub(crate) fn run_observed<B: StoreBackend>(
        &self,
        backend: B,
        progress: &mut dyn FnMut(DemoProgress),
    ) -> Result<StoreDemoReport, ConnectorError> {
        let c = StoreConnector::new(self.config(), backend)?;
        let kv_block = u64::from(self.kv_heads) * u64::from(self.block_tokens) * self.head_bytes;
        if !kv_block.is_multiple_of(8) {
            return Err(too_large());
        }
        let block_words = usize::try_from(kv_block / 8).map_err(|_| too_large())?;
        let pool = (self.slots())
            .checked_mul(self.blocks_per_request())
            .ok_or_else(too_large)?;
        let mem = Memory::new(2 * self.layers, block_words, pool);
        let mut run = Run::new(self, c, mem)?;
        let started = Instant::now();
        while run.finished < self.requests {
            run.admit();
            run.step();
            progress(DemoProgress {
                saved: run.saved,
                loaded: run.finished,
                of: self.requests,
            });
        }
        Ok(run.finish(started.elapsed()))
    }
}

/// A shape whose pool cannot be addressed, or whose blocks are not whole
/// words.
fn too_large() -> ConnectorError {
    ConnectorError::Config(kvferry::machines::InputError::Misuse(
        "the demo's blocks must be whole 8-byte words and its pool addressable",
    ))
}

/// Where a request in flight is.
enum Step {
    /// Its save runs on these blocks.
    Saving(Vec<u32>),
    /// Its load runs on these blocks; `hit` of them were found.
    Loading {
        blocks: Vec<u32>,
        hit: u32,
        started: Instant,
    },
}

/// One run of the demo: the connector, the memory it reads and writes,
/// and the requests in flight. `c` is declared before `mem`, so the
/// connector (and its backend thread) is gone before the memory is freed.
struct Run<'d> {
    demo: &'d StoreDemo,
    c: StoreConnector,
    mem: Memory,
    scope: RequestScope,
    live: HashMap<u32, Step>,
    next: u32,
    saved: u32,
    finished: u32,
    latency: Latency,
    report: StoreDemoReport,
}

/// The ids of request `r`'s save and load: a request's save and load are
/// two requests to the connector.
fn save_id(r: u32) -> TransferId {
    TransferId(2 * u64::from(r))
}

fn load_id(r: u32) -> TransferId {
    TransferId(2 * u64::from(r) + 1)
}

fn request_of(id: TransferId) -> u32 {
    (id.0 / 2) as u32
}

impl<'d> Run<'d> {
    fn new(
        demo: &'d StoreDemo,
        mut c: StoreConnector,
        mem: Memory,
    ) -> Result<Self, ConnectorError> {
        // SAFETY: `mem` outlives `c` (see `Run`), and the demo touches a
        // block only while no save or load holds it: a block is on the free
        // list or held by exactly one request, and written by the demo only
        // before `start_save` and after its load is reported.
        unsafe { c.register_kv_caches(mem.layout())? };
        let scope = c.keyspace().scope(None, &[])?;
        let report = StoreDemoReport {
            requests: demo.requests,
            concurrency: demo.concurrency,
            pool_bytes: mem.bytes(),
            ..StoreDemoReport::default()
        };
        Ok(Run {
            demo,
            c,
            mem,
            scope,
            live: HashMap::new(),
            next: 0,
            saved: 0,
            finished: 0,
            latency: Latency::new(),
            report,
        })
    }

    fn request(&self, id: TransferId, hashes: &[u64], blocks: &[u32]) -> StoreRequest {
        StoreRequest {
            id,
            block_hashes: vec![hashes.iter().map(|&h| BlockHash::from_u64(h)).collect()],
            block_ids: vec![blocks.iter().map(|&b| BlockId(b)).collect()],
            lora: None,
            extra_keys: Vec::new(),
        }
    }

    /// Starts requests until `concurrency` are in flight: blocks computed,
    /// save started.
    fn admit(&mut self) {
        let per = self.demo.blocks_per_request();
        while self.live.len() < self.demo.slots() as usize && self.next < self.demo.requests {
            let r = self.next;
            self.next += 1;
            let hashes = self.demo.hashes(r);
            let blocks = self.mem.take(per);
            for (b, h) in blocks.iter().zip(&hashes) {
                self.mem.fill(*b, *h);
            }
            let meta = StoreSaveMeta {
                request: self.request(save_id(r), &hashes, &blocks),
                token_len: per * self.demo.block_tokens,
                token_ids: None,
            };
            match self.c.start_save(Instant::now(), meta) {
                Ok(()) => {
                    self.live.insert(r, Step::Saving(blocks));
                }
                Err(e) => {
                    warn_first(self.report.save_errors, r, &e, "save not started");
                    self.report.save_errors += u64::from(per);
                    self.saved += 1;
                    self.start_load(r, blocks);
                }
            }
        }
    }

    /// Waits for the store's next answer or timeout, then carries out what
    /// ended.
    fn step(&mut self) {
        let bound = self.demo.store.op_bound;
        let until = (self.c.poll_timeout()).unwrap_or_else(|| Instant::now() + bound);
        self.c.poll_wait(until);
        let (saved, loaded) = self.c.get_finished_reports();
        // Taken with the reports it belongs to; the reports say the same
        // per block.
        let _ = self.c.block_ids_with_load_errors();
        for (id, report) in saved {
            self.saved += 1;
            self.count_save(&report);
            let r = request_of(id);
            if let Some(Step::Saving(blocks)) = self.live.remove(&r) {
                self.start_load(r, blocks);
            }
        }
        for (id, report) in loaded {
            let r = request_of(id);
            if let Some(Step::Loading {
                blocks,
                hit,
                started,
            }) = self.live.remove(&r)
            {
                self.latency.record(started.elapsed());
                self.end_load(r, &blocks, hit, &report);
                self.end(blocks);
            }
        }
    }

    fn count_save(&mut self, report: &SaveReport) {
        let pressure = matches!(report.end, SaveEnd::Skipped | SaveEnd::StoreFull);
        for r in &report.results {
            match r {
                SaveKeyResult::Stored | SaveKeyResult::Deduped => {}
                SaveKeyResult::Full | SaveKeyResult::TooLarge => {
                    self.report.save_refused_blocks += 1;
                }
                SaveKeyResult::NotAttempted if pressure => self.report.save_refused_blocks += 1,
                SaveKeyResult::Failed | SaveKeyResult::NotAttempted => {
                    self.report.save_errors += 1;
                }
            }
        }
    }

    /// The engine forgot request `r`'s KV: look it up and load the hit into
    /// `blocks` (poisoned first), or end the request when nothing is to
    /// load.
    fn start_load(&mut self, r: u32, blocks: Vec<u32>) {
        let per = self.demo.blocks_per_request();
        let request = self.request(load_id(r), &self.demo.hashes(r), &blocks);
        let started = Instant::now();
        let tokens = per * self.demo.block_tokens;
        let hit = match self
            .c
            .lookup_hit(&self.scope, tokens, &request.block_hashes)
        {
            Ok(hit) => hit,
            Err(e) => {
                warn_first(self.report.lookup_errors, r, &e, "lookup failed");
                self.report.lookup_errors += 1;
                return self.end(blocks);
            }
        };
        let hit_blocks = hit.tokens / self.demo.block_tokens;
        self.report.lookup_hit_tokens += u64::from(hit.tokens);
        self.report.lookup_miss_blocks += u64::from(per - hit_blocks);
        if hit_blocks == 0 {
            return self.end(blocks);
        }
        for b in &blocks[..hit_blocks as usize] {
            self.mem.poison(*b);
        }
        let meta = StoreLoadMeta {
            request,
            hit,
            local_tokens: 0,
        };
        match self.c.start_load_kv(Instant::now(), meta) {
            Ok(()) => {
                let step = Step::Loading {
                    blocks,
                    hit: hit_blocks,
                    started,
                };
                self.live.insert(r, step);
            }
            Err(e) => {
                warn_first(self.report.load_errors, r, &e, "load not started");
                self.report.load_errors += u64::from(hit_blocks);
                self.end(blocks);
            }
        }
    }

    /// Counts request `r`'s load block by block and verifies every block
    /// it loaded.
    fn end_load(&mut self, r: u32, blocks: &[u32], hit: u32, report: &LoadReport) {
        let hashes = self.demo.hashes(r);
        // Keys the store no longer had, and those not asked for once the
        // load stopped at them, are evictions; anything else not loaded
        // is an error.
        let evicted_only = report.end == LoadEnd::KeyFailed
            && (report.results.iter()).all(|x| {
                matches!(
                    x,
                    LoadKeyResult::Loaded | LoadKeyResult::NotFound | LoadKeyResult::NotAttempted
                )
            });
        for (pos, b) in blocks.iter().enumerate().take(hit as usize) {
            let result = (report.items.iter().zip(&report.results))
                .find(|(it, _)| it.block == BlockId(*b))
                .map(|(_, x)| x);
            match result {
                Some(LoadKeyResult::Loaded) => {
                    self.report.loaded_blocks += 1;
                    if !self.mem.holds(*b, hashes[pos]) {
                        self.report.verify_errors += 1;
                    }
                }
                Some(LoadKeyResult::NotFound) => self.report.evicted_blocks += 1,
                Some(LoadKeyResult::NotAttempted) if evicted_only => {
                    self.report.evicted_blocks += 1;
                }
                // A hit block the load did not plan is a load error too.
                _ => self.report.load_errors += 1,
            }
        }
    }

    /// Request over: its blocks back to the pool.
    fn end(&mut self, blocks: Vec<u32>) {
        self.mem.give(blocks);
        self.finished += 1;
    }

    fn finish(mut self, elapsed: Duration) -> StoreDemoReport {
        let stats = self.c.stats();
        let kv_block = (self.mem.block_words * 8) as u64;
        let value_bytes = kv_block * self.mem.regions.len() as u64;
        let r = &mut self.report;
        r.saved_blocks = stats.saved_keys;
        r.dedup_skipped = stats.dedup_skipped;
        r.elapsed_s = elapsed.as_secs_f64();
        r.put_gbps = gbps(stats.saved_keys * value_bytes, elapsed);
        r.get_gbps = gbps(r.loaded_blocks * value_bytes, elapsed);
        r.p50_ms = ms(self.latency.quantile(0.50));
        r.p99_ms = ms(self.latency.quantile(0.99));
        self.report
    }
}

/// Logs an error of a kind as a warning the first time (`so_far` == 0) and
/// at debug level after: a dead store fails every request, and the report
/// counts them.
fn warn_first(so_far: u64, request: u32, error: &ConnectorError, what: &str) {
    if so_far == 0 {
        tracing::warn!(request, %error, "{what}; later ones are logged at debug level");
    } else {
        tracing::debug!(request, %error, "{what}");
    }
}

fn gbps(bytes: u64, time: Duration) -> f64 {
    let s = time.as_secs_f64();
    if s > 0.0 {
        bytes as f64 / s / 1e9
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvferry_store::internal::inproc::{InprocConfig, InprocStore};

    #[test]
    fn the_demo_verifies_every_byte_it_loads() {
        let demo = StoreDemo {
            requests: 4,
            concurrency: 2,
            shared_blocks: 3,
            own_blocks: 2,
            layers: 2,
            kv_heads: 2,
            block_tokens: 4,
            head_bytes: 16,
            store: StoreConfig::default(),
        };
        let store = InprocStore::new(InprocConfig::default()).unwrap();
        let report = demo.run_observed(store, &mut |_| {}).unwrap();
        assert_eq!(report.requests, 4);
        assert_eq!(report.saved_blocks, 3 + 4 * 2);
        assert_eq!(report.dedup_skipped, 3 * 3);
        assert_eq!(report.lookup_hit_tokens, 4 * 5 * 4);
        assert_eq!(report.loaded_blocks, 4 * 5);
        assert_eq!((report.load_errors, report.verify_errors), (0, 0));
    }
}
