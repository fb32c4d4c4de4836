"""kvferry as a vLLM KV connector (P/D disaggregation), for vLLM 0.33.x.

Load it with::

    --kv-transfer-config '{"kv_connector": "KvferryConnector",
                           "kv_connector_module_path": "kvferry.vllm",
                           "kv_role": "kv_producer",
                           "kv_connector_extra_config": {"bootstrap": "10.0.0.1:8998"}}'

``kv_role`` is ``kv_producer`` (prefill), ``kv_consumer`` (decode) or
``kv_both``. ``kv_connector_extra_config`` holds the node's settings
(``docs/config.md``: ``mode``, ``host``, timeouts as ``*_ms``, ...); on a
prefill engine ``bootstrap`` is the ``host:port`` of its bootstrap
service, which TP rank 0 of DP rank 0 serves and every rank registers at.
Requests carry the ``kv_transfer_params`` a MooncakeConnector deployment's
router sends (``do_remote_decode`` on prefill; ``do_remote_prefill``,
``transfer_id``, ``remote_engine_id``, ``remote_bootstrap_addr`` on
decode), so the proxy needs no change.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.request import RequestStatus

import kvferry

logger = logging.getLogger(__name__)

#: The vLLM releases this connector is written for.
SUPPORTED_VLLM = ("0.33.",)

#: Keys of ``kv_connector_extra_config`` the connector reads itself; every
#: other key is a node setting.
_CONNECTOR_KEYS = {"bootstrap", "tp_rank"}

_STATUS = {
    RequestStatus.FINISHED_LENGTH_CAPPED: "length_capped",
    RequestStatus.FINISHED_STOPPED: "stopped",
    RequestStatus.FINISHED_ABORTED: "aborted",
    RequestStatus.FINISHED_IGNORED: "ignored",
    RequestStatus.FINISHED_ERROR: "error",
}

_NODE_ROLE = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "both"}


def _check_version() -> None:
    if not vllm.__version__.startswith(SUPPORTED_VLLM):
        raise RuntimeError(
            f"kvferry.vllm supports vLLM {', '.join(v + 'x' for v in SUPPORTED_VLLM)}, "
            f"not {vllm.__version__}"
        )


class KvferryStats(KVConnectorStats):
    """The node's counters (`Node.stats()`: requests ok, failed, bytes,
    resends, ...) added up since the last report, summed across workers.
    Every counter is also on the node's `/metrics` (`metrics_listen`)."""

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


class KvferryMetadata(KVConnectorMetadata):
    """One step's loads and sends, the vLLM request id of each transfer,
    and the transfers worth aborting."""

    def __init__(self, meta: kvferry.LoadMeta, names: "dict[int, str]", aborts: "list[int]"):
        self.meta = meta
        self.names = names
        self.aborts = aborts


class KvferryConnector(KVConnectorBase_V1, SupportsHMA):
    """The scheduler role drives :class:`kvferry.Scheduler`; the worker
    role a :class:`kvferry.Node` per TP rank. Several KV-cache groups
    (vLLM's hybrid allocator) move together: every group's blocks in every
    layer's memory (groups alias the same bytes, a block belonging to one
    group at a time), sliding-window groups only their window's blocks."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        _check_version()
        super().__init__(vllm_config, role, kv_cache_config)
        kt = vllm_config.kv_transfer_config
        extra = dict(kt.kv_connector_extra_config or {})
        self._sched: Optional[_SchedulerSide] = None
        self._worker: Optional[_WorkerSide] = None
        if role == KVConnectorRole.SCHEDULER:
            self._sched = _SchedulerSide(vllm_config, extra, kv_cache_config)
        else:
            self._worker = _WorkerSide(vllm_config, extra)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> Optional[str]:
        # Heads outermost in a block: a TP rank's heads are one contiguous
        # run, so heterogeneous TP moves runs, not scattered rows.
        mc = vllm_config.model_config
        if mc is not None and mc.use_mla:
            return None
        return "HND"

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

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._sched is not None
        return self._sched.build_connector_meta()

    def request_finished(self, request: Any, block_ids: "list[int]"):
        assert self._sched is not None
        return self._sched.request_finished(request, [block_ids])

    def request_finished_all_groups(self, request: Any, block_ids: "tuple[list[int], ...]"):
        assert self._sched is not None
        return self._sched.request_finished(request, [list(g) for g in block_ids])

    def update_connector_output(self, connector_output: Any) -> None:
        if self._sched is not None:
            self._sched.update_connector_output(connector_output)

    # -- worker side -----------------------------------------------------

    def register_kv_caches(self, kv_caches: "dict[str, torch.Tensor]") -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvferryMetadata)
        self._worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # The KV of a request lands whole, between steps (async loads).
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any):
        # Prefill sends the finished blocks; nothing is saved per layer.
        pass

    def wait_for_save(self) -> None:
        pass

    def get_finished(self, finished_req_ids: "set[str]"):
        assert self._worker is not None
        return self._worker.get_finished()

    def get_block_ids_with_load_errors(self) -> "set[int]":
        assert self._worker is not None
        return self._worker.node.block_ids_with_load_errors()

    def get_kv_connector_stats(self) -> Optional[KVConnectorStats]:
        if self._worker is None:
            return None
        return self._worker.stats()

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[dict] = None) -> KVConnectorStats:
        return KvferryStats(data=dict(data or {}))

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.node.shutdown()


def _windows(kv_cache_config: Any, block_size: int) -> "list[int]":
    """Per KV-cache group, its sliding window in tokens (0: full attention);
    every group must use the engine's block size."""
    groups = kv_cache_config.kv_cache_groups if kv_cache_config is not None else []
    windows = []
    for g in groups:
        spec = g.kv_cache_spec
        if getattr(spec, "block_size", block_size) != block_size:
            raise kvferry.MisuseError(
                f"KV-cache group {g.layer_names[:1]} has blocks of {spec.block_size} tokens, "
                f"the engine {block_size}: kvferry needs one block size"
            )
        windows.append(int(getattr(spec, "sliding_window", None) or 0))
    return windows or [0]


