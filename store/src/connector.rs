//! `StoreConnector`: the worker side of store offload, vLLM-shaped, and
//! the scheduler side's lookup.
//!
//! The connector lives on the engine's thread and drives the save and
//! load machines of `kvferry_machines::store`; the backend runs on its
//! own thread ([`super::worker`]). Nothing here blocks except the calls
//! that say so (`lookup`, `wait_for_save`, `wait_for_load`): the others
//! post, and [`StoreConnector::poll`] collects the answers, turns timeouts
//! into transitions (`poll_timeout`, `handle_timeout` with the `now` the
//! caller passes) and carries out the machines' actions.
//!
//! Every block a put reads or a get writes is addressed through
//! [`RegisteredMemory`]: a block id outside the registered blocks is
//! refused when the request starts, so no descriptor leaves the regions.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Instant;

use kvferry_machines::common::{AbortReason, BlockId, TransferId};
use kvferry_machines::layout::RankLayout;
use kvferry_machines::store::events::{stored_events, EventLog, EventSource, KvEvent};
use kvferry_machines::store::key::Replica;
use kvferry_machines::store::load::{self, plan_load, LoadMachine, LoadReport};
use kvferry_machines::store::lookup::{Lookup, LookupHit};
use kvferry_machines::store::save::{self, plan_save, SaveMachine, SaveReport};
use kvferry_machines::store::{
    BlockHash, ChunkKey, GroupBlocks, Keyspace, Pressure, RequestScope, Shard, StoreFault,
    StoreItem,
};
use kvferry_machines::Machine;

use super::after;
use super::backend::{get_result, put_result, GetItem, PutItem, StoreBackend};
use super::config::{
    ConnectorConfig, ConnectorError, ConnectorStats, StoreLoadMeta, StoreRequest, StoreSaveMeta,
};
use super::memory::RegisteredMemory;
use super::worker::{BackendOp, BackendReply, BackendWorker, Call, Done};

/// Which machine a posted call answers to.
#[derive(Clone, Copy, Debug)]
enum CallFor {
    SaveExists(TransferId, Run),
    Put(TransferId, Run, u32),
    Get(TransferId, Run, u32),
}

/// Which save or load of a request a call belongs to: a request id can
/// save (or load) again after its previous run ended, while a call of
/// that run is still out, and its late answer must not feed the new run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Run(u64);

/// A running load.
struct LoadSlot {
    machine: LoadMachine,
    run: Run,
}

/// A running save and what its events need.
struct SaveSlot {
    machine: SaveMachine,
    run: Run,
    hashes: Vec<Vec<BlockHash>>,
    token_ids: Option<Vec<u32>>,
    lora: Option<String>,
}

/// The calls out at the backend thread.
struct Calls {
    worker: BackendWorker,
    out: HashMap<u64, CallFor>,
    next_id: u64,
    done_tx: flume::Sender<Done>,
    done_rx: flume::Receiver<Done>,
}

impl Calls {
    /// Posts `op`; an error means the call failed at once (and is not out).
    fn post(
        &mut self,
        now: Instant,
        op_bound: std::time::Duration,
        op: BackendOp,
        to: CallFor,
    ) -> Result<(), super::worker::PostError> {
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

/// The worker side of store offload. See the module docs.
pub struct StoreConnector {
    cfg: ConnectorConfig,
    keyspace: Keyspace,
    /// `kvf1:{model}:{layout}:{dtype}:d{head_bytes}:`, to tell this
    /// engine's removed keys from others'.
    key_prefix: String,
    memory: Option<(RegisteredMemory, Shard, Replica)>,
    calls: Calls,
    saves: HashMap<TransferId, SaveSlot>,
    loads: HashMap<TransferId, LoadSlot>,
    next_run: u64,
    saved: Vec<(TransferId, SaveReport)>,
    loaded: Vec<(TransferId, LoadReport)>,
    load_errors: BTreeSet<BlockId>,
    pressure: Pressure,
    events: EventLog,
    stats: ConnectorStats,
}

impl std::fmt::Debug for StoreConnector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreConnector")
            .field("backend", &self.calls.worker.name())
            .field("stats", &self.stats())
            .finish()
    }
}

