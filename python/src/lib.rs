#![warn(missing_docs)]
//! `kvferry._native`: the node, its handles and its errors for Python.
//!
//! The Python package (`kvferry/__init__.py`) wraps these classes: it turns
//! tensors into regions, phases into `kvferry.Phase` and string request ids
//! back into strings. Every call that can wait releases the GIL, and
//! `wait` checks for signals between slices of at most [`WAIT_SLICE`], so
//! Ctrl-C interrupts it promptly.

use std::time::{Duration, Instant};

use kvferry::node::{NodeSettings, PrefillTarget};
use kvferry::{ModelSpec, NodeError, Phase, TransferId};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyInt, PyString};

mod args;
mod errors;
mod logs;
mod pages;
mod sched;
mod store;

use args::{block_lists, layout_kind, regions_of, same_process, seconds};
use errors::{
    misuse, node_err, timeout_type, BusyError, Error, MisuseError, ParamsError, PeerError,
    TransportError,
};

/// Longest stretch `wait` holds without checking for signals.
const WAIT_SLICE: Duration = Duration::from_millis(50);
/// A transfer as Python names it: a number it owns, or a string request id.
enum TransferRef {
    Number(TransferId),
    Name(String),
}

impl TransferRef {
    fn from_py(id: &Bound<'_, PyAny>) -> PyResult<TransferRef> {
        if let Ok(s) = id.cast::<PyString>() {
            return Ok(TransferRef::Name(s.to_str()?.to_owned()));
        }
        if id.is_instance_of::<PyInt>() {
            let n: i128 = id.extract()?;
            return u64::try_from(n)
                .map(|n| TransferRef::Number(TransferId(n)))
                .map_err(|_| misuse(format!("transfer id {n} is not in 0..2**64")));
        }
        Err(PyTypeError::new_err(format!(
            "a transfer id is an int or a str, not {}",
            id.get_type().name()?
        )))
    }
}

/// `(phase name, failure reason)`, the names of the Rust phases.
fn phase_pair(p: Phase) -> (&'static str, Option<String>) {
    match p {
        Phase::Bootstrapping => ("Bootstrapping", None),
        Phase::WaitingForInput => ("WaitingForInput", None),
        Phase::Transferring => ("Transferring", None),
        Phase::Success => ("Success", None),
        Phase::Failed(why) => ("Failed", Some(format!("{why:?}"))),
        Phase::Expired => ("Expired", None),
    }
}

/// Waits for `poll` to turn terminal, up to `timeout_s`, in slices that
/// release the GIL and check for signals in between.
fn wait_phase(
    py: Python<'_>,
    timeout_s: f64,
    wait: impl Fn(Duration) -> Phase + Sync,
) -> PyResult<(&'static str, Option<String>)> {
    let deadline = Instant::now() + seconds("timeout_s", timeout_s)?;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let p = py.detach(|| wait(left.min(WAIT_SLICE)));
        if p.is_terminal() || Instant::now() >= deadline {
            return Ok(phase_pair(p));
        }
        py.check_signals()?;
    }
}

/// `(kind, items, [(base, item_len)])`: a pool of per-request items beside
/// the KV (SGLang's aux and state buffers).
type PoolSpec = (String, u64, Vec<(u64, u64)>);

fn pool((kind, items, regions): PoolSpec) -> PyResult<kvferry::node::Pool> {
    let kind = match kind.as_str() {
        "aux" => kvferry::node::PoolKind::Aux,
        "state" => kvferry::node::PoolKind::State,
        _ => {
            return Err(misuse(format!(
                "a pool is \"aux\" or \"state\", not {kind:?}"
            )))
        }
    };
    let regions = regions
        .into_iter()
        .map(|(base, item_len)| kvferry::node::PoolRegion { base, item_len })
        .collect();
    Ok(kvferry::node::Pool {
        kind,
        items,
        regions,
    })
}

/// One prefill or decode rank (`kvferry.Node` wraps it).
#[pyclass(module = "kvferry._native", frozen)]
struct Node {
    node: kvferry::Node,
    /// The process that started it (see [`same_process`]).
    pid: u32,
    /// Every setting it was started with (see [`Node::settings`]).
    settings: NodeSettings,
}

