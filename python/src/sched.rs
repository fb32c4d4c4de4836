//! The scheduler half of a vLLM connector (`kvferry::scheduler`) and the
//! step's metadata it hands the worker, for Python.

use std::sync::Mutex;

use kvferry::scheduler::{
    Blame, FinishStatus, KvRole, KvTransferParams, SchedError, SchedRequest, SchedulerConfig,
};
use kvferry::TransferId;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::args::block_lists;
use crate::errors::{misuse, BusyError, ParamsError};

fn sched_err(e: SchedError) -> PyErr {
    let text = e.to_string();
    match e.blame() {
        Blame::Misuse => misuse(text),
        Blame::Router => ParamsError::new_err(text),
        Blame::Capacity => BusyError::new_err(text),
    }
}

fn role(name: &str) -> PyResult<KvRole> {
    match name {
        "kv_producer" | "prefill" => Ok(KvRole::Producer),
        "kv_consumer" | "decode" => Ok(KvRole::Consumer),
        "kv_both" | "both" => Ok(KvRole::Both),
        _ => Err(misuse(format!(
            "kv_role is kv_producer, kv_consumer or kv_both, not {name:?}"
        ))),
    }
}

fn status(name: &str) -> PyResult<FinishStatus> {
    match name {
        "length_capped" => Ok(FinishStatus::LengthCapped),
        "stopped" => Ok(FinishStatus::Stopped),
        "aborted" => Ok(FinishStatus::Aborted),
        "ignored" => Ok(FinishStatus::Ignored),
        "error" => Ok(FinishStatus::Error),
        _ => Err(misuse(format!(
            "finish status is length_capped, stopped, aborted, ignored or error, not {name:?}"
        ))),
    }
}

/// `kv_transfer_params` as JSON (what the router sent), or none.
fn params(json: Option<&str>) -> PyResult<Option<KvTransferParams>> {
    json.map(|j| {
        serde_json::from_str(j)
            .map_err(|e| ParamsError::new_err(format!("kv_transfer_params: {e}")))
    })
    .transpose()
}

/// The step's loads and sends for `Node.start_load_kv`, opaque to Python
/// but for the transfers it names.
#[pyclass(module = "kvferry._native", frozen)]
pub(crate) struct LoadMeta {
    pub(crate) meta: kvferry::LoadMeta,
}

#[pymethods]
impl LoadMeta {
    /// The transfer ids of its loads and of its sends.
    fn transfer_ids(&self) -> (Vec<u64>, Vec<u64>) {
        let loads = self.meta.loads.iter().map(|l| l.transfer_id.0).collect();
        let sends = self.meta.sends.iter().map(|s| s.transfer_id.0).collect();
        (loads, sends)
    }

    /// How many transfers it names: its loads plus its sends.
    fn __len__(&self) -> usize {
        self.meta.loads.len() + self.meta.sends.len()
    }

    /// Compact bytes (postcard) that `from_bytes` turns back into this.
    fn to_bytes<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.meta.encode())
    }

    /// The `LoadMeta` of `to_bytes`; bytes that are not one, or over the
    /// size bound, raise `MisuseError`.
    #[staticmethod]
    fn from_bytes(data: &[u8]) -> PyResult<LoadMeta> {
        kvferry::LoadMeta::decode(data)
            .map(|meta| LoadMeta { meta })
            .map_err(|e| misuse(e.to_string()))
    }

    /// Pickles as its bytes: vLLM's multiprocess executor pickles the
    /// connector metadata to its worker processes.
    fn __reduce__<'py>(
        slf: &Bound<'py, Self>,
    ) -> PyResult<(Bound<'py, PyAny>, (Bound<'py, PyBytes>,))> {
        let from_bytes = slf.get_type().getattr("from_bytes")?;
        Ok((from_bytes, (slf.get().to_bytes(slf.py()),)))
    }
}

/// One request as the engine's scheduler sees it.
struct Req<'a> {
    request_id: &'a str,
    prompt_len: u64,
    computed_len: u64,
    blocks: kvferry::BlockLists,
    params: Option<KvTransferParams>,
}

impl Req<'_> {
    fn view(&self) -> SchedRequest<'_> {
        SchedRequest {
            request_id: self.request_id,
            prompt_len_tokens: self.prompt_len,
            computed_len_tokens: self.computed_len,
            block_ids: &self.blocks,
            params: self.params.as_ref(),
        }
    }
}

/// The scheduler half (`kvferry.Scheduler` wraps it).
#[pyclass(module = "kvferry._native", frozen)]
pub(crate) struct Scheduler {
    s: Mutex<kvferry::Scheduler>,
}

