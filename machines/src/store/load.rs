//! `LoadMachine`: one load of a request's stored blocks into the engine's
//! blocks, on one rank.
//!
//! # Contract
//!
//! * Plan the blocks with [`plan_load`] from a [`LookupHit`] (the load
//!   masks) and the tokens the engine holds itself, then create the
//!   machine with [`LoadMachine::new`].
//! * Gets go in batches of at most `max_keys_per_batch` keys, at most
//!   `max_batches_in_flight` at once and, with a staging budget, never
//!   more value bytes in flight than the budget (so no single batch needs
//!   more either). A single value larger than the budget fails the whole
//!   load before any get, naming every block ([`LoadEnd::ValueTooLarge`]):
//!   no allocation is sized by the store's data.
//! * Exactly once, [`Action::Finished`] with a [`LoadReport`], in the same
//!   call that turns the phase terminal, and only once no get can write
//!   the blocks anymore (each was answered or passed its `op_bound`). Its
//!   [`LoadReport::error_blocks`] are exactly the blocks that were not
//!   loaded (vLLM's `block_ids_with_load_errors`): a block whose get failed,
//!   was never answered, was not attempted or came back the wrong size. A
//!   block may be half-written only if it is among them.
//! * A key that does not load stops the load: later batches are not
//!   posted (their blocks are reported), batches in flight still land.
//!   The request deadline and an abort stop it the same way. Terminal
//!   machines absorb every input.

use std::collections::VecDeque;
use std::time::Instant;

use crate::common::{after, earliest, AbortReason, BlockId, FailReason, InputError, Phase};
use crate::machine::Machine;

use super::batch::{Answer, Batches};
use super::key::{ChunkKey, Keyspace, RequestScope, Shard};
use super::lookup::LookupHit;
use super::{GroupBlocks, StoreConfig, StoreFault, StoreItem, StorePlanError};

/// What the store answered for one key of a get.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GetResult {
    /// The value landed in the block, whole.
    Loaded,
    /// No such key (evicted since the lookup).
    NotFound,
    /// The stored value has another size than the block's; the backend
    /// wrote nothing past the block.
    WrongSize {
        /// The stored value's size.
        got_bytes: u64,
    },
    /// Any other failure of this key.
    Failed,
}

/// Inputs of a [`LoadMachine`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// The answer to [`Action::Get`] `batch`.
    GetDone {
        /// The batch.
        batch: u32,
        /// One result per key of the batch, or the call's failure.
        answer: Result<Vec<GetResult>, StoreFault>,
    },
}

/// Outputs of a [`LoadMachine`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Get each item's value into its block, then report [`Event::GetDone`].
    Get {
        /// The batch id, 0, 1, 2, ...
        batch: u32,
        /// The items.
        items: Vec<StoreItem>,
        /// Their value bytes: at most the staging budget.
        bytes: u64,
    },
    /// The load is over: no get writes the blocks anymore (once).
    Finished {
        /// What became of each key.
        report: LoadReport,
    },
}

/// What became of one key of a load.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoadKeyResult {
    /// In the block, whole.
    Loaded,
    /// Not stored.
    NotFound,
    /// Stored with another size.
    WrongSize {
        /// The stored value's size.
        got_bytes: u64,
    },
    /// The get failed or was not answered within its bound.
    Failed,
    /// Never asked for: the load stopped first.
    NotAttempted,
}

/// How a load ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LoadEnd {
    /// Every key loaded.
    Loaded,
    /// A value is larger than the staging budget: nothing was loaded.
    ValueTooLarge {
        /// The key.
        key: ChunkKey,
        /// Its value's size.
        value_bytes: u64,
        /// The budget.
        budget_bytes: u64,
    },
    /// A key did not load (not found, wrong size, failed).
    KeyFailed,
    /// A whole call failed.
    Fault(StoreFault),
    /// The request timed out.
    Expired,
    /// The request was aborted.
    Aborted(AbortReason),
}

impl std::fmt::Display for LoadEnd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LoadEnd::Loaded => f.write_str("loaded"),
            LoadEnd::ValueTooLarge {
                key,
                value_bytes,
                budget_bytes,
            } => write!(
                f,
                "value of {key} is {value_bytes} bytes, over the staging budget of {budget_bytes} bytes"
            ),
            LoadEnd::KeyFailed => f.write_str("a key did not load"),
            LoadEnd::Fault(fault) => write!(f, "a store call failed: {fault:?}"),
            LoadEnd::Expired => f.write_str("the load timed out"),
            LoadEnd::Aborted(r) => write!(f, "aborted: {r:?}"),
        }
    }
}