impl Node {
    fn live(&self) -> PyResult<&kvferry::Node> {
        same_process(self.pid)?;
        Ok(&self.node)
    }
}

#[pymethods]
impl Node {
    /// Starts a node from its settings, as JSON (the schema of
    /// `kvferry::node::NodeSettings`, `docs/config.md`). A key the JSON
    /// leaves out is taken from its `KVFERRY_<KEY>` variable, else its
    /// default: engines that start nodes themselves (SGLang) pass only
    /// what they know, and the rest is the deployment's environment.
    #[new]
    fn new(py: Python<'_>, settings: &str) -> PyResult<Node> {
        let config = NodeSettings::from_env()
            .and_then(|env| Ok(env.overridden_by(NodeSettings::from_json(settings)?)))
            .and_then(|s| s.build())
            .map_err(|e| misuse(e.to_string()))?;
        let settings = NodeSettings::of(&config);
        let node = py
            .detach(|| kvferry::Node::start(config))
            .map_err(node_err)?;
        Ok(Node {
            node,
            pid: std::process::id(),
            settings,
        })
    }

    /// Every setting the node runs with, as JSON: the explicit ones, then
    /// `KVFERRY_*` variables, then defaults.
    fn settings(&self) -> String {
        serde_json::to_string(&self.settings).expect("settings serialize as JSON")
    }

    /// Makes the node's device copies wait for what the engine's stream
    /// `stream` (a `CUstream`) ran so far (`kvferry::Node::engine_handoff`).
    fn engine_handoff(&self, py: Python<'_>, stream: u64) -> PyResult<()> {
        let node = self.live()?;
        py.detach(|| node.engine_handoff(stream)).map_err(node_err)
    }

    /// Registers raw regions `(base, block_len, kv_block_len)` of
    /// `num_blocks` blocks each. The caller keeps the memory alive until
    /// the node is shut down (the Python wrapper holds the tensors).
    #[pyo3(signature = (regions, num_blocks, layout, total_kv_heads, block_tokens, head_bytes, first_region=0, pools=None))]
    #[allow(clippy::too_many_arguments)]
    fn register_regions(
        &self,
        py: Python<'_>,
        regions: Vec<(u64, u64, u64)>,
        num_blocks: u64,
        layout: &str,
        total_kv_heads: u32,
        block_tokens: u32,
        head_bytes: u64,
        first_region: u32,
        pools: Option<Vec<PoolSpec>>,
    ) -> PyResult<()> {
        let pools = pools
            .unwrap_or_default()
            .into_iter()
            .map(pool)
            .collect::<PyResult<_>>()?;
        let layout = kvferry::KvLayout {
            model: ModelSpec {
                layout: layout_kind(layout)?,
                total_kv_heads,
                block_tokens,
                head_bytes,
            },
            num_blocks,
            regions: regions_of(regions),
            first_region,
            pools,
        };
        // SAFETY: the wrapper keeps the tensors (or the caller the memory
        // behind raw regions, as documented) alive until `shutdown`, and
        // the regions were checked to lie inside them.
        let node = self.live()?;
        py.detach(|| unsafe { node.register_kv_caches(layout) })
            .map_err(node_err)
    }

    /// The handle of a send (prefill), by number or string request id.
    fn sender(&self, transfer_id: &Bound<'_, PyAny>) -> PyResult<Sender> {
        let tx = match TransferRef::from_py(transfer_id)? {
            TransferRef::Number(tid) => self.live()?.sender(tid),
            TransferRef::Name(name) => self.live()?.sender_named(&name),
        };
        tx.map(|tx| Sender { tx, pid: self.pid }).map_err(node_err)
    }

