//! Seeded faults on the store path. A backend wrapping the in-process
//! store answers each call, by a seeded draw, normally (at once or a
//! little later), fails it whole (`Transport`, `Refused`, before or after
//! doing the work), fails single keys (`Transport`, `Full`, `Timeout`),
//! answers it late (the work done in time, the answer after the deadline)
//! or drops it (nothing done, `Timeout` after the deadline). Saves, one at
//! a time, then loads, all at once, run through a real `StoreConnector`,
//! some aborted midway, some expiring; a model made from what the backend
//! answered checks every report, every byte of the engine and of the
//! store, that no call touched a block no save or load held, dedup and
//! the pressure path.
//!
//! The backend contract (store/src/backend.rs) bounds what may be
//! checked: a call touches no memory after its deadline, and an answer
//! that arrives after it may or may not be taken. So an answer given with
//! [`SURE_LEFT`] to spare must be taken, a late one may go either way, and
//! a call that starts with less than [`START_GUARD`] left is answered
//! `Timeout` untouched.
//!
//! `KVFERRY_STORE_SEED=<n>` runs seed `n` alone.
//!
//! After it, scripted backends pin single orderings of a late answer that
//! the seeds reach only by chance: a lookup's, and a put's or a get's
//! that comes in while a later save or load of the same request runs.

use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeSet, HashMap};
use std::hash::{Hash, Hasher};
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kvferry_machines::internal::common::{AbortReason, BlockId, TransferId};
use kvferry_machines::internal::store::events::{KvEvent, Medium};
use kvferry_machines::internal::store::load::{LoadEnd, LoadReport};
use kvferry_machines::internal::store::save::{SaveEnd, SaveKeyResult, SaveReport};
use kvferry_machines::internal::store::{
    BlockHash, ChunkKey, GroupSpec, KeyspaceSpec, PressureStats, StoreConfig,
};
use kvferry_machines::{RankLayout, Region, Stage};
use kvferry_store::{
    Answers, CallError, ConnectorConfig, ConnectorLimits, GetItem, InprocConfig, InprocStore,
    ItemError, PutItem, PutOutcome, Scatter, StoreBackend, StoreConnector, StoreLoadMeta,
    StoreRequest, StoreSaveMeta,
};
use kvferry_testkit::model::{self, ModelSpecExt};

/// Seeds of a full run.
const SEEDS: u64 = 200;
/// Every call's bound; late and dropped calls cost about this much time.
const OP_BOUND: Duration = Duration::from_millis(24);
/// A call reaching the backend with less than this left is answered
/// `Timeout` without touching memory.
const START_GUARD: Duration = Duration::from_millis(18);
/// An answer returned with at least this left reaches the connector
/// before the deadline unless the backend thread stalls this long.
const SURE_LEFT: Duration = Duration::from_millis(12);
/// How far past the deadline a late or dropped call answers.
const LATE_BY: Duration = Duration::from_millis(6);
/// Most late or dropped calls of one seed (they cost real time).
const LATE_MAX: u32 = 2;
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
/// The request timeout of every seventh seed, whose slow calls may make
/// a request expire.
const SHORT_REQUEST_TIMEOUT: Duration = Duration::from_millis(10);
/// How much later than at once a slow call answers (still in time).
const SLOW_BY: Duration = Duration::from_millis(4);
/// Time the test's driver loop may take on top of a request's deadline.
const DRIVER_SLACK: Duration = Duration::from_secs(2);

fn short_timeout(seed: u64) -> bool {
    seed % 7 == 3
}

const BLOCK_TOKENS: u32 = 16;
const HEADS: u32 = 2;
const HEAD_BYTES: u64 = 8;
const KV_BLOCK: u64 = HEADS as u64 * BLOCK_TOKENS as u64 * HEAD_BYTES;
/// Bytes after each block's KV that no store call may touch.
const SLACK: u64 = 24;
const REGIONS: usize = 2;
/// Blocks of the engine; the last [`CANARIES`] are never given out.
const NUM_BLOCKS: u32 = 420;
const CANARIES: u32 = 20;
const SENTINEL: u8 = 0xEE;

/// Group 0: full attention, 16-token blocks; group 1: 32-token blocks
/// with a 64-token sliding window.
fn groups() -> Vec<GroupSpec> {
    vec![
        GroupSpec {
            block_tokens: BLOCK_TOKENS,
            window_tokens: None,
        },
        GroupSpec {
            block_tokens: 2 * BLOCK_TOKENS,
            window_tokens: Some(4 * BLOCK_TOKENS),
        },
    ]
}

// ---------------------------------------------------------------- engine

/// The engine's KV cache: one heap buffer per region.
struct Engine {
    regions: Vec<Vec<u8>>,
}

impl Engine {
    fn new() -> Engine {
        let len = (u64::from(NUM_BLOCKS) * (KV_BLOCK + SLACK)) as usize;
        Engine {
            regions: (0..REGIONS).map(|_| vec![SENTINEL; len]).collect(),
        }
    }

