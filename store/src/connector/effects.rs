//! What the save and load machines' actions act on: everything of the
//! connector but its drivers. The drivers hand each action to
//! [`Effects`] (their [`ActionSink`]); a call that cannot be posted
//! becomes its machine's failed answer, queued here and fed back once the
//! driver has returned (a sink cannot reach its driver).

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use kvferry_machines::store::events::{stored_events, EventLog, EventSource, KvEvent};
use kvferry_machines::store::key::Replica;
use kvferry_machines::store::load::{self, LoadReport};
use kvferry_machines::store::save::{self, SaveReport};
use kvferry_machines::store::{
    BlockHash, ChunkKey, GroupBlocks, Keyspace, Pressure, RequestScope, Shard, StoreFault,
    StoreItem,
};
use kvferry_machines::{BlockId, TransferId};
use kvferry_reactor::ActionSink;

use super::runs::{CallFor, LoadRun, LoadStep, Run, SaveOrigin, SaveRun, SaveStep};
use crate::after;
use crate::backend::{GetItem, PutItem};
use crate::config::{ConnectorConfig, ConnectorError, ConnectorStats, StoreRequest};
use crate::memory::RegisteredMemory;
use crate::worker::{BackendOp, BackendReply, BackendWorker, Call, Done, PostError};

/// The calls out at the backend thread.
pub(super) struct Calls {
    pub(super) worker: BackendWorker,
    pub(super) out: std::collections::HashMap<u64, CallFor>,
    pub(super) next_id: u64,
    pub(super) done_tx: flume::Sender<Done>,
    pub(super) done_rx: flume::Receiver<Done>,
}

impl Calls {
    /// Posts `op`; an error means the call failed at once (and is not out).
    fn post(
        &mut self,
        now: Instant,
        op_bound: Duration,
        op: BackendOp,
        to: CallFor,
    ) -> Result<(), PostError> {
        let id = self.next_id;
        self.next_id += 1;
        self.worker.post(Call {
            id,
            op,
            deadline: after(now, op_bound),
            reply: self.done_tx.clone(),
        })?;
        self.out.insert(id, to);
        Ok(())
    }
}

/// See the module docs.
pub(super) struct Effects {
    pub(super) cfg: ConnectorConfig,
    pub(super) keyspace: Keyspace,
    /// `kvf1:{model}:{layout}:{dtype}:d{head_bytes}:`, to tell this
    /// engine's removed keys from others'.
    pub(super) key_prefix: String,
    pub(super) memory: Option<(RegisteredMemory, Shard, Replica)>,
    pub(super) calls: Calls,
    /// The `now` of the input being driven.
    pub(super) now: Instant,
    pub(super) unposted_saves: Vec<(TransferId, (Run, save::Event))>,
    pub(super) unposted_loads: Vec<(TransferId, (Run, load::Event))>,
    pub(super) saved: Vec<(TransferId, SaveReport)>,
    pub(super) loaded: Vec<(TransferId, LoadReport)>,
    pub(super) load_errors: BTreeSet<BlockId>,
    pub(super) pressure: Pressure,
    pub(super) events: EventLog,
    pub(super) stats: ConnectorStats,
}

impl ActionSink<SaveRun> for Effects {
    fn execute(&mut self, id: TransferId, step: SaveStep) {
        let (run, failed, posted) = match step {
            SaveStep::Exists { run, keys } => {
                self.stats.exists_calls += 1;
                let to = CallFor::SaveExists(id, run);
                let posted = self.post(BackendOp::Exists(keys), to).map_err(Into::into);
                let answer = Err(StoreFault::Transport);
                (run, save::Event::ExistsDone { answer }, posted)
            }
            SaveStep::Put { run, batch, items } => {
                self.stats.put_calls += 1;
                let posted = self.put_items(&items).and_then(|items| {
                    Ok(self.post(BackendOp::Put(items), CallFor::Put(id, run, batch))?)
                });
                let answer = Err(StoreFault::Transport);
                (run, save::Event::PutDone { batch, answer }, posted)
            }
            SaveStep::Released { report, origin } => {
                self.finish_save(id, origin, report);
                return;
            }
        };
        if let Err(e) = posted {
            not_posted(&e);
            self.stats.post_failures += 1;
            self.unposted_saves.push((id, (run, failed)));
        }
    }
}