    /// The handle of a receive (decode) from the prefill engine named by
    /// `prefill_engine_id` at the bootstrap service `bootstrap`, or by the
    /// side channels of its ranks.
    #[pyo3(signature = (transfer_id, prefill_engine_id=None, bootstrap=None, prefill_dp_rank=None, side_channels=None, prefill_tp_size=1, prefill_pp_size=1))]
    #[allow(clippy::too_many_arguments)]
    fn receiver(
        &self,
        transfer_id: &Bound<'_, PyAny>,
        prefill_engine_id: Option<String>,
        bootstrap: Option<String>,
        prefill_dp_rank: Option<u32>,
        side_channels: Option<Vec<String>>,
        prefill_tp_size: u32,
        prefill_pp_size: u32,
    ) -> PyResult<Receiver> {
        let target = match (prefill_engine_id, side_channels) {
            (Some(engine_id), None) => PrefillTarget::Bootstrap {
                addr: bootstrap
                    .or_else(|| self.node.bootstrap_addr())
                    .ok_or_else(|| misuse("prefill_engine_id needs a bootstrap address"))?,
                engine_id,
                dp_rank: prefill_dp_rank,
            },
            (None, Some(side_channels)) => PrefillTarget::Direct {
                tp_size: prefill_tp_size,
                pp_size: prefill_pp_size,
                side_channels,
            },
            _ => return Err(misuse(
                "name the prefill engine by prefill_engine_id or by side_channels (one of them)",
            )),
        };
        let rx = match TransferRef::from_py(transfer_id)? {
            TransferRef::Number(tid) => self.live()?.receiver(tid, &target),
            TransferRef::Name(name) => self.live()?.receiver_named(&name, &target),
        };
        rx.map(|rx| Receiver { rx, pid: self.pid })
            .map_err(node_err)
    }

    /// Starts every load and send of one step's `meta`
    /// (`Scheduler.build_connector_meta`).
    fn start_load_kv(&self, py: Python<'_>, meta: &sched::LoadMeta) -> PyResult<()> {
        let node = self.live()?;
        py.detach(|| node.start_load_kv(&meta.meta))
            .map_err(node_err)
    }

    /// Starts every load and send of `meta` that it can: one refused
    /// request does not keep the others from starting. Returns the refused
    /// ones as `(loads, sends)`, each a list of `(transfer_id, why)`.
    /// `kernel_blocks_per_block`: the engine registered kernel blocks, each
    /// of its scheduler's blocks that many (`LoadMeta::in_kernel_blocks`).
    #[allow(clippy::type_complexity)]
    #[pyo3(signature = (meta, kernel_blocks_per_block=1))]
    fn start_load_kv_each(
        &self,
        py: Python<'_>,
        meta: &sched::LoadMeta,
        kernel_blocks_per_block: u32,
    ) -> PyResult<(Vec<(u64, String)>, Vec<(u64, String)>)> {
        let node = self.live()?;
        let failed = py.detach(|| match kernel_blocks_per_block {
            1 => node.start_load_kv_each(&meta.meta),
            n => node.start_load_kv_each(&meta.meta.in_kernel_blocks(n)),
        });
        let texts = |v: Vec<(TransferId, NodeError)>| {
            v.into_iter().map(|(t, e)| (t.0, e.to_string())).collect()
        };
        Ok((texts(failed.loads), texts(failed.sends)))
    }

    /// Aborts `transfer_id` (either direction).
    fn abort(&self, transfer_id: u64) -> PyResult<()> {
        self.live()?
            .abort(TransferId(transfer_id))
            .map_err(node_err)
    }

    /// The transfer id every node computes for string request id `name`.
    fn transfer_id_of(&self, name: &str) -> PyResult<u64> {
        self.live()?
            .transfer_id_of(name)
            .map(|t| t.0)
            .map_err(node_err)
    }

    /// `(finished sending, finished receiving)` transfer ids since the
    /// last call.
    fn get_finished(&self) -> PyResult<(Vec<u64>, Vec<u64>)> {
        let (sent, received) = self.live()?.get_finished();
        let ids = |v: Vec<TransferId>| v.into_iter().map(|t| t.0).collect();
        Ok((ids(sent), ids(received)))
    }

    /// `(finished sending, loads that succeeded, loads that failed)`
    /// transfer ids since the last call; each ended transfer in one list.
    fn get_finished_loads(&self) -> PyResult<(Vec<u64>, Vec<u64>, Vec<u64>)> {
        let f = self.live()?.get_finished_loads();
        let ids = |v: Vec<TransferId>| v.into_iter().map(|t| t.0).collect();
        Ok((ids(f.sent), ids(f.received), ids(f.failed_loads)))
    }

