//! Store offload for Python: the scheduler half ([`StoreSched`]), whose
//! prefix lookups never hold the engine's scheduler for long, and the
//! worker half ([`StoreWorker`]), a `StoreConnector` over any store URL
//! whose TP rank 0 answers the scheduler's lookups.
//!
//! ```text
//!  scheduler process                          worker processes
//!  StoreSched ── lookup thread ── ZeroMQ ──▶ rank 0: LookupServer
//!      │  (answers kept until asked)              (existence calls)
//!      └─ StoreMeta bytes, pickled by vLLM ──▶ every rank: StoreWorker
//!                                                 (saves, loads)
//! ```
//!
//! Nothing of Rust crosses a pickle: the step's metadata is the
//! scheduler's postcard bytes.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use kvferry::machines::store::events::KvEvent;
use kvferry::machines::store::key::model_key_prefix;
use kvferry::machines::store::lookup::LookupHit;
use kvferry::machines::store::BlockHash;
use kvferry::machines::{RankLayout, Stage};
use kvferry::reactor::lock;
use kvferry::{BlockId, ModelSpec};
use kvferry_store::{
    AnyStore, BoardError, EngineWorker, LookupBoard, LookupFailure, LookupQuery, Scheduled,
    StoreBackend, StoreReq, StoreSchedError, StoreScheduler, StoreSettings, WorkerError,
};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::args::{layout_kind, regions_of, same_process};
use crate::errors::{misuse, BusyError, Error, TransportError};

fn settings_err(e: serde_json::Error) -> PyErr {
    misuse(format!("store settings: {e}"))
}

fn board_err(e: BoardError) -> PyErr {
    match e {
        BoardError::Connect(_) => misuse(e.to_string()),
        BoardError::Thread(_) => Error::new_err(e.to_string()),
    }
}

fn sched_err(e: StoreSchedError) -> PyErr {
    match e {
        StoreSchedError::Full { .. } => BusyError::new_err(e.to_string()),
        e => misuse(e.to_string()),
    }
}

/// Per group, the request's block hashes from their bytes.
fn hashes(groups: Vec<Vec<Vec<u8>>>) -> PyResult<Vec<Vec<BlockHash>>> {
    (groups.into_iter())
        .map(|g| {
            (g.iter())
                .map(|h| BlockHash::from_bytes(h).map_err(|e| misuse(e.to_string())))
                .collect()
        })
        .collect()
}

fn block_lists(groups: Vec<Vec<u32>>) -> Vec<Vec<BlockId>> {
    (groups.into_iter())
        .map(|g| g.into_iter().map(BlockId).collect())
        .collect()
}

// ---------------------------------------------------------------------------
// The scheduler half.

/// The scheduler half of the store connector (`kvferry.vllm`'s
/// `KvferryStoreConnector` in the scheduler process).
#[pyclass(module = "kvferry._native", frozen)]
pub(crate) struct StoreSched {
    sched: Mutex<StoreScheduler>,
    lookups: LookupBoard,
    /// The store's URL and this model's key prefix, for `reset`.
    store_url: String,
    model_prefix: String,
    /// A client of the store of its own, opened by the first `reset`.
    store: Mutex<Option<AnyStore>>,
}

#[pymethods]
impl StoreSched {
    /// The scheduler half from the settings both halves share, as JSON
    /// (from `kvferry.vllm`: the store's URL, rank 0's lookup endpoint,
    /// the KV-cache groups, what to load and save, the bounds), with a
    /// client of the lookup endpoint. Settings that do not parse, or an
    /// endpoint other than `ipc://PATH` or `tcp://127.0.0.1:PORT`, are a
    /// `MisuseError`.
    #[new]
    fn new(settings: &str) -> PyResult<StoreSched> {
        let s = StoreSettings::parse(settings).map_err(settings_err)?;
        let sched = StoreScheduler::new(s.scheduler_config()).map_err(sched_err)?;
        let lookups = s.start_lookups().map_err(board_err)?;
        let model_prefix = model_key_prefix(&s.model_name).map_err(|e| misuse(e.to_string()))?;
        Ok(StoreSched {
            sched: Mutex::new(sched),
            lookups,
            store_url: s.store,
            model_prefix,
            store: Mutex::new(None),
        })
    }