impl ActionSink<LoadRun> for Effects {
    fn execute(&mut self, id: TransferId, step: LoadStep) {
        match step {
            LoadStep::Get { run, batch, items } => {
                self.stats.get_calls += 1;
                let posted = self.get_items(&items).and_then(|items| {
                    Ok(self.post(BackendOp::Get(items), CallFor::Get(id, run, batch))?)
                });
                if let Err(e) = posted {
                    not_posted(&e);
                    self.stats.post_failures += 1;
                    let answer = Err(StoreFault::Transport);
                    let failed = load::Event::GetDone { batch, answer };
                    self.unposted_loads.push((id, (run, failed)));
                }
            }
            LoadStep::Finished { report } => self.finish_load(id, report),
        }
    }
}

/// A call that could not be posted fails at once as a transport fault of
/// its machine; the reason goes to the log.
fn not_posted(e: &ConnectorError) {
    tracing::warn!("store call not posted: {e}");
}

impl Effects {
    fn post(&mut self, op: BackendOp, to: CallFor) -> Result<(), PostError> {
        self.calls.post(self.now, self.cfg.store.op_bound, op, to)
    }

    /// Posts `op` outside the machines and waits for its answer, at most
    /// `bound`; the keys the answer says left the store become events as
    /// with every answer. `Err(Timeout)` when none came in time.
    pub(super) fn call_now(
        &mut self,
        op: BackendOp,
        bound: Duration,
    ) -> Result<Result<BackendReply, StoreFault>, ConnectorError> {
        let (tx, rx) = flume::bounded(1);
        let deadline = after(Instant::now(), bound);
        self.calls.worker.post(Call {
            id: u64::MAX,
            op,
            deadline,
            reply: tx,
        })?;
        Ok(match rx.recv_deadline(deadline) {
            Ok(done) => {
                self.take_removed(done.removed);
                Ok(done.reply)
            }
            Err(_) => Err(StoreFault::Timeout),
        })
    }

    /// One existence call, waited for on a channel of its own.
    pub(super) fn exists_now(&mut self, keys: Vec<ChunkKey>) -> Result<Vec<bool>, ConnectorError> {
        let fault = match self.call_now(BackendOp::Exists(keys), self.cfg.store.op_bound)? {
            Ok(BackendReply::Exists(Ok(e))) => return Ok(e),
            Ok(BackendReply::Exists(Err(e))) => e.into(),
            Ok(_) => StoreFault::Refused,
            Err(fault) => fault,
        };
        Err(ConnectorError::Lookup(fault))
    }

    /// The request's groups as the machines take them, every block id
    /// checked against the registered memory.
    pub(super) fn groups(
        &self,
        req: &StoreRequest,
    ) -> Result<(RequestScope, Vec<GroupBlocks>), ConnectorError> {
        let (memory, _, _) = self.memory.as_ref().ok_or(ConnectorError::NotRegistered)?;
        let extra: Vec<&str> = req.extra_keys.iter().map(String::as_str).collect();
        let scope = self.keyspace.scope(req.lora.as_deref(), &extra)?;
        for b in req.block_ids.iter().flatten() {
            memory.check_block(*b)?;
        }
        let value_bytes = memory.value_bytes();
        let groups = (req.block_hashes.iter().zip(&req.block_ids))
            .map(|(h, b)| GroupBlocks {
                hashes: h.clone(),
                block_ids: b.clone(),
                value_bytes,
            })
            .collect();
        Ok((scope, groups))
    }

    /// Scatter lists of a put; every block was checked when the request
    /// started, so an error here means a machine named a foreign block.
    fn put_items(&self, items: &[StoreItem]) -> Result<Vec<PutItem>, ConnectorError> {
        let (memory, _, _) = self.memory.as_ref().ok_or(ConnectorError::NotRegistered)?;
        (items.iter())
            .map(|it| {
                let from = memory.scatter(it.block)?;
                Ok(PutItem {
                    key: it.key.clone(),
                    from,
                })
            })
            .collect()
    }

