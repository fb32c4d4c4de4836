//! The scheduler side of store offload (docs/design.md, "Store: the
//! scheduler side"): per request, what the workers' [`super::StoreConnector`]s
//! must load from the store before the request computes, and which of
//! its computed prefix they must save, handed over once per step as a
//! [`StoreMeta`].
//!
//! Pure like the P2P scheduler (`kvferry::Scheduler`): no IO, no clock, no threads. The one
//! outside call is the prefix lookup, made through a [`PrefixLookup`]:
//! a [`super::StoreConnector`] asked directly, a [`super::LookupClient`]
//! asking the rank-0 worker's [`super::LookupServer`], or any closure
//! (the [`super::lookup`] module).
//!
//! ```text
//!  engine scheduler                 StoreScheduler                 workers
//!  waiting request ─ get_num_new_matched_tokens ─▶ lookup ─▶ (tokens, async)
//!  blocks allocated ─ update_state_after_alloc ─▶ load planned
//!  end of step ────── build_connector_meta ─────▶ StoreMeta ─▶ start_load_kv,
//!                                                              start_save
//!  load reported ──── loads_finished ───────────▶ load done
//!  request ends ───── request_finished ─────────▶ delay free?
//!  preemption ─────── request_preempted ────────▶ state dropped
//! ```
//!
//! * A lookup asks about one token less than the prompt (vLLM must compute
//!   at least one token), so a hit is whole blocks of the groups' common
//!   block multiple, and the tokens promised are the hit less the engine's
//!   own prefix hit.
//! * A load is handed to the workers exactly once, in the meta of the step
//!   its blocks were allocated in.
//! * A save covers the prompt's whole-multiple prefix computed by the end
//!   of the step; each step saves only when that prefix grew, so a chunked
//!   prefill saves each chunk once (the connector's existence check skips
//!   the blocks saved before). Decode tokens are not saved.
//! * A request that ends with a save planned, or a load not yet reported
//!   finished, keeps its blocks (`delay_free_blocks`); the next meta names
//!   it in [`StoreMeta::delayed_free`], so the workers report it finished
//!   once their saves and loads of it are collected.
//! * A preempted request loses its state (vLLM recomputes it from the
//!   start and asks again); the next meta names it in
//!   [`StoreMeta::preempted`], so the workers abort what still runs.
//!
//! Every map has a bound ([`StoreSchedulerConfig::max_requests`]); a call
//! that would pass it fails with [`StoreSchedError::Full`] and changes
//! nothing.

use std::collections::{HashMap, VecDeque};

use serde::{Deserialize, Serialize};

use kvferry_machines::store::lookup::{lcm_block_tokens, LookupHit};
use kvferry_machines::store::{BlockHash, GroupSpec};
use kvferry_machines::{BlockId, BlockLists, TransferId};

use super::config::{StoreLoadMeta, StoreRequest, StoreSaveMeta};
use super::lookup::wire::{wire_hashes, wire_hit};
use super::lookup::{LookupQuery, PrefixLookup};

/// How a [`StoreScheduler`] runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoreSchedulerConfig {
    /// The engine's KV-cache groups, as the keyspace names them.
    pub groups: Vec<GroupSpec>,
    /// Look prefixes up and load hits (false: every lookup is a miss).
    pub load: bool,
    /// Save computed prefixes (vLLM's `kv_producer` and `kv_both`).
    pub save: bool,
    /// Save past the prompt too, as decode tokens fill blocks (vLLM's
    /// `save_decode_cache`); the engine extends each request's hashes
    /// ([`StoreScheduler::extend_hashes`]).
    pub save_decode: bool,
    /// Loads run while the request waits (vLLM's `load_async`).
    pub load_async: bool,
    /// Most requests tracked, and most notices waiting for the next meta.
    pub max_requests: usize,
}

impl StoreSchedulerConfig {
    /// Loads and saves, asynchronous loads, 4096 requests.
    pub fn new(groups: Vec<GroupSpec>) -> StoreSchedulerConfig {
        StoreSchedulerConfig {
            groups,
            load: true,
            save: true,
            save_decode: false,
            load_async: true,
            max_requests: 4096,
        }
    }
}

/// A request as the scheduler sees it when it first asks about it.
#[derive(Clone, Copy, Debug)]
pub struct StoreReq<'a> {
    /// The engine's request id.
    pub request_id: &'a str,
    /// Tokens in the prompt.
    pub prompt_len_tokens: u32,
    /// Per group, the engine's block hashes of the prompt, block 0 first.
    pub block_hashes: &'a [Vec<BlockHash>],
    /// The LoRA adapter, if any.
    pub lora: Option<&'a str>,
    /// The engine's extra hash inputs.
    pub extra_keys: &'a [String],
}

/// One request scheduled in a step (vLLM's `num_scheduled_tokens` and
/// `new_block_ids` of a new or cached request).
#[derive(Clone, Copy, Debug)]
pub struct Scheduled<'a> {
    /// The request.
    pub request_id: &'a str,
    /// Tokens it computes in this step.
    pub num_scheduled_tokens: u32,
    /// Per group, blocks allocated to it in this step, appended to its
    /// blocks (empty lists when none).
    pub new_block_ids: &'a [Vec<BlockId>],
}

/// Why a scheduler call was refused; a refused call changes nothing.
#[non_exhaustive]
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum StoreSchedError {
    /// The configuration is unusable.
    #[error("bad store scheduler config: {0}")]
    BadConfig(&'static str),
    /// A bound is reached.
    #[error("{what}: at most {max}")]
    Full {
        /// What is full.
        what: &'static str,
        /// The bound.
        max: usize,
    },
    /// The call needs a request the scheduler does not track.
    #[error("request {request_id:?} is not tracked")]
    UnknownRequest {
        /// The request.
        request_id: String,
    },
    /// Another tracked request has the same transfer id.
    #[error("request {request_id:?} has the transfer id of request {other:?}")]
    IdCollision {
        /// The request asked about.
        request_id: String,
        /// The request tracked.
        other: String,
    },
    /// The call does not fit the request's state.
    #[error("request {request_id:?}: {call} not allowed once {state}")]
    WrongState {
        /// The request.
        request_id: String,
        /// The call.
        call: &'static str,
        /// The request's state.
        state: &'static str,
    },
    /// `update_state_after_alloc` with other external tokens than promised.
    #[error("request {request_id:?}: {got} external tokens, {want} promised")]
    ExternalTokens {
        /// The request.
        request_id: String,
        /// Tokens the engine allocated for.
        got: u32,
        /// Tokens promised (0 when none were).
        want: u32,
    },
    /// Block lists for another number of groups than configured.
    #[error("{got} groups of blocks or hashes, {want} configured")]
    GroupCount {
        /// Groups given.
        got: usize,
        /// Groups configured.
        want: usize,
    },
}

/// Where a request's load stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Load {
    /// Nothing to load.
    None,
    /// Tokens promised by `get_num_new_matched_tokens`, not allocated yet.
    Promised,
    /// Allocated; waits for the next meta.
    Planned,
    /// In a meta; not reported finished yet.
    InFlight,
    /// Reported finished.
    Done,
}

