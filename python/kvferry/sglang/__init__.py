"""kvferry as SGLang's KV transfer backend (SGLang 0.5.x disaggregation).

SGLang has no registry of third-party transfer backends; it has a plugin
hook. Installing kvferry installs a ``sglang.srt.plugins`` entry point,
:func:`plugin`, and with ``KVFERRY_SGLANG=1`` in the environment of every
SGLang process the ``mooncake`` backend's classes are kvferry's::

    KVFERRY_SGLANG=1 python -m sglang.launch_server ... \\
        --disaggregation-mode prefill --disaggregation-transfer-backend mooncake

Each attention-TP rank is a :class:`kvferry.Node`; the prefill engine's
bootstrap service is kvferry's (:class:`KvferryKVBootstrapServer`). A
request's ``bootstrap_room`` is its transfer id. KV pages are kvferry
blocks (one region per layer's K and V buffer, token-major pages: NHD),
aux buffers one ``aux`` pool and each state type one ``state`` pool.

Settings: what SGLang knows (role, attention TP and DP ranks, PP stage,
bootstrap address, ``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`` and
``SGLANG_DISAGGREGATION_WAITING_TIMEOUT``) comes from SGLang; every other
node setting from its ``KVFERRY_<KEY>`` variable (``docs/python.md``). The
advertised host is the one SGLang's own backends advertise
(``SGLANG_HOST_IP``, else the interface the default route leaves by)
unless ``KVFERRY_HOST`` names one.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import json
import logging
import os
import time
from typing import Any, Callable, List, NoReturn, Optional

import numpy as np
from sglang.srt.disaggregation.base.conn import (
    BaseKVBootstrapServer,
    BaseKVManager,
    BaseKVReceiver,
    BaseKVSender,
    KVArgs,
    KVPoll,
    KVTransferDestination,
    KVTransferMetric,
)
from sglang.srt.disaggregation.utils import DisaggregationMode

import kvferry
from kvferry import Phase, _native
import kvferry._adapters as adapters

logger = logging.getLogger(__name__)

#: The engine id every prefill engine's ranks register under at its own
#: bootstrap service (SGLang runs one bootstrap service per prefill engine).
ENGINE_ID = "sglang"

#: The SGLang series this backend is written against; 0.5.23 is tested.
#: A newer 0.5.x is accepted when it has every interface :func:`check_sglang`
#: looks for.
SGLANG_SERIES = "0.5."

#: SGLang's own variables for a transfer's timeouts and liveness (seconds,
#: or a count), the node settings they become and the factor to their
#: unit; ``KVFERRY_<KEY>`` wins over each (docs/config.md).
SGLANG_KNOBS = {
    "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": ("bootstrap_timeout_ms", 1000),
    "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": ("waiting_timeout_ms", 1000),
    "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": ("heartbeat_interval_ms", 1000),
    "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": ("heartbeat_misses", 1),
    "SGLANG_FAILED_SESSION_PROBE_INTERVAL_S": ("probe_interval_ms", 1000),
}

#: How long ``try_ensure_parallel_info`` waits for the bootstrap service
#: (SGLang calls it from its scheduler loop, once a second per address).
QUERY_TIMEOUT_S = 0.5

_POLL = {
    Phase.Bootstrapping: KVPoll.Bootstrapping,
    Phase.WaitingForInput: KVPoll.WaitingForInput,
    Phase.Transferring: KVPoll.Transferring,
    Phase.Success: KVPoll.Success,
    Phase.Failed: KVPoll.Failed,
    Phase.Expired: KVPoll.Failed,
}


def check_sglang() -> None:
    """Raises :class:`kvferry.Error` unless the installed SGLang is a 0.5.x
    with every interface this backend uses."""
    version = importlib.metadata.version("sglang")
    missing = [name for name, ok in _features() if not ok]
    if version.startswith(SGLANG_SERIES) and not missing:
        return
    raise kvferry.Error(
        f"kvferry's SGLang backend needs SGLang 0.5.23 or a newer 0.5.x; found {version}"
        + (f", which lacks {', '.join(missing)}" if missing else "")
    )


def _features() -> "list[tuple[str, bool]]":
    from sglang.srt.disaggregation.common import conn as common

    params = inspect.signature(BaseKVReceiver.send_metadata).parameters
    try:
        from sglang.srt.runtime_context import get_parallel  # noqa: F401

        parallel = True
    except ImportError:
        parallel = False
    return [
        ("send_metadata(decode_prefix_len=)", "decode_prefix_len" in params),
        ("BaseKVSender.should_send_kv_chunk", hasattr(BaseKVSender, "should_send_kv_chunk")),
        ("common.conn.KVTransferError", hasattr(common, "KVTransferError")),
        ("common.conn.PrefillServerInfo", hasattr(common, "PrefillServerInfo")),
        ("runtime_context.get_parallel", parallel),
    ]


def plugin() -> None:
    """SGLang's plugin entry point: with ``KVFERRY_SGLANG=1``, the
    ``mooncake`` transfer backend's classes become kvferry's."""
    if os.environ.get("KVFERRY_SGLANG", "") not in ("1", "true", "yes"):
        return
    check_sglang()
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(
        "sglang.srt.disaggregation.utils.get_kv_class", _get_kv_class, HookType.AROUND
    )
    HookRegistry.register(MOONCAKE_ENGINE, _no_engine_for_transfers, HookType.AROUND)


#: SGLang builds one Mooncake TransferEngine per scheduler for its Mooncake
#: users, the ``mooncake`` transfer backend among them.
MOONCAKE_ENGINE = (
    "sglang.srt.distributed.device_communicators.mooncake_transfer_engine."
    "maybe_init_shared_mooncake_transfer_engine"
)


def _no_engine_for_transfers(original: Any, *args: Any, **kwargs: Any) -> Any:
    """Builds the shared Mooncake engine only for SGLang's other Mooncake
    users (HiCache storage, elastic EP, encoder transfers): kvferry stands in
    for the transfer backend, and without the ``mooncake`` package the
    engine SGLang would build for it kills the scheduler at start."""
    from sglang.srt.runtime_context import get_disagg

    disagg = get_disagg()
    if disagg.disaggregation_transfer_backend != "mooncake":
        return original(*args, **kwargs)
    with disagg.override(disaggregation_transfer_backend="kvferry"):
        return original(*args, **kwargs)


def _get_kv_class(original: Any, transfer_backend: Any, class_type: Any) -> Any:
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend

    if transfer_backend != TransferBackend.MOONCAKE:
        return original(transfer_backend, class_type)
    return {
        KVClassType.KVARGS: KVArgs,
        KVClassType.MANAGER: KvferryKVManager,
        KVClassType.SENDER: KvferryKVSender,
        KVClassType.RECEIVER: KvferryKVReceiver,
        KVClassType.BOOTSTRAP_SERVER: KvferryKVBootstrapServer,
    }[class_type]


class KvferryKVBootstrapServer(BaseKVBootstrapServer):
    """The prefill engine's bootstrap service, kvferry's."""

    def __init__(self, host: str, port: int):
        self.server = kvferry.BootstrapServer(f"{host}:{port}")

    def close(self) -> None:
        self.server.stop()


def node_settings(args: KVArgs, mode: DisaggregationMode, server_args: Any) -> "dict[str, Any]":
    """The node settings SGLang decides for one rank: the attention-TP
    group is what pairs with the peer's (DP attention shrinks it below
    ``tp_size``), and each system DP rank owns a KV cache of its own."""
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    cp = int(getattr(parallel, "attn_cp_size", 1) or 1)
    if cp > 1:
        # KV striped by token over ranks: kvferry's plans (heads by TP
        # rank, layers by stage) do not describe it.
        raise kvferry.MisuseError(
            f"kvferry does not move KV striped by context parallelism (--attn-cp-size {cp}): "
            "run the engine with --attn-cp-size 1, or with another transfer backend"
        )
    prefill = mode == DisaggregationMode.PREFILL
    settings: "dict[str, Any]" = {
        "role": "prefill" if prefill else "decode",
        "engine_id": ENGINE_ID,
        "tp_size": int(parallel.attn_tp_size),
        "tp_rank": int(parallel.attn_tp_rank),
        "dp_rank": int(getattr(args, "system_dp_rank", 0) or 0),
        "pp_size": int(parallel.pp_size),
        "pp_rank": int(parallel.pp_rank),
    }
    # SGLang's ranks on a host: its TP × PP ranks (attention DP within TP)
    # and the system DP ranks of a `--dp` launch, each a scheduler.
    pp = int(parallel.pp_size)
    index = (settings["dp_rank"] * pp + int(parallel.pp_rank)) * int(parallel.tp_size) + int(parallel.tp_rank)
    adapters.with_rank_ports(settings, index)
    if prefill:
        settings["bootstrap"] = f"{_bootstrap_host(server_args)}:{server_args.disaggregation_bootstrap_port}"
    settings["device"] = _engine_device(args, server_args)
    adapters.with_engine_knobs(settings, SGLANG_KNOBS)
    adapters.with_detected_host(settings, advertised_host)
    return settings


def _shares_kv(settings: "dict[str, Any]") -> bool:
    """Whether this rank's host KV pages move onto shared files, so peers
    on this host copy straight into them: ``KVFERRY_SHARED_MEMORY`` when
    set, else as for vLLM, unless the node serves other hosts (a cluster
    key, or ``allow_unauthenticated_remote``), where no peer can use them."""
    given = os.environ.get("KVFERRY_SHARED_MEMORY")
    if given is None or not given.strip():
        return not adapters.serves_other_hosts(settings)
    return adapters.flag(given)


def advertised_host() -> str:
    """The address SGLang's own transfer backends advertise for this
    machine (``SGLANG_HOST_IP``, a named interface, else the source
    address of the default route: a route lookup, no packet sent)."""
    from sglang.srt.utils.network import get_local_ip_auto

    return get_local_ip_auto("127.0.0.1")


def _bootstrap_host(server_args: Any) -> str:
    """Where a prefill rank finds its engine's bootstrap service, as
    SGLang's own backends find it: on the node of ``--dist-init-addr``
    (rank 0's, which serves it) when one is given, since ranks on other
    nodes cannot reach it at their own ``--host``; else at ``--host``."""
    dist = getattr(server_args, "dist_init_addr", None)
    if dist:
        host = str(dist).rsplit(":", 1)[0] if not str(dist).startswith("[") else str(dist)[1:].split("]")[0]
        return f"[{host}]" if ":" in host else host
    return _reachable(server_args.host)


def _reachable(host: str) -> str:
    """Where a rank reaches a service that listens on ``host``."""
    return "127.0.0.1" if host in ("", "0.0.0.0", "::") else host


def _pool(
    kind: str, ptrs: List[int], lens: List[int], item_lens: List[int]
) -> "tuple[str, int, list[tuple[int, int]]]":
    items = {n // i for n, i in zip(lens, item_lens) if i}
    if len(items) != 1:
        raise kvferry.MisuseError(f"the {kind} buffers of one pool need as many items each")
    return (kind, items.pop(), list(zip(ptrs, item_lens)))


class KvferryKVManager(BaseKVManager):
    """One attention-TP rank's node, with its KV pages, aux and state
    buffers registered."""

    def __init__(
        self,
        args: KVArgs,
        disaggregation_mode: DisaggregationMode,
        server_args: Any,
        is_mla_backend: Optional[bool] = False,
    ):
        check_sglang()
        self.kv_args = args
        self.disaggregation_mode = disaggregation_mode
        self.server_args = server_args
        self.is_mla_backend = bool(is_mla_backend)
        #: Decode: the prefill engines' topology by bootstrap address, as
        #: SGLang's decode queue reads it (``try_ensure_parallel_info``).
        self.prefill_info_table: "dict[str, Any]" = {}
        #: Decode: bootstrap services that refused this engine, logged once
        #: each (bounded: past it, refusals go unlogged).
        self._refused_by: "set[str]" = set()
        settings = node_settings(args, disaggregation_mode, server_args)
        self.node = kvferry.Node(**settings)
        files: "list[int]" = []
        try:
            if self.node.device == "cpu" and _shares_kv(settings):
                # SGLang allocated the pool (``MHATokenToKVPool``) before the
                # manager exists, for the life of the scheduler process: its
                # pages move onto shared files in place.
                files = adapters.share_buffers(zip(args.kv_data_ptrs, args.kv_data_lens))
            self.pools = self._register(args, self.is_mla_backend)
        except BaseException:
            self.node.shutdown()
            raise
        finally:
            # Registration found the files by their descriptors; the
            # mappings hold the memory from now on.
            for fd in files:
                os.close(fd)

    def _register(self, a: KVArgs, mla: bool) -> "list[str]":
        item = a.kv_item_lens[0]
        num_blocks = min(n // i for n, i in zip(a.kv_data_lens, a.kv_item_lens))
        heads, total_heads = _heads(a, self.server_args, mla)
        if item % (a.page_size * heads):
            raise kvferry.MisuseError(
                f"a KV page of {item} bytes does not split into {a.page_size} tokens "
                f"of {heads} heads"
            )
        pools = []
        if getattr(a, "aux_data_ptrs", None):
            pools.append(_pool("aux", a.aux_data_ptrs, a.aux_data_lens, a.aux_item_lens))
        states = zip(
            getattr(a, "state_data_ptrs", None) or [],
            getattr(a, "state_data_lens", None) or [],
            getattr(a, "state_item_lens", None) or [],
        )
        for ptrs, lens, items in states:
            pools.append(_pool("state", ptrs, lens, items))
        regions, first = _kv_regions(a, mla, int(self.node.settings["pp_size"]), self.server_args)
        self.node.register_kv_caches(
            regions=regions,
            first_region=first,
            num_blocks=num_blocks,
            layout="mla" if mla else (getattr(a, "kv_layout", None) or "nhd"),
            total_kv_heads=total_heads,
            block_tokens=a.page_size,
            head_bytes=item // (a.page_size * heads),
            pools=pools,
        )
        #: Bytes of one slot of each pool, in the pools' order.
        self.slot_bytes = [sum(n for _, n in buffers) for _, _, buffers in pools]
        return [k for k, _, _ in pools]

    def register_to_bootstrap(self) -> None:
        # The node registers at its bootstrap service when it starts, and
        # again in the background until the service is up.
        pass

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """Decode: learns the prefill engine's DP size from its bootstrap
        service (SGLang retries a False once a second, 15 times)."""
        if bootstrap_addr in self.prefill_info_table:
            return True
        # Signed with the cluster key, when there is one (docs/security.md).
        try:
            ranks = json.loads(_native._query_bootstrap(bootstrap_addr, ENGINE_ID, QUERY_TIMEOUT_S))
        except kvferry.PeerError as e:
            # Refused for who this host is: SGLang asks again each second,
            # and the answer stays the same; said once per service.
            if bootstrap_addr not in self._refused_by and len(self._refused_by) < 1024:
                self._refused_by.add(bootstrap_addr)
                logger.error("kvferry: the prefill's bootstrap service at %s refused this engine: %s",
                             bootstrap_addr, e)
            return False
        except (kvferry.TransportError, kvferry.MisuseError, ValueError) as e:
            logger.debug("bootstrap query at %s: %s", bootstrap_addr, e)
            return False
        if not ranks:
            return False
        from sglang.srt.disaggregation.common.conn import PrefillServerInfo

        first = next(iter(ranks.values()))["worker_addr"]
        self.prefill_info_table[bootstrap_addr] = PrefillServerInfo(
            attn_tp_size=len(first),
            attn_cp_size=1,
            dp_size=len(ranks),
            pp_size=len(first.get("0", {})) or 1,
            page_size=None,
            kv_cache_dtype=None,
            # A request goes to prefill DP rank `room % dp_size` unless the
            # router named one (kvferry's receiver takes the rank it is given).
            follow_bootstrap_room=True,
        )
        return True

    def bytes_of(self, kv: "list[int]", pools: "list[list[int]]") -> int:
        """Bytes one chunk's pages and slots hold on this rank: every
        layer's KV of each page, and each aux or state slot's items."""
        total = len(kv) * sum(self.kv_args.kv_item_lens)
        for slot, slots in zip(self.slot_bytes, pools):
            total += len(slots) * slot
        return total

    def pool_lists(
        self, aux_index: Optional[int], state_indices: Optional[List[Any]]
    ) -> "list[list[int]]":
        """The index lists of this rank's pools for one request: the aux
        index, then each state type's indices."""
        states = list(state_indices or [])
        out: "list[list[int]]" = []
        for kind in self.pools:
            if kind == "aux":
                out.append([] if aux_index is None else [int(aux_index)])
            else:
                s = states.pop(0) if states else []
                # numpy's isscalar guard admits complex too; SGLang's are integers.
                out.append(
                    [int(s)] if np.isscalar(s) else [int(x) for x in s]  # type: ignore[arg-type]
                )
        return out


def _kv_regions(
    a: KVArgs, mla: bool, pp_size: int, server_args: Any
) -> "tuple[list[tuple[int, int, int]], int]":
    """This rank's KV regions in kvferry's model order, layer by layer (K
    then V; MLA: one buffer per layer), and the index of its first one in
    the model's. SGLang lists K of every layer, then V of every layer; a
    pipeline stage lists its own layers only, from ``prefill_start_layer``
    (a decode stage's is not in its KV args), which in layer order are one
    run of the model's regions."""
    bufs = list(zip(a.kv_data_ptrs, a.kv_item_lens))
    start = getattr(a, "prefill_start_layer", None)
    if start is None and pp_size > 1:
        start = _decode_start_layer(server_args, int(a.pp_rank), pp_size)
    start = int(start or 0)
    end = getattr(a, "prefill_end_layer", None)
    per_layer = 1 if mla else 2
    if pp_size > 1 and end is not None and len(bufs) != per_layer * (end - start):
        raise kvferry.MisuseError(
            f"pipeline stage {start}..{end} lists {len(bufs)} KV buffers, not its layers' "
            "(a draft model's KV under pipeline parallelism is not supported)"
        )
    if mla:
        return [(p, i, i) for p, i in bufs], start
    if len(bufs) % 2:
        raise kvferry.MisuseError(f"{len(bufs)} KV buffers are not a K and a V per layer")
    half = len(bufs) // 2
    # Without stages a draft model's K and V follow the main model's: the
    # halves interleave the same way on both sides.
    layered = [b for k, v in zip(bufs[:half], bufs[half:]) for b in (k, v)]
    return [(p, i, i) for p, i in layered], 2 * start


def _decode_start_layer(server_args: Any, pp_rank: int, pp_size: int) -> int:
    """A decode stage's first layer among the peers' KV lists: SGLang's
    split of the model's layers (``get_pp_indices``, what its model runner
    builds the stage from), counted in full-attention layers for a hybrid
    model, as the prefill's ``prefill_start_layer`` is."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed.utils import get_pp_indices

    model = ModelConfig.from_server_args(server_args)
    start, _ = get_pp_indices(model.num_hidden_layers, pp_rank, pp_size)
    full = getattr(model.hf_text_config, "full_attention_layer_ids", None)
    return start if full is None else sum(1 for layer in full if layer < start)


def _heads(a: KVArgs, server_args: Any, mla: bool) -> "tuple[int, int]":
    """(KV heads of this rank, KV heads of the model). SGLang's prefill
    queue sets both in the KV args; its decode queue sets neither, so the
    decode side reads them from the model's config as SGLang does."""
    if mla:
        return 1, 1
    heads, total = getattr(a, "kv_head_num", None), getattr(a, "total_kv_head_num", None)
    if heads and total:
        return int(heads), int(total)
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.runtime_context import get_parallel

    model = ModelConfig.from_server_args(server_args)
    return model.get_num_kv_heads(get_parallel().attn_tp_size), model.get_total_num_kv_heads()


def _engine_device(args: KVArgs, server_args: Any) -> str:
    """Where SGLang keeps this rank's KV pool, as node settings name it:
    ``cuda:<gpu_id>`` unless SGLang runs on the CPU. The node then
    registers the pool as that device's memory (tcp stages it through
    pinned host buffers; Mooncake registers it at that location; the
    local transport refuses it)."""
    device = str(getattr(server_args, "device", None) or "cuda")
    if device == "cpu":
        return "cpu"
    if device != "cuda":
        raise kvferry.MisuseError(
            f"SGLang runs on {device!r}: kvferry moves CPU and CUDA memory only"
        )
    return f"cuda:{int(getattr(args, 'gpu_id', 0) or 0)}"


class _Transfer:
    """What a sender and a receiver share: poll, failure, abort."""

    handle: Optional[kvferry._Handle] = None
    #: The request's transfer id (SGLang's ``bootstrap_room``).
    room: int
    #: Why this rank's transfer failed before or outside its handle.
    failure: Optional[str] = None

    #: Whether SGLang aborted the request on this rank.
    aborted = False

    def own_phase(self) -> Optional[Phase]:
        if self.handle is None:
            return None
        phase = self.handle.poll()
        if phase == Phase.Success and self.aborted:
            # The node applies an abort when it gets to it, and a transfer
            # whose last byte landed first has succeeded there; SGLang's
            # abort paths count on the request failing (its pages are free
            # either way, the transfer being over).
            self.failure = self.failure or "Aborted by AbortReq."
            return Phase.Failed
        return phase

    def failed_here(self) -> bool:
        return self.failure is not None or self.own_phase() in (Phase.Failed, Phase.Expired)

    def failure_exception(self) -> NoReturn:
        """Raises SGLang's ``KVTransferError``; a rank that did not fail
        itself (SGLang polls the minimum over its ranks) says so, and
        SGLang logs it at debug level."""
        from sglang.srt.disaggregation.common.conn import KVTransferError

        here = self.failed_here()
        if self.failure is not None:
            reason = self.failure
        elif here and self.handle is not None:  # its handle failed
            reason = f"kvferry: {self.handle.failure or 'Expired'}"
        else:
            reason = "Failed due to an unknown reason from another rank"
        raise KVTransferError(self.room, reason, is_from_another_rank=not here)

    def abort(self) -> None:
        self.aborted = True
        if self.handle is not None:
            try:
                self.handle.abort()
                return
            except kvferry.Error as e:
                self.failure = f"kvferry: abort: {e}"
        if self.failure is None:
            self.failure = "Aborted by AbortReq."

    def _start(self, make: "Callable[[], kvferry._Handle]") -> None:
        try:
            self.handle = make()
        except kvferry.Error as e:
            self.failure = f"kvferry: {e}"


class KvferryKVSender(_Transfer, BaseKVSender):
    """The prefill side of one request: ``Bootstrapping`` until the decode
    rank's request arrives, ``WaitingForInput`` until the last chunk."""

    handle: Optional[kvferry.Sender]
    #: Pages the request sends in all (``init``), and its aux index.
    total: Optional[int]
    aux_index: Optional[int]

    def __init__(
        self,
        mgr: KvferryKVManager,
        bootstrap_addr: str,
        bootstrap_room: int,
        req_has_disagg_prefill_dp_rank: bool = False,
    ):
        self.kv_mgr, self.room = mgr, int(bootstrap_room)
        self.total, self.sent, self.aux_index = None, 0, None
        #: What SGLang's prefill scheduler reports once the request is
        #: done (``kv_transfer_latency_ms``, ``kv_transfer_speed_gb_s``):
        #: this rank's bytes, and the time from its first chunk to Success.
        self.metric = KVTransferMetric(transfer_total_bytes=0)
        self._first_chunk_at: Optional[float] = None
        self._start(lambda: mgr.node.sender(self.room))

    def init(self, num_kv_indices: int, aux_index: Optional[int] = None) -> None:
        self.total, self.aux_index = int(num_kv_indices), aux_index

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        # The last chunk goes even without pages: it carries aux and state.
        return num_pages > 0 or last_chunk

    def send(
        self,
        kv_indices: Any,
        state_indices: Optional[List[Any]] = None,
        num_kv_tokens: Optional[int] = None,
        indices_event: Any = None,
    ) -> None:
        if self.handle is None:
            return
        self._hand_off(indices_event)
        kv = [int(x) for x in kv_indices]
        self.sent += len(kv)
        last = self.total is None or self.sent >= self.total
        pools = self.kv_mgr.pool_lists(self.aux_index, state_indices) if last else [
            [] for _ in self.kv_mgr.pools
        ]
        if self._first_chunk_at is None:
            self._first_chunk_at = time.perf_counter()
        try:
            self.handle.send([kv] + pools, is_last=last)
            self.metric.transfer_total_bytes += self.kv_mgr.bytes_of(kv, pools)
        except kvferry.Error as e:
            # Earlier chunks may still be moving: the transfer fails through
            # its handle, which turns terminal once no peer touches its pages.
            logger.warning("kvferry: transfer %s refused a chunk (%s); aborting it", self.room, e)
            self.abort()

    def _hand_off(self, indices_event: Any) -> None:
        """On a GPU, orders the node's copies out of the pool after the
        kernels that wrote these pages. SGLang synchronizes the batch's
        ``copy_done`` before it sends a finished request
        (sglang/srt/disaggregation/prefill.py,
        ``process_batch_result_disagg_prefill``), but sends a chunk early
        with an event on its forward stream (``_early_send_wait_event``,
        the overlap scheduler) or ``indices_event``: the current stream
        waits for those on the device, then the node records its event
        there."""
        node = self.kv_mgr.node
        if node.device == "cpu":
            return
        import torch

        stream = torch.cuda.current_stream()
        for ev in (getattr(self, "_early_send_wait_event", None), indices_event):
            if ev is not None:
                stream.wait_event(ev)
        node.engine_handoff(stream.cuda_stream)

    def poll(self) -> int:
        if self.failure is not None:
            return KVPoll.Failed
        phase = self.own_phase()
        if phase is None:
            return KVPoll.Failed  # no handle: its start failed, which set `failure`
        if phase == Phase.Success and self.metric.transfer_latency_s is None and self._first_chunk_at:
            self.metric.transfer_latency_s = time.perf_counter() - self._first_chunk_at
        return _POLL[phase]

    def poll_pp_consensus(self) -> int:
        """What PP rank 0's bootstrap queue polls for every stage (SGLang's
        Mooncake backend gathers each stage's state there). A kvferry
        sender takes its KV before or after the decode's request reaches
        it, and the decode asks every stage at once, so the other stages
        need not be bootstrapped before this one's forward: the first
        stage's state is the request's. The release after the transfer
        goes through SGLang's own per-stage consensus of ``poll``."""
        return self.poll()

    def get_transfer_metric(self) -> KVTransferMetric:
        return self.metric


class KvferryKVReceiver(_Transfer, BaseKVReceiver):
    """The decode side of one request: ``Bootstrapping`` until SGLang
    resolved the prefill DP rank (``init``), then ``WaitingForInput`` while
    kvferry finds the prefill ranks and until the KV moves."""

    handle: Optional[kvferry.Receiver]

    def __init__(
        self, mgr: KvferryKVManager, bootstrap_addr: str, bootstrap_room: Optional[int] = None
    ):
        self.kv_mgr, self.bootstrap_addr = mgr, bootstrap_addr
        self.room = int(bootstrap_room or 0)

    def init(self, prefill_dp_rank: int) -> None:
        if self.failure is not None:
            return
        self._start(
            lambda: self.kv_mgr.node.receiver(
                self.room,
                prefill_engine_id=ENGINE_ID,
                bootstrap=self.bootstrap_addr,
                prefill_dp_rank=int(prefill_dp_rank or 0),
            )
        )

    def poll(self) -> int:
        if self.failure is not None:
            return KVPoll.Failed
        phase = self.own_phase()
        if phase is None:
            return KVPoll.Bootstrapping
        state = _POLL[phase]
        # SGLang's poll never goes back: once init ran it is at least
        # WaitingForInput, whatever kvferry still resolves.
        return state if state == KVPoll.Failed else max(state, KVPoll.WaitingForInput)

    def send_metadata(
        self,
        kv_indices: Any,
        aux_index: Optional[int] = None,
        state_indices: Optional[List[Any]] = None,
        decode_prefix_len: Optional[int] = None,
        destination: KVTransferDestination = KVTransferDestination.DEVICE,
        **_: Any,
    ) -> None:
        if self.handle is None or self.failure is not None or self.aborted:
            return
        page = int(self.kv_mgr.kv_args.page_size)
        prefix = int(decode_prefix_len or 0)
        if prefix % page:
            self.failure = f"kvferry: a decode prefix of {prefix} tokens is not whole pages of {page}"
            self.abort()
            return
        lists = [[int(x) for x in kv_indices]] + self.kv_mgr.pool_lists(aux_index, state_indices)
        # Decode's radix cache holds the first pages: the prefill sends all
        # of its pages and kvferry skips those.
        try:
            self.handle.request(lists, prefix_blocks=[prefix // page] + [0] * len(self.kv_mgr.pools))
        except kvferry.Error as e:
            self.failure = f"kvferry: {e}"
            self.abort()
