//! `StoreConnector`: the worker side of store offload, vLLM-shaped, and
//! the scheduler side's lookup.
//!
//! The connector lives on the engine's thread and drives the save and
//! load machines of `kvferry_machines::store` with two
//! [`kvferry_reactor::Driver`]s, the node's own (one deadline heap, one
//! index, late answers of an ended run dropped); the backend runs on its
//! own thread ([`super::worker`]). Nothing here blocks except the calls
//! that say so (`lookup`, `wait_for_save`, `wait_for_load`): the others
//! post, and [`StoreConnector::poll`] collects the answers, turns timeouts
//! into transitions (`poll_timeout`, `handle_timeout` with the `now` the
//! caller passes) and carries out the machines' actions.
//!
//! Every block a put reads or a get writes is addressed through
//! [`RegisteredMemory`]: a block id outside the registered blocks is
//! refused when the request starts, so no descriptor leaves the regions.

mod effects;
mod runs;

use std::collections::{BTreeSet, HashMap};
use std::time::Instant;

use kvferry_machines::store::events::{EventLog, KvEvent};
use kvferry_machines::store::load::{self, plan_load, LoadMachine, LoadReport};
use kvferry_machines::store::lookup::{Lookup, LookupHit};
use kvferry_machines::store::save::{self, plan_save, SaveMachine, SaveReport};
use kvferry_machines::store::{BlockHash, Keyspace, Pressure, RequestScope, StoreFault};
use kvferry_machines::{AbortReason, BlockId, RankLayout, TransferId};
use kvferry_reactor::{Driver, DriverConfig, DriverError};

use self::effects::{key_prefix, Calls, Effects};
use self::runs::{CallFor, LoadRun, Run, SaveOrigin, SaveRun};
use super::backend::{get_result, put_result, StoreBackend};
use super::config::{
    ConnectorConfig, ConnectorError, ConnectorStats, StoreLoadMeta, StoreSaveMeta,
};
use super::memory::RegisteredMemory;
use super::worker::{BackendOp, BackendReply, BackendWorker, Done};

/// The worker side of store offload. See the module docs.
pub struct StoreConnector {
    saves: Driver<SaveRun>,
    loads: Driver<LoadRun>,
    next_run: u64,
    /// What the machines' actions act on.
    fx: Effects,
}