/// A tracked request.
#[derive(Clone, Debug)]
struct Tracked {
    request_id: String,
    prompt_len: u32,
    hashes: Vec<Vec<BlockHash>>,
    lora: Option<String>,
    extra_keys: Vec<String>,
    /// The lookup's answer (a miss when none was found).
    hit: LookupHit,
    /// The engine's own prefix hit when the lookup was made.
    local_tokens: u32,
    load: Load,
    /// `update_state_after_alloc` was called.
    allocated: bool,
    block_ids: BlockLists,
    /// Tokens whose KV the engine holds once the latest planned step ran.
    computed: u32,
    /// Tokens the store holds or a planned save covers.
    saved: u32,
    /// Saves planned.
    saves: u32,
}

impl Tracked {
    fn state(&self) -> &'static str {
        if self.allocated {
            "allocated"
        } else {
            "matched"
        }
    }

    fn request(&self, id: TransferId) -> PlannedRequest {
        PlannedRequest {
            request_id: self.request_id.clone(),
            id,
            block_hashes: self.hashes.clone(),
            block_ids: self.block_ids.clone(),
            lora: self.lora.clone(),
            extra_keys: self.extra_keys.clone(),
        }
    }
}

/// Counters of a [`StoreScheduler`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StoreSchedStats {
    /// Lookups asked.
    pub lookups: u64,
    /// Lookups that failed or answered nonsense (taken as misses).
    pub lookup_failures: u64,
    /// Tokens promised to the engine by lookups.
    pub promised_tokens: u64,
    /// Loads handed to the workers.
    pub loads_planned: u64,
    /// Saves handed to the workers.
    pub saves_planned: u64,
    /// Requests that ended with their blocks held.
    pub delayed_frees: u64,
    /// Requests preempted with their state dropped.
    pub preempted: u64,
    /// Scheduled requests not tracked, run without the store.
    pub untracked_scheduled: u64,
    /// Loads the engine reported failed.
    pub loads_failed: u64,
}

/// The scheduler side of store offload. See the module docs.
#[derive(Debug)]
pub struct StoreScheduler {
    cfg: StoreSchedulerConfig,
    /// The groups' common block multiple: hits and saves are multiples.
    unit: u32,
    requests: HashMap<TransferId, Tracked>,
    preempted: Vec<PlannedRef>,
    delayed_free: Vec<PlannedRef>,
    /// Requests whose load failed: their next lookup is a miss (bounded
    /// by `max_requests`, the oldest forgotten first).
    no_lookup: VecDeque<TransferId>,
    stats: StoreSchedStats,
}

impl StoreScheduler {
    /// A scheduler with nothing tracked.
    pub fn new(cfg: StoreSchedulerConfig) -> Result<StoreScheduler, StoreSchedError> {
        if cfg.max_requests == 0 {
            return Err(StoreSchedError::BadConfig(
                "max_requests must be at least 1",
            ));
        }
        if cfg.groups.is_empty() {
            return Err(StoreSchedError::BadConfig("at least one group"));
        }
        let unit = lcm_block_tokens(&cfg.groups)
            .map_err(|_| StoreSchedError::BadConfig("block sizes without a common multiple"))?;
        Ok(StoreScheduler {
            cfg,
            unit,
            requests: HashMap::new(),
            preempted: Vec::new(),
            delayed_free: Vec::new(),
            no_lookup: VecDeque::new(),
            stats: StoreSchedStats::default(),
        })
    }

    /// Requests tracked.
    pub fn tracked(&self) -> usize {
        self.requests.len()
    }

    /// Whether `request_id` is tracked.
    pub fn is_tracked(&self, request_id: &str) -> bool {
        self.requests
            .get(&TransferId::of_request_id(request_id))
            .is_some_and(|t| t.request_id == request_id)
    }

    /// Counters.
    pub fn stats(&self) -> StoreSchedStats {
        self.stats
    }

    /// The tracked request `request_id`, or why not.
    fn get_mut(&mut self, request_id: &str) -> Result<&mut Tracked, StoreSchedError> {
        let id = TransferId::of_request_id(request_id);
        match self.requests.get_mut(&id) {
            Some(t) if t.request_id == request_id => Ok(t),
            _ => Err(StoreSchedError::UnknownRequest {
                request_id: request_id.to_owned(),
            }),
        }
    }

    /// vLLM's `get_num_new_matched_tokens`: looks the prompt up and
    /// promises the stored tokens past the engine's own
    /// `num_computed_tokens`; the bool is "loaded asynchronously". A
    /// failed lookup is a miss. Asking again before allocation asks the
    /// store again.
    pub fn get_num_new_matched_tokens(
        &mut self,
        req: &StoreReq<'_>,
        num_computed_tokens: u32,
        lookup: &mut dyn PrefixLookup,
    ) -> Result<(u32, bool), StoreSchedError> {
        let id = TransferId::of_request_id(req.request_id);
        self.check_new(id, req)?;
        let hit = self.look_up(req, lookup);
        let promised = hit.tokens.saturating_sub(num_computed_tokens);
        self.stats.promised_tokens += u64::from(promised);
        let saved = hit.tokens;
        let t = Tracked {
            request_id: req.request_id.to_owned(),
            prompt_len: req.prompt_len_tokens,
            hashes: req.block_hashes.to_vec(),
            lora: req.lora.map(str::to_owned),
            extra_keys: req.extra_keys.to_vec(),
            hit,
            local_tokens: num_computed_tokens,
            load: if promised > 0 {
                Load::Promised
            } else {
                Load::None
            },
            allocated: false,
            block_ids: vec![Vec::new(); self.cfg.groups.len()],
            computed: 0,
            saved,
            saves: 0,
        };
        self.requests.insert(id, t);
        Ok((promised, promised > 0 && self.cfg.load_async))
    }