/// The outcome of a load, key by key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoadReport {
    /// How it ended.
    pub end: LoadEnd,
    /// The items, as planned.
    pub items: Vec<StoreItem>,
    /// `results[i]` for `items[i]`.
    pub results: Vec<LoadKeyResult>,
}

impl LoadReport {
    /// The blocks that were not loaded, sorted, each once.
    pub fn error_blocks(&self) -> Vec<BlockId> {
        let mut out: Vec<BlockId> = (self.items.iter().zip(&self.results))
            .filter(|(_, r)| **r != LoadKeyResult::Loaded)
            .map(|(it, _)| it.block)
            .collect();
        out.sort_unstable();
        out.dedup();
        out
    }

    /// Keys loaded.
    pub fn loaded(&self) -> usize {
        (self.results.iter())
            .filter(|r| **r == LoadKeyResult::Loaded)
            .count()
    }

    fn phase(&self) -> Phase {
        match self.end {
            LoadEnd::Loaded => Phase::Success,
            LoadEnd::Expired => Phase::Expired,
            LoadEnd::Aborted(r) => Phase::Failed(FailReason::Aborted(r)),
            LoadEnd::ValueTooLarge { .. } => Phase::Failed(FailReason::BadMetadata),
            LoadEnd::KeyFailed | LoadEnd::Fault(_) => Phase::Failed(FailReason::Transport),
        }
    }
}

/// The blocks to load on this rank: per group, the blocks of the hit's
/// load mask that the engine does not hold itself (it holds its first
/// `local_tokens` tokens: vLLM's locally cached tokens).
pub fn plan_load(
    keyspace: &Keyspace,
    shard: &Shard,
    scope: &RequestScope,
    groups: &[GroupBlocks],
    hit: &LookupHit,
    local_tokens: u32,
) -> Result<Vec<StoreItem>, StorePlanError> {
    let specs = keyspace.groups();
    if groups.len() != specs.len() || hit.load.len() != specs.len() {
        return Err(StorePlanError::GroupCount {
            got: groups.len().min(hit.load.len()),
            want: specs.len(),
        });
    }
    let mut items = Vec::new();
    for (g, ((spec, blocks), range)) in specs.iter().zip(groups).zip(&hit.load).enumerate() {
        let g = g as u32;
        let local = local_tokens / spec.block_tokens;
        for index in range.start.max(local)..range.end {
            let i = index as usize;
            let (Some(hash), Some(&block)) = (blocks.hashes.get(i), blocks.block_ids.get(i)) else {
                return Err(StorePlanError::MissingBlock { group: g, index });
            };
            items.push(StoreItem {
                key: keyspace.key(shard, scope, g, hash)?,
                group: g,
                index,
                block,
                hash: *hash,
                value_bytes: blocks.value_bytes,
            });
        }
    }
    Ok(items)
}

#[derive(Clone, Debug)]
enum State {
    /// Gets are posted or in flight; `end` once the outcome is decided.
    Loading {
        batches: Batches,
        end: Option<LoadEnd>,
    },
    /// `Finished` was queued; absorbs every later input.
    Finished(Phase),
}

/// One load of one request on one rank. See the module docs.
#[derive(Clone, Debug)]
pub struct LoadMachine {
    cfg: StoreConfig,
    deadline: Instant,
    items: Vec<StoreItem>,
    results: Vec<LoadKeyResult>,
    state: State,
    actions: VecDeque<Action>,
}

impl LoadMachine {
    /// A load of `items` (from [`plan_load`]). Refused when there are more
    /// than `max_keys_per_request` items.
    pub fn new(
        now: Instant,
        cfg: &StoreConfig,
        items: Vec<StoreItem>,
    ) -> Result<LoadMachine, InputError> {
        if items.len() > cfg.max_keys_per_request {
            return Err(InputError::Misuse("more items than max_keys_per_request"));
        }
        let budget = cfg.staging_budget_bytes;
        let too_large = budget.and_then(|max| {
            let it = items.iter().find(|it| it.value_bytes > max)?;
            Some(LoadEnd::ValueTooLarge {
                key: it.key.clone(),
                value_bytes: it.value_bytes,
                budget_bytes: max,
            })
        });
        let batches = Batches::plan(&items, 0..items.len(), cfg, budget);
        let mut m = LoadMachine {
            cfg: *cfg,
            deadline: after(now, cfg.request_timeout),
            results: vec![LoadKeyResult::NotAttempted; items.len()],
            items,
            state: State::Loading {
                batches,
                end: too_large,
            },
            actions: VecDeque::new(),
        };
        m.progress(now);
        Ok(m)
    }

