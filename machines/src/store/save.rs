//! `SaveMachine`: one save of a request's blocks to the store, on one rank.
//!
//! # Contract
//!
//! * Plan the blocks with [`plan_save`] (which blocks this rank stores:
//!   the store mask of each group and the replica striding), then create
//!   the machine with [`SaveMachine::new`]. It asks the [`Pressure`] value
//!   of the connector whether the request may save at all.
//! * Phases: `WaitingForInput` while the existence check is out (it reads
//!   no block), `Transferring` while puts are posted or in flight, then
//!   terminal. Dedup comes first: one batched [`Action::Exists`] for every
//!   key; only the missing keys are put, in batches of at most
//!   `max_keys_per_batch` keys, at most `max_batches_in_flight` at once.
//! * The engine's blocks stay the machine's until [`Action::Release`],
//!   queued exactly once, in the same call that turns the phase terminal,
//!   and only once no put can read them anymore: every put was answered or
//!   passed its `op_bound`. The report says what became of each key; the
//!   driver hands it to [`Pressure::handle_report`].
//! * A put answered "full" stops the save: the rest is not attempted, and
//!   the pressure skips later saves of the request until a save stores
//!   again. A whole call that fails stops it too; a key refused alone
//!   (too large, failed) does not.
//! * Timeouts are transitions: the existence check or a put past
//!   `op_bound` fails, the request past `request_timeout` stops posting
//!   and ends `Expired` once nothing is in flight. An abort stops posting
//!   and ends the same way. Terminal machines absorb every input.

use std::collections::{HashSet, VecDeque};
use std::time::Instant;

use crate::common::{after, earliest, AbortReason, InputError, Phase, TransferId};
use crate::machine::Machine;

use super::batch::{Answer, Batches};
use super::key::{ChunkKey, Keyspace, Replica, RequestScope, Shard};
use super::lookup::{lcm_block_tokens, store_mask};
pub use super::report::{SaveEnd, SaveKeyResult, SaveReport};
use super::{GroupBlocks, Pressure, StoreConfig, StoreFault, StoreItem, StorePlanError};

/// What the store answered for one key of a put.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PutResult {
    /// The value is stored.
    Stored,
    /// Another writer stored the key first: the value is there.
    Exists,
    /// The store is full (Mooncake's `NO_AVAILABLE_HANDLE`).
    Full,
    /// The store refuses a value this large.
    TooLarge,
    /// Any other failure of this key.
    Failed,
}

/// Inputs of a [`SaveMachine`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// The answer to [`Action::Exists`]: per key, whether it is stored.
    ExistsDone {
        /// One flag per key asked about, or the call's failure.
        answer: Result<Vec<bool>, StoreFault>,
    },
    /// The answer to [`Action::Put`] `batch`.
    PutDone {
        /// The batch.
        batch: u32,
        /// One result per key of the batch, or the call's failure.
        answer: Result<Vec<PutResult>, StoreFault>,
    },
}

/// Outputs of a [`SaveMachine`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Ask the store which of `keys` exist (one call), then report
    /// [`Event::ExistsDone`]. Reads no block.
    Exists {
        /// The keys, in item order.
        keys: Vec<ChunkKey>,
    },
    /// Put each item's block as its key's value, then report
    /// [`Event::PutDone`].
    Put {
        /// The batch id, 0, 1, 2, ...
        batch: u32,
        /// The items.
        items: Vec<StoreItem>,
    },
    /// The save is over: no put reads the blocks anymore (once).
    Release {
        /// What became of each key.
        report: SaveReport,
    },
}

