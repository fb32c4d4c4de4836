//! [`EngineWorker`]: the worker half of an engine's store connector, one
//! per TP and PP rank. It holds a [`StoreConnector`] over the store, and
//! by request: the save running and the one waiting behind it, the load
//! running, and whether the scheduler finished the request (its blocks
//! held for its saves); it says which requests finished sending, loaded
//! or failed since it was last asked. Rank 0 (TP and PP) also serves the
//! scheduler's lookups. The engine bindings wrap it and do nothing else.

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::Instant;

use kvferry_machines::store::events::KvEvent;
use kvferry_machines::{AbortReason, ModelSpec, RankLayout, TransferId};

use crate::any::{AnyStore, OpenError};
use crate::config::{ConnectorError, StoreSaveMeta};
use crate::lookup::{LookupServer, LookupServerError};
use crate::scheduler::StoreMeta;
use crate::settings::StoreSettings;
use crate::StoreConnector;

/// KV events a worker holds for the scheduler: a few steps' worth.
const EVENTS_MAX: usize = 1 << 16;

/// Why a worker call failed, the blame kept apart.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WorkerError {
    /// The step's metadata bytes do not decode (the scheduler's bytes).
    #[error("store metadata: {0}")]
    Meta(#[from] postcard::Error),
    /// A call that needs the KV cache before `register`.
    #[error("register the KV cache first")]
    NotRegistered,
    /// `register` called twice.
    #[error("registered twice")]
    RegisteredTwice,
    /// The connector refused the layout.
    #[error(transparent)]
    Connector(#[from] ConnectorError),
    /// The store's second handle, for the lookup server, could not open.
    #[error(transparent)]
    Store(#[from] OpenError),
    /// The lookup server could not start.
    #[error(transparent)]
    Lookups(#[from] LookupServerError),
}

/// See the module docs.
pub struct EngineWorker {
    settings: StoreSettings,
    /// The store until `register` hands it to the connector.
    store: Option<AnyStore>,
    connector: Option<StoreConnector>,
    /// Rank 0's lookup server.
    server: Option<LookupServer>,
    names: HashMap<TransferId, String>,
    saving: HashSet<TransferId>,
    /// A save that waits for the request's running one (a chunk of a
    /// chunked prefill): the newer covers the older.
    pending: HashMap<TransferId, StoreSaveMeta>,
    loading: HashSet<TransferId>,
    /// Finished on the scheduler's side, blocks held for its saves.
    delayed: VecDeque<TransferId>,
    sent: Vec<String>,
    received: Vec<String>,
    failed: Vec<String>,
    not_started: u64,
    /// KV events not yet taken, at most [`EVENTS_MAX`].
    events: VecDeque<KvEvent>,
    events_dropped: u64,
}

impl EngineWorker {
    /// A worker over `store`; its connector starts at
    /// [`register`](EngineWorker::register).
    pub fn new(settings: StoreSettings, store: AnyStore) -> EngineWorker {
        EngineWorker {
            settings,
            store: Some(store),
            connector: None,
            server: None,
            names: HashMap::new(),
            saving: HashSet::new(),
            pending: HashMap::new(),
            loading: HashSet::new(),
            delayed: VecDeque::new(),
            sent: Vec::new(),
            received: Vec::new(),
            failed: Vec::new(),
            not_started: 0,
            events: VecDeque::new(),
            events_dropped: 0,
        }
    }

    /// The settings it runs with.
    pub fn settings(&self) -> &StoreSettings {
        &self.settings
    }

    /// Registers the KV cache (`rank`'s regions, the model's shape) and
    /// starts the connector; rank 0 (TP and PP) also starts serving the
    /// scheduler's lookups. [`registration`](EngineWorker::registration),
    /// [`Registration::start`] and [`install`](EngineWorker::install) in
    /// one call.
    ///
    /// # Safety
    ///
    /// As [`StoreConnector::register_kv_caches`]: the memory stays
    /// allocated while the worker lives, and the engine does not touch a
    /// block while a save or load holds it.
    pub unsafe fn register(
        &mut self,
        model: ModelSpec,
        rank: RankLayout,
    ) -> Result<(), WorkerError> {
        let registration = self.registration(model, rank)?;
        // SAFETY: the caller's contract.
        let started = unsafe { registration.start() }?;
        self.install(started);
        Ok(())
    }

    /// What registering `rank` starts, to start apart from the worker (off
    /// an engine thread that must not wait on the store); the store goes
    /// with it.
    pub fn registration(
        &mut self,
        model: ModelSpec,
        rank: RankLayout,
    ) -> Result<Registration, WorkerError> {
        let s = &self.settings;
        let store = self.store.take().ok_or(WorkerError::RegisteredTwice)?;
        Ok(Registration {
            cfg: s.connector_config(model),
            store,
            serves_lookups: s.tp_rank == 0 && s.pp_rank == 0,
            lookup_endpoint: s.lookup_endpoint.clone(),
            rank,
        })
    }

    /// The connector (and lookup server) a [`Registration`] started.
    pub fn install(&mut self, started: Started) {
        self.connector = Some(started.connector);
        self.server = started.server;
    }

    fn connector(&mut self) -> Result<&mut StoreConnector, WorkerError> {
        (self.connector.as_mut()).ok_or(WorkerError::NotRegistered)
    }

    /// The step's loads (and its preempted and delayed requests), from the
    /// scheduler's metadata bytes; the loads that could not start are
    /// reported failed.
    pub fn start_loads(&mut self, meta: &[u8]) -> Result<(), WorkerError> {
        let meta = StoreMeta::decode(meta)?;
        self.connector()?;
        let now = Instant::now();
        let preempted: Vec<TransferId> = meta.preempted.iter().map(|p| p.id).collect();
        self.abort(&preempted, now);
        for d in meta.delayed_free {
            self.names.insert(d.id, d.request_id);
            if !self.delayed.contains(&d.id) {
                self.delayed.push_back(d.id);
            }
        }
        for load in meta.loads {
            let (id, rid) = (load.request.id, load.request.request_id.clone());
            self.names.insert(id, rid.clone());
            match self.connector()?.start_load_kv(now, load.load_meta()) {
                Ok(()) => {
                    self.loading.insert(id);
                }
                Err(e) => {
                    tracing::warn!("store load of {rid} not started: {e}");
                    self.not_started += 1;
                    self.failed.push(rid);
                }
            }
        }
        Ok(())
    }

    /// vLLM's `handle_preemptions`, first half: aborts the saves and loads
    /// of the step's preempted requests, and says which they are and until
    /// when one may still touch its blocks (one store call's bound: no call
    /// touches memory past its deadline).
    pub fn preempt(&mut self, meta: &[u8]) -> Result<(Vec<TransferId>, Instant), WorkerError> {
        let meta = StoreMeta::decode(meta)?;
        let ids: Vec<TransferId> = meta.preempted.iter().map(|p| p.id).collect();
        let now = Instant::now();
        self.abort(&ids, now);
        Ok((ids, now + self.settings.op_bound()))
    }

    fn abort(&mut self, ids: &[TransferId], now: Instant) {
        for id in ids {
            self.pending.remove(id);
            self.names.remove(id);
            if let Some(c) = self.connector.as_mut() {
                c.abort(now, *id, AbortReason::Engine);
            }
        }
    }

    /// True while a save or load of one of `ids` may touch its blocks
    /// (after [`collect`](EngineWorker::collect)).
    pub fn touches(&self, ids: &[TransferId]) -> bool {
        ids.iter()
            .any(|id| self.saving.contains(id) || self.loading.contains(id))
    }

    /// True once no save or load runs or waits (after
    /// [`collect`](EngineWorker::collect)).
    pub fn is_idle(&self) -> bool {
        self.saving.is_empty() && self.loading.is_empty() && self.pending.is_empty()
    }

    /// The step's saves, from the same metadata: started now, after the
    /// forward pass wrote their blocks.
    pub fn start_saves(&mut self, meta: &[u8]) -> Result<(), WorkerError> {
        let meta = StoreMeta::decode(meta)?;
        self.connector()?;
        for save in meta.saves {
            self.names
                .insert(save.request.id, save.request.request_id.clone());
            self.start_save(save.save_meta());
        }
        Ok(())
    }

    fn start_save(&mut self, meta: StoreSaveMeta) {
        let id = meta.request.id;
        if self.saving.contains(&id) {
            self.pending.insert(id, meta);
            return;
        }
        let Some(c) = self.connector.as_mut() else {
            return;
        };
        match c.start_save(Instant::now(), meta) {
            Ok(()) => {
                self.saving.insert(id);
            }
            Err(e) => {
                self.not_started += 1;
                tracing::warn!("store save of {:?} not started: {e}", self.names.get(&id));
            }
        }
    }

    /// Collects what ended, starts the saves that waited, and reports the
    /// delayed requests none of whose saves is left.
    pub fn collect(&mut self) {
        let Some(c) = self.connector.as_mut() else {
            return;
        };
        c.poll(Instant::now());
        let (saved, loaded) = c.get_finished_reports();
        let _ = c.block_ids_with_load_errors();
        for e in c.get_kv_events() {
            if self.events.len() >= EVENTS_MAX {
                self.events_dropped += 1;
            } else {
                self.events.push_back(e);
            }
        }
        for (id, report) in loaded {
            self.loading.remove(&id);
            let Some(rid) = self.names.remove(&id) else {
                continue;
            };
            if report.error_blocks().is_empty() {
                self.received.push(rid);
            } else {
                self.failed.push(rid);
            }
        }
        for (id, _) in saved {
            self.saving.remove(&id);
            if let Some(next) = self.pending.remove(&id) {
                self.start_save(next);
            }
        }
        self.release_delayed();
    }

    /// The delayed requests none of whose saves runs or waits: sent.
    fn release_delayed(&mut self) {
        let (saving, pending) = (&self.saving, &self.pending);
        let (done, wait): (Vec<TransferId>, Vec<TransferId>) = (self.delayed.drain(..))
            .partition(|id| !saving.contains(id) && !pending.contains_key(id));
        self.delayed = wait.into();
        for id in done {
            if let Some(rid) = self.names.remove(&id) {
                self.sent.push(rid);
            }
        }
    }

    /// `(finished sending, loaded, failed loads)` request ids since the
    /// last call.
    pub fn take_results(&mut self) -> (Vec<String>, Vec<String>, Vec<String>) {
        self.collect();
        (
            std::mem::take(&mut self.sent),
            std::mem::take(&mut self.received),
            std::mem::take(&mut self.failed),
        )
    }

    /// The KV events since the last call, and how many shards store each
    /// block (a block is stored once every shard reported it).
    pub fn take_events(&mut self) -> (Vec<KvEvent>, usize) {
        self.collect();
        let shards = (self.connector.as_ref()).map_or(1, |c| c.keyspace().shards().len());
        (self.events.drain(..).collect(), shards)
    }

    /// Stops serving the scheduler's lookups: the server, for the caller
    /// to drop (its socket's endpoint is free once it is).
    pub fn close_lookups(&mut self) -> Option<LookupServer> {
        self.server.take()
    }

    /// The counters: the worker's, the connector's and the lookup
    /// server's, by name.
    pub fn stats(&self) -> Vec<(&'static str, u64)> {
        let mut out = vec![
            ("saves_not_started", self.not_started),
            ("events_dropped", self.events_dropped),
        ];
        if let Some(c) = &self.connector {
            let s = c.stats();
            out.extend([
                ("saves_finished", s.saves_finished),
                ("saved_keys", s.saved_keys),
                ("dedup_skipped", s.dedup_skipped),
                ("save_failed_keys", s.save_failed_keys),
                ("loads_finished", s.loads_finished),
                ("loaded_keys", s.loaded_keys),
                ("load_error_blocks", s.load_error_blocks),
                ("post_failures", s.post_failures),
            ]);
        }
        if let Some(server) = &self.server {
            let s = server.stats();
            out.extend([
                ("lookups_answered", s.answered),
                ("lookups_failed", s.failed),
            ]);
        }
        out
    }
}

/// The connector and lookup server of a worker, to be started
/// ([`EngineWorker::registration`]).
pub struct Registration {
    cfg: crate::config::ConnectorConfig,
    store: AnyStore,
    serves_lookups: bool,
    lookup_endpoint: String,
    rank: RankLayout,
}

/// What a [`Registration`] started, for [`EngineWorker::install`].
pub struct Started {
    connector: StoreConnector,
    server: Option<LookupServer>,
}

impl Registration {
    /// Starts the connector over the store with the KV cache registered,
    /// and on rank 0 the lookup server over a second handle of the store.
    ///
    /// # Safety
    ///
    /// As [`EngineWorker::register`].
    pub unsafe fn start(self) -> Result<Started, WorkerError> {
        let second = self
            .serves_lookups
            .then(|| self.store.second_handle())
            .transpose()?;
        let mut connector = StoreConnector::new(self.cfg.clone(), self.store)?;
        // SAFETY: the caller's contract.
        unsafe { connector.register_kv_caches(self.rank) }?;
        let server = match second {
            Some(second) => Some(LookupServer::spawn_for_store(
                &self.lookup_endpoint,
                self.cfg,
                second,
            )?),
            None => None,
        };
        Ok(Started { connector, server })
    }
}