impl Scheduler {
    fn lock(&self) -> std::sync::MutexGuard<'_, kvferry::Scheduler> {
        self.s.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[pymethods]
impl Scheduler {
    /// The scheduler half of one engine. `kv_role`: `"kv_producer"` (or
    /// `"prefill"`), `"kv_consumer"` (`"decode"`) or `"kv_both"`
    /// (`"both"`). `engine_id`, `bootstrap_addr` and `dp_rank`: this
    /// engine as prefill hands it to decode. `block_size`: tokens per KV
    /// block, the same on both engines. `window_tokens`: per KV-cache
    /// group, its sliding window in tokens (0: full attention); its length
    /// is the number of groups (one when not given). `max_tracked_requests`:
    /// most requests tracked at once (65536 when not given). A bad role or
    /// a zero size is a `MisuseError`.
    #[new]
    #[pyo3(signature = (kv_role, engine_id, bootstrap_addr, block_size, dp_rank=0, window_tokens=None, max_tracked_requests=None))]
    fn new(
        kv_role: &str,
        engine_id: String,
        bootstrap_addr: String,
        block_size: u32,
        dp_rank: u32,
        window_tokens: Option<Vec<u64>>,
        max_tracked_requests: Option<usize>,
    ) -> PyResult<Scheduler> {
        let mut c = SchedulerConfig::new(role(kv_role)?, engine_id, bootstrap_addr, block_size);
        c.dp_rank = dp_rank;
        if let Some(w) = window_tokens {
            c.num_groups = w.len().max(1);
            c.window_tokens = w;
        }
        if let Some(m) = max_tracked_requests {
            c.max_tracked_requests = m;
        }
        let s = kvferry::Scheduler::new(c).map_err(sched_err)?;
        Ok(Scheduler { s: Mutex::new(s) })
    }

    /// `(tokens to load, asynchronously)` for a waiting request.
    #[pyo3(signature = (request_id, prompt_len, computed_len, params=None))]
    fn get_num_new_matched_tokens(
        &self,
        request_id: &str,
        prompt_len: u64,
        computed_len: u64,
        params: Option<&str>,
    ) -> PyResult<(u64, bool)> {
        let r = Req {
            request_id,
            prompt_len,
            computed_len,
            blocks: Vec::new(),
            params: self::params(params)?,
        };
        self.lock()
            .get_num_new_matched_tokens(&r.view())
            .map_err(sched_err)
    }

    /// Records what the blocks just allocated (`block_ids`, per group, in
    /// token order) need.
    #[pyo3(signature = (request_id, prompt_len, computed_len, block_ids, params, num_external_tokens))]
    fn update_state_after_alloc(
        &self,
        request_id: &str,
        prompt_len: u64,
        computed_len: u64,
        block_ids: &Bound<'_, PyAny>,
        params: Option<&str>,
        num_external_tokens: u64,
    ) -> PyResult<()> {
        let r = Req {
            request_id,
            prompt_len,
            computed_len,
            blocks: block_lists(block_ids)?,
            params: self::params(params)?,
        };
        self.lock()
            .update_state_after_alloc(&r.view(), num_external_tokens)
            .map_err(sched_err)
    }

    /// `(keep the blocks until finished, params for the decode engine as
    /// JSON)` for a request that ended with `status`.
    #[pyo3(signature = (request_id, prompt_len, computed_len, block_ids, params, status))]
    fn request_finished(
        &self,
        request_id: &str,
        prompt_len: u64,
        computed_len: u64,
        block_ids: &Bound<'_, PyAny>,
        params: Option<&str>,
        status: &str,
    ) -> PyResult<(bool, Option<String>)> {
        let r = Req {
            request_id,
            prompt_len,
            computed_len,
            blocks: block_lists(block_ids)?,
            params: self::params(params)?,
        };
        let d = self
            .lock()
            .request_finished(&r.view(), self::status(status)?)
            .map_err(sched_err)?;
        let json = d
            .params
            .map(|p| serde_json::to_string(&p).map_err(|e| misuse(e.to_string())))
            .transpose()?;
        Ok((d.delay_free, json))
    }

    /// Everything recorded since the last call, for `Node.start_load_kv`.
    fn build_connector_meta(&self) -> LoadMeta {
        LoadMeta {
            meta: self.lock().build_connector_meta(),
        }
    }

    /// The node's finished transfer ids to `(finished_sending,
    /// finished_recving, freed)` request ids.
    fn handle_finished(
        &self,
        sent: Vec<u64>,
        received: Vec<u64>,
    ) -> (Vec<String>, Vec<String>, Vec<String>) {
        let ids = |v: Vec<u64>| v.into_iter().map(TransferId).collect::<Vec<_>>();
        let f = self.lock().handle_finished(&ids(sent), &ids(received));
        (f.finished_sending, f.finished_recving, f.freed)
    }

    /// The next transfer worth aborting (a request that ended during its load).
    fn poll_abort(&self) -> Option<u64> {
        self.lock().poll_abort().map(|t| t.0)
    }

    /// The request id tracked under `transfer_id`, or `None` when no
    /// tracked request has it.
    fn request_id_of(&self, transfer_id: u64) -> Option<String> {
        self.lock()
            .request_id_of(TransferId(transfer_id))
            .map(str::to_owned)
    }

    /// The transfer id of the tracked request `request_id`, or `None` when
    /// it is not tracked.
    fn transfer_id_of(&self, request_id: &str) -> Option<u64> {
        self.lock().transfer_id_of(request_id).map(|t| t.0)
    }
}