    /// Refuses a request that cannot be (re)tracked, before any lookup.
    fn check_new(&self, id: TransferId, req: &StoreReq<'_>) -> Result<(), StoreSchedError> {
        let want = self.cfg.groups.len();
        if req.block_hashes.len() != want {
            let got = req.block_hashes.len();
            return Err(StoreSchedError::GroupCount { got, want });
        }
        match self.requests.get(&id) {
            Some(t) if t.request_id != req.request_id => Err(StoreSchedError::IdCollision {
                request_id: req.request_id.to_owned(),
                other: t.request_id.clone(),
            }),
            Some(t) if t.allocated => Err(StoreSchedError::WrongState {
                request_id: req.request_id.to_owned(),
                call: "get_num_new_matched_tokens",
                state: t.state(),
            }),
            Some(_) => Ok(()),
            None if self.requests.len() >= self.cfg.max_requests => Err(StoreSchedError::Full {
                what: "requests tracked",
                max: self.cfg.max_requests,
            }),
            None => Ok(()),
        }
    }

    /// The question [`StoreScheduler::get_num_new_matched_tokens`] asks
    /// the store about `req`: the prompt less one token. `None` when it
    /// asks nothing (loads off, a one-token prompt, a request whose load
    /// just failed): a caller that looks up ahead of the call (off the
    /// scheduler's thread) asks exactly this.
    pub fn lookup_query(&self, req: &StoreReq<'_>) -> Option<LookupQuery> {
        let id = TransferId::of_request_id(req.request_id);
        if !self.cfg.load || req.prompt_len_tokens <= 1 || self.no_lookup.contains(&id) {
            return None;
        }
        Some(LookupQuery {
            token_len: req.prompt_len_tokens - 1,
            block_hashes: req.block_hashes.to_vec(),
            lora: req.lora.map(str::to_owned),
            extra_keys: req.extra_keys.to_vec(),
        })
    }

    /// The store's hit for [`StoreScheduler::lookup_query`]; a miss when
    /// there is none, the lookup fails, or its answer does not fit.
    fn look_up(&mut self, req: &StoreReq<'_>, lookup: &mut dyn PrefixLookup) -> LookupHit {
        let groups = self.cfg.groups.len();
        let miss = LookupHit {
            tokens: 0,
            load: vec![0..0; groups],
        };
        let id = TransferId::of_request_id(req.request_id);
        if let Some(at) = self.no_lookup.iter().position(|n| *n == id) {
            self.no_lookup.remove(at);
            return miss;
        }
        let Some(query) = self.lookup_query(req) else {
            return miss;
        };
        self.stats.lookups += 1;
        match lookup.lookup(&query) {
            Ok(hit) if self.fits(&hit, query.token_len) => hit,
            Ok(hit) => {
                tracing::warn!(
                    "lookup answer {hit:?} does not fit {} tokens",
                    query.token_len
                );
                self.stats.lookup_failures += 1;
                miss
            }
            Err(e) => {
                tracing::warn!("store lookup failed, taken as a miss: {e}");
                self.stats.lookup_failures += 1;
                miss
            }
        }
    }

    /// A hit of whole units within the question, with a load range per
    /// group inside its blocks of the hit.
    fn fits(&self, hit: &LookupHit, token_len: u32) -> bool {
        hit.tokens <= token_len
            && hit.tokens.is_multiple_of(self.unit)
            && hit.load.len() == self.cfg.groups.len()
            && (hit.load.iter().zip(&self.cfg.groups))
                .all(|(r, g)| r.start <= r.end && r.end <= hit.tokens / g.block_tokens)
    }

    /// vLLM's `update_state_after_alloc`: the request's blocks so far
    /// (every group, token order) and the external tokens the engine
    /// allocated for: those promised, or 0 to not load. A second call for
    /// an asynchronously loaded request (with 0) only updates the blocks.
    pub fn update_state_after_alloc(
        &mut self,
        request_id: &str,
        block_ids: &[Vec<BlockId>],
        num_external_tokens: u32,
    ) -> Result<(), StoreSchedError> {
        let want = self.cfg.groups.len();
        if block_ids.len() != want {
            let got = block_ids.len();
            return Err(StoreSchedError::GroupCount { got, want });
        }
        let t = self.get_mut(request_id)?;
        let promised = t.hit.tokens.saturating_sub(t.local_tokens);
        let first = !t.allocated;
        let load = match (t.load, num_external_tokens) {
            (Load::Promised, n) if n == promised => Load::Planned,
            (Load::Promised, 0) => Load::None,
            (l, 0) => l,
            (l, got) => {
                let want = if l == Load::Promised { promised } else { 0 };
                return Err(StoreSchedError::ExternalTokens {
                    request_id: request_id.to_owned(),
                    got,
                    want,
                });
            }
        };
        if first {
            t.computed = t.local_tokens + num_external_tokens;
        }
        t.load = load;
        t.allocated = true;
        t.block_ids = block_ids.to_vec();
        Ok(())
    }