    fn layout(&self) -> RankLayout {
        RankLayout {
            tp_size: 1,
            tp_rank: 0,
            num_blocks: u64::from(NUM_BLOCKS),
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

    /// Which block a scatter list starts in (its first segment lies in
    /// region 0).
    fn block_map(&self) -> BlockMap {
        BlockMap {
            base: self.regions[0].as_ptr() as u64,
            stride: KV_BLOCK + SLACK,
        }
    }

    fn span(block: u32) -> std::ops::Range<usize> {
        let start = (u64::from(block) * (KV_BLOCK + SLACK)) as usize;
        start..start + (KV_BLOCK + SLACK) as usize
    }

    fn fill(&mut self, block: u32, hash: u64) {
        for (r, region) in self.regions.iter_mut().enumerate() {
            let kv = &mut region[Engine::span(block)][..KV_BLOCK as usize];
            for (i, b) in kv.iter_mut().enumerate() {
                *b = pattern(hash, r, i);
            }
        }
    }

    fn drop_all(&mut self) {
        for r in &mut self.regions {
            r.fill(SENTINEL);
        }
    }

    /// `block` holds `hash`'s bytes, its slack untouched.
    fn holds(&self, block: u32, hash: u64) -> bool {
        (self.regions.iter().enumerate()).all(|(r, region)| {
            let (kv, slack) = region[Engine::span(block)].split_at(KV_BLOCK as usize);
            (kv.iter().enumerate()).all(|(i, b)| *b == pattern(hash, r, i))
                && slack.iter().all(|b| *b == SENTINEL)
        })
    }

    fn untouched(&self, block: u32) -> bool {
        (self.regions.iter())
            .all(|region| region[Engine::span(block)].iter().all(|b| *b == SENTINEL))
    }

    fn slack_untouched(&self, block: u32) -> bool {
        (self.regions.iter()).all(|region| {
            region[Engine::span(block)][KV_BLOCK as usize..]
                .iter()
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

/// The value a store must hold for `hash`: its bytes in every region.
fn value_of(hash: u64) -> Vec<u8> {
    (0..REGIONS)
        .flat_map(|r| (0..KV_BLOCK as usize).map(move |i| pattern(hash, r, i)))
        .collect()
}

#[derive(Clone, Copy)]
struct BlockMap {
    base: u64,
    stride: u64,
}

impl BlockMap {
    fn block(&self, s: &Scatter) -> u32 {
        ((s.segments()[0].addr - self.base) / self.stride) as u32
    }
}

// --------------------------------------------------------------- backend

/// How one call is answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Plan {
    /// Answered in time (single keys may still fail).
    Normal,
    /// Fails as a whole; with `after_work`, once the work is done.
    Fail { err: CallError, after_work: bool },
    /// The work done in time, the answer after the deadline.
    Late,
    /// Nothing done; `Timeout` after the deadline.
    Drop,
}

/// The fault rates of one seed.
#[derive(Clone, Copy, Debug)]
struct Profile {
    fail: f64,
    key: f64,
    late: f64,
    drop: f64,
    /// Calls answered normally but [`SLOW_BY`] late, in time.
    slow: f64,
}

impl Profile {
    /// Every tenth seed runs without faults: the model's baseline.
    fn of(seed: u64) -> Profile {
        if seed.is_multiple_of(10) {
            return Profile {
                fail: 0.0,
                key: 0.0,
                late: 0.0,
                drop: 0.0,
                slow: 0.0,
            };
        }
        let mut rng = fastrand::Rng::with_seed(seed ^ 0x5EED_FA17);
        Profile {
            fail: rng.f64() * 0.15,
            key: rng.f64() * 0.15,
            late: rng.f64() * 0.08,
            drop: rng.f64() * 0.08,
            slow: if short_timeout(seed) { 0.3 } else { 0.0 },
        }
    }
}

/// One key of a put or get as the backend answered it.
#[derive(Clone, Debug)]
struct KeyRec<T> {
    key: ChunkKey,
    block: u32,
    answer: Result<T, ItemError>,
    /// Answered normally with [`SURE_LEFT`] to spare of the call's
    /// deadline: the connector takes the answer, unless the request's own
    /// deadline came first (see [`World::sure`]). Otherwise it may or may
    /// not.
    sure: bool,
    /// When the connector posted the call.
    posted: Instant,
    /// When the backend answered.
    answered: Instant,
}

#[derive(Clone, Debug)]
struct ExistsRec {
    keys: Vec<ChunkKey>,
    answer: Vec<bool>,
    sure: bool,
    posted: Instant,
    answered: Instant,
}

/// When a call with this deadline was posted.
fn posted(deadline: Instant) -> Instant {
    deadline
        .checked_sub(OP_BOUND)
        .expect("a deadline after the start")
}

/// Counts of what the backend did, over a run.
#[derive(Clone, Copy, Debug, Default)]
struct Counts {
    calls: u64,
    refused_late_start: u64,
    normal: u64,
    failed: u64,
    failed_after_work: u64,
    late: u64,
    dropped: u64,
    slow: u64,
    key_faults: u64,
    full_keys: u64,
}

/// What the backend answered since the test last took it.
#[derive(Default)]
struct Log {
    faults: bool,
    exists: Vec<ExistsRec>,
    puts: Vec<KeyRec<PutOutcome>>,
    gets: Vec<KeyRec<()>>,
    /// Keys put while the store held them already.
    redundant_puts: Vec<ChunkKey>,
    /// Each block a put read or a get wrote, and when the copy was over.
    touches: Vec<(u32, Instant)>,
    counts: Counts,
}

type Shared = Arc<Mutex<Log>>;

fn lock(log: &Shared) -> MutexGuard<'_, Log> {
    log.lock().unwrap_or_else(|p| p.into_inner())
}

const OP_EXISTS: u8 = 0;
const OP_PUT: u8 = 1;
const OP_GET: u8 = 2;

/// The in-process store with seeded faults. See the module docs.
struct FaultyBackend {
    inner: InprocStore,
    log: Shared,
    seed: u64,
    profile: Profile,
    late_left: u32,
    /// Calls per (op, first key) so far: a retried key draws anew.
    attempts: HashMap<(u8, ChunkKey), u32>,
    blocks: BlockMap,
}

fn left(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now())
}

/// Blocks the backend thread until `LATE_BY` past `deadline` (the slow
/// store itself, not a wait for the test).
fn sleep_past(deadline: Instant) {
    std::thread::sleep(left(deadline) + LATE_BY);
}

impl FaultyBackend {
    fn faults(&self) -> bool {
        lock(&self.log).faults
    }

    /// The draw of one call: its plan and the generator for its keys. A
    /// call that starts too close to its deadline is `None` (refused).
    /// The draw of one call: its plan and the generator for its keys,
    /// from the seed, the op, its first key and how often that key was
    /// asked (so a retry draws anew, whatever the timing). A call that
    /// starts too close to its deadline is `None` (refused).
    fn plan(
        &mut self,
        op: u8,
        first: Option<&ChunkKey>,
        deadline: Instant,
    ) -> Option<(Plan, fastrand::Rng)> {
        lock(&self.log).counts.calls += 1;
        if left(deadline) < START_GUARD {
            lock(&self.log).counts.refused_late_start += 1;
            return None;
        }
        let mut h = DefaultHasher::new();
        (self.seed, op, first.map(ChunkKey::as_str)).hash(&mut h);
        if let Some(k) = first {
            let n = self.attempts.entry((op, k.clone())).or_insert(0);
            *n += 1;
            n.hash(&mut h);
        }
        let mut rng = fastrand::Rng::with_seed(h.finish());
        let plan = self.draw(&mut rng);
        let slow = plan == Plan::Normal && rng.f64() < self.profile.slow;
        let mut log = lock(&self.log);
        let counts = &mut log.counts;
        match plan {
            Plan::Normal => counts.normal += 1,
            Plan::Fail { after_work, .. } => {
                counts.failed += 1;
                counts.failed_after_work += u64::from(after_work);
            }
            Plan::Late => counts.late += 1,
            Plan::Drop => counts.dropped += 1,
        }
        counts.slow += u64::from(slow);
        drop(log);
        if slow {
            std::thread::sleep(SLOW_BY);
        }
        Some((plan, rng))
    }

    /// A plan by the seed's rates; late and dropped calls only while the
    /// seed's budget of them lasts.
    fn draw(&mut self, rng: &mut fastrand::Rng) -> Plan {
        let p = self.profile;
        let x = rng.f64();
        let plan = if x < p.fail {
            let err = [CallError::Transport, CallError::Refused][rng.usize(..2)];
            Plan::Fail {
                err,
                after_work: rng.bool(),
            }
        } else if x < p.fail + p.late {
            Plan::Late
        } else if x < p.fail + p.late + p.drop {
            Plan::Drop
        } else {
            Plan::Normal
        };
        if matches!(plan, Plan::Late | Plan::Drop) {
            if self.late_left == 0 {
                return Plan::Normal;
            }
            self.late_left -= 1;
        }
        plan
    }

    fn touched(&self, s: &Scatter) {
        let at = Instant::now();
        lock(&self.log).touches.push((self.blocks.block(s), at));
    }

    /// A key's own fault, if the draw gives one.
    fn key_fault(&self, rng: &mut fastrand::Rng, choices: &[ItemError]) -> Option<ItemError> {
        if rng.f64() >= self.profile.key {
            return None;
        }
        let e = choices[rng.usize(..choices.len())];
        let mut log = lock(&self.log);
        log.counts.key_faults += 1;
        log.counts.full_keys += u64::from(e == ItemError::Full);
        Some(e)
    }

    /// One put or get under its seeded plan: dropped, failed before or
    /// after its work, answered late or normally; the answers of its
    /// `keys` (key, block) go to the log list `records` picks.
    fn faulty_call<T: Clone>(
        &mut self,
        op: u8,
        keys: Vec<(ChunkKey, u32)>,
        deadline: Instant,
        records: fn(&mut Log) -> &mut Vec<KeyRec<T>>,
        work: impl FnOnce(&mut Self, &mut fastrand::Rng) -> Vec<Result<T, ItemError>>,
    ) -> Answers<T> {
        let Some((plan, mut rng)) = self.plan(op, keys.first().map(|(k, _)| k), deadline) else {
            return Err(CallError::Timeout);
        };
        let log = self.log.clone();
        let record = |answers: &[Result<T, ItemError>], in_time: bool| {
            let recs = FaultyBackend::records(keys.iter().cloned(), answers, in_time, deadline);
            records(&mut lock(&log)).extend(recs);
        };
        let failed = |err: CallError| {
            let answers = vec![Err(ItemError::Transport); keys.len()];
            record(&answers, left(deadline) >= SURE_LEFT);
            Err(err)
        };
        match plan {
            Plan::Drop => {
                sleep_past(deadline);
                return Err(CallError::Timeout);
            }
            Plan::Fail {
                err,
                after_work: false,
            } => return failed(err),
            _ => {}
        }
        let answers = work(self, &mut rng);
        if let Plan::Fail { err, .. } = plan {
            return failed(err);
        }
        record(
            &answers,
            plan == Plan::Normal && left(deadline) >= SURE_LEFT,
        );
        if plan == Plan::Late {
            sleep_past(deadline);
        }
        Ok(answers)
    }

    fn put_work(
        &mut self,
        items: &[PutItem],
        deadline: Instant,
        rng: &mut fastrand::Rng,
    ) -> Vec<Result<PutOutcome, ItemError>> {
        let faults = [ItemError::Transport, ItemError::Full, ItemError::Timeout];
        let mut out = Vec::with_capacity(items.len());
        for it in items {
            if let Some(e) = self.key_fault(rng, &faults) {
                out.push(Err(e));
                continue;
            }
            if self.inner.value(&it.key).is_some() {
                lock(&self.log).redundant_puts.push(it.key.clone());
            }
            let r = self.inner.put(std::slice::from_ref(it), deadline);
            self.touched(&it.from);
            out.push(r.map_or(Err(ItemError::Transport), |mut v| v.remove(0)));
        }
        out
    }

    fn get_work(
        &mut self,
        items: &[GetItem],
        deadline: Instant,
        rng: &mut fastrand::Rng,
    ) -> Vec<Result<(), ItemError>> {
        let faults = [ItemError::Transport, ItemError::Timeout];
        let mut out = Vec::with_capacity(items.len());
        for it in items {
            if let Some(e) = self.key_fault(rng, &faults) {
                out.push(Err(e));
                continue;
            }
            let r = self.inner.get(std::slice::from_ref(it), deadline);
            self.touched(&it.into);
            out.push(r.map_or(Err(ItemError::Transport), |mut v| v.remove(0)));
        }
        out
    }

    /// The backend's answers to a call's keys; `in_time`: answered
    /// normally with [`SURE_LEFT`] to spare.
    fn records<T: Clone>(
        keys: impl Iterator<Item = (ChunkKey, u32)>,
        answers: &[Result<T, ItemError>],
        in_time: bool,
        deadline: Instant,
    ) -> Vec<KeyRec<T>> {
        keys.zip(answers)
            .map(|((key, block), answer)| KeyRec {
                key,
                block,
                sure: in_time,
                posted: posted(deadline),
                answered: Instant::now(),
                answer: answer.clone(),
            })
            .collect()
    }
}

impl StoreBackend for FaultyBackend {
    fn name(&self) -> &'static str {
        "faulty"
    }

    fn exists(&mut self, keys: &[ChunkKey], deadline: Instant) -> Result<Vec<bool>, CallError> {
        if !self.faults() {
            return self.inner.exists(keys, deadline);
        }
        let Some((plan, _)) = self.plan(OP_EXISTS, keys.first(), deadline) else {
            return Err(CallError::Timeout);
        };
        match plan {
            Plan::Drop => {
                sleep_past(deadline);
                return Err(CallError::Timeout);
            }
            Plan::Fail { err, .. } => return Err(err),
            Plan::Normal | Plan::Late => {}
        }
        let answer = self.inner.exists(keys, deadline)?;
        let late = plan == Plan::Late;
        lock(&self.log).exists.push(ExistsRec {
            keys: keys.to_vec(),
            posted: posted(deadline),
            answered: Instant::now(),
            answer: answer.clone(),
            sure: !late && left(deadline) >= SURE_LEFT,
        });
        if late {
            sleep_past(deadline);
        }
        Ok(answer)
    }

    fn put(&mut self, items: &[PutItem], deadline: Instant) -> Answers<PutOutcome> {
        if !self.faults() {
            return self.inner.put(items, deadline);
        }
        let keys = (items.iter())
            .map(|it| (it.key.clone(), self.blocks.block(&it.from)))
            .collect();
        self.faulty_call(
            OP_PUT,
            keys,
            deadline,
            |l| &mut l.puts,
            |b, rng| b.put_work(items, deadline, rng),
        )
    }

    fn get(&mut self, items: &[GetItem], deadline: Instant) -> Answers<()> {
        if !self.faults() {
            return self.inner.get(items, deadline);
        }
        let keys = (items.iter())
            .map(|it| (it.key.clone(), self.blocks.block(&it.into)))
            .collect();
        self.faulty_call(
            OP_GET,
            keys,
            deadline,
            |l| &mut l.gets,
            |b, rng| b.get_work(items, deadline, rng),
        )
    }

    fn remove(&mut self, keys: &[ChunkKey], deadline: Instant) -> Answers<()> {
        self.inner.remove(keys, deadline)
    }

    fn take_removed(&mut self, max: usize) -> Vec<ChunkKey> {
        self.inner.take_removed(max)
    }
}

// -------------------------------------------------------------- workload

/// One request: per group, the seeds of its block hashes.
#[derive(Clone, Debug)]
struct Req {
    id: u64,
    tokens: u32,
    hashes: Vec<Vec<u64>>,
}

/// A few dozen requests of up to 10 blocks; each shares a leading part
/// with the others of its family (same prefix, same hashes, same bytes).
fn workload(rng: &mut fastrand::Rng) -> Vec<Req> {
    let requests = rng.u64(10..=18);
    (1..=requests)
        .map(|id| {
            let blocks = rng.u32(2..=10);
            let family = rng.u64(1..=3);
            let shared = rng.u32(0..=blocks) * BLOCK_TOKENS;
            let hashes = (groups().iter().enumerate())
                .map(|(g, spec)| {
                    let n = (blocks * BLOCK_TOKENS).div_ceil(spec.block_tokens);
                    (0..n)
                        .map(|i| {
                            let own = (i + 1) * spec.block_tokens > shared;
                            let owner = if own { 100 + id } else { family };
                            owner << 32 | (g as u64) << 16 | u64::from(i)
                        })
                        .collect()
                })
                .collect();
            Req {
                id,
                tokens: blocks * BLOCK_TOKENS,
                hashes,
            }
        })
        .collect()
}

/// Per request and group, distinct engine blocks in shuffled order; the
/// canaries stay out.
fn allocate(reqs: &[Req], rng: &mut fastrand::Rng) -> Vec<Vec<Vec<u32>>> {
    let mut free: Vec<u32> = (0..NUM_BLOCKS - CANARIES).collect();
    rng.shuffle(&mut free);
    let mut free = free.into_iter();
    (reqs.iter())
        .map(|r| {
            (r.hashes.iter())
                .map(|h| {
                    h.iter()
                        .map(|_| free.next().expect("enough blocks"))
                        .collect()
                })
                .collect()
        })
        .collect()
}

fn block_hashes(req: &Req) -> Vec<Vec<BlockHash>> {
    (req.hashes.iter())
        .map(|h| h.iter().map(|&x| BlockHash::from_u64(x)).collect())
        .collect()
}

fn request(id: u64, req: &Req, blocks: &[Vec<u32>]) -> StoreRequest {
    StoreRequest {
        id: TransferId(id),
        block_hashes: block_hashes(req),
        block_ids: (blocks.iter())
            .map(|b| b.iter().map(|&x| BlockId(x)).collect())
            .collect(),
        lora: None,
        extra_keys: Vec::new(),
    }
}

// ----------------------------------------------------------------- world

/// The pressure rule of the connector's docs, kept by the test.
#[derive(Default)]
struct PressureModel {
    skipped: Vec<TransferId>,
    stats: PressureStats,
}

impl PressureModel {
    fn admit(&mut self, id: TransferId) -> bool {
        let admitted = !self.skipped.contains(&id);
        self.stats.skipped_saves += u64::from(!admitted);
        admitted
    }

    fn report(&mut self, id: TransferId, report: &SaveReport) {
        if report.end == SaveEnd::StoreFull {
            self.stats.full_saves += 1;
            if !self.skipped.contains(&id) {
                self.skipped.push(id);
            }
        } else if report.stored() > 0 && !self.skipped.is_empty() {
            self.stats.clears += 1;
            self.skipped.clear();
        }
    }
}

/// What a seed exercised, summed over the run.
#[derive(Clone, Copy, Debug, Default)]
struct Totals {
    seeds: u64,
    counts: Counts,
    saves: u64,
    stored_keys: u64,
    deduped_keys: u64,
    pressure: PressureStats,
    loads: u64,
    aborted: u64,
    expired: u64,
    loaded_blocks: u64,
    error_blocks: u64,
    either_blocks: u64,
}

impl Totals {
    fn add(&mut self, t: &Totals) {
        let (a, b) = (&mut self.counts, &t.counts);
        a.calls += b.calls;
        a.refused_late_start += b.refused_late_start;
        a.normal += b.normal;
        a.failed += b.failed;
        a.failed_after_work += b.failed_after_work;
        a.late += b.late;
        a.dropped += b.dropped;
        a.slow += b.slow;
        a.key_faults += b.key_faults;
        a.full_keys += b.full_keys;
        self.seeds += t.seeds;
        self.saves += t.saves;
        self.stored_keys += t.stored_keys;
        self.deduped_keys += t.deduped_keys;
        self.pressure.full_saves += t.pressure.full_saves;
        self.pressure.skipped_saves += t.pressure.skipped_saves;
        self.pressure.clears += t.pressure.clears;
        self.loads += t.loads;
        self.aborted += t.aborted;
        self.expired += t.expired;
        self.loaded_blocks += t.loaded_blocks;
        self.error_blocks += t.error_blocks;
        self.either_blocks += t.either_blocks;
    }
}

/// One seed's connector, store and engine.
struct World {
    seed: u64,
    /// Declared first, so dropped first: its backend thread is done with
    /// the engine's memory before the engine goes.
    c: StoreConnector,
    log: Shared,
    store: InprocStore,
    engine: Engine,
    pressure: PressureModel,
    /// Per block, the times a save or load held it: from its start until
    /// `get_finished` named it.
    held: HashMap<u32, Vec<(Instant, Instant)>>,
    request_timeout: Duration,
    /// Which saves and loads are aborted, and when.
    rng: fastrand::Rng,
    totals: Totals,
}

fn keyspace() -> KeyspaceSpec {
    let m = model::small()
        .with_heads(HEADS)
        .with_block_tokens(BLOCK_TOKENS)
        .with_head_bytes(HEAD_BYTES);
    KeyspaceSpec {
        groups: groups(),
        ..model::keyspace("test/model", m)
    }
}

fn connector_config(request_timeout: Duration) -> ConnectorConfig {
    ConnectorConfig {
        store: StoreConfig {
            max_keys_per_batch: 3,
            max_batches_in_flight: 2,
            op_bound: OP_BOUND,
            request_timeout,
            ..StoreConfig::default()
        },
        keyspace: keyspace(),
        medium: Medium::Cpu,
        limits: ConnectorLimits::default(),
    }
}

impl World {
    fn new(seed: u64) -> World {
        let engine = Engine::new();
        let store = InprocStore::new(InprocConfig::default()).unwrap();
        let log: Shared = Arc::default();
        lock(&log).faults = true;
        let backend = FaultyBackend {
            inner: store.clone(),
            log: log.clone(),
            seed,
            profile: Profile::of(seed),
            late_left: LATE_MAX,
            attempts: HashMap::new(),
            blocks: engine.block_map(),
        };
        let request_timeout = if short_timeout(seed) {
            SHORT_REQUEST_TIMEOUT
        } else {
            REQUEST_TIMEOUT
        };
        let mut c = StoreConnector::new(connector_config(request_timeout), backend).unwrap();
        // SAFETY: the engine's buffers outlive the connector (dropped
        // first, see `World`) and the test touches a block only while no
        // save or load holds it.
        unsafe { c.register_kv_caches(engine.layout()).unwrap() };
        World {
            seed,
            c,
            log,
            store,
            engine,
            pressure: PressureModel::default(),
            held: HashMap::new(),
            request_timeout,
            rng: fastrand::Rng::with_seed(seed ^ 0xAB0B7),
            totals: Totals {
                seeds: 1,
                ..Totals::default()
            },
        }
    }

    fn key(&self, group: usize, hash: u64) -> ChunkKey {
        let ks = self.c.keyspace();
        let scope = ks.scope(None, &[]).unwrap();
        ks.key(
            &ks.shards()[0],
            &scope,
            group as u32,
            &BlockHash::from_u64(hash),
        )
        .unwrap()
    }

    /// Whether the connector must have taken an answer given `answered`,
    /// `in_time` for its call's deadline, to a request started at
    /// `start`: a request deadline that passes first expires the request
    /// with the answer still out, however early the call's own deadline
    /// made it.
    fn sure(&self, in_time: bool, answered: Instant, start: Instant) -> bool {
        in_time && answered + SURE_LEFT <= start + self.request_timeout
    }

    /// The backend's records of the calls posted from `since` on (those
    /// of earlier saves and loads, which the connector gave up on, go:
    /// none touched memory late, or the touch check says so).
    #[allow(clippy::type_complexity)]
    fn take_records(
        &self,
        since: Instant,
    ) -> (Vec<ExistsRec>, Vec<KeyRec<PutOutcome>>, Vec<KeyRec<()>>) {
        let mut log = lock(&self.log);
        let mut exists = std::mem::take(&mut log.exists);
        let mut puts = std::mem::take(&mut log.puts);
        let mut gets = std::mem::take(&mut log.gets);
        exists.retain(|r| r.posted >= since);
        puts.retain(|r| r.posted >= since);
        gets.retain(|r| r.posted >= since);
        (exists, puts, gets)
    }

    /// Drives the connector until `get_finished` named every save and
    /// load in `saves` and `loads` (each once), each by its deadline;
    /// aborts each of `aborts` at its step of the loop.
    #[allow(clippy::type_complexity)]
    fn drive(
        &mut self,
        saves: &[TransferId],
        loads: &[TransferId],
        last_start: Instant,
        aborts: &[(TransferId, u32)],
    ) -> (
        Vec<(TransferId, SaveReport, Instant)>,
        Vec<(TransferId, LoadReport, Instant)>,
    ) {
        let bound = last_start + self.request_timeout + OP_BOUND + DRIVER_SLACK;
        let (mut saved, mut loaded) = (Vec::new(), Vec::new());
        for step in 0u32.. {
            for &(id, _) in aborts.iter().filter(|(_, at)| *at == step) {
                self.c.abort(Instant::now(), id, AbortReason::Engine);
            }
            let (s, l) = self.c.get_finished_reports();
            let seen = Instant::now();
            saved.extend(s.into_iter().map(|(id, r)| (id, r, seen)));
            loaded.extend(l.into_iter().map(|(id, r)| (id, r, seen)));
            if saved.len() >= saves.len() && loaded.len() >= loads.len() {
                break;
            }
            let now = Instant::now();
            assert!(
                now < bound,
                "seed {}: {} of {} saves and {} of {} loads ended by their deadline",
                self.seed,
                saved.len(),
                saves.len(),
                loaded.len(),
                loads.len()
            );
            self.c.poll_wait((now + OP_BOUND / 4).min(bound));
        }
        let ids = |v: Vec<TransferId>| {
            let mut v = v;
            v.sort_unstable();
            v
        };
        let seed = self.seed;
        let got = ids(saved.iter().map(|(id, _, _)| *id).collect());
        assert_eq!(got, ids(saves.to_vec()), "seed {seed}: each save ends once");
        let got = ids(loaded.iter().map(|(id, _, _)| *id).collect());
        assert_eq!(got, ids(loads.to_vec()), "seed {seed}: each load ends once");
        (saved, loaded)
    }
}

// ----------------------------------------------------------------- saves

/// One save run to its end, checked against the backend's records and
/// the pressure rule.
fn save_checked(w: &mut World, req: &Req, blocks: &[Vec<u32>]) -> SaveReport {
    let id = TransferId(req.id);
    let posts = |c: &StoreConnector| (c.stats().exists_calls, c.stats().put_calls);
    let before = posts(&w.c);
    let admitted = w.pressure.admit(id);
    let meta = StoreSaveMeta {
        request: request(req.id, req, blocks),
        token_len: req.tokens,
        token_ids: None,
    };
    let abort = (w.rng.u8(..8) == 0).then(|| (id, w.rng.u32(0..4)));
    let start = Instant::now();
    w.c.start_save(start, meta).unwrap();
    let (mut saved, _) = w.drive(&[id], &[], start, abort.as_slice());
    let (_, report, seen) = saved.pop().unwrap();
    for &b in blocks.iter().flatten() {
        w.held.entry(b).or_default().push((start, seen));
    }
    let ctx = format!("seed {}, save of request {}", w.seed, req.id);
    if let SaveEnd::Aborted(_) = report.end {
        assert!(abort.is_some(), "{ctx}: aborted, never asked to");
        w.totals.aborted += 1;
    }
    w.totals.expired += u64::from(report.end == SaveEnd::Expired);
    if admitted {
        assert_ne!(report.end, SaveEnd::Skipped, "{ctx}: admitted");
        let (since, aborted) = (start, abort.is_some());
        check_save(w, req, blocks, &report, (since, aborted), &ctx);
    } else {
        assert_eq!(report.end, SaveEnd::Skipped, "{ctx}: under pressure");
        assert_eq!(posts(&w.c), before, "{ctx}: a skipped save asks nothing");
    }
    w.pressure.report(id, &report);
    assert_eq!(w.c.stats().pressure, w.pressure.stats, "{ctx}: pressure");
    w.totals.saves += 1;
    w.totals.stored_keys += report.stored() as u64;
    w.totals.deduped_keys += report.deduped() as u64;
    report
}

fn check_save(
    w: &World,
    req: &Req,
    blocks: &[Vec<u32>],
    report: &SaveReport,
    (since, aborted): (Instant, bool),
    ctx: &str,
) {
    let (exists, puts, _) = w.take_records(since);
    // The plan: blocks of the request, each under its own key.
    let mut at: HashMap<ChunkKey, (u32, u64)> = HashMap::new();
    for it in &report.items {
        let (g, i) = (it.group as usize, it.index as usize);
        let hash = req.hashes[g][i];
        assert_eq!(it.block, BlockId(blocks[g][i]), "{ctx}: an item's block");
        assert_eq!(it.key, w.key(g, hash), "{ctx}: an item's key");
        at.insert(it.key.clone(), (it.block.0, hash));
    }
    assert!(exists.len() <= 1, "{ctx}: one existence check");
    let keys: Vec<ChunkKey> = report.items.iter().map(|it| it.key.clone()).collect();
    if let Some(e) = exists.first() {
        assert_eq!(e.keys, keys, "{ctx}: the existence check asks every key");
    }
    let mut put_of: HashMap<ChunkKey, KeyRec<PutOutcome>> = HashMap::new();
    for p in puts {
        let Some(&(block, _)) = at.get(&p.key) else {
            panic!("{ctx}: a put of a key outside the save: {}", p.key.as_str());
        };
        assert_eq!(p.block, block, "{ctx}: a put reads its key's block");
        let key = p.key.clone();
        assert!(put_of.insert(key, p).is_none(), "{ctx}: a key put twice");
    }
    for (i, (it, res)) in report.items.iter().zip(&report.results).enumerate() {
        // An abort while the existence check is out releases at once:
        // its answer, however early, may come too late.
        let said =
            (exists.first()).map(|e| (e.answer[i], w.sure(e.sure, e.answered, since) && !aborted));
        let put = (put_of.get(&it.key)).map(|p| (p.answer, w.sure(p.sure, p.answered, since)));
        check_save_key(*res, said, put, ctx);
        if matches!(res, SaveKeyResult::Stored | SaveKeyResult::Deduped) {
            let held = w.store.value(&it.key);
            let want = value_of(at[&it.key].1);
            assert!(
                held == Some(want),
                "{ctx}: a key saved holds its block's bytes"
            );
        }
    }
    for (g, bs) in blocks.iter().enumerate() {
        for (i, &b) in bs.iter().enumerate() {
            assert!(
                w.engine.holds(b, req.hashes[g][i]),
                "{ctx}: a put wrote block {b}"
            );
        }
    }
    let has = |r: SaveKeyResult| report.results.contains(&r);
    if report.end == SaveEnd::StoreFull {
        assert!(
            has(SaveKeyResult::Full),
            "{ctx}: store full without a full key"
        );
    }
    if report.end == SaveEnd::Done {
        assert!(!has(SaveKeyResult::NotAttempted), "{ctx}: done, keys left");
    }
}

/// One key of a save: what the report says against what the backend
/// answered (`said`: the existence answer, `put`: the put answer, each
/// with whether the connector must have taken it).
fn check_save_key(
    res: SaveKeyResult,
    said: Option<(bool, bool)>,
    put: Option<(Result<PutOutcome, ItemError>, bool)>,
    ctx: &str,
) {
    use SaveKeyResult as R;
    let ok = match res {
        R::Stored => matches!(put, Some((Ok(PutOutcome::Stored), _))),
        R::Deduped => {
            said.is_some_and(|(e, _)| e) || matches!(put, Some((Ok(PutOutcome::Exists), _)))
        }
        R::Full => matches!(put, Some((Err(ItemError::Full), _))),
        R::NotAttempted => put.is_none(),
        R::Failed => true,
        R::TooLarge => false,
    };
    assert!(
        ok,
        "{ctx}: {res:?} but the store answered {said:?} / {put:?}"
    );
    let want = match (said, put) {
        (Some((true, true)), _) => Some(R::Deduped),
        (_, Some((Ok(PutOutcome::Stored), true))) => Some(R::Stored),
        (_, Some((Ok(PutOutcome::Exists), true))) => Some(R::Deduped),
        (_, Some((Err(ItemError::Full), true))) => Some(R::Full),
        (_, Some((Err(_), true))) => Some(R::Failed),
        _ => None,
    };
    if let Some(want) = want {
        assert_eq!(
            res, want,
            "{ctx}: the store answered {said:?} / {put:?} in time"
        );
    }
    if said == Some((true, true)) {
        assert!(put.is_none(), "{ctx}: a key found stored is put");
    }
}

/// Every request saved in turn (so a stored key is never put again); a
/// save that met a full store is tried again at once (skipped), and
/// again after a later save cleared the pressure (admitted).
fn save_phase(w: &mut World, reqs: &[Req], blocks: &[Vec<Vec<u32>>]) {
    let mut met_full: Vec<usize> = Vec::new();
    for (i, (req, bl)) in reqs.iter().zip(blocks).enumerate() {
        for (g, bs) in bl.iter().enumerate() {
            for (&b, &h) in bs.iter().zip(&req.hashes[g]) {
                w.engine.fill(b, h);
            }
        }
        let clears = w.pressure.stats.clears;
        let report = save_checked(w, req, bl);
        if report.end == SaveEnd::StoreFull {
            let again = save_checked(w, req, bl);
            assert_eq!(again.end, SaveEnd::Skipped, "seed {}", w.seed);
            met_full.push(i);
        } else if w.pressure.stats.clears > clears {
            if let Some(j) = met_full.pop() {
                save_checked(w, &reqs[j], &blocks[j]);
            }
        }
    }
    let redundant = std::mem::take(&mut lock(&w.log).redundant_puts);
    assert!(
        redundant.is_empty(),
        "seed {}: keys put while stored: {redundant:?}",
        w.seed
    );
}

// ----------------------------------------------------------------- loads

/// A load as the test planned it from the lookup: block to (group, hash).
struct PlannedLoad {
    id: TransferId,
    blocks: HashMap<u32, (usize, u64)>,
    /// Every block of the request, planned or not.
    all: Vec<u32>,
    start: Instant,
}

/// Looks every request up (no faults: the lookup is not under test) and
/// starts all the loads at once into fresh blocks, some with a local
/// prefix the engine holds itself.
fn start_loads(w: &mut World, reqs: &[Req], rng: &mut fastrand::Rng) -> Vec<PlannedLoad> {
    w.engine.drop_all();
    let dest = allocate(reqs, rng);
    let mut metas = Vec::new();
    lock(&w.log).faults = false;
    for (req, d) in reqs.iter().zip(&dest) {
        let scope = w.c.keyspace().scope(None, &[]).unwrap();
        let hit = (w.c.lookup_hit(&scope, req.tokens, &block_hashes(req)))
            .unwrap_or_else(|e| panic!("seed {}: lookup without faults: {e}", w.seed));
        let local = if rng.u8(..4) == 0 {
            rng.u32(0..=hit.tokens / BLOCK_TOKENS) * BLOCK_TOKENS
        } else {
            0
        };
        let mut blocks = HashMap::new();
        for (g, (spec, range)) in groups().iter().zip(&hit.load).enumerate() {
            for i in range.start.max(local / spec.block_tokens)..range.end {
                let i = i as usize;
                blocks.insert(d[g][i], (g, req.hashes[g][i]));
            }
        }
        let id = TransferId(1000 + req.id);
        let meta = StoreLoadMeta {
            request: request(id.0, req, d),
            hit,
            local_tokens: local,
        };
        let all = d.iter().flatten().copied().collect();
        let start = Instant::now();
        metas.push((
            PlannedLoad {
                id,
                blocks,
                all,
                start,
            },
            meta,
        ));
    }
    lock(&w.log).faults = true;
    let mut loads = Vec::new();
    for (mut plan, meta) in metas {
        plan.start = Instant::now();
        w.c.start_load_kv(plan.start, meta).unwrap();
        loads.push(plan);
    }
    loads
}

/// The backend's get records of the load wave, by block: each into a
/// planned block, under that block's key, once.
fn gets_by_block(
    w: &World,
    planned: &HashMap<u32, (usize, u64)>,
    since: Instant,
) -> HashMap<u32, KeyRec<()>> {
    let seed = w.seed;
    let (_, _, gets) = w.take_records(since);
    let mut got: HashMap<u32, KeyRec<()>> = HashMap::new();
    for g in gets {
        let Some(&(group, hash)) = planned.get(&g.block) else {
            panic!(
                "seed {seed}: a get into block {}, in no load's plan",
                g.block
            );
        };
        assert_eq!(g.key, w.key(group, hash), "seed {seed}: a get's key");
        let block = g.block;
        assert!(
            got.insert(block, g).is_none(),
            "seed {seed}: block {block} gotten twice"
        );
    }
    got
}

fn load_phase(w: &mut World, reqs: &[Req], rng: &mut fastrand::Rng) {
    let loads = start_loads(w, reqs, rng);
    let ids: Vec<TransferId> = loads.iter().map(|l| l.id).collect();
    let mut aborts: Vec<(TransferId, u32)> = Vec::new();
    for &id in &ids {
        if rng.u8(..8) == 0 {
            aborts.push((id, rng.u32(0..6)));
        }
    }
    let (_, loaded) = w.drive(&[], &ids, Instant::now(), &aborts);
    let seed = w.seed;
    for (id, report, _) in &loaded {
        if let LoadEnd::Aborted(_) = report.end {
            let asked = aborts.iter().any(|(a, _)| a == id);
            assert!(asked, "seed {seed}: load {id:?} aborted, never asked to");
            w.totals.aborted += 1;
        }
        w.totals.expired += u64::from(report.end == LoadEnd::Expired);
    }
    let seen: HashMap<TransferId, Instant> = loaded.iter().map(|(id, _, t)| (*id, *t)).collect();
    for l in &loads {
        for &b in &l.all {
            w.held.entry(b).or_default().push((l.start, seen[&l.id]));
        }
    }
    let errors: BTreeSet<u32> = (w.c.block_ids_with_load_errors().into_iter())
        .map(|b| b.0)
        .collect();
    let planned: HashMap<u32, (usize, u64)> = (loads.iter())
        .flat_map(|l| l.blocks.iter().map(|(b, gh)| (*b, *gh)))
        .collect();
    let since = loads.iter().map(|l| l.start).min();
    let got = gets_by_block(w, &planned, since.unwrap_or_else(Instant::now));
    let started: HashMap<u32, Instant> = (loads.iter())
        .flat_map(|l| l.blocks.keys().map(|b| (*b, l.start)))
        .collect();
    for (&b, &(_, hash)) in &planned {
        let loaded = !errors.contains(&b);
        let sure = |r: &KeyRec<()>| w.sure(r.sure, r.answered, started[&b]);
        match got.get(&b).map(|r| (r.answer.is_ok(), sure(r))) {
            Some((true, true)) => assert!(loaded, "seed {seed}: block {b} got in time, not loaded"),
            Some((true, false)) => w.totals.either_blocks += 1,
            other => assert!(
                !loaded,
                "seed {seed}: block {b} reported loaded, its get answered {other:?}"
            ),
        }
        if loaded {
            assert!(
                w.engine.holds(b, hash),
                "seed {seed}: block {b} loaded, bytes wrong"
            );
        }
        assert!(
            w.engine.slack_untouched(b),
            "seed {seed}: block {b}'s slack written"
        );
        w.totals.loaded_blocks += u64::from(loaded);
        w.totals.error_blocks += u64::from(!loaded);
    }
    let stray: Vec<&u32> = errors.iter().filter(|b| !planned.contains_key(b)).collect();
    assert!(
        stray.is_empty(),
        "seed {seed}: load errors for unplanned blocks {stray:?}"
    );
    for b in (0..NUM_BLOCKS).filter(|b| !planned.contains_key(b)) {
        assert!(
            w.engine.untouched(b),
            "seed {seed}: block {b}, in no load's plan, written"
        );
    }
    let loaded_keys: usize = loaded.iter().map(|(_, r, _)| r.loaded()).sum();
    let reported = planned.len() - errors.len();
    assert_eq!(loaded_keys, reported, "seed {seed}: reports against errors");
    w.totals.loads += loaded.len() as u64;
}

fn run_seed(seed: u64) -> Totals {
    let mut rng = fastrand::Rng::with_seed(seed);
    let reqs = workload(&mut rng);
    let blocks = allocate(&reqs, &mut rng);
    let mut w = World::new(seed);
    save_phase(&mut w, &reqs, &blocks);
    load_phase(&mut w, &reqs, &mut rng);
    // Every call posted is answered in the end, late ones included, and
    // an answer to a request already over changes nothing.
    let bound = Instant::now() + OP_BOUND + LATE_BY + DRIVER_SLACK;
    while w.c.stats().calls_in_flight > 0 {
        let now = Instant::now();
        assert!(now < bound, "seed {seed}: calls never answered");
        w.c.poll_wait((now + OP_BOUND / 4).min(bound));
    }
    assert_eq!(
        w.c.get_finished(),
        (vec![], vec![]),
        "seed {seed}: ends once"
    );
    assert!(w.c.block_ids_with_load_errors().is_empty(), "seed {seed}");
    let stats = w.c.stats();
    assert_eq!((stats.saves_running, stats.loads_running), (0, 0));
    w.totals.counts = lock(&w.log).counts;
    w.totals.pressure = stats.pressure;
    let World {
        c,
        log,
        held,
        totals,
        ..
    } = w;
    // Joins the backend thread (or waits out its last deadline): every
    // touch of engine memory is logged by then.
    drop(c);
    for (b, at) in std::mem::take(&mut lock(&log).touches) {
        let holds = held
            .get(&b)
            .is_some_and(|h| h.iter().any(|(s, e)| *s <= at && at <= *e));
        assert!(
            holds,
            "seed {seed}: block {b} touched by a store call while no save or load held it"
        );
    }
    totals
}

#[test]
fn seeded_store_faults_keep_reports_bytes_dedup_and_pressure_true() {
    let one = std::env::var("KVFERRY_STORE_SEED").ok();
    let seeds: Vec<u64> = match &one {
        Some(s) => vec![s.parse().expect("KVFERRY_STORE_SEED is a number")],
        None => (0..SEEDS).collect(),
    };
    let started = Instant::now();
    let mut totals = Totals::default();
    for seed in seeds {
        match catch_unwind(AssertUnwindSafe(|| run_seed(seed))) {
            Ok(t) => totals.add(&t),
            Err(panic) => {
                eprintln!("store fault seed {seed} failed; replay: KVFERRY_STORE_SEED={seed}");
                resume_unwind(panic);
            }
        }
    }
    eprintln!("{totals:#?}\nin {:?}", started.elapsed());
    if one.is_none() {
        let c = &totals.counts;
        let exercised = [
            ("whole-call failures", c.failed),
            ("failures after the work", c.failed_after_work),
            ("late answers", c.late),
            ("dropped calls", c.dropped),
            ("key faults", c.key_faults),
            ("full keys", c.full_keys),
            ("deduped keys", totals.deduped_keys),
            ("full saves", totals.pressure.full_saves),
            ("skipped saves", totals.pressure.skipped_saves),
            ("pressure clears", totals.pressure.clears),
            ("aborted saves and loads", totals.aborted),
            ("expired saves and loads", totals.expired),
            ("slow calls", c.slow),
            ("blocks loaded", totals.loaded_blocks),
            ("load error blocks", totals.error_blocks),
        ];
        for (what, n) in exercised {
            assert!(n > 0, "no {what} in {SEEDS} seeds");
        }
    }
}

/// The in-process store whose existence calls, once `hold` is set, wait
/// for the test's go: an answer that comes after its deadline, on cue.
struct HeldExists {
    inner: InprocStore,
    hold: Arc<std::sync::atomic::AtomicBool>,
    go: flume::Receiver<()>,
}

impl StoreBackend for HeldExists {
    fn name(&self) -> &'static str {
        "held"
    }
    fn exists(&mut self, keys: &[ChunkKey], d: Instant) -> Result<Vec<bool>, CallError> {
        if self.hold.load(std::sync::atomic::Ordering::SeqCst) {
            self.go.recv().map_err(|_| CallError::Transport)?;
        }
        self.inner.exists(keys, d)
    }
    fn put(&mut self, items: &[PutItem], d: Instant) -> Answers<PutOutcome> {
        self.inner.put(items, d)
    }
    fn get(&mut self, items: &[GetItem], d: Instant) -> Answers<()> {
        self.inner.get(items, d)
    }
    fn remove(&mut self, keys: &[ChunkKey], d: Instant) -> Answers<()> {
        self.inner.remove(keys, d)
    }
    fn take_removed(&mut self, max: usize) -> Vec<ChunkKey> {
        self.inner.take_removed(max)
    }
}

#[test]
fn keys_removed_before_a_late_lookup_still_become_block_removed_events() {
    let mut engine = Engine::new();
    let store = InprocStore::new(InprocConfig::default()).unwrap();
    let hold = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (go, go_rx) = flume::unbounded();
    let backend = HeldExists {
        inner: store.clone(),
        hold: hold.clone(),
        go: go_rx,
    };
    let mut c = StoreConnector::new(connector_config(REQUEST_TIMEOUT), backend).unwrap();
    // SAFETY: `engine` outlives `c` (declared before it), and is touched
    // only while no save or load holds its blocks.
    unsafe { c.register_kv_caches(engine.layout()).unwrap() };
    let req = Req {
        id: 1,
        tokens: 2 * BLOCK_TOKENS,
        hashes: vec![vec![1, 2], vec![3]],
    };
    let blocks = vec![vec![0, 1], vec![2]];
    for (bs, hs) in blocks.iter().zip(&req.hashes) {
        for (&b, &h) in bs.iter().zip(hs) {
            engine.fill(b, h);
        }
    }
    let meta = StoreSaveMeta {
        request: request(1, &req, &blocks),
        token_len: req.tokens,
        token_ids: None,
    };
    c.start_save(Instant::now(), meta).unwrap();
    c.wait_for_save();
    let (saved, _) = c.get_finished_reports();
    assert!(saved[0].1.is_complete());
    let _ = c.get_kv_events();
    // Another rank sharing the store removes block 1's key.
    let ks = c.keyspace();
    let gone = ks
        .key(
            &ks.shards()[0],
            &ks.scope(None, &[]).unwrap(),
            0,
            &BlockHash::from_u64(1),
        )
        .unwrap();
    let mut handle = store.clone();
    let far = Instant::now() + Duration::from_secs(60);
    assert_eq!(handle.remove(&[gone], far).unwrap(), vec![Ok(())]);
    // The next call of this connector's backend thread is a lookup that
    // answers after its deadline.
    hold.store(true, std::sync::atomic::Ordering::SeqCst);
    let hashes = block_hashes(&req);
    assert!(c.lookup(req.tokens, &hashes).is_err(), "past its deadline");
    hold.store(false, std::sync::atomic::Ordering::SeqCst);
    go.send(()).unwrap();
    // Queued behind the late one: when it answers, the late one did too.
    assert_eq!(c.lookup(req.tokens, &hashes).unwrap(), 0);
    let removed: Vec<BlockHash> = (c.get_kv_events().into_iter())
        .flat_map(|e| match e {
            KvEvent::BlockRemoved { block_hashes, .. } => block_hashes,
            _ => Vec::new(),
        })
        .collect();
    assert_eq!(removed, vec![BlockHash::from_u64(1)]);
    drop(c);
}

/// The in-process store whose puts (`on_puts`) or gets the test
/// scripts: the first does its work at once and answers on `answer`'s
/// go; later ones do nothing before `work`'s go, and nothing at all once
/// past their deadline.
struct Scripted {
    inner: InprocStore,
    on_puts: bool,
    calls: u32,
    answer: flume::Receiver<()>,
    work: flume::Receiver<()>,
}

impl Scripted {
    fn script<T>(
        &mut self,
        d: Instant,
        call: impl FnOnce(&mut InprocStore) -> Answers<T>,
    ) -> Answers<T> {
        self.calls += 1;
        if self.calls == 1 {
            let answers = call(&mut self.inner);
            self.answer.recv().map_err(|_| CallError::Transport)?;
            return answers;
        }
        self.work.recv().map_err(|_| CallError::Transport)?;
        if Instant::now() >= d {
            return Err(CallError::Timeout);
        }
        call(&mut self.inner)
    }
}

impl StoreBackend for Scripted {
    fn name(&self) -> &'static str {
        "scripted"
    }
    fn exists(&mut self, keys: &[ChunkKey], d: Instant) -> Result<Vec<bool>, CallError> {
        self.inner.exists(keys, d)
    }
    fn put(&mut self, items: &[PutItem], d: Instant) -> Answers<PutOutcome> {
        if !self.on_puts {
            return self.inner.put(items, d);
        }
        self.script(d, |s| s.put(items, d))
    }
    fn get(&mut self, items: &[GetItem], d: Instant) -> Answers<()> {
        if self.on_puts {
            return self.inner.get(items, d);
        }
        self.script(d, |s| s.get(items, d))
    }
    fn remove(&mut self, keys: &[ChunkKey], d: Instant) -> Answers<()> {
        self.inner.remove(keys, d)
    }
}