    /// Scatter lists of a get (see `put_items`).
    fn get_items(&self, items: &[StoreItem]) -> Result<Vec<GetItem>, ConnectorError> {
        let (memory, _, _) = self.memory.as_ref().ok_or(ConnectorError::NotRegistered)?;
        (items.iter())
            .map(|it| {
                let into = memory.scatter(it.block)?;
                Ok(GetItem {
                    key: it.key.clone(),
                    into,
                })
            })
            .collect()
    }

    fn finish_save(&mut self, id: TransferId, origin: SaveOrigin, report: SaveReport) {
        self.pressure.handle_report(id, &report);
        let src = EventSource {
            groups: self.keyspace.groups(),
            hashes: &origin.hashes,
            token_ids: origin.token_ids.as_deref(),
            lora_name: origin.lora.as_deref(),
            medium: self.cfg.medium,
        };
        self.events.extend(stored_events(&report, &src));
        let stored = report.stored() as u64;
        let deduped = report.deduped() as u64;
        self.stats.saves_finished += 1;
        self.stats.saved_keys += stored;
        self.stats.dedup_skipped += deduped;
        self.stats.save_failed_keys += report.items.len() as u64 - stored - deduped;
        self.saved.push((id, report));
    }

    fn finish_load(&mut self, id: TransferId, report: LoadReport) {
        self.stats.loads_finished += 1;
        self.stats.loaded_keys += report.loaded() as u64;
        let errors = report.error_blocks();
        self.stats.load_error_blocks += errors.len() as u64;
        for b in errors {
            if self.load_errors.len() < self.cfg.limits.max_load_error_blocks {
                self.load_errors.insert(b);
            } else {
                self.stats.load_errors_dropped += 1;
            }
        }
        self.loaded.push((id, report));
    }

    /// Turns keys gone from the store into `BlockRemoved` events: one per
    /// group, each hash once (the shards of a block share its hash).
    pub(super) fn take_removed(&mut self, removed: Vec<ChunkKey>) {
        if removed.is_empty() {
            return;
        }
        self.stats.removed_keys += removed.len() as u64;
        let mut by_group: BTreeMap<u32, Vec<BlockHash>> = BTreeMap::new();
        for key in &removed {
            if let Some((group, hash)) = parse_tail(&self.key_prefix, key) {
                let hashes = by_group.entry(group).or_default();
                if !hashes.contains(&hash) {
                    hashes.push(hash);
                }
            }
        }
        let medium = self.cfg.medium;
        self.events
            .extend(
                by_group
                    .into_iter()
                    .map(|(group, block_hashes)| KvEvent::BlockRemoved {
                        block_hashes,
                        medium,
                        group: Some(group),
                    }),
            );
    }
}

/// The first five fields of this keyspace's keys, from a key of it (the
/// format is documented in `kvferry_machines::store::key`).
pub(super) fn key_prefix(keyspace: &Keyspace) -> Result<String, ConnectorError> {
    let shard = keyspace.shards()[0];
    let key = keyspace.key(
        &shard,
        &keyspace.scope(None, &[])?,
        0,
        &BlockHash::from_u64(0),
    )?;
    let fields: Vec<&str> = key.as_str().splitn(6, ':').take(5).collect();
    Ok(format!("{}:", fields.join(":")))
}

/// Group and block hash of a key of this keyspace: its last three fields
/// are `g{group}:b{block_tokens}:{hex hash}`.
fn parse_tail(prefix: &str, key: &ChunkKey) -> Option<(u32, BlockHash)> {
    let text = key.as_str().strip_prefix(prefix)?;
    let mut fields = text.rsplitn(4, ':');
    let hex = fields.next()?;
    let _block_tokens = fields.next()?.strip_prefix('b')?;
    let group = fields.next()?.strip_prefix('g')?.parse().ok()?;
    if hex.len() % 2 != 0 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let bytes: Option<Vec<u8>> = (0..hex.len() / 2)
        .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).ok())
        .collect();
    Some((group, BlockHash::from_bytes(&bytes?).ok()?))
}