impl StoreConnector {
    /// A connector over `backend`, which it starts on a thread of its own.
    pub fn new<B: StoreBackend>(
        cfg: ConnectorConfig,
        backend: B,
    ) -> Result<StoreConnector, ConnectorError> {
        cfg.store.validate().map_err(ConnectorError::Config)?;
        let keyspace = Keyspace::new(&cfg.keyspace)?;
        let key_prefix = key_prefix(&keyspace)?;
        let queue = cfg.limits.backend_queue(&cfg.store);
        let worker = BackendWorker::spawn(backend, queue).map_err(ConnectorError::Spawn)?;
        // Each call out sends one answer, and no more calls than the queue
        // holds plus the one running are out: this bound is never reached.
        let (done_tx, done_rx) = flume::bounded(queue.saturating_add(1));
        Ok(StoreConnector {
            pressure: Pressure::new(cfg.limits.max_pressure_requests),
            events: EventLog::new(cfg.limits.max_events),
            keyspace,
            key_prefix,
            memory: None,
            calls: Calls {
                worker,
                out: HashMap::new(),
                next_id: 0,
                done_tx,
                done_rx,
            },
            saves: HashMap::new(),
            loads: HashMap::new(),
            next_run: 0,
            saved: Vec::new(),
            loaded: Vec::new(),
            load_errors: BTreeSet::new(),
            stats: ConnectorStats::default(),
            cfg,
        })
    }

    /// Registers the engine's KV cache: the only memory the connector's
    /// puts read and gets write. Call once, before saves and loads.
    ///
    /// # Safety
    ///
    /// Every region must point at `num_blocks × block_len` bytes that stay
    /// allocated while the connector lives, and the engine must not touch
    /// a block while a save or load holds it (from `start_save` or
    /// `start_load_kv` until `get_finished` names the request).
    pub unsafe fn register_kv_caches(&mut self, layout: RankLayout) -> Result<(), ConnectorError> {
        if self.memory.is_some() {
            return Err(ConnectorError::RegisteredTwice);
        }
        let (shard, replica) = self.keyspace.shard_of_layout(&layout)?;
        let memory = RegisteredMemory::new(layout)?;
        self.register_with_backend(memory.layout())?;
        self.memory = Some((memory, shard, replica));
        Ok(())
    }

    /// Hands the layout to the backend ([`StoreBackend::register`]) and
    /// waits for its answer, at most `max_register_wait`.
    fn register_with_backend(&mut self, layout: &RankLayout) -> Result<(), ConnectorError> {
        let wait = self.cfg.limits.max_register_wait;
        let fault = match self.call_now(BackendOp::Register(Box::new(layout.clone())), wait)? {
            Ok(BackendReply::Register(Ok(()))) => return Ok(()),
            Ok(BackendReply::Register(Err(e))) => e.into(),
            Ok(_) => StoreFault::Refused,
            Err(fault) => fault,
        };
        Err(ConnectorError::Register(fault))
    }