/// A connector over a [`Scripted`] store, with its two gates.
fn scripted(
    engine: &Engine,
    store: &InprocStore,
    on_puts: bool,
) -> (StoreConnector, flume::Sender<()>, flume::Sender<()>) {
    let (answer_tx, answer) = flume::unbounded();
    let (work_tx, work) = flume::unbounded();
    let backend = Scripted {
        inner: store.clone(),
        on_puts,
        calls: 0,
        answer,
        work,
    };
    let mut c = StoreConnector::new(connector_config(REQUEST_TIMEOUT), backend).unwrap();
    // SAFETY: every caller declares `engine` before the connector, so it
    // outlives it, and touches a block only while no save or load holds it.
    unsafe { c.register_kv_caches(engine.layout()).unwrap() };
    (c, answer_tx, work_tx)
}

/// Drives `c` until `get_finished` names load `id`; its error blocks.
fn load_errors_of(c: &mut StoreConnector, id: TransferId) -> Vec<BlockId> {
    let bound = Instant::now() + REQUEST_TIMEOUT + OP_BOUND + DRIVER_SLACK;
    loop {
        let (_, loaded) = c.get_finished();
        if !loaded.is_empty() {
            assert_eq!(loaded, vec![id]);
            return c.block_ids_with_load_errors();
        }
        let now = Instant::now();
        assert!(now < bound, "load {id:?} never ended");
        c.poll_wait((now + OP_BOUND / 4).min(bound));
    }
}