    /// vLLM's `get_num_new_matched_tokens`: `(tokens, load_async)`, or
    /// `None` while the store's answer is out (vLLM asks again next step).
    /// Waits for the answer at most `wait_s`. With `give_up_s` (another
    /// source holds the whole prompt) a lookup out that long is a miss,
    /// counted as `lookups_given_up`: the request waits no longer.
    #[pyo3(signature = (request_id, prompt_len, block_hashes, num_computed_tokens, lora=None, wait_s=0.002, give_up_s=None))]
    #[allow(clippy::too_many_arguments)]
    fn get_num_new_matched_tokens(
        &self,
        py: Python<'_>,
        request_id: &str,
        prompt_len: u32,
        block_hashes: Vec<Vec<Vec<u8>>>,
        num_computed_tokens: u32,
        lora: Option<String>,
        wait_s: f64,
        give_up_s: Option<f64>,
    ) -> PyResult<Option<(u32, bool)>> {
        let give_up = give_up_s
            .map(|s| crate::args::seconds("give_up_s", s))
            .transpose()?;
        let hashes = hashes(block_hashes)?;
        let req = StoreReq {
            request_id,
            prompt_len_tokens: prompt_len,
            block_hashes: &hashes,
            lora: lora.as_deref(),
            extra_keys: &[],
        };
        let query = lock(&self.sched).lookup_query(&req);
        let answer = match query {
            None => Err("no lookup".to_owned()),
            Some(q) => {
                let wait = crate::args::seconds("wait_s", wait_s)?;
                let groups = q.block_hashes.len();
                match py.detach(|| self.lookups.answer(request_id, q, wait)) {
                    Some(a) => a,
                    None if give_up.is_some_and(|g| self.lookups.give_up(request_id, g)) => {
                        Ok(LookupHit {
                            tokens: 0,
                            load: vec![0..0; groups],
                        })
                    }
                    None => return Ok(None),
                }
            }
        };
        let mut lookup = |_: &LookupQuery| -> Result<LookupHit, LookupFailure> {
            answer
                .clone()
                .map_err(|e| LookupFailure::Transport(std::io::Error::other(e)))
        };
        let r =
            lock(&self.sched).get_num_new_matched_tokens(&req, num_computed_tokens, &mut lookup);
        r.map(Some).map_err(sched_err)
    }

    /// vLLM's `update_state_after_alloc`: the request's blocks so far, per
    /// group, and the external tokens allocated.
    fn update_state_after_alloc(
        &self,
        request_id: &str,
        block_ids: Vec<Vec<u32>>,
        num_external_tokens: u32,
    ) -> PyResult<()> {
        let blocks = block_lists(block_ids);
        lock(&self.sched)
            .update_state_after_alloc(request_id, &blocks, num_external_tokens)
            .map_err(sched_err)
    }

    /// The request's hashes per group, grown past its prompt (decode
    /// saves); each list extends the one given before.
    fn extend_hashes(&self, request_id: &str, block_hashes: Vec<Vec<Vec<u8>>>) -> PyResult<()> {
        let hashes = hashes(block_hashes)?;
        lock(&self.sched)
            .extend_hashes(request_id, &hashes)
            .map_err(sched_err)
    }

    /// vLLM's `build_connector_meta`: `steps` are `(request id, tokens
    /// scheduled, new blocks per group)`; `preempted` the step's preempted
    /// requests. The workers' metadata, as bytes.
    fn build_connector_meta<'py>(
        &self,
        py: Python<'py>,
        steps: Vec<(String, u32, Vec<Vec<u32>>)>,
        preempted: Vec<String>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let mut sched = lock(&self.sched);
        for rid in &preempted {
            self.lookups.forget(rid);
            sched.request_preempted(rid).map_err(sched_err)?;
        }
        let blocks: Vec<Vec<Vec<BlockId>>> = steps
            .iter()
            .map(|(_, _, b)| block_lists(b.clone()))
            .collect();
        let step: Vec<Scheduled<'_>> = (steps.iter().zip(&blocks))
            .map(|((rid, n, _), b)| Scheduled {
                request_id: rid,
                num_scheduled_tokens: *n,
                new_block_ids: b,
            })
            .collect();
        let meta = sched.build_connector_meta(&step).map_err(sched_err)?;
        Ok(PyBytes::new(py, &meta.encode()))
    }

    /// vLLM's `update_connector_output`: loads finished and failed.
    fn loads_finished(&self, finished: Vec<String>, failed: Vec<String>) {
        let mut sched = lock(&self.sched);
        for rid in &failed {
            sched.load_failed(rid);
        }
        let ok: Vec<&str> = (finished.iter())
            .filter(|r| !failed.contains(r))
            .map(String::as_str)
            .collect();
        sched.loads_finished(&ok);
    }

    /// vLLM's `request_finished`: whether its blocks wait for the workers.
    fn request_finished(&self, request_id: &str, block_ids: Vec<Vec<u32>>) -> PyResult<bool> {
        self.lookups.forget(request_id);
        let blocks = block_lists(block_ids);
        lock(&self.sched)
            .request_finished(request_id, &blocks)
            .map_err(sched_err)
    }

    /// vLLM's `reset_cache`: removes this model's keys from the store
    /// (every layout, dtype and shard; other models' stay), waiting at most
    /// `timeout_s`. The count, or why not: a store that cannot list its
    /// keys, one that is down, or `inproc` (a store of one process only).
    fn reset(&self, py: Python<'_>, timeout_s: f64) -> PyResult<u64> {
        if self.store_url == "inproc" {
            return Err(misuse(
                "an unnamed inproc store is not shared: nothing to reset",
            ));
        }
        let deadline = Instant::now() + crate::args::seconds("timeout_s", timeout_s)?;
        let (cell, url, prefix) = (&self.store, &self.store_url, &self.model_prefix);
        py.detach(|| {
            let mut store = lock(cell);
            if store.is_none() {
                *store = Some(AnyStore::open(url).map_err(|e| e.to_string())?);
            }
            let s = store.as_mut().ok_or("no store")?;
            s.remove_prefix(prefix, deadline)
                .map_err(|e| format!("{e:?}"))
        })
        .map_err(|e: String| TransportError::new_err(format!("store {url:?}: reset: {e}")))
    }

    /// Counters.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = lock(&self.sched).stats();
        let d = PyDict::new(py);
        for (k, v) in [
            ("lookups", s.lookups),
            ("lookup_failures", s.lookup_failures),
            ("promised_tokens", s.promised_tokens),
            ("loads_planned", s.loads_planned),
            ("saves_planned", s.saves_planned),
            ("delayed_frees", s.delayed_frees),
            ("preempted", s.preempted),
            ("untracked_scheduled", s.untracked_scheduled),
            ("loads_failed", s.loads_failed),
        ]
        .into_iter()
        .chain(self.lookups.stats())
        {
            d.set_item(k, v)?;
        }
        Ok(d)
    }
}