class _SchedulerSide:
    def __init__(self, vllm_config: Any, extra: dict, kv_cache_config: Any):
        kt = vllm_config.kv_transfer_config
        block_size = vllm_config.cache_config.block_size
        self._sched = kvferry.Scheduler(
            kt.kv_role,
            kt.engine_id,
            extra.get("bootstrap", ""),
            block_size,
            dp_rank=vllm_config.parallel_config.data_parallel_rank,
            window_tokens=_windows(kv_cache_config, block_size),
        )
        #: Local prefix tokens of each waiting request, from
        #: `get_num_new_matched_tokens` to `update_state_after_alloc`.
        self._computed: "dict[str, int]" = {}

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
        params = request.kv_transfer_params
        if not params:
            return 0, False
        self._computed[request.request_id] = num_computed_tokens
        return self._sched.get_num_new_matched_tokens(
            request.request_id, request.num_prompt_tokens, num_computed_tokens, params
        )

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        params = request.kv_transfer_params
        if not params:
            return
        computed = self._computed.pop(request.request_id, request.num_computed_tokens)
        block_ids = [list(g) for g in blocks.get_block_ids()]
        self._sched.update_state_after_alloc(
            request.request_id,
            request.num_prompt_tokens,
            computed,
            block_ids,
            params,
            num_external_tokens,
        )

    def build_connector_meta(self) -> KvferryMetadata:
        meta = self._sched.build_connector_meta()
        loads, sends = meta.transfer_ids()
        names = {}
        for t in loads + sends:
            rid = self._sched.request_id_of(t)
            # Release-only loads and cancelled sends belong to no request
            # vLLM still knows: their ends are not reported.
            if rid is not None:
                names[t] = rid
        aborts = []
        while (t := self._sched.poll_abort()) is not None:
            aborts.append(t)
        return KvferryMetadata(meta, names, aborts)

    def request_finished(self, request: Any, block_ids: "list[list[int]]"):
        self._computed.pop(request.request_id, None)
        params = request.kv_transfer_params
        if not params:
            return False, None
        status = _STATUS.get(request.status, "error")
        return self._sched.request_finished(
            request.request_id, request.num_prompt_tokens, 0, block_ids, params, status
        )

    def update_connector_output(self, out: Any) -> None:
        tid = self._sched.transfer_id_of
        sent = [t for r in (out.finished_sending or ()) if (t := tid(r)) is not None]
        received = [t for r in (out.finished_recving or ()) if (t := tid(r)) is not None]
        if sent or received:
            self._sched.handle_finished(sent, received)