#[test]
fn a_late_answer_to_an_earlier_load_of_a_request_is_not_taken_for_a_later_one() {
    let engine = Engine::new();
    let store = InprocStore::new(InprocConfig::default()).unwrap();
    let (mut c, answer_tx, work_tx) = scripted(&engine, &store, false);
    let req = Req {
        id: 7,
        tokens: 2 * BLOCK_TOKENS,
        hashes: vec![vec![1, 2], vec![3]],
    };
    let ks = c.keyspace();
    let scope = ks.scope(None, &[]).unwrap();
    for (g, hs) in req.hashes.iter().enumerate() {
        for &h in hs {
            let key = (ks.key(&ks.shards()[0], &scope, g as u32, &BlockHash::from_u64(h))).unwrap();
            store.insert(key, &value_of(h)).unwrap();
        }
    }
    let hit = (c.lookup_hit(&scope, req.tokens, &block_hashes(&req))).unwrap();
    assert_eq!(hit.tokens, req.tokens);
    let id = TransferId(req.id);
    let load = |c: &mut StoreConnector, blocks: &[Vec<u32>]| {
        let meta = StoreLoadMeta {
            request: request(req.id, &req, blocks),
            hit: hit.clone(),
            local_tokens: 0,
        };
        c.start_load_kv(Instant::now(), meta).unwrap();
    };
    // The first load's get lands in time but answers after its deadline:
    // the load fails with every block.
    load(&mut c, &[vec![10, 11], vec![12]]);
    let first = load_errors_of(&mut c, id);
    assert_eq!(first, [10, 11, 12].map(BlockId));
    // The request loads again, into other blocks; the old answer comes in
    // while the new get waits, untouched, past its deadline.
    load(&mut c, &[vec![20, 21], vec![22]]);
    answer_tx.send(()).unwrap();
    let second = load_errors_of(&mut c, id);
    for (b, hash) in [(20, 1), (21, 2), (22, 3)] {
        let loaded = !second.contains(&BlockId(b));
        let holds = engine.holds(b, hash);
        assert!(!loaded || holds, "block {b} reported loaded, never written");
    }
    assert_eq!(second, [20, 21, 22].map(BlockId));
    // Past its deadline, the new get touches nothing.
    work_tx.send(()).unwrap();
    drop(c);
}