    /// vLLM's `build_connector_meta`: records the step's scheduled
    /// requests and hands over every load planned, the saves of prefixes
    /// that grew, and the notices since the last call. A request not
    /// tracked (refused when it was matched) runs without the store and
    /// is counted. Validates the whole step first: on an error nothing
    /// changed.
    pub fn build_connector_meta(
        &mut self,
        step: &[Scheduled<'_>],
    ) -> Result<StoreMeta, StoreSchedError> {
        let want = self.cfg.groups.len();
        if let Some(s) = step.iter().find(|s| s.new_block_ids.len() != want) {
            let got = s.new_block_ids.len();
            return Err(StoreSchedError::GroupCount { got, want });
        }
        let mut meta = StoreMeta {
            preempted: std::mem::take(&mut self.preempted),
            delayed_free: std::mem::take(&mut self.delayed_free),
            ..StoreMeta::default()
        };
        for s in step {
            if self.get_mut(s.request_id).is_err() {
                self.stats.untracked_scheduled += 1;
                continue;
            }
            let id = TransferId::of_request_id(s.request_id);
            if let Some(save) = self.schedule(id, s) {
                meta.saves.push(save);
            }
        }
        for (id, t) in &mut self.requests {
            if t.load == Load::Planned {
                t.load = Load::InFlight;
                meta.loads.push(PlannedLoad {
                    request: t.request(*id),
                    hit: t.hit.clone(),
                    local_tokens: t.local_tokens,
                });
            }
        }
        meta.loads.sort_by_key(|l| l.request.id);
        self.stats.loads_planned += meta.loads.len() as u64;
        self.stats.saves_planned += meta.saves.len() as u64;
        Ok(meta)
    }

    /// One scheduled request: its new blocks and tokens, and the save of
    /// its prompt prefix when that grew to a further whole unit.
    fn schedule(&mut self, id: TransferId, s: &Scheduled<'_>) -> Option<PlannedSave> {
        let save = self.cfg.save;
        let unit = self.unit;
        let t = self.requests.get_mut(&id)?;
        for (blocks, new) in t.block_ids.iter_mut().zip(s.new_block_ids) {
            blocks.extend_from_slice(new);
        }
        t.computed = t.computed.saturating_add(s.num_scheduled_tokens);
        let limit = if self.cfg.save_decode {
            u32::MAX
        } else {
            t.prompt_len
        };
        let prefix = t.computed.min(limit) / unit * unit;
        let covered = (self.cfg.groups.iter().zip(&t.block_ids).zip(&t.hashes))
            .all(|((g, b), h)| (prefix / g.block_tokens) as usize <= b.len().min(h.len()));
        if !save || prefix <= t.saved || !covered {
            return None;
        }
        t.saved = prefix;
        t.saves += 1;
        Some(PlannedSave {
            request: t.request(id),
            token_len: prefix,
        })
    }

    /// The request's hashes, per group, now that its tokens grew past the
    /// prompt (decode saves): each list must start with the one the
    /// scheduler holds. Refused, changing nothing, otherwise.
    pub fn extend_hashes(
        &mut self,
        request_id: &str,
        block_hashes: &[Vec<BlockHash>],
    ) -> Result<(), StoreSchedError> {
        let want = self.cfg.groups.len();
        if block_hashes.len() != want {
            let got = block_hashes.len();
            return Err(StoreSchedError::GroupCount { got, want });
        }
        let t = self.get_mut(request_id)?;
        let extends = (t.hashes.iter().zip(block_hashes)).all(|(old, new)| new.starts_with(old));
        if !extends {
            return Err(StoreSchedError::WrongState {
                request_id: request_id.to_owned(),
                call: "extend_hashes",
                state: "hashes that do not extend the request's",
            });
        }
        t.hashes = block_hashes.to_vec();
        Ok(())
    }

    /// vLLM's `update_connector_output`, its `finished_recving`: these
    /// requests' loads ended (unknown ones are skipped).
    pub fn loads_finished(&mut self, request_ids: &[&str]) {
        for r in request_ids {
            if let Ok(t) = self.get_mut(r) {
                if t.load == Load::InFlight {
                    t.load = Load::Done;
                }
            }
        }
    }

    /// vLLM's `request_finished`: forgets the request and says whether its
    /// blocks must stay allocated until the workers report it finished (a
    /// save planned, or a load not reported finished, and blocks to keep).
    /// An unknown request frees at once.
    pub fn request_finished(
        &mut self,
        request_id: &str,
        block_ids: &[Vec<BlockId>],
    ) -> Result<bool, StoreSchedError> {
        let Ok(t) = self.get_mut(request_id) else {
            return Ok(false);
        };
        // Only saves hold blocks past the end: vLLM itself keeps the blocks
        // of a request whose load is in flight until the workers report it
        // (`finished_recving`), and a second report of it as sent would be
        // one too many.
        let delay = t.saves > 0 && block_ids.iter().any(|b| !b.is_empty());
        self.notice(request_id, delay, false)?;
        Ok(delay)
    }

    /// vLLM's `failed_recving`: the request's load failed and the engine
    /// computes it again from the start. Forgets it (the load ended, no
    /// notice), and its next lookup is a miss without asking the store, so
    /// a load that failed is not tried again at once. A request without a
    /// store load in flight is skipped: the failed load was another
    /// source's (the prefill engine's, when one connector has both).
    pub fn load_failed(&mut self, request_id: &str) {
        let Ok(t) = self.get_mut(request_id) else {
            return;
        };
        if t.load != Load::InFlight {
            return;
        }
        t.load = Load::Done;
        let id = TransferId::of_request_id(request_id);
        self.requests.remove(&id);
        if self.no_lookup.len() >= self.cfg.max_requests {
            self.no_lookup.pop_front();
        }
        self.no_lookup.push_back(id);
        self.stats.loads_failed += 1;
    }

    /// The request was preempted (its blocks freed; vLLM recomputes it and
    /// asks again): forgets it, and the next meta names it when a save or
    /// load of it may still run. An unknown request is no error.
    pub fn request_preempted(&mut self, request_id: &str) -> Result<(), StoreSchedError> {
        let Ok(t) = self.get_mut(request_id) else {
            return Ok(());
        };
        let busy = t.saves > 0 || t.load == Load::InFlight;
        self.notice(request_id, busy, true)
    }

    /// Forgets a tracked request, queueing a notice of it when `notify`.
    fn notice(
        &mut self,
        request_id: &str,
        notify: bool,
        preempt: bool,
    ) -> Result<(), StoreSchedError> {
        let id = TransferId::of_request_id(request_id);
        let max = self.cfg.max_requests;
        let list = if preempt {
            &mut self.preempted
        } else {
            &mut self.delayed_free
        };
        if notify {
            if list.len() >= max {
                let what = "notices waiting for the next meta";
                return Err(StoreSchedError::Full { what, max });
            }
            list.push(PlannedRef {
                request_id: request_id.to_owned(),
                id,
            });
        }
        if notify && preempt {
            self.stats.preempted += 1;
        } else if notify {
            self.stats.delayed_frees += 1;
        }
        self.requests.remove(&id);
        Ok(())
    }
}

/// A request as a meta names it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlannedRef {
    /// The engine's request id (what the workers report back).
    pub request_id: String,
    /// Its transfer id (what the connector keys it by).
    pub id: TransferId,
}