/// The blocks of the first `token_len` tokens this rank stores: per group,
/// the store mask ([`store_mask`]) of the tokens aligned down to the
/// groups' common block multiple, of the blocks whose hash and block id
/// the request has, and of those the striding gives this replica.
pub fn plan_save(
    keyspace: &Keyspace,
    shard: &Shard,
    replica: &Replica,
    scope: &RequestScope,
    token_len: u32,
    groups: &[GroupBlocks],
) -> Result<Vec<StoreItem>, StorePlanError> {
    let specs = keyspace.groups();
    if groups.len() != specs.len() {
        return Err(StorePlanError::GroupCount {
            got: groups.len(),
            want: specs.len(),
        });
    }
    let lcm = lcm_block_tokens(specs)?;
    let covered = (specs.iter().zip(groups))
        .map(|(s, g)| u64::from(s.block_tokens) * g.hashes.len().min(g.block_ids.len()) as u64)
        .fold(u64::from(token_len), u64::min) as u32;
    let tokens = covered / lcm * lcm;
    let mut items = Vec::new();
    for (g, (spec, blocks)) in specs.iter().zip(groups).enumerate() {
        let g = g as u32;
        for (i, stored) in store_mask(spec, lcm, tokens).into_iter().enumerate() {
            let index = i as u32;
            if stored && replica.stores(g, index) {
                let hash = blocks.hashes[i];
                items.push(StoreItem {
                    key: keyspace.key(shard, scope, g, &hash)?,
                    group: g,
                    index,
                    block: blocks.block_ids[i],
                    hash,
                    value_bytes: blocks.value_bytes,
                });
            }
        }
    }
    Ok(items)
}

#[derive(Clone, Debug)]
enum State {
    /// The existence check is out; no block is read.
    Checking {
        /// When the check has failed for want of an answer.
        deadline: Instant,
    },
    /// Puts are posted or in flight; `end` once the outcome is decided.
    Putting {
        batches: Batches,
        end: Option<SaveEnd>,
    },
    /// `Release` was queued; absorbs every later input.
    Finished(Phase),
}

/// One save of one request on one rank. See the module docs.
#[derive(Clone, Debug)]
pub struct SaveMachine {
    cfg: StoreConfig,
    request: TransferId,
    deadline: Instant,
    items: Vec<StoreItem>,
    results: Vec<SaveKeyResult>,
    state: State,
    actions: VecDeque<Action>,
}

impl SaveMachine {
    /// A save of `items` (from [`plan_save`]) for `request`. Refused when
    /// there are more than `max_keys_per_request` items or two share a key.
    /// When `pressure` skips the request, the machine ends at once with a
    /// report of [`SaveEnd::Skipped`].
    pub fn new(
        now: Instant,
        cfg: &StoreConfig,
        request: TransferId,
        items: Vec<StoreItem>,
        pressure: &mut Pressure,
    ) -> Result<SaveMachine, InputError> {
        if items.len() > cfg.max_keys_per_request {
            return Err(InputError::Misuse("more items than max_keys_per_request"));
        }
        let mut seen = HashSet::with_capacity(items.len());
        if !items.iter().all(|it| seen.insert(&it.key)) {
            return Err(InputError::Misuse("two items of a save share a key"));
        }
        let mut m = SaveMachine {
            cfg: *cfg,
            request,
            deadline: after(now, cfg.request_timeout),
            results: vec![SaveKeyResult::NotAttempted; items.len()],
            items,
            state: State::Checking {
                deadline: after(now, cfg.op_bound),
            },
            actions: VecDeque::new(),
        };
        if !pressure.admit(request) {
            m.finish(SaveEnd::Skipped);
        } else if m.items.is_empty() {
            m.finish(SaveEnd::Done);
        } else {
            let keys = m.items.iter().map(|it| it.key.clone()).collect();
            m.actions.push_back(Action::Exists { keys });
        }
        Ok(m)
    }

    /// The request this save belongs to.
    pub fn request(&self) -> TransferId {
        self.request
    }

    /// True once `Release` was queued.
    pub fn is_released(&self) -> bool {
        matches!(self.state, State::Finished(_))
    }

    fn finish(&mut self, end: SaveEnd) {
        let report = SaveReport {
            end,
            items: self.items.clone(),
            results: self.results.clone(),
        };
        self.state = State::Finished(report.phase());
        self.actions.push_back(Action::Release { report });
    }

    fn handle_exists(
        &mut self,
        now: Instant,
        answer: Result<Vec<bool>, StoreFault>,
    ) -> Result<(), InputError> {
        let exists = match answer {
            Ok(e) if e.len() != self.items.len() => {
                return Err(InputError::Misuse(
                    "existence answer of another length than the keys",
                ))
            }
            Ok(e) => e,
            Err(fault) => {
                self.finish(SaveEnd::Fault(fault));
                return Ok(());
            }
        };
        let mut missing = Vec::new();
        for (i, e) in exists.into_iter().enumerate() {
            if e {
                self.results[i] = SaveKeyResult::Deduped;
            } else {
                missing.push(i);
            }
        }
        let batches = Batches::plan(&self.items, missing, &self.cfg, None);
        self.state = State::Putting { batches, end: None };
        self.progress(now);
        Ok(())
    }