// ---------------------------------------------------------------------------
// The worker half.

/// The worker half of the store connector, one per TP and PP rank: a
/// [`EngineWorker`] for Python.
#[pyclass(module = "kvferry._native", frozen)]
pub(crate) struct StoreWorker {
    state: Mutex<EngineWorker>,
    pid: u32,
}

/// A KV event for Python (see `StoreWorker::take_events`).
type EventTuple = (
    &'static str,
    Option<u32>,
    Vec<Vec<u8>>,
    Option<Vec<u8>>,
    u32,
    Vec<u32>,
    Option<String>,
    &'static str,
);

fn event_tuple(e: KvEvent) -> EventTuple {
    let bytes = |h: &[BlockHash]| h.iter().map(|h| h.as_bytes().to_vec()).collect();
    match e {
        KvEvent::BlockStored(b) => (
            "stored",
            Some(b.group),
            bytes(&b.block_hashes),
            b.parent_block_hash.map(|h| h.as_bytes().to_vec()),
            b.block_size,
            b.token_ids,
            b.lora_name,
            b.medium.as_str(),
        ),
        KvEvent::BlockRemoved {
            block_hashes,
            medium,
            group,
        } => (
            "removed",
            group,
            bytes(&block_hashes),
            None,
            0,
            Vec::new(),
            None,
            medium.as_str(),
        ),
        KvEvent::AllBlocksCleared => ("cleared", None, Vec::new(), None, 0, Vec::new(), None, ""),
    }
}

fn worker_err(e: WorkerError) -> PyErr {
    match e {
        WorkerError::Store(_) | WorkerError::Lookups(_) => TransportError::new_err(e.to_string()),
        e => misuse(e.to_string()),
    }
}

impl StoreWorker {
    fn state(&self) -> PyResult<std::sync::MutexGuard<'_, EngineWorker>> {
        same_process(self.pid)?;
        Ok(lock(&self.state))
    }

    /// Collects until `done` holds of the worker or `until` passes, the
    /// GIL released between tries. Whether `done` held.
    fn wait_until(
        &self,
        py: Python<'_>,
        until: Instant,
        pause: Duration,
        done: impl Fn(&EngineWorker) -> bool,
    ) -> PyResult<bool> {
        loop {
            {
                let mut st = self.state()?;
                st.collect();
                if done(&st) {
                    return Ok(true);
                }
            }
            if Instant::now() >= until {
                return Ok(false);
            }
            py.detach(|| std::thread::sleep(pause));
        }
    }
}

#[pymethods]
impl StoreWorker {
    /// Opens the store; the connector starts at `register`.
    #[new]
    fn new(py: Python<'_>, settings: &str) -> PyResult<StoreWorker> {
        let s = StoreSettings::parse(settings).map_err(settings_err)?;
        let store = open_store(py, &s.store)?;
        Ok(StoreWorker {
            state: Mutex::new(EngineWorker::new(s, store)),
            pid: std::process::id(),
        })
    }