    /// Destination blocks whose load failed since the last call.
    fn block_ids_with_load_errors(&self) -> PyResult<Vec<u32>> {
        let ids = self.live()?.block_ids_with_load_errors();
        Ok(ids.into_iter().map(|b| b.0).collect())
    }

    /// The node's counters, by name.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (name, value) in self.live()?.stats().fields() {
            d.set_item(name, value)?;
        }
        Ok(d)
    }

    /// Stops the node; live requests get `grace_s` to tell their peers.
    #[pyo3(signature = (grace_s=0.2))]
    fn shutdown(&self, py: Python<'_>, grace_s: f64) -> PyResult<()> {
        let grace = seconds("grace_s", grace_s)?;
        // In a forked child there is nothing to stop (its threads are the
        // parent's); only the parent's node may be stopped.
        if std::process::id() == self.pid {
            py.detach(|| self.node.shutdown(grace));
        }
        Ok(())
    }

    /// `"prefill"`, `"decode"` or `"both"`.
    #[getter]
    fn role(&self) -> &'static str {
        match self.node.role() {
            kvferry::Role::Prefill => "prefill",
            kvferry::Role::Decode => "decode",
            kvferry::Role::Both => "both",
        }
    }

    /// The side channel peers connect to (`tcp://host:port`; empty on a
    /// decode node).
    #[getter]
    fn side_channel_addr(&self) -> String {
        self.node.side_channel_addr()
    }

    /// The data-plane endpoint.
    #[getter]
    fn endpoint(&self) -> String {
        self.node.endpoint()
    }

    /// The bootstrap service this node registers at or serves, if any.
    #[getter]
    fn bootstrap_addr(&self) -> Option<String> {
        self.node.bootstrap_addr()
    }
}

/// The prefill side of one transfer.
#[pyclass(module = "kvferry._native", frozen)]
struct Sender {
    tx: kvferry::Sender,
    pid: u32,
}

#[pymethods]
impl Sender {
    /// Hands the KV of `block_ids` (one group's ids, or a list per group)
    /// to the transfer; `is_last` on the request's last chunk.
    #[pyo3(signature = (block_ids, is_last=true))]
    fn send(&self, block_ids: &Bound<'_, PyAny>, is_last: bool) -> PyResult<()> {
        same_process(self.pid)?;
        let blocks = block_lists(block_ids)?;
        self.tx.send(blocks, is_last).map_err(node_err)
    }

    /// The current phase as `(name, failure)`, without waiting: `name` is
    /// a `kvferry.Phase` name, `failure` why the transfer failed when
    /// `name` is `"Failed"`, else `None`. Terminal once the source blocks
    /// may be reused.
    fn poll(&self) -> PyResult<(&'static str, Option<String>)> {
        same_process(self.pid)?;
        Ok(phase_pair(self.tx.poll()))
    }

    /// Waits up to `timeout_s` seconds for a terminal phase and returns
    /// `(name, failure)` as `poll` does, terminal or not. Releases the GIL
    /// and checks for signals between slices of at most 50 ms; a
    /// `timeout_s` below 0 or over a year is a `MisuseError`.
    fn wait(&self, py: Python<'_>, timeout_s: f64) -> PyResult<(&'static str, Option<String>)> {
        same_process(self.pid)?;
        wait_phase(py, timeout_s, |d| self.tx.wait(d))
    }

    /// Aborts the transfer; its phase turns terminal once no peer can read
    /// the source blocks any more. A transfer the node no longer knows is
    /// a `MisuseError`.
    fn abort(&self) -> PyResult<()> {
        same_process(self.pid)?;
        self.tx.abort().map_err(node_err)
    }

    /// The transfer's number: the one it was opened with, or the one the
    /// node derived from its string request id (`Node.transfer_id_of`).
    #[getter]
    fn transfer_id(&self) -> u64 {
        self.tx.transfer_id().0
    }
}

/// The decode side of one transfer.
#[pyclass(module = "kvferry._native", frozen)]
struct Receiver {
    rx: kvferry::Receiver,
    pid: u32,
}