    fn handle_put(
        &mut self,
        now: Instant,
        batch: u32,
        answer: Result<Vec<PutResult>, StoreFault>,
    ) -> Result<(), InputError> {
        let State::Putting { batches, end } = &mut self.state else {
            return Err(InputError::Misuse("put answer before the existence check"));
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
                        PutResult::Stored => SaveKeyResult::Stored,
                        PutResult::Exists => SaveKeyResult::Deduped,
                        PutResult::Full => {
                            end.get_or_insert(SaveEnd::StoreFull);
                            SaveKeyResult::Full
                        }
                        PutResult::TooLarge => SaveKeyResult::TooLarge,
                        PutResult::Failed => SaveKeyResult::Failed,
                    };
                }
            }
            Err(fault) => {
                flight.fail(&mut self.results, SaveKeyResult::Failed);
                end.get_or_insert(SaveEnd::Fault(fault));
            }
        }
        self.progress(now);
        Ok(())
    }

    /// Posts what may be posted; once the outcome is decided, gives up the
    /// rest and releases when nothing is in flight.
    fn progress(&mut self, now: Instant) {
        let State::Putting { batches, end } = &mut self.state else {
            return;
        };
        if end.is_none() && now >= self.deadline {
            *end = Some(SaveEnd::Expired);
        }
        if let Some(e) = *end {
            batches.cancel();
            if batches.is_idle() {
                self.finish(e);
            }
            return;
        }
        while let Some(f) = batches.post(now, &self.cfg) {
            let items = f.items.iter().map(|&i| self.items[i].clone()).collect();
            self.actions.push_back(Action::Put { batch: f.id, items });
        }
        if batches.is_done() {
            self.finish(SaveEnd::Done);
        }
    }
}

impl Machine for SaveMachine {
    type Event = Event;
    type Action = Action;

    fn handle_event(&mut self, now: Instant, event: Event) -> Result<(), InputError> {
        match (&self.state, event) {
            (State::Finished(_), _) => Ok(()),
            (State::Checking { .. }, Event::ExistsDone { answer }) => {
                self.handle_exists(now, answer)
            }
            (State::Putting { .. }, Event::ExistsDone { .. }) => {
                Err(InputError::Misuse("existence answered twice"))
            }
            (State::Checking { .. } | State::Putting { .. }, Event::PutDone { batch, answer }) => {
                self.handle_put(now, batch, answer)
            }
        }
    }

    fn handle_timeout(&mut self, now: Instant) {
        match &mut self.state {
            State::Checking { deadline } => {
                if now >= *deadline {
                    self.finish(SaveEnd::Fault(StoreFault::Timeout));
                } else if now >= self.deadline {
                    self.finish(SaveEnd::Expired);
                }
            }
            State::Putting { batches, end } => {
                let gone = batches.expire(now);
                if !gone.is_empty() {
                    end.get_or_insert(SaveEnd::Fault(StoreFault::Timeout));
                }
                for f in &gone {
                    f.fail(&mut self.results, SaveKeyResult::Failed);
                }
                self.progress(now);
            }
            State::Finished(_) => {}
        }
    }

    fn abort(&mut self, now: Instant, reason: AbortReason) {
        match &mut self.state {
            // The existence check reads no block: release at once.
            State::Checking { .. } => self.finish(SaveEnd::Aborted(reason)),
            State::Putting { end, .. } => {
                end.get_or_insert(SaveEnd::Aborted(reason));
                self.progress(now);
            }
            State::Finished(_) => {}
        }
    }

    fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    fn poll_timeout(&self) -> Option<Instant> {
        match &self.state {
            State::Checking { deadline } => Some((*deadline).min(self.deadline)),
            State::Putting { batches, end } => {
                let request = end.is_none().then_some(self.deadline);
                earliest(batches.poll_timeout(), request)
            }
            State::Finished(_) => None,
        }
    }

    fn phase(&self) -> Phase {
        match &self.state {
            State::Checking { .. } => Phase::WaitingForInput,
            State::Putting { .. } => Phase::Transferring,
            State::Finished(p) => *p,
        }
    }
}