impl std::fmt::Debug for StoreConnector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreConnector")
            .field("backend", &self.fx.calls.worker.name())
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
        // The limits are checked before a machine is inserted, and the
        // drivers' completions are dropped as they come: never full.
        let saves = Driver::new(0, DriverConfig::with_max_machines(cfg.limits.max_saves));
        let loads = Driver::new(0, DriverConfig::with_max_machines(cfg.limits.max_loads));
        let fx = Effects {
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
            now: Instant::now(),
            unposted_saves: Vec::new(),
            unposted_loads: Vec::new(),
            saved: Vec::new(),
            loaded: Vec::new(),
            load_errors: BTreeSet::new(),
            stats: ConnectorStats::default(),
            cfg,
        };
        Ok(StoreConnector {
            saves,
            loads,
            next_run: 0,
            fx,
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
        if self.fx.memory.is_some() {
            return Err(ConnectorError::RegisteredTwice);
        }
        let (shard, replica) = self.fx.keyspace.shard_of_layout(&layout)?;
        let memory = RegisteredMemory::new(layout)?;
        self.register_with_backend(memory.layout())?;
        self.fx.memory = Some((memory, shard, replica));
        Ok(())
    }

    /// Hands the layout to the backend ([`StoreBackend::register`]) and
    /// waits for its answer, at most `max_register_wait`.
    fn register_with_backend(&mut self, layout: &RankLayout) -> Result<(), ConnectorError> {
        let wait = self.fx.cfg.limits.max_register_wait;
        let op = BackendOp::Register(Box::new(layout.clone()));
        let fault = match self.fx.call_now(op, wait)? {
            Ok(BackendReply::Register(Ok(()))) => return Ok(()),
            Ok(BackendReply::Register(Err(e))) => e.into(),
            Ok(_) => StoreFault::Refused,
            Err(fault) => fault,
        };
        Err(ConnectorError::Register(fault))
    }

    /// The keyspace the connector's keys are made in.
    pub fn keyspace(&self) -> &Keyspace {
        &self.fx.keyspace
    }

    /// The scheduler side: leading tokens of a request stored for every
    /// rank and group ([`StoreConnector::lookup_hit`]'s tokens).
    pub fn lookup(
        &mut self,
        token_len: u32,
        block_hashes: &[Vec<BlockHash>],
    ) -> Result<u32, ConnectorError> {
        let scope = self.fx.keyspace.scope(None, &[])?;
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
        let fx = &mut self.fx;
        let max_keys = fx.cfg.store.max_lookup_keys;
        let lookup = Lookup::new(&fx.keyspace, scope, token_len, block_hashes, max_keys)?;
        let keys = lookup.keys().to_vec();
        let exists = if keys.is_empty() {
            Vec::new()
        } else {
            fx.stats.lookup_calls += 1;
            fx.stats.lookup_keys += keys.len() as u64;
            fx.exists_now(keys)?
        };
        let hit = lookup.resolve(&exists)?;
        fx.stats.lookups += 1;
        fx.stats.lookup_hit_tokens += u64::from(hit.tokens);
        Ok(hit)
    }

    /// Starts saving the first `token_len` tokens of a request (what the
    /// reference does in `wait_for_save`, but without waiting): dedup
    /// first, then bounded batches of puts. The blocks are the connector's
    /// until `get_finished` names the request among the saved.
    pub fn start_save(&mut self, now: Instant, meta: StoreSaveMeta) -> Result<(), ConnectorError> {
        let id = meta.request.id;
        if self.saves.contains(id) || self.fx.saved.iter().any(|(r, _)| *r == id) {
            return Err(ConnectorError::DuplicateRequest(id));
        }
        let max = self.fx.cfg.limits.max_saves;
        if self.saves.len() + self.fx.saved.len() >= max {
            return Err(ConnectorError::TooManySaves { max });
        }
        let fx = &mut self.fx;
        let (scope, groups) = fx.groups(&meta.request)?;
        let Some((_, shard, replica)) = &fx.memory else {
            return Err(ConnectorError::NotRegistered);
        };
        let items = plan_save(
            &fx.keyspace,
            shard,
            replica,
            &scope,
            meta.token_len,
            &groups,
        )?;
        let machine = SaveMachine::new(now, &fx.cfg.store, id, items, &mut fx.pressure)?;
        fx.stats.saves_started += 1;
        let origin = SaveOrigin {
            hashes: meta.request.block_hashes,
            token_ids: meta.token_ids,
            lora: meta.request.lora,
        };
        let run = SaveRun {
            machine,
            run: self.run(),
            origin,
        };
        self.fx.now = now;
        let inserted = self.saves.insert(now, id, run, &mut self.fx);
        self.settle();
        inserted.map_err(|e| refused(e, id, ConnectorError::TooManySaves { max }))
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
        if self.loads.contains(id) || self.fx.loaded.iter().any(|(r, _)| *r == id) {
            return Err(ConnectorError::DuplicateRequest(id));
        }
        let max = self.fx.cfg.limits.max_loads;
        if self.loads.len() + self.fx.loaded.len() >= max {
            return Err(ConnectorError::TooManyLoads { max });
        }
        let fx = &mut self.fx;
        let (scope, groups) = fx.groups(&meta.request)?;
        let Some((_, shard, _)) = &fx.memory else {
            return Err(ConnectorError::NotRegistered);
        };
        let (hit, local) = (&meta.hit, meta.local_tokens);
        let items = plan_load(&fx.keyspace, shard, &scope, &groups, hit, local)?;
        let machine = LoadMachine::new(now, &fx.cfg.store, items)?;
        fx.stats.loads_started += 1;
        let run = LoadRun {
            machine,
            run: self.run(),
        };
        self.fx.now = now;
        let inserted = self.loads.insert(now, id, run, &mut self.fx);
        self.settle();
        inserted.map_err(|e| refused(e, id, ConnectorError::TooManyLoads { max }))
    }

    /// Aborts the request's save and load, if running: each still ends
    /// once, when no call can touch its blocks anymore.
    pub fn abort(&mut self, now: Instant, id: TransferId, reason: AbortReason) {
        self.fx.now = now;
        // `Unknown`: nothing of that request is running.
        let _ = self.saves.abort(now, id, reason, &mut self.fx);
        let _ = self.loads.abort(now, id, reason, &mut self.fx);
        self.settle();
    }

    /// The request is over on the scheduler's side: the pressure path
    /// forgets it.
    pub fn request_finished(&mut self, id: TransferId) {
        self.fx.pressure.forget(id);
    }

    /// Collects the backend's answers and passes due timeouts; never waits.
    pub fn poll(&mut self, now: Instant) {
        while let Ok(done) = self.fx.calls.done_rx.try_recv() {
            self.handle_done(now, done);
        }
        self.fx.now = now;
        self.saves.handle_timers(now, &mut self.fx);
        self.loads.handle_timers(now, &mut self.fx);
        self.settle();
    }

    /// Waits until one answer of the backend arrives or `until` passes,
    /// then polls: the step of a driver loop with nothing else to do.
    pub fn poll_wait(&mut self, until: Instant) {
        if let Ok(d) = self.fx.calls.done_rx.recv_deadline(until) {
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
                .unwrap_or_else(|| super::after(Instant::now(), self.fx.cfg.store.op_bound));
            self.poll_wait(next);
        }
    }

    /// The earliest time a running save or load times out: when a driver
    /// loop must call [`StoreConnector::poll`] even if no answer came.
    pub fn poll_timeout(&mut self) -> Option<Instant> {
        let saves = self.saves.poll_timeout();
        let loads = self.loads.poll_timeout();
        saves.into_iter().chain(loads).min()
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
            std::mem::take(&mut self.fx.saved),
            std::mem::take(&mut self.fx.loaded),
        )
    }

    /// The blocks of finished loads that were not loaded, since the last
    /// call (vLLM's `get_block_ids_with_load_errors`).
    pub fn block_ids_with_load_errors(&mut self) -> Vec<BlockId> {
        std::mem::take(&mut self.fx.load_errors)
            .into_iter()
            .collect()
    }

    /// The KV events since the last call.
    pub fn get_kv_events(&mut self) -> Vec<KvEvent> {
        self.fx.events.take()
    }

    /// Counters and gauges.
    pub fn stats(&self) -> ConnectorStats {
        ConnectorStats {
            pressure: self.fx.pressure.stats(),
            events_dropped: self.fx.events.dropped(),
            calls_in_flight: self.fx.calls.out.len() as u64,
            saves_running: self.saves.len() as u64,
            loads_running: self.loads.len() as u64,
            ..self.fx.stats
        }
    }

    fn handle_done(&mut self, now: Instant, done: Done) {
        self.fx.take_removed(done.removed);
        let Some(to) = self.fx.calls.out.remove(&done.id) else {
            return;
        };
        self.fx.now = now;
        let fed = match (to, done.reply) {
            (CallFor::SaveExists(id, run), BackendReply::Exists(r)) => {
                let answer = r.map_err(Into::into);
                let ev = save::Event::ExistsDone { answer };
                self.saves.handle_event(now, id, (run, ev), &mut self.fx)
            }
            (CallFor::Put(id, run, batch), BackendReply::Put(r)) => {
                let answer = (r.map(|v| v.iter().map(put_result).collect())).map_err(Into::into);
                let ev = save::Event::PutDone { batch, answer };
                self.saves.handle_event(now, id, (run, ev), &mut self.fx)
            }
            (CallFor::Get(id, run, batch), BackendReply::Get(r)) => {
                let answer = (r.map(|v| v.iter().map(get_result).collect())).map_err(Into::into);
                let ev = load::Event::GetDone { batch, answer };
                self.loads.handle_event(now, id, (run, ev), &mut self.fx)
            }
            // The worker answers each op with its own kind.
            _ => Ok(()),
        };
        self.settle();
        match fed {
            // A request released already absorbs its late answers.
            Ok(()) | Err(DriverError::Unknown(_)) => {}
            Err(e) => tracing::warn!("store answer refused by its machine: {e}"),
        }
    }

    /// Feeds the answers of calls that could not be posted back to their
    /// machines, finishes the drains the drivers capped, and drops the
    /// drivers' completions (the connector reports through its own
    /// lists). Ends: every unposted answer moves its machine towards its
    /// end, which posts no more.
    fn settle(&mut self) {
        let now = self.fx.now;
        loop {
            let saves = std::mem::take(&mut self.fx.unposted_saves);
            let loads = std::mem::take(&mut self.fx.unposted_loads);
            let pending = self.saves.has_pending() || self.loads.has_pending();
            if saves.is_empty() && loads.is_empty() && !pending {
                break;
            }
            for (id, ev) in saves {
                let _ = self.saves.handle_event(now, id, ev, &mut self.fx);
            }
            for (id, ev) in loads {
                let _ = self.loads.handle_event(now, id, ev, &mut self.fx);
            }
            self.saves.drive_pending(now, &mut self.fx);
            self.loads.drive_pending(now, &mut self.fx);
        }
        while self.saves.poll_completion().is_some() {}
        while self.loads.poll_completion().is_some() {}
    }

    /// A new run number.
    fn run(&mut self) -> Run {
        self.next_run += 1;
        Run(self.next_run)
    }
}

/// A driver's refusal of a machine the checks before it let through.
fn refused(e: DriverError, id: TransferId, full: ConnectorError) -> ConnectorError {
    match e {
        DriverError::Full { .. } => full,
        _ => ConnectorError::DuplicateRequest(id),
    }
}