/// Drives `c` until `get_finished` names save `id`; its report.
fn save_report_of(c: &mut StoreConnector, id: TransferId) -> SaveReport {
    let bound = Instant::now() + REQUEST_TIMEOUT + OP_BOUND + DRIVER_SLACK;
    loop {
        let (mut saved, _) = c.get_finished_reports();
        if let Some((got, report)) = saved.pop() {
            assert_eq!(got, id);
            return report;
        }
        let now = Instant::now();
        assert!(now < bound, "save {id:?} never ended");
        c.poll_wait((now + OP_BOUND / 4).min(bound));
    }
}

/// The save side of the load test above: a save begins with its
/// existence check, which the backend thread answers after every call
/// posted before it, so the old answer finds the new save checking.
#[test]
fn a_late_answer_to_an_earlier_save_of_a_request_is_not_taken_for_a_later_one() {
    let mut engine = Engine::new();
    let store = InprocStore::new(InprocConfig::default()).unwrap();
    let (mut c, answer_tx, work_tx) = scripted(&engine, &store, true);
    // Four 16-token blocks in group 0, two 32-token blocks in group 1.
    let req = Req {
        id: 7,
        tokens: 4 * BLOCK_TOKENS,
        hashes: vec![vec![1, 2, 3, 4], vec![5, 6]],
    };
    let blocks = vec![vec![0, 1, 2, 3], vec![4, 5]];
    for (bs, hs) in blocks.iter().zip(&req.hashes) {
        for (&b, &h) in bs.iter().zip(hs) {
            engine.fill(b, h);
        }
    }
    let id = TransferId(req.id);
    let save = |c: &mut StoreConnector, tokens: u32| {
        let meta = StoreSaveMeta {
            request: request(req.id, &req, &blocks),
            token_len: tokens,
            token_ids: None,
        };
        c.start_save(Instant::now(), meta).unwrap();
    };
    // The first save (32 tokens: three keys, one put) stores in time but
    // answers after its deadline: the save fails.
    save(&mut c, 2 * BLOCK_TOKENS);
    let first = save_report_of(&mut c, id);
    assert_eq!(first.items.len(), 3);
    assert_eq!(first.stored(), 0, "{first:?}");
    // The request saves on (64 tokens): its three new keys go in one put,
    // which waits, untouched, past its deadline while the old answer
    // comes in.
    save(&mut c, 4 * BLOCK_TOKENS);
    answer_tx.send(()).unwrap();
    let second = save_report_of(&mut c, id);
    for (it, r) in second.items.iter().zip(&second.results) {
        if *r == SaveKeyResult::Stored {
            let held = store.value(&it.key);
            assert!(
                held.is_some(),
                "{:?} reported stored, not in the store",
                it.key
            );
        }
    }
    assert_eq!(second.stored(), 0, "{second:?}");
    work_tx.send(()).unwrap();
    drop(c);
}