    /// Posts `op` outside the machines and waits for its answer, at most
    /// `bound`; the keys the answer says left the store become events as
    /// with every answer. `Err(Timeout)` when none came in time.
    fn call_now(
        &mut self,
        op: BackendOp,
        bound: std::time::Duration,
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

    /// The keyspace the connector's keys are made in.
    pub fn keyspace(&self) -> &Keyspace {
        &self.keyspace
    }

    /// The scheduler side: leading tokens of a request stored for every
    /// rank and group ([`StoreConnector::lookup_hit`]'s tokens).
    pub fn lookup(
        &mut self,
        token_len: u32,
        block_hashes: &[Vec<BlockHash>],
    ) -> Result<u32, ConnectorError> {
        let scope = self.keyspace.scope(None, &[])?;
        Ok(self.lookup_hit(&scope, token_len, block_hashes)?.tokens)
    }

    /// The lookup with its load masks, in one batched existence call
    /// (none when there is nothing to ask). Waits at most `op_bound`.
    pub fn lookup_hit(
        &mut self,
        scope: &RequestScope,
        token_len: u32,
        block_hashes: &[Vec<BlockHash>],
    ) -> Result<LookupHit, ConnectorError> {
        let max_keys = self.cfg.store.max_lookup_keys;
        let lookup = Lookup::new(&self.keyspace, scope, token_len, block_hashes, max_keys)?;
        let keys = lookup.keys().to_vec();
        let exists = if keys.is_empty() {
            Vec::new()
        } else {
            self.stats.lookup_calls += 1;
            self.stats.lookup_keys += keys.len() as u64;
            self.exists_now(keys)?
        };
        let hit = lookup.resolve(&exists)?;
        self.stats.lookups += 1;
        self.stats.lookup_hit_tokens += u64::from(hit.tokens);
        Ok(hit)
    }

    /// One existence call, waited for on a channel of its own.
    fn exists_now(&mut self, keys: Vec<ChunkKey>) -> Result<Vec<bool>, ConnectorError> {
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
    fn groups(
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

    /// Starts saving the first `token_len` tokens of a request (what the
    /// reference does in `wait_for_save`, but without waiting): dedup
    /// first, then bounded batches of puts. The blocks are the connector's
    /// until `get_finished` names the request among the saved.
    pub fn start_save(&mut self, now: Instant, meta: StoreSaveMeta) -> Result<(), ConnectorError> {
        let id = meta.request.id;
        if self.saves.contains_key(&id) || self.saved.iter().any(|(r, _)| *r == id) {
            return Err(ConnectorError::DuplicateRequest(id));
        }
        let max = self.cfg.limits.max_saves;
        if self.saves.len() + self.saved.len() >= max {
            return Err(ConnectorError::TooManySaves { max });
        }
        let (scope, groups) = self.groups(&meta.request)?;
        let Some((_, shard, replica)) = &self.memory else {
            return Err(ConnectorError::NotRegistered);
        };
        let items = plan_save(
            &self.keyspace,
            shard,
            replica,
            &scope,
            meta.token_len,
            &groups,
        )?;
        let machine = SaveMachine::new(now, &self.cfg.store, id, items, &mut self.pressure)?;
        self.stats.saves_started += 1;
        let slot = SaveSlot {
            machine,
            run: self.run(),
            hashes: meta.request.block_hashes,
            token_ids: meta.token_ids,
            lora: meta.request.lora,
        };
        self.saves.insert(id, slot);
        self.drive_save(now, id);
        Ok(())
    }

    /// Starts loading a lookup's hit into the request's blocks. The blocks
    /// are the connector's until `get_finished` names the request among
    /// the loaded; then `block_ids_with_load_errors` names those that
    /// did not load.
    pub fn start_load_kv(
        &mut self,
        now: Instant,
        meta: StoreLoadMeta,
    ) -> Result<(), ConnectorError> {
        let id = meta.request.id;
        if self.loads.contains_key(&id) || self.loaded.iter().any(|(r, _)| *r == id) {
            return Err(ConnectorError::DuplicateRequest(id));
        }
        let max = self.cfg.limits.max_loads;
        if self.loads.len() + self.loaded.len() >= max {
            return Err(ConnectorError::TooManyLoads { max });
        }
        let (scope, groups) = self.groups(&meta.request)?;
        let Some((_, shard, _)) = &self.memory else {
            return Err(ConnectorError::NotRegistered);
        };
        let items = plan_load(
            &self.keyspace,
            shard,
            &scope,
            &groups,
            &meta.hit,
            meta.local_tokens,
        )?;
        let machine = LoadMachine::new(now, &self.cfg.store, items)?;
        self.stats.loads_started += 1;
        let run = self.run();
        self.loads.insert(id, LoadSlot { machine, run });
        self.drive_load(now, id);
        Ok(())
    }

    /// Aborts the request's save and load, if running: each still ends
    /// once, when no call can touch its blocks anymore.
    pub fn abort(&mut self, now: Instant, id: TransferId, reason: AbortReason) {
        if let Some(slot) = self.saves.get_mut(&id) {
            slot.machine.abort(now, reason);
            self.drive_save(now, id);
        }
        if let Some(l) = self.loads.get_mut(&id) {
            l.machine.abort(now, reason);
            self.drive_load(now, id);
        }
    }

    /// The request is over on the scheduler's side: the pressure path
    /// forgets it.
    pub fn request_finished(&mut self, id: TransferId) {
        self.pressure.forget(id);
    }

    /// Collects the backend's answers and passes due timeouts; never waits.
    pub fn poll(&mut self, now: Instant) {
        while let Ok(done) = self.calls.done_rx.try_recv() {
            self.handle_done(now, done);
        }
        let due_saves: Vec<TransferId> = (self.saves.iter())
            .filter(|(_, s)| s.machine.poll_timeout().is_some_and(|t| t <= now))
            .map(|(id, _)| *id)
            .collect();
        for id in due_saves {
            if let Some(slot) = self.saves.get_mut(&id) {
                slot.machine.handle_timeout(now);
            }
            self.drive_save(now, id);
        }
        let due_loads: Vec<TransferId> = (self.loads.iter())
            .filter(|(_, l)| l.machine.poll_timeout().is_some_and(|t| t <= now))
            .map(|(id, _)| *id)
            .collect();
        for id in due_loads {
            if let Some(l) = self.loads.get_mut(&id) {
                l.machine.handle_timeout(now);
            }
            self.drive_load(now, id);
        }
    }

    /// Waits until one answer of the backend arrives or `until` passes,
    /// then polls: the step of a driver loop with nothing else to do.
    pub fn poll_wait(&mut self, until: Instant) {
        if let Ok(d) = self.calls.done_rx.recv_deadline(until) {
            self.handle_done(Instant::now(), d);
        }
        self.poll(Instant::now());
    }

    /// Blocks until every save started has released its blocks (vLLM's
    /// `wait_for_save`).
    pub fn wait_for_save(&mut self) {
        self.wait_until(|c| c.saves.is_empty());
    }

    /// Blocks until every load started has finished.
    pub fn wait_for_load(&mut self) {
        self.wait_until(|c| c.loads.is_empty());
    }

    fn wait_until(&mut self, done: impl Fn(&StoreConnector) -> bool) {
        self.poll(Instant::now());
        while !done(self) {
            let next = (self.poll_timeout())
                .unwrap_or_else(|| after(Instant::now(), self.cfg.store.op_bound));
            self.poll_wait(next);
        }
    }

    /// The earliest time a running save or load times out: when a driver
    /// loop must call [`StoreConnector::poll`] even if no answer came.
    pub fn poll_timeout(&self) -> Option<Instant> {
        (self.saves.values().map(|s| s.machine.poll_timeout()))
            .chain(self.loads.values().map(|l| l.machine.poll_timeout()))
            .flatten()
            .min()
    }

    /// The requests whose saves released their blocks and whose loads
    /// finished since the last call: `(saved, loaded)`.
    pub fn get_finished(&mut self) -> (Vec<TransferId>, Vec<TransferId>) {
        let (saved, loaded) = self.get_finished_reports();
        (
            saved.into_iter().map(|(id, _)| id).collect(),
            loaded.into_iter().map(|(id, _)| id).collect(),
        )
    }

    /// [`StoreConnector::get_finished`] with each request's report.
    #[allow(clippy::type_complexity)]
    pub fn get_finished_reports(
        &mut self,
    ) -> (Vec<(TransferId, SaveReport)>, Vec<(TransferId, LoadReport)>) {
        (
            std::mem::take(&mut self.saved),
            std::mem::take(&mut self.loaded),
        )
    }

    /// The blocks of finished loads that were not loaded, since the last
    /// call (vLLM's `get_block_ids_with_load_errors`).
    pub fn block_ids_with_load_errors(&mut self) -> Vec<BlockId> {
        std::mem::take(&mut self.load_errors).into_iter().collect()
    }

    /// The KV events since the last call.
    pub fn get_kv_events(&mut self) -> Vec<KvEvent> {
        self.events.take()
    }

    /// Counters and gauges.
    pub fn stats(&self) -> ConnectorStats {
        ConnectorStats {
            pressure: self.pressure.stats(),
            events_dropped: self.events.dropped(),
            calls_in_flight: self.calls.out.len() as u64,
            saves_running: self.saves.len() as u64,
            loads_running: self.loads.len() as u64,
            ..self.stats
        }
    }

    fn handle_done(&mut self, now: Instant, done: Done) {
        self.take_removed(done.removed);
        let Some(to) = self.calls.out.remove(&done.id) else {
            return;
        };
        let result = match (to, done.reply) {
            (CallFor::SaveExists(id, run), BackendReply::Exists(r)) => {
                let answer = r.map_err(Into::into);
                let ev = save::Event::ExistsDone { answer };
                self.feed_save(now, id, run, ev)
            }
            (CallFor::Put(id, run, batch), BackendReply::Put(r)) => {
                let answer = (r.map(|v| v.iter().map(put_result).collect())).map_err(Into::into);
                self.feed_save(now, id, run, save::Event::PutDone { batch, answer })
            }
            (CallFor::Get(id, run, batch), BackendReply::Get(r)) => {
                let answer = (r.map(|v| v.iter().map(get_result).collect())).map_err(Into::into);
                self.feed_load(now, id, run, load::Event::GetDone { batch, answer })
            }
            // The worker answers each op with its own kind.
            _ => Ok(()),
        };
        if let Err(e) = result {
            tracing::warn!("store answer refused by its machine: {e}");
        }
    }

    fn feed_save(
        &mut self,
        now: Instant,
        id: TransferId,
        run: Run,
        ev: save::Event,
    ) -> Result<(), kvferry_machines::InputError> {
        // A request already released, or saving again, absorbs the late
        // answers of its earlier run.
        let Some(slot) = self.saves.get_mut(&id).filter(|s| s.run == run) else {
            return Ok(());
        };
        let r = slot.machine.handle_event(now, ev);
        self.drive_save(now, id);
        r
    }

    fn feed_load(
        &mut self,
        now: Instant,
        id: TransferId,
        run: Run,
        ev: load::Event,
    ) -> Result<(), kvferry_machines::InputError> {
        let Some(l) = self.loads.get_mut(&id).filter(|l| l.run == run) else {
            return Ok(());
        };
        let r = l.machine.handle_event(now, ev);
        self.drive_load(now, id);
        r
    }

    /// Carries out a save's actions until it has none.
    fn drive_save(&mut self, now: Instant, id: TransferId) {
        let bound = self.cfg.store.op_bound;
        while let Some((action, run)) = self
            .saves
            .get_mut(&id)
            .and_then(|s| Some((s.machine.poll_action()?, s.run)))
        {
            let failed = match action {
                save::Action::Exists { keys } => {
                    self.stats.exists_calls += 1;
                    let to = CallFor::SaveExists(id, run);
                    let posted = self.calls.post(now, bound, BackendOp::Exists(keys), to);
                    posted.err().map(|e| {
                        not_posted(&e.into());
                        save::Event::ExistsDone {
                            answer: Err(StoreFault::Transport),
                        }
                    })
                }
                save::Action::Put { batch, items } => {
                    self.stats.put_calls += 1;
                    let posted = self.put_items(&items).and_then(|items| {
                        let to = CallFor::Put(id, run, batch);
                        Ok(self.calls.post(now, bound, BackendOp::Put(items), to)?)
                    });
                    posted.err().map(|e| {
                        not_posted(&e);
                        save::Event::PutDone {
                            batch,
                            answer: Err(StoreFault::Transport),
                        }
                    })
                }
                save::Action::Release { report } => {
                    if let Some(slot) = self.saves.remove(&id) {
                        self.finish_save(id, slot, report);
                    }
                    return;
                }
            };
            if let (Some(ev), Some(slot)) = (failed, self.saves.get_mut(&id)) {
                self.stats.post_failures += 1;
                let _ = slot.machine.handle_event(now, ev);
            }
        }
    }

    /// Carries out a load's actions until it has none.
    fn drive_load(&mut self, now: Instant, id: TransferId) {
        let bound = self.cfg.store.op_bound;
        while let Some((action, run)) =
            (self.loads.get_mut(&id)).and_then(|l| Some((l.machine.poll_action()?, l.run)))
        {
            match action {
                load::Action::Get { batch, items, .. } => {
                    self.stats.get_calls += 1;
                    let posted = self.get_items(&items).and_then(|items| {
                        let to = CallFor::Get(id, run, batch);
                        Ok(self.calls.post(now, bound, BackendOp::Get(items), to)?)
                    });
                    if let Err(e) = posted {
                        not_posted(&e);
                        self.stats.post_failures += 1;
                        let answer = Err(StoreFault::Transport);
                        if let Some(l) = self.loads.get_mut(&id) {
                            let ev = load::Event::GetDone { batch, answer };
                            let _ = l.machine.handle_event(now, ev);
                        }
                    }
                }
                load::Action::Finished { report } => {
                    self.loads.remove(&id);
                    self.finish_load(id, report);
                    return;
                }
            }
        }
    }

    /// A new run number.
    fn run(&mut self) -> Run {
        self.next_run += 1;
        Run(self.next_run)
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

    fn finish_save(&mut self, id: TransferId, slot: SaveSlot, report: SaveReport) {
        self.pressure.handle_report(id, &report);
        let src = EventSource {
            groups: self.keyspace.groups(),
            hashes: &slot.hashes,
            token_ids: slot.token_ids.as_deref(),
            lora_name: slot.lora.as_deref(),
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
    fn take_removed(&mut self, removed: Vec<ChunkKey>) {
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

/// A call that could not be posted fails at once as a transport fault of
/// its machine; the reason goes to the log.
fn not_posted(e: &ConnectorError) {
    tracing::warn!("store call not posted: {e}");
}

/// The first five fields of this keyspace's keys, from a key of it (the
/// format is documented in `kvferry_machines::store::key`).
fn key_prefix(keyspace: &Keyspace) -> Result<String, ConnectorError> {
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