/// The request-wide inputs of a planned load or save.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlannedRequest {
    /// The engine's request id.
    pub request_id: String,
    /// Its transfer id.
    pub id: TransferId,
    /// Per group, the engine's block hashes.
    #[serde(with = "wire_hashes")]
    pub block_hashes: Vec<Vec<BlockHash>>,
    /// Per group, the engine's blocks.
    pub block_ids: BlockLists,
    /// The LoRA adapter, if any.
    pub lora: Option<String>,
    /// The engine's extra hash inputs.
    pub extra_keys: Vec<String>,
}

impl PlannedRequest {
    fn store_request(&self) -> StoreRequest {
        StoreRequest {
            id: self.id,
            block_hashes: self.block_hashes.clone(),
            block_ids: self.block_ids.clone(),
            lora: self.lora.clone(),
            extra_keys: self.extra_keys.clone(),
        }
    }
}

/// A load for the workers' `start_load_kv`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlannedLoad {
    /// The request.
    pub request: PlannedRequest,
    /// The lookup's hit.
    #[serde(with = "wire_hit")]
    pub hit: LookupHit,
    /// Leading tokens the engine holds itself.
    pub local_tokens: u32,
}

impl PlannedLoad {
    /// The connector's [`StoreLoadMeta`].
    pub fn load_meta(&self) -> StoreLoadMeta {
        StoreLoadMeta {
            request: self.request.store_request(),
            hit: self.hit.clone(),
            local_tokens: self.local_tokens,
        }
    }
}

/// A save for the workers' `start_save`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlannedSave {
    /// The request.
    pub request: PlannedRequest,
    /// Leading tokens to save (a multiple of the groups' common block).
    pub token_len: u32,
}

impl PlannedSave {
    /// The connector's [`StoreSaveMeta`] (no token ids for events).
    pub fn save_meta(&self) -> StoreSaveMeta {
        StoreSaveMeta {
            request: self.request.store_request(),
            token_len: self.token_len,
            token_ids: None,
        }
    }
}

/// One step's work for the workers (vLLM's connector metadata): shipped
/// from the scheduler's process to every worker ([`StoreMeta::encode`]).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoreMeta {
    /// Loads to start, each once.
    pub loads: Vec<PlannedLoad>,
    /// Saves to start after the step's forward pass.
    pub saves: Vec<PlannedSave>,
    /// Preempted requests: abort their saves and loads still running.
    pub preempted: Vec<PlannedRef>,
    /// Finished requests whose blocks wait: report each finished
    /// (`finished_sending`) once its saves and loads are collected.
    pub delayed_free: Vec<PlannedRef>,
}

impl StoreMeta {
    /// Nothing to do.
    pub fn is_empty(&self) -> bool {
        self.loads.is_empty()
            && self.saves.is_empty()
            && self.preempted.is_empty()
            && self.delayed_free.is_empty()
    }

    /// Its postcard bytes.
    pub fn encode(&self) -> Vec<u8> {
        // Serializing plain data into a Vec cannot fail.
        postcard::to_allocvec(self).unwrap_or_default()
    }