class _WorkerSide:
    def __init__(self, vllm_config: Any, extra: dict):
        from vllm.distributed import parallel_state as ps

        kt = vllm_config.kv_transfer_config
        pc = vllm_config.parallel_config
        if ps.model_parallel_is_initialized():
            tp_rank, tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
        else:
            # Outside vLLM's worker processes (tests): the rank is given.
            tp_rank, tp_size = int(extra.get("tp_rank", 0)), pc.tensor_parallel_size
        self.model = vllm_config.model_config
        self.block_size = vllm_config.cache_config.block_size
        self.tp_size = tp_size
        settings = {k: v for k, v in extra.items() if k not in _CONNECTOR_KEYS}
        role = _NODE_ROLE[kt.kv_role]
        bootstrap = extra.get("bootstrap")
        if bootstrap and role != "decode":
            settings["bootstrap"] = bootstrap
            if tp_rank == 0 and pc.data_parallel_rank == 0:
                settings["serve_bootstrap"] = bootstrap
        self.node = kvferry.Node(
            role=role,
            engine_id=kt.engine_id,
            tp_size=tp_size,
            tp_rank=tp_rank,
            dp_rank=pc.data_parallel_rank,
            **settings,
        )
        #: vLLM request id of each transfer started, until it is reported.
        self.names: "dict[int, str]" = {}
        self.tensors: list = []
        #: The counters at the last stats report.
        self.reported: "dict[str, int]" = {}

    def register_kv_caches(self, kv_caches: "dict[str, torch.Tensor]") -> None:
        regions, num_blocks, kind, heads, head_bytes = [], None, None, None, None
        seen = set()
        for name, t in kv_caches.items():
            # Layers of different KV-cache groups share their tensor: its
            # memory is registered once, and every group's blocks index it.
            view = (t.data_ptr(), tuple(t.shape), tuple(t.stride()))
            if view in seen:
                continue
            seen.add(view)
            r, n, k, h, hb = kv_regions(t, self.block_size)
            if num_blocks not in (None, n) or kind not in (None, k):
                raise kvferry.MisuseError(f"layer {name}: its KV cache differs from the others'")
            regions += r
            num_blocks, kind, heads, head_bytes = n, k, h, hb
            self.tensors.append(t)
        total = 1 if kind == "mla" else self.model.get_total_num_kv_heads()
        self.node.register_kv_caches(
            regions=regions,
            num_blocks=num_blocks,
            layout=kind,
            total_kv_heads=total,
            block_tokens=self.block_size,
            head_bytes=head_bytes,
        )

    def start_load_kv(self, meta: KvferryMetadata) -> None:
        self.names.update(meta.names)
        for t in meta.aborts:
            try:
                self.node.abort(t)
            except kvferry.MisuseError:
                pass  # ended meanwhile
        if len(meta.meta):
            self.node.start_load_kv(meta.meta)

    def stats(self) -> Optional[KvferryStats]:
        """What the counters grew by since the last report (`dead_now` as
        it is now), or None when nothing changed."""
        now = self.node.stats()
        delta = {k: v - self.reported.get(k, 0) for k, v in now.items() if k != "dead_now"}
        delta["dead_now"] = now.get("dead_now", 0)
        self.reported = now
        stats = KvferryStats(data=delta)
        return None if stats.is_empty() else stats

    def get_finished(self):
        sent, received = self.node._native.get_finished()
        names = lambda ids: {r for t in ids if (r := self.names.pop(t, None)) is not None}  # noqa: E731
        s, r = names(sent), names(received)
        return (s or None), (r or None)


def kv_regions(t: torch.Tensor, block_size: int):
    """The regions of one layer's KV cache tensor: ``([(base, block_len,
    kv_block_len)], num_blocks, layout, heads per rank, head bytes)``.

    K/V split tensors (a dimension of 2 first, or right after the blocks,
    as FlashAttention's ``(2, num_blocks, block_size, heads, head_size)``)
    give a K and a V region per layer; MLA's ``(num_blocks, block_size,
    dim)`` one. Whether a block holds its heads outermost (HND) or its
    tokens (NHD) is read from the strides; the bytes of one block's K (or
    V) must be dense."""
    if t.device.type != "cpu":
        raise kvferry.MisuseError(f"only CPU tensors can be registered, not {t.device}")
    es = t.element_size()
    if t.dim() == 3:
        nb, bs, dim = t.shape
        if bs != block_size or t.stride(2) != 1 or t.stride(1) != dim:
            raise kvferry.MisuseError(f"an MLA cache of shape {tuple(t.shape)} is not dense per block")
        return [(t.data_ptr(), t.stride(0) * es, bs * dim * es)], nb, "mla", 1, dim * es
    if t.dim() != 5 or 2 not in (t.shape[0], t.shape[1]):
        raise kvferry.MisuseError(f"unrecognised KV cache shape {tuple(t.shape)}")
    kv_dim, block_dim = (0, 1) if t.shape[0] == 2 else (1, 0)
    nb = t.shape[block_dim]
    inner = [2, 3, 4]
    # Which inner dimension holds the tokens: the one of block_size (the
    # FlashAttention order, tokens before heads, when both are equal).
    tokens_dim = 2 if t.shape[2] == block_size else 3
    heads_dim = 5 - tokens_dim
    if t.stride(4) != 1:
        raise kvferry.MisuseError("head_size must be the innermost dimension")
    heads, hd = t.shape[heads_dim], t.shape[4]
    by_stride = sorted(inner, key=lambda d: -t.stride(d))
    dense = t.stride(by_stride[1]) == hd and t.stride(by_stride[0]) == hd * t.shape[by_stride[1]]
    if not dense:
        raise kvferry.MisuseError(f"a block's KV of shape {tuple(t.shape)} is not dense")
    layout = "hnd" if by_stride[0] == heads_dim else "nhd"
    kv_block_len = heads * block_size * hd * es
    regions = [
        (t.data_ptr() + i * t.stride(kv_dim) * es, t.stride(block_dim) * es, kv_block_len)
        for i in (0, 1)
    ]
    return regions, nb, layout, heads, hd * es