#[pymethods]
impl Receiver {
    /// Asks the prefill ranks for the KV, into `block_ids` (one group's
    /// ids, or a list per group); `prefix_blocks`: per group, how many of
    /// the prefill side's leading blocks this rank holds already.
    #[pyo3(signature = (block_ids, prefix_blocks=None))]
    fn request(
        &self,
        block_ids: &Bound<'_, PyAny>,
        prefix_blocks: Option<Vec<u32>>,
    ) -> PyResult<()> {
        same_process(self.pid)?;
        let blocks = block_lists(block_ids)?;
        let r = match prefix_blocks {
            Some(p) => self.rx.request_with_prefix(blocks, p),
            None => self.rx.request(blocks),
        };
        r.map_err(node_err)
    }

    /// The current phase as `(name, failure)`, without waiting: `name` is
    /// a `kvferry.Phase` name (`"Bootstrapping"` before `request`),
    /// `failure` why the transfer failed when `name` is `"Failed"`, else
    /// `None`. Terminal once the destination blocks are the engine's again.
    fn poll(&self) -> PyResult<(&'static str, Option<String>)> {
        same_process(self.pid)?;
        Ok(phase_pair(self.rx.poll()))
    }

    /// Waits up to `timeout_s` seconds for a terminal phase and returns
    /// `(name, failure)` as `poll` does, terminal or not. Releases the GIL
    /// and checks for signals between slices of at most 50 ms; a
    /// `timeout_s` below 0 or over a year is a `MisuseError`.
    fn wait(&self, py: Python<'_>, timeout_s: f64) -> PyResult<(&'static str, Option<String>)> {
        same_process(self.pid)?;
        wait_phase(py, timeout_s, |d| self.rx.wait(d))
    }

    /// Aborts the transfer. Before `request` the prefill ranks are told
    /// all the same, so they release the KV they hold for it at once
    /// rather than at their bootstrap timeout.
    fn abort(&self) -> PyResult<()> {
        same_process(self.pid)?;
        self.rx.abort().map_err(node_err)
    }

    /// The transfer's number: the one it was opened with, or the one the
    /// node derived from its string request id (`Node.transfer_id_of`).
    #[getter]
    fn transfer_id(&self) -> u64 {
        self.rx.transfer_id().0
    }
}

/// A standalone bootstrap service (vLLM's routes): where the ranks of
/// prefill engines register and decode ranks look them up.
#[pyclass(module = "kvferry._native", frozen)]
struct BootstrapServer {
    server: std::sync::Mutex<Option<kvferry::bootstrap::BootstrapServer>>,
    addr: String,
}

#[pymethods]
impl BootstrapServer {
    /// Serves on `addr` (`host:port`; port 0 picks one), with the cluster
    /// key of `KVFERRY_CLUSTER_KEY_FILE`; without one on loopback only,
    /// unless `KVFERRY_ALLOW_UNAUTHENTICATED_REMOTE` says otherwise.
    #[new]
    fn new(py: Python<'_>, addr: &str) -> PyResult<BootstrapServer> {
        let key = kvferry::auth::ClusterKey::from_env().map_err(|e| misuse(e.to_string()))?;
        let allow = NodeSettings::from_env()
            .map_err(|e| misuse(e.to_string()))?
            .allow_unauthenticated_remote
            .unwrap_or(false);
        let config = kvferry::bootstrap::ServerConfig {
            auth: key.map(kvferry::bootstrap::ServerAuth::new),
            allow_unauthenticated_remote: allow,
            ..Default::default()
        };
        let server = py
            .detach(|| kvferry::bootstrap::BootstrapServer::start_with(addr, config, None))
            .map_err(|e| TransportError::new_err(e.to_string()))?;
        let addr = server.local_addr().to_string();
        Ok(BootstrapServer {
            server: std::sync::Mutex::new(Some(server)),
            addr,
        })
    }

    /// The address it serves on (`ip:port`).
    #[getter]
    fn addr(&self) -> String {
        self.addr.clone()
    }

    /// Stops serving.
    fn stop(&self, py: Python<'_>) {
        let server = self.server.lock().unwrap_or_else(|e| e.into_inner()).take();
        py.detach(|| drop(server));
    }
}