    /// True once `Finished` was queued.
    pub fn is_finished(&self) -> bool {
        matches!(self.state, State::Finished(_))
    }

    fn finish(&mut self, end: LoadEnd) {
        let report = LoadReport {
            end,
            items: self.items.clone(),
            results: self.results.clone(),
        };
        self.state = State::Finished(report.phase());
        self.actions.push_back(Action::Finished { report });
    }

    fn handle_get(
        &mut self,
        now: Instant,
        batch: u32,
        answer: Result<Vec<GetResult>, StoreFault>,
    ) -> Result<(), InputError> {
        let State::Loading { batches, end } = &mut self.state else {
            return Ok(());
        };
        let keys = answer.as_ref().ok().map(Vec::len);
        let flight = match batches.answer(batch, keys)? {
            Answer::Current(f) => f,
            Answer::Late => return Ok(()),
        };
        match answer {
            Ok(results) => {
                for (&i, r) in flight.items.iter().zip(results) {
                    self.results[i] = match r {
                        GetResult::Loaded => LoadKeyResult::Loaded,
                        GetResult::NotFound => LoadKeyResult::NotFound,
                        GetResult::WrongSize { got_bytes } => {
                            LoadKeyResult::WrongSize { got_bytes }
                        }
                        GetResult::Failed => LoadKeyResult::Failed,
                    };
                    if self.results[i] != LoadKeyResult::Loaded {
                        end.get_or_insert(LoadEnd::KeyFailed);
                    }
                }
            }
            Err(fault) => {
                flight.fail(&mut self.results, LoadKeyResult::Failed);
                end.get_or_insert(LoadEnd::Fault(fault));
            }
        }
        self.progress(now);
        Ok(())
    }

    /// Posts what may be posted; once the outcome is decided, gives up the
    /// rest and finishes when nothing is in flight.
    fn progress(&mut self, now: Instant) {
        let State::Loading { batches, end } = &mut self.state else {
            return;
        };
        if end.is_none() && now >= self.deadline {
            *end = Some(LoadEnd::Expired);
        }
        if let Some(e) = end {
            batches.cancel();
            if batches.is_idle() {
                let e = e.clone();
                self.finish(e);
            }
            return;
        }
        while let Some(f) = batches.post(now, &self.cfg) {
            let items = f.items.iter().map(|&i| self.items[i].clone()).collect();
            self.actions.push_back(Action::Get {
                batch: f.id,
                items,
                bytes: f.bytes,
            });
        }
        if batches.is_done() {
            self.finish(LoadEnd::Loaded);
        }
    }
}

impl Machine for LoadMachine {
    type Event = Event;
    type Action = Action;

    fn handle_event(&mut self, now: Instant, event: Event) -> Result<(), InputError> {
        match event {
            Event::GetDone { batch, answer } => self.handle_get(now, batch, answer),
        }
    }

    fn handle_timeout(&mut self, now: Instant) {
        let State::Loading { batches, end } = &mut self.state else {
            return;
        };
        let gone = batches.expire(now);
        if !gone.is_empty() {
            end.get_or_insert(LoadEnd::Fault(StoreFault::Timeout));
        }
        for f in &gone {
            f.fail(&mut self.results, LoadKeyResult::Failed);
        }
        self.progress(now);
    }

    fn abort(&mut self, now: Instant, reason: AbortReason) {
        if let State::Loading { end, .. } = &mut self.state {
            end.get_or_insert(LoadEnd::Aborted(reason));
            self.progress(now);
        }
    }

    fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    fn poll_timeout(&self) -> Option<Instant> {
        match &self.state {
            State::Loading { batches, end } => {
                let request = end.is_none().then_some(self.deadline);
                earliest(batches.poll_timeout(), request)
            }
            State::Finished(_) => None,
        }
    }

    fn phase(&self) -> Phase {
        match &self.state {
            State::Loading { .. } => Phase::Transferring,
            State::Finished(p) => *p,
        }
    }
}