    /// A meta from [`StoreMeta::encode`]'s bytes.
    pub fn decode(bytes: &[u8]) -> Result<StoreMeta, postcard::Error> {
        match postcard::take_from_bytes(bytes)? {
            (meta, []) => Ok(meta),
            _ => Err(postcard::Error::DeserializeBadEncoding),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lookup::LookupFailure;
    use proptest::prelude::*;
    use std::ops::Range;

    const BT: u32 = 16;

    fn cfg(max_requests: usize) -> StoreSchedulerConfig {
        StoreSchedulerConfig {
            max_requests,
            ..StoreSchedulerConfig::new(vec![GroupSpec {
                block_tokens: BT,
                window_tokens: None,
            }])
        }
    }

    fn sched() -> StoreScheduler {
        StoreScheduler::new(cfg(8)).unwrap()
    }

    fn hashes(prompt: u32) -> Vec<Vec<BlockHash>> {
        vec![(0..prompt.div_ceil(BT))
            .map(|i| BlockHash::from_u64(u64::from(i)))
            .collect()]
    }

    /// A store holding the first `stored` blocks of every request.
    fn store(stored: u32) -> impl FnMut(&LookupQuery) -> Result<LookupHit, LookupFailure> {
        move |q| {
            let blocks = (q.token_len / BT).min(stored);
            Ok(LookupHit {
                tokens: blocks * BT,
                load: std::iter::once(0..blocks).collect(),
            })
        }
    }

    fn blocks(ids: Range<u32>) -> Vec<Vec<BlockId>> {
        vec![ids.map(BlockId).collect()]
    }

    fn step(s: &mut StoreScheduler, id: &str, tokens: u32, new: Range<u32>) -> StoreMeta {
        let new = blocks(new);
        let sched = [Scheduled {
            request_id: id,
            num_scheduled_tokens: tokens,
            new_block_ids: &new,
        }];
        s.build_connector_meta(&sched).unwrap()
    }

    fn matched(
        s: &mut StoreScheduler,
        id: &str,
        prompt: u32,
        local: u32,
        stored: u32,
    ) -> (u32, bool) {
        let h = hashes(prompt);
        let req = StoreReq {
            request_id: id,
            prompt_len_tokens: prompt,
            block_hashes: &h,
            lora: None,
            extra_keys: &[],
        };
        s.get_num_new_matched_tokens(&req, local, &mut store(stored))
            .unwrap()
    }

    #[test]
    fn a_chunked_prefill_saves_each_block_once() {
        let mut s = sched();
        assert_eq!(matched(&mut s, "r", 100, 0, 0), (0, false));
        s.update_state_after_alloc("r", &blocks(0..2), 0).unwrap();
        let mut saved = Vec::new();
        // Chunks of 24 tokens (not block-aligned), then two decode steps.
        let chunks = [
            (24, 0..0),
            (24, 2..3),
            (24, 3..5),
            (24, 5..6),
            (4, 6..7),
            (1, 0..0),
            (1, 0..0),
        ];
        for (tokens, new) in chunks {
            let meta = step(&mut s, "r", tokens, new);
            assert!(meta.loads.is_empty());
            saved.extend(meta.saves.iter().map(|m| m.token_len));
        }
        assert_eq!(saved, [16, 48, 64, 96]);
        // Every save's blocks are the request's first blocks.
        let meta = step(&mut s, "r", 1, 0..0);
        assert!(meta.is_empty());
        assert_eq!(s.stats().saves_planned, 4);
    }

    #[test]
    fn a_full_hit_loads_and_saves_only_the_last_block() {
        let mut s = sched();
        // 64 prompt tokens, all 4 blocks stored: 48 tokens can be loaded
        // (one token must be computed, so the last block is not).
        assert_eq!(matched(&mut s, "r", 64, 0, 4), (48, true));
        s.update_state_after_alloc("r", &blocks(10..14), 48)
            .unwrap();
        let meta = s.build_connector_meta(&[]).unwrap();
        assert_eq!(meta.loads.len(), 1);
        let load = meta.loads[0].load_meta();
        assert_eq!((load.hit.tokens, load.local_tokens), (48, 0));
        assert_eq!(load.request.block_ids, blocks(10..14));
        assert!(
            s.build_connector_meta(&[]).unwrap().is_empty(),
            "loaded twice"
        );
        s.loads_finished(&["r"]);
        // The second call once the load is done only updates the blocks.
        s.update_state_after_alloc("r", &blocks(10..14), 0).unwrap();
        let meta = step(&mut s, "r", 16, 0..0);
        assert_eq!(meta.saves.len(), 1);
        assert_eq!(meta.saves[0].token_len, 64);
        assert!(s.request_finished("r", &blocks(10..14)).unwrap());
        assert_eq!(s.tracked(), 0);
    }

    #[test]
    fn a_partial_hit_loads_past_the_local_prefix_then_computes() {
        let mut s = StoreScheduler::new(StoreSchedulerConfig {
            load_async: false,
            ..cfg(8)
        })
        .unwrap();
        // 96 tokens, 3 blocks stored, 1 held locally: 32 tokens to load.
        assert_eq!(matched(&mut s, "r", 96, 16, 3), (32, false));
        s.update_state_after_alloc("r", &blocks(0..6), 32).unwrap();
        // Synchronous: loaded and computed in the same step.
        let meta = step(&mut s, "r", 48, 0..0);
        assert_eq!(meta.loads.len(), 1);
        assert_eq!(meta.loads[0].local_tokens, 16);
        assert_eq!(meta.loads[0].hit.tokens, 48);
        assert_eq!(meta.saves.len(), 1);
        assert_eq!(meta.saves[0].token_len, 96);
    }

    #[test]
    fn declining_the_promised_tokens_loads_nothing() {
        let mut s = sched();
        assert_eq!(matched(&mut s, "r", 64, 0, 2), (32, true));
        s.update_state_after_alloc("r", &blocks(0..4), 0).unwrap();
        let meta = step(&mut s, "r", 64, 0..0);
        assert!(meta.loads.is_empty());
        // The store holds 32 tokens already: the save is of the rest.
        assert_eq!(meta.saves[0].token_len, 64);
    }

    #[test]
    fn preempted_and_finished_requests_leave_no_state() {
        let mut s = sched();
        matched(&mut s, "a", 64, 0, 0);
        s.update_state_after_alloc("a", &blocks(0..4), 0).unwrap();
        assert_eq!(step(&mut s, "a", 32, 0..0).saves.len(), 1);
        s.request_preempted("a").unwrap();
        assert!(!s.is_tracked("a"));
        let meta = s.build_connector_meta(&[]).unwrap();
        assert_eq!(meta.preempted[0].request_id, "a");
        assert!(s.build_connector_meta(&[]).unwrap().is_empty());
        // Asked again after preemption: a new life, saving from the start.
        matched(&mut s, "a", 64, 0, 0);
        s.update_state_after_alloc("a", &blocks(4..8), 0).unwrap();
        assert_eq!(step(&mut s, "a", 64, 0..0).saves[0].token_len, 64);
        // Finished with a save planned: blocks held, then forgotten.
        assert!(s.request_finished("a", &blocks(4..8)).unwrap());
        assert_eq!(s.tracked(), 0);
        let meta = s.build_connector_meta(&[]).unwrap();
        assert_eq!(meta.delayed_free[0].request_id, "a");
        // Finished before anything was planned: freed at once.
        matched(&mut s, "b", 64, 0, 0);
        assert!(!s.request_finished("b", &blocks(0..4)).unwrap());
        assert_eq!(s.tracked(), 0);
        assert!(!s.request_finished("never-seen", &[]).unwrap());
    }

    #[test]
    fn a_request_ended_during_its_load_is_not_held_for_it() {
        // vLLM holds the blocks of a request whose load is in flight until
        // the workers report it loaded; a delayed free would report it a
        // second time.
        let mut s = sched();
        assert_eq!(matched(&mut s, "a", 64, 0, 3), (48, true));
        s.update_state_after_alloc("a", &blocks(0..4), 48).unwrap();
        assert_eq!(s.build_connector_meta(&[]).unwrap().loads.len(), 1);
        assert!(!s.request_finished("a", &blocks(0..4)).unwrap());
        assert!(s.build_connector_meta(&[]).unwrap().delayed_free.is_empty());
    }

    #[test]
    fn another_sources_failed_load_leaves_the_request_tracked() {
        let mut s = sched();
        assert_eq!(matched(&mut s, "a", 64, 0, 0), (0, false));
        s.update_state_after_alloc("a", &blocks(0..4), 0).unwrap();
        s.build_connector_meta(&[]).unwrap();
        s.load_failed("a");
        assert!(s.is_tracked("a"));
        assert_eq!(s.stats().loads_failed, 0);
    }

    #[test]
    fn after_a_failed_load_the_request_computes_without_asking_the_store() {
        let mut s = sched();
        assert_eq!(matched(&mut s, "a", 64, 0, 3), (48, true));
        s.update_state_after_alloc("a", &blocks(0..4), 48).unwrap();
        s.build_connector_meta(&[]).unwrap();
        s.load_failed("a");
        assert!(!s.is_tracked("a"));
        assert_eq!(s.stats().loads_failed, 1);
        let h = hashes(64);
        let req = StoreReq {
            request_id: "a",
            prompt_len_tokens: 64,
            block_hashes: &h,
            lora: None,
            extra_keys: &[],
        };
        assert_eq!(s.lookup_query(&req), None);
        let mut asked = false;
        let mut ask = |q: &LookupQuery| {
            asked = true;
            store(3)(q)
        };
        assert_eq!(
            s.get_num_new_matched_tokens(&req, 0, &mut ask),
            Ok((0, false))
        );
        assert!(!asked, "the store was asked again");
        // Only that once: a later life of the id asks again.
        s.request_finished("a", &blocks(0..4)).unwrap();
        assert!(s.lookup_query(&req).is_some());
        assert_eq!(matched(&mut s, "a", 64, 0, 3), (48, true));
    }

    #[test]
    fn decode_saves_follow_the_computed_tokens_as_far_as_the_hashes_go() {
        let save_decode = StoreSchedulerConfig {
            save_decode: true,
            ..cfg(8)
        };
        let mut s = StoreScheduler::new(save_decode).unwrap();
        matched(&mut s, "a", 40, 0, 0);
        s.update_state_after_alloc("a", &blocks(0..3), 0).unwrap();
        assert_eq!(step(&mut s, "a", 40, 0..0).saves[0].token_len, 32);
        // Decode: one token a step; the third block fills at 48 tokens.
        for _ in 40..47 {
            assert!(step(&mut s, "a", 1, 0..0).saves.is_empty());
        }
        assert_eq!(step(&mut s, "a", 1, 0..0).saves[0].token_len, 48);
        // The fourth block fills, but its hash is not known yet.
        for _ in 48..64 {
            assert!(step(&mut s, "a", 1, 3..3).saves.is_empty());
        }
        let other = vec![vec![BlockHash::from_u64(99); 4]];
        assert!(s.extend_hashes("a", &other).is_err(), "not an extension");
        s.extend_hashes("a", &hashes(64)).unwrap();
        let meta = step(&mut s, "a", 0, 3..4);
        assert_eq!(meta.saves[0].token_len, 64);
        assert_eq!(meta.saves[0].request.block_hashes, hashes(64));
        // Without decode saves the prompt is the limit.
        let mut s = sched();
        matched(&mut s, "b", 40, 0, 0);
        s.update_state_after_alloc("b", &blocks(0..3), 0).unwrap();
        step(&mut s, "b", 40, 0..0);
        s.extend_hashes("b", &hashes(64)).unwrap();
        assert!(step(&mut s, "b", 24, 3..4).saves.is_empty());
    }

    #[test]
    fn bounds_and_misuse_are_typed_errors_that_change_nothing() {
        let mut s = StoreScheduler::new(cfg(2)).unwrap();
        matched(&mut s, "a", 64, 0, 0);
        matched(&mut s, "b", 64, 0, 2);
        let h = hashes(64);
        let req = StoreReq {
            request_id: "c",
            prompt_len_tokens: 64,
            block_hashes: &h,
            lora: None,
            extra_keys: &[],
        };
        let full = s.get_num_new_matched_tokens(&req, 0, &mut store(0));
        assert!(matches!(full, Err(StoreSchedError::Full { max: 2, .. })));
        assert_eq!(s.tracked(), 2);
        let wrong = s.update_state_after_alloc("b", &blocks(0..4), 16);
        assert!(matches!(
            wrong,
            Err(StoreSchedError::ExternalTokens {
                got: 16,
                want: 32,
                ..
            })
        ));
        let groups = s.update_state_after_alloc("b", &[], 32);
        assert!(matches!(
            groups,
            Err(StoreSchedError::GroupCount { got: 0, want: 1 })
        ));
        let unknown = s.update_state_after_alloc("c", &blocks(0..4), 0);
        assert!(matches!(
            unknown,
            Err(StoreSchedError::UnknownRequest { .. })
        ));
        let again = s.get_num_new_matched_tokens(
            &StoreReq {
                request_id: "b",
                ..req
            },
            0,
            &mut store(0),
        );
        assert!(
            again.is_ok(),
            "a request may be asked about again before allocation"
        );
        s.update_state_after_alloc("a", &blocks(0..4), 0).unwrap();
        let again = s.get_num_new_matched_tokens(
            &StoreReq {
                request_id: "a",
                ..req
            },
            0,
            &mut store(0),
        );
        assert!(matches!(again, Err(StoreSchedError::WrongState { .. })));
        assert!(StoreScheduler::new(cfg(0)).is_err());
    }

    #[test]
    fn a_refused_step_records_nothing_and_untracked_requests_run_without_the_store() {
        let mut s = sched();
        matched(&mut s, "a", 64, 0, 0);
        matched(&mut s, "b", 64, 0, 0);
        s.update_state_after_alloc("a", &blocks(0..4), 0).unwrap();
        let new = blocks(0..0);
        let bad_step = [
            Scheduled {
                request_id: "a",
                num_scheduled_tokens: 64,
                new_block_ids: &new,
            },
            Scheduled {
                request_id: "b",
                num_scheduled_tokens: 64,
                new_block_ids: &[],
            },
        ];
        let refused = s.build_connector_meta(&bad_step);
        assert!(matches!(
            refused,
            Err(StoreSchedError::GroupCount { got: 0, want: 1 })
        ));
        // A request refused when matched runs without the store.
        let untracked = [Scheduled {
            request_id: "c",
            num_scheduled_tokens: 64,
            new_block_ids: &new,
        }];
        assert!(s.build_connector_meta(&untracked).unwrap().is_empty());
        assert_eq!(s.stats().untracked_scheduled, 1);
        // Nothing of the refused step was recorded.
        assert_eq!(step(&mut s, "a", 16, 0..0).saves[0].token_len, 16);
    }

    #[test]
    fn a_failed_or_nonsense_lookup_is_a_miss() {
        let mut s = sched();
        let h = hashes(64);
        let req = StoreReq {
            request_id: "r",
            prompt_len_tokens: 64,
            block_hashes: &h,
            lora: None,
            extra_keys: &[],
        };
        let mut failing = |_: &LookupQuery| Err(LookupFailure::Timeout(std::time::Duration::ZERO));
        assert_eq!(
            s.get_num_new_matched_tokens(&req, 0, &mut failing).unwrap(),
            (0, false)
        );
        // More tokens than asked about: not believed.
        let mut lying = |_: &LookupQuery| {
            Ok(LookupHit {
                tokens: 64,
                load: std::iter::once(0..4).collect(),
            })
        };
        assert_eq!(
            s.get_num_new_matched_tokens(&req, 0, &mut lying).unwrap(),
            (0, false)
        );
        assert_eq!(s.stats().lookup_failures, 2);
    }

    #[test]
    fn a_meta_survives_its_bytes() {
        let mut s = sched();
        matched(&mut s, "r", 64, 0, 2);
        s.update_state_after_alloc("r", &blocks(0..4), 32).unwrap();
        let meta = step(&mut s, "r", 32, 0..0);
        assert_eq!(meta.loads.len() + meta.saves.len(), 2);
        assert_eq!(StoreMeta::decode(&meta.encode()).unwrap(), meta);
        let mut bytes = meta.encode();
        bytes.push(0);
        assert!(StoreMeta::decode(&bytes).is_err());
    }

    /// One call of the engine's scheduler.
    #[derive(Clone, Debug)]
    enum Op {
        Match {
            req: usize,
            local_blocks: u32,
            stored: u32,
        },
        Alloc {
            req: usize,
            accept: bool,
        },
        Step {
            reqs: Vec<(usize, u32)>,
        },
        LoadsDone {
            req: usize,
        },
        Finish {
            req: usize,
        },
        Preempt {
            req: usize,
        },
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0..4usize, 0..3u32, 0..8u32).prop_map(|(req, local_blocks, stored)| Op::Match {
                req,
                local_blocks,
                stored
            }),
            (0..4usize, any::<bool>()).prop_map(|(req, accept)| Op::Alloc { req, accept }),
            proptest::collection::vec((0..4usize, 1..40u32), 0..4)
                .prop_map(|reqs| Op::Step { reqs }),
            (0..4usize).prop_map(|req| Op::LoadsDone { req }),
            (0..4usize).prop_map(|req| Op::Finish { req }),
            (0..4usize).prop_map(|req| Op::Preempt { req }),
        ]
    }