/// Moves the whole pages of `[addr, addr + length)` onto a sealed `memfd`
/// in place (`kvferry::transport::share_pages`) and returns its
/// descriptor, which the caller owns, or -1 when the range holds no whole
/// page. For an adapter that shares an engine's KV tensors with peers on
/// its host: the caller promises the range is a live host buffer nobody
/// touches during the call (the GIL is held throughout).
#[pyfunction]
fn _share_pages(addr: u64, length: u64) -> PyResult<i64> {
    use std::os::fd::IntoRawFd;
    let len = usize::try_from(length).map_err(|_| misuse("length out of range"))?;
    // SAFETY: the caller's promise above; the adapters pass tensors they
    // hold, before the engine runs a step.
    let fd = unsafe { kvferry::transport::share_pages(addr as usize as *mut u8, len) }
        .map_err(|e| misuse(format!("sharing KV memory: {e}")))?;
    Ok(fd.map_or(-1, |fd| i64::from(fd.into_raw_fd())))
}

/// The ranks of `engine_id` at the bootstrap service `addr`, as the JSON
/// of `GET /query` (one attempt, bounded by `timeout_s`), the request
/// signed with the cluster key of `KVFERRY_CLUSTER_KEY_FILE` when set;
/// `PeerError` when the service refuses this host (401, 403).
#[pyfunction]
fn _query_bootstrap(
    py: Python<'_>,
    addr: &str,
    engine_id: &str,
    timeout_s: f64,
) -> PyResult<String> {
    let timeout = seconds("timeout_s", timeout_s)?;
    let key = kvferry::auth::ClusterKey::from_env().map_err(|e| misuse(e.to_string()))?;
    let client = kvferry::bootstrap::BootstrapClient::new(addr)
        .map_err(|e| misuse(e.to_string()))?
        .with_io_timeout(timeout)
        .with_key(key);
    // Turned away for who this host is (no shared key; another host
    // without one): the peer's doing, and the same until an operator acts.
    let ranks = py.detach(|| client.query(Some(engine_id))).map_err(|e| {
        if e.is_refusal() {
            PeerError::new_err(e.to_string())
        } else {
            TransportError::new_err(e.to_string())
        }
    })?;
    Ok(serde_json::to_string(&ranks).expect("ranks serialize"))
}

/// Bytes this process copied through peers' shared memory so far.
#[pyfunction]
fn _shm_copied_bytes() -> u64 {
    kvferry::transport::shm_copied_bytes()
}

/// The native half of kvferry (PyO3): the node and its handles, the
/// schedulers, the store connector's halves, the page store and the
/// errors. Use the wrappers in `kvferry`.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<Node>()?;
    m.add_class::<Sender>()?;
    m.add_class::<Receiver>()?;
    m.add_class::<sched::Scheduler>()?;
    m.add_class::<sched::LoadMeta>()?;
    m.add_class::<BootstrapServer>()?;
    m.add_class::<store::StoreSched>()?;
    m.add_class::<store::StoreWorker>()?;
    m.add_class::<pages::PageStore>()?;
    m.add("STORE_URLS", kvferry_store::STORE_URLS)?;
    m.add("Error", py.get_type::<Error>())?;
    m.add("MisuseError", py.get_type::<MisuseError>())?;
    m.add("PeerError", py.get_type::<PeerError>())?;
    m.add("TransportError", py.get_type::<TransportError>())?;
    m.add("TimeoutError", timeout_type(py)?.bind(py))?;
    m.add("BusyError", py.get_type::<BusyError>())?;
    m.add("ParamsError", py.get_type::<ParamsError>())?;
    m.add("REQUEST_ID_MAX_BYTES", kvferry::REQUEST_ID_MAX_BYTES)?;
    m.add(
        "SETTING_KEYS",
        kvferry::node::setting_keys().collect::<Vec<_>>(),
    )?;
    m.add_function(wrap_pyfunction!(_share_pages, m)?)?;
    m.add_function(wrap_pyfunction!(_shm_copied_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(_query_bootstrap, m)?)?;
    m.add_function(wrap_pyfunction!(logs::_next_logs, m)?)?;
    m.add_function(wrap_pyfunction!(logs::_wake_logs, m)?)?;
    logs::install();
    Ok(())
}