    /// Registers the KV cache's regions `(base, block_len, kv_block_len)`
    /// of `num_blocks` blocks (the caller keeps the memory alive while the
    /// worker lives) and starts the connector; rank 0 (TP and PP) also
    /// serves the scheduler's lookups.
    #[pyo3(signature = (regions, num_blocks, layout, total_kv_heads, block_tokens, head_bytes, first_region=0))]
    #[allow(clippy::too_many_arguments)]
    fn register(
        &self,
        py: Python<'_>,
        regions: Vec<(u64, u64, u64)>,
        num_blocks: u64,
        layout: &str,
        total_kv_heads: u32,
        block_tokens: u32,
        head_bytes: u64,
        first_region: u32,
    ) -> PyResult<()> {
        let mut st = self.state()?;
        let model = ModelSpec {
            layout: layout_kind(layout)?,
            total_kv_heads,
            block_tokens,
            head_bytes,
        };
        let s = st.settings();
        let rank = RankLayout {
            tp_size: s.tp_size,
            tp_rank: s.tp_rank,
            num_blocks,
            regions: regions_of(regions),
            stage: Stage {
                pp_size: s.pp_size,
                pp_rank: s.pp_rank,
                first_region,
            },
            pools: Vec::new(),
        };
        let registration = st.registration(model, rank).map_err(worker_err)?;
        // SAFETY: the Python wrapper keeps vLLM's KV tensors alive as long
        // as this worker, and vLLM does not touch a block while a save or
        // load holds it (the scheduler's delayed frees).
        let started = py.detach(|| unsafe { registration.start() });
        st.install(started.map_err(worker_err)?);
        Ok(())
    }

    /// The step's loads (and its preempted and delayed requests), from the
    /// scheduler's metadata bytes; the loads that could not start are
    /// reported failed.
    fn start_loads(&self, meta: &[u8]) -> PyResult<()> {
        self.state()?.start_loads(meta).map_err(worker_err)
    }

    /// vLLM's `handle_preemptions`, before the step's forward pass reuses
    /// the preempted requests' blocks: aborts their saves and loads and
    /// waits until none of them touches its blocks, at most one store
    /// call's bound (no call touches memory past its deadline). False when
    /// some still ran then.
    fn preempt(&self, py: Python<'_>, meta: &[u8]) -> PyResult<bool> {
        let (ids, until) = self.state()?.preempt(meta).map_err(worker_err)?;
        if ids.is_empty() {
            return Ok(true);
        }
        self.wait_until(py, until, Duration::from_millis(1), |w| !w.touches(&ids))
    }

    /// The step's saves, from the same metadata: started now, after the
    /// forward pass wrote their blocks.
    fn start_saves(&self, meta: &[u8]) -> PyResult<()> {
        self.state()?.start_saves(meta).map_err(worker_err)
    }

    /// `(finished sending, loaded, failed loads)` request ids since the
    /// last call.
    fn transfer_results(&self) -> PyResult<(Vec<String>, Vec<String>, Vec<String>)> {
        Ok(self.state()?.take_results())
    }

    /// The KV events since the last call, one tuple each: `(kind, group,
    /// hashes, parent, block_size, token_ids, lora, medium)`, `kind` one of
    /// `stored`, `removed`, `cleared`; and how many shards store each
    /// block (a block is stored once every shard reported it).
    #[allow(clippy::type_complexity)]
    fn take_events(&self) -> PyResult<(Vec<EventTuple>, usize)> {
        let (events, shards) = self.state()?.take_events();
        Ok((events.into_iter().map(event_tuple).collect(), shards))
    }

    /// Waits until no save or load runs, at most `timeout_s` (shutdown).
    fn drain(&self, py: Python<'_>, timeout_s: f64) -> PyResult<bool> {
        let until = Instant::now() + crate::args::seconds("timeout_s", timeout_s)?;
        self.wait_until(py, until, Duration::from_millis(2), EngineWorker::is_idle)
    }

    /// Stops serving the scheduler's lookups (shutdown): the endpoint is
    /// free at once for the engine that takes it next, and a server
    /// dropped later cannot remove that one's socket.
    fn close_lookups(&self, py: Python<'_>) -> PyResult<()> {
        let server = self.state()?.close_lookups();
        py.detach(move || drop(server));
        Ok(())
    }

    /// Counters: the worker's, the connector's and the lookup server's.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (k, v) in self.state()?.stats() {
            d.set_item(k, v)?;
        }
        Ok(d)
    }
}

/// The store at `url`, opened with the GIL released: a URL that is wrong
/// is a misuse, a store that cannot be reached a transport error.
pub(crate) fn open_store(py: Python<'_>, url: &str) -> PyResult<AnyStore> {
    py.detach(|| AnyStore::open(url)).map_err(|e| {
        if e.is_bad_url() {
            misuse(format!("store {url:?}: {e}"))
        } else {
            TransportError::new_err(format!("store {url:?}: {e}"))
        }
    })
}