    /// What the test remembers of one life of a request.
    #[derive(Clone, Debug, Default)]
    struct Life {
        prompt: u32,
        promised: u32,
        allocated: bool,
        loads: u32,
        last_save: u32,
    }

    const NAMES: [&str; 4] = ["r0", "r1", "r2", "r3"];
    const PROMPT: [u32; 4] = [100, 64, 17, 130];

    /// One step of the allocated requests among `reqs`: the metadata
    /// round-trips, no block is saved twice, no request loads twice.
    fn step_keeps_the_invariants(
        s: &mut StoreScheduler,
        lives: &mut [Option<Life>; 4],
        reqs: &[(usize, u32)],
    ) -> Result<(), TestCaseError> {
        let none = blocks(0..0);
        let mut seen = std::collections::HashSet::new();
        let step: Vec<Scheduled> = (reqs.iter())
            .filter(|(r, _)| lives[*r].as_ref().is_some_and(|l| l.allocated))
            .filter(|(r, _)| seen.insert(*r))
            .map(|(r, t)| Scheduled {
                request_id: NAMES[*r],
                num_scheduled_tokens: *t,
                new_block_ids: &none,
            })
            .collect();
        let meta = s.build_connector_meta(&step).unwrap();
        prop_assert_eq!(StoreMeta::decode(&meta.encode()).unwrap(), meta.clone());
        for save in &meta.saves {
            let i = NAMES
                .iter()
                .position(|n| *n == save.request.request_id)
                .unwrap();
            let l = lives[i].as_mut().unwrap();
            prop_assert_eq!(save.token_len % BT, 0);
            prop_assert!(save.token_len <= l.prompt);
            prop_assert!(save.token_len > l.last_save, "a block saved twice");
            l.last_save = save.token_len;
        }
        for load in &meta.loads {
            let i = NAMES
                .iter()
                .position(|n| *n == load.request.request_id)
                .unwrap();
            let l = lives[i].as_mut().unwrap();
            l.loads += 1;
            prop_assert_eq!(l.loads, 1, "loaded twice");
            prop_assert!(load.hit.tokens > load.local_tokens);
        }
        Ok(())
    }

    proptest! {
        #[test]
        fn random_calls_keep_the_invariants(ops in proptest::collection::vec(op(), 1..60)) {
            let mut s = StoreScheduler::new(cfg(3)).unwrap();
            let mut lives: [Option<Life>; 4] = Default::default();
            for op in ops {
                let before = s.tracked();
                match op {
                    Op::Match { req, local_blocks, stored } => {
                        let prompt = PROMPT[req];
                        let local = (local_blocks * BT).min(prompt - 1) / BT * BT;
                        let h = hashes(prompt);
                        let r = StoreReq { request_id: NAMES[req], prompt_len_tokens: prompt, block_hashes: &h, lora: None, extra_keys: &[] };
                        match s.get_num_new_matched_tokens(&r, local, &mut store(stored)) {
                            Ok((n, _)) => {
                                prop_assert!(local + n < prompt, "promised the whole prompt");
                                lives[req] = Some(Life { prompt, promised: n, ..Life::default() });
                            }
                            Err(_) => prop_assert_eq!(s.tracked(), before),
                        }
                    }
                    Op::Alloc { req, accept } => {
                        let n = match &lives[req] { Some(l) if accept && !l.allocated => l.promised, _ => 0 };
                        let b = blocks(0..PROMPT[req].div_ceil(BT));
                        match s.update_state_after_alloc(NAMES[req], &b, n) {
                            Ok(()) => { if let Some(l) = &mut lives[req] { l.allocated = true; } }
                            Err(_) => prop_assert!(lives[req].is_none()),
                        }
                    }
                    Op::Step { reqs } => step_keeps_the_invariants(&mut s, &mut lives, &reqs)?,
                    Op::LoadsDone { req } => s.loads_finished(&[NAMES[req]]),
                    Op::Finish { req } => {
                        let b = blocks(0..1);
                        if s.request_finished(NAMES[req], &b).is_ok() {
                            lives[req] = None;
                            prop_assert!(!s.is_tracked(NAMES[req]));
                        }
                    }
                    Op::Preempt { req } => {
                        if s.request_preempted(NAMES[req]).is_ok() {
                            lives[req] = None;
                            prop_assert!(!s.is_tracked(NAMES[req]));
                        }
                    }
                }
                prop_assert!(s.tracked() <= 3);
                for (l, n) in lives.iter().zip(NAMES) {
                    prop_assert_eq!(l.is_some(), s.is_tracked(n), "{} tracked", n);
                }
            }
        }
    }
}
