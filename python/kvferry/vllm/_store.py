"""kvferry's store connector for vLLM (``kvferry.vllm.KvferryStoreConnector``).

Engines save the KV of the prompt prefixes they compute to a shared store
and load what the store holds instead of recomputing it::

    --kv-transfer-config '{"kv_connector": "KvferryStoreConnector",
                           "kv_connector_module_path": "kvferry.vllm",
                           "kv_role": "kv_both",
                           "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"store": "kvferry://10.0.0.5:7600"}}'

``store`` is any kvferry store URL (``kvferry.STORE_URLS``). ``kv_role``
``kv_producer`` only saves, ``kv_consumer`` only loads, ``kv_both`` does
both. A store that is down or slow is a miss, never a failed request; a
load that fails once its blocks are allocated is reported to vLLM per
request, which ``kv_load_failure_policy: recompute`` computes again.

Keys do not depend on vLLM's own block hashes (which follow the hash
algorithm, ``PYTHONHASHSEED`` and the adapter's path): each block's key
chains SHA-256 over the token ids from a root fixed by the model's name
and the block size (:func:`chain_hashes`), so every engine serving the
model finds what another saved.
"""

from __future__ import annotations

import array
import hashlib
import json
import logging
import os
import re
import struct
import sys
import tempfile
from typing import TYPE_CHECKING, Any, Optional, Sequence

from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVConnectorKVEvents,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

import kvferry
from kvferry import _native
from kvferry.vllm._base import (
    KvferryStats,
    _dp_layout,
    _KvferryConnectorBase,
    _windows,
    register_plan,
)

if TYPE_CHECKING:
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvferry._native import _EventRecord

logger = logging.getLogger("kvferry.vllm")

#: Where the chain of block hashes starts; part of every key.
CHAIN_TAG = b"kvferry-chain-v1\0"

#: Blocks some but not every shard reported stored, kept for later
#: reports (the oldest forgotten first).
_EVENT_COUNTS_MAX = 1 << 16

#: ``kv_connector_extra_config`` keys of the store connector.
_STORE_KEYS = {
    "store", "model_name", "lookup_endpoint", "lookup_timeout_ms", "lookup_wait_ms", "pd_lookup_wait_ms",
    "op_bound_ms", "request_timeout_ms", "max_requests", "save", "load", "shutdown_drain_ms",
    "save_decode_cache", "tp_rank", "shared_memory",
}
#: Mooncake store connector keys an operator brings along: accepted, logged.
_MOONCAKE_STORE_KEYS = {"load_async", "lookup_async", "enable_lookup", "lookup_rpc_port"}


def chain_root(model_name: str, block_tokens: int) -> bytes:
    """The hash before block 0 of every request of a model and block size."""
    name = model_name.encode()
    return hashlib.sha256(
        CHAIN_TAG + struct.pack("<I", len(name)) + name + struct.pack("<I", block_tokens)
    ).digest()


def _encode(x: Any) -> bytes:
    """vLLM's extra keys (tuples of str, bytes, int, float) as bytes that
    do not depend on the Python process."""
    if x is None:
        return b"n"
    if isinstance(x, bool):
        return b"B1" if x else b"B0"
    if isinstance(x, int):
        return b"i" + struct.pack("<q", x)
    if isinstance(x, float):
        return b"f" + struct.pack("<d", x)
    if isinstance(x, str):
        x = x.encode()
        return b"s" + struct.pack("<I", len(x)) + x
    if isinstance(x, (bytes, bytearray)):
        return b"b" + struct.pack("<I", len(x)) + bytes(x)
    if isinstance(x, (tuple, list)):
        return b"t" + struct.pack("<I", len(x)) + b"".join(_encode(i) for i in x)
    raise TypeError(f"an extra key of type {type(x).__name__}")


def chain_hashes(
    root: bytes,
    tokens: Sequence[int],
    block_tokens: int,
    extras: "Sequence[Optional[bytes]] | None" = None,
) -> "list[bytes]":
    """The hash of each whole block of ``tokens``: SHA-256 of the previous
    block's hash (``root`` for block 0), the block's index and token ids
    (u32, little-endian) and ``0x00``, or ``0x01`` and its extra keys'
    digest."""
    data = array.array("I", tokens)
    if sys.byteorder != "little":
        data.byteswap()
    raw = data.tobytes()
    step = 4 * block_tokens
    out, h = [], root
    for i in range(len(data) // block_tokens):
        x = extras[i] if extras is not None else None
        tail = b"\x00" if x is None else b"\x01" + x
        h = hashlib.sha256(h + struct.pack("<I", i) + raw[i * step:(i + 1) * step] + tail).digest()
        out.append(h)
    return out


def _extras(request: Any, blocks: int, block_tokens: int) -> "list[Optional[bytes]] | None":
    """Per block, the digest of vLLM's extra keys (LoRA, multimodal
    inputs, ``cache_salt``, prompt embeddings); ``None`` when the request
    has none."""
    if not (
        getattr(request, "lora_request", None)
        or getattr(request, "mm_features", None)
        or getattr(request, "cache_salt", None)
        or getattr(request, "prompt_embeds", None) is not None
    ):
        return None
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

    out, mm = [], 0
    for i in range(blocks):
        keys, mm = generate_block_hash_extra_keys(request, i * block_tokens, (i + 1) * block_tokens, mm)
        out.append(None if keys is None else hashlib.sha256(_encode(keys)).digest())
    return out


def _prompt(request: Any) -> "Sequence[int] | None":
    tokens = getattr(request, "prompt_token_ids", None)
    return None if tokens is None else tokens


def _settings(vllm_config: Any, extra: "dict[str, Any]", kv_cache_config: Any) -> "dict[str, Any]":
    """The native halves' settings (the same on the scheduler and every
    worker of an engine)."""
    for key in extra:
        if key in _MOONCAKE_STORE_KEYS:
            logger.info("kvferry: Mooncake store setting %s means nothing here; ignored", key)
        elif key not in _STORE_KEYS:
            logger.warning("kvferry: unknown store setting %s ignored", key)
    if not extra.get("store"):
        raise kvferry.MisuseError(
            f"KvferryStoreConnector needs kv_connector_extra_config.store, one of {_native.STORE_URLS}"
        )
    kt, mc, cc = vllm_config.kv_transfer_config, vllm_config.model_config, vllm_config.cache_config
    block = cc.block_size
    groups = [
        {"block_tokens": block, "window_tokens": w or None} for w in _windows(kv_cache_config, block)
    ]
    dtype = cc.cache_dtype if cc.cache_dtype != "auto" else str(mc.dtype).removeprefix("torch.")
    engine = re.sub(r"[^A-Za-z0-9_.-]", "_", str(kt.engine_id))[:40]
    dp = _dp_layout(vllm_config.parallel_config)[0]
    endpoint = f"ipc://{tempfile.gettempdir()}/kvferry-lookup-{engine}-dp{dp}"
    s = {
        "store": str(extra["store"]),
        "lookup_endpoint": str(extra.get("lookup_endpoint") or endpoint),
        "groups": groups,
        "load": bool(extra.get("load", kt.kv_role in ("kv_consumer", "kv_both"))),
        "save": bool(extra.get("save", kt.kv_role in ("kv_producer", "kv_both"))),
        "save_decode": bool(extra.get("save_decode_cache", False)),
        "model_name": str(extra.get("model_name") or os.path.basename(str(mc.model).rstrip("/"))),
        "dtype": dtype,
    }
    for key in ("lookup_timeout_ms", "op_bound_ms", "request_timeout_ms", "max_requests"):
        if key in extra:
            s[key] = int(extra[key])
    return s


class KvferryStoreMetadata(KVConnectorMetadata):
    """One step's loads, saves and notices: the scheduler's bytes (vLLM
    pickles the metadata to every worker), and the requests whose blocks
    wait for a load that will not come (every worker reports them failed,
    so vLLM's `kv_load_failure_policy` ends their wait)."""

    def __init__(self, data: bytes, failed: "list[str] | None" = None):
        self.data = data
        self.failed = list(failed or ())


class KvferryStoreKVEvents(KVConnectorKVEvents):
    """One step's KV events of the workers (``StoreWorker.take_events``
    records), concatenated by vLLM's output aggregator; the scheduler side
    counts them across shards (:class:`_EventQuorum`)."""

    def __init__(self, records: "list[_EventRecord]", shards: int, workers: int = 1):
        self.records = list(records)
        self.shards = shards
        self.workers = workers

    def add_events(self, events: "list[_EventRecord]") -> None:
        self.records.extend(events)

    def aggregate(self) -> "KvferryStoreKVEvents":
        return self

    def increment_workers(self, count: int = 1) -> None:
        self.workers += count

    def get_all_events(self) -> "list[_EventRecord]":
        return list(self.records)

    def get_number_of_workers(self) -> int:
        return self.workers

    def clear_events(self) -> None:
        self.records = []


class _EventQuorum:
    """vLLM events of the store tier: a block is stored once every shard
    reported it (each shard stores its own value); removals and clears
    pass at once, each block once per step. Hashes are kvferry's chain
    (:func:`chain_hashes`), the same on every engine."""

    def __init__(self) -> None:
        self.counts: "dict[tuple[Optional[int], bytes], int]" = {}
        self.ready: "list[Any]" = []
        self.dropped = 0

    def take(self, batch: KvferryStoreKVEvents) -> None:
        removed: "set[tuple[Optional[int], bytes]]" = set()
        for kind, group, hashes, parent, size, tokens, lora, medium in batch.records:
            if kind == "stored":
                for i, h in enumerate(hashes):
                    if self._count((group, h), batch.shards):
                        self.ready.append(BlockStored(
                            block_hashes=[maybe_convert_block_hash(h)],
                            parent_block_hash=_parent(parent if i == 0 else hashes[i - 1]),
                            token_ids=list(tokens[i * size:(i + 1) * size]),
                            block_size=size, lora_id=None, medium=medium, lora_name=lora,
                            group_idx=group,
                        ))
            elif kind == "removed":
                fresh = [h for h in hashes if (group, h) not in removed]
                removed.update((group, h) for h in fresh)
                if fresh:
                    self.ready.append(BlockRemoved(
                        block_hashes=[maybe_convert_block_hash(h) for h in fresh], medium=medium,
                        group_idx=group,
                    ))
            elif kind == "cleared":
                self.ready.append(AllBlocksCleared())

    def _count(self, key: "tuple[Optional[int], bytes]", shards: int) -> bool:
        n = self.counts.pop(key, 0) + 1
        if n >= shards:
            return True
        if len(self.counts) >= _EVENT_COUNTS_MAX:
            self.counts.pop(next(iter(self.counts)))
            self.dropped += 1
        self.counts[key] = n
        return False

    def drain(self) -> "list[Any]":
        out, self.ready = self.ready, []
        return out


def _parent(h: "Optional[bytes]") -> Any:
    return None if h is None else maybe_convert_block_hash(h)


class KvferryStoreConnector(_KvferryConnectorBase):
    """See the module docs: the scheduler role looks prefixes up and plans
    loads and saves; the worker role (one per TP and PP rank) runs them."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        super().__init__(vllm_config, role, kv_cache_config, _SchedulerSide, _WorkerSide, extra)

    @property
    def requires_kv_delivery(self) -> bool:
        # A cache: a preempted request's save may be dropped.
        return False


class _SchedulerSide:
    def __init__(self, vllm_config: Any, extra: "dict[str, Any]", kv_cache_config: Any):
        settings = _settings(vllm_config, extra, kv_cache_config)
        self._native = _native.StoreSched(json.dumps(settings))
        self._block = vllm_config.cache_config.block_size
        self._groups = len(settings["groups"])
        self._transfer = list(kv_cache_config.transfer_group_ids)
        self._root = chain_root(settings["model_name"], self._block)
        self._wait_s = float(extra.get("lookup_wait_ms", 2)) / 1000.0
        self._pd_wait_s = float(extra.get("pd_lookup_wait_ms", 20)) / 1000.0
        self._reset_s = float(extra.get("op_bound_ms", 10000)) / 1000.0
        #: Each waiting request's block hashes, until it is allocated.
        self._hashes: "dict[str, list[bytes]]" = {}
        #: With decode saves, each tracked request and its chain so far.
        self._save_decode = bool(settings["save_decode"])
        self._growing: "dict[str, tuple[Any, list[bytes]]]" = {}
        self._reported: "dict[str, int]" = {}
        self.fallbacks = 0
        self.events = _EventQuorum()
        #: Requests promised a load that will not start, until the next meta.
        self._failed: "list[str]" = []

    def _fall_back(self, rid: str, err: Exception, what: str) -> None:
        logger.warning("kvferry store: request %s: %s failed (%s: %s); computed without the store",
                       rid, what, type(err).__name__, err)
        self.fallbacks += 1

    def _block_hashes(self, request: Any, tokens: Sequence[int]) -> "list[bytes]":
        rid = request.request_id
        if rid not in self._hashes:
            blocks = len(tokens) // self._block
            extras = _extras(request, blocks, self._block)
            self._hashes[rid] = chain_hashes(self._root, tokens, self._block, extras)
        return self._hashes[rid]

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int,
                                   other_source: bool = False) -> "tuple[Optional[int], bool]":
        """vLLM's hook. With `other_source` (another source holds the whole
        prompt) a lookup out `pd_lookup_wait_ms` is a miss."""
        rid = request.request_id
        tokens = _prompt(request)
        if tokens is None:
            return 0, False
        try:
            hashes = self._block_hashes(request, tokens)
            lora = getattr(getattr(request, "lora_request", None), "lora_name", None)
            r = self._native.get_num_new_matched_tokens(
                rid, len(tokens), [hashes] * self._groups, num_computed_tokens, lora, self._wait_s,
                self._pd_wait_s if other_source else None,
            )
        except (kvferry.Error, TypeError, ValueError) as e:
            self._fall_back(rid, e, "the store lookup")
            return 0, False
        if r is None:
            return None, False
        return r

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        rid = request.request_id
        hashes = self._hashes.pop(rid, None)
        if self._save_decode and hashes is not None:
            self._growing[rid] = (request, hashes)
        ids = blocks.get_block_ids()
        try:
            self._native.update_state_after_alloc(rid, [list(ids[g]) for g in self._transfer],
                                                  num_external_tokens)
        except kvferry.Error as e:
            self._fall_back(rid, e, "tracking its blocks")
            if num_external_tokens > 0:
                # vLLM waits for the load it was promised: end it as failed.
                self._failed.append(rid)

    def _grow(self, rid: str) -> None:
        """With decode saves: the request's chain over every token it holds
        now, handed to the scheduler when a block filled."""
        growing = self._growing.get(rid)
        if growing is None:
            return
        request, hashes = growing
        tokens = request.all_token_ids
        if len(tokens) // self._block <= len(hashes):
            return
        grown = chain_hashes(self._root, tokens, self._block,
                             _extras(request, len(tokens) // self._block, self._block))
        try:
            self._native.extend_hashes(rid, [grown] * self._groups)
            self._growing[rid] = (request, grown)
        except kvferry.Error as e:
            self._growing.pop(rid, None)
            self._fall_back(rid, e, "extending its hashes")

    def build_connector_meta(self, so: Any) -> KvferryStoreMetadata:
        none: "list[list[int]]" = [[] for _ in self._transfer]
        if self._save_decode:
            for rid in so.num_scheduled_tokens:
                self._grow(rid)
        steps = [(r.req_id, so.num_scheduled_tokens[r.req_id], none) for r in so.scheduled_new_reqs]
        cached = so.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", None) or set()
        for i, rid in enumerate(cached.req_ids):
            new = cached.new_block_ids[i]
            # A resumed request's list is its whole table, which
            # `update_state_after_alloc` already gave.
            blocks = none if new is None or rid in resumed else [list(new[g]) for g in self._transfer]
            steps.append((rid, so.num_scheduled_tokens[rid], blocks))
        preempted = list(getattr(so, "preempted_req_ids", None) or ())
        for rid in preempted:
            self._growing.pop(rid, None)
        failed, self._failed = self._failed, []
        return KvferryStoreMetadata(self._native.build_connector_meta(steps, preempted), failed)

    def take_events(self) -> "list[Any]":
        return self.events.drain()

    def reset_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache(reset_connector=True)``, generation
        paused: this model's keys leave the store, other models' stay."""
        try:
            removed = self._native.reset(self._reset_s)
        except kvferry.Error as e:
            logger.warning("kvferry store: reset failed (%s: %s)", type(e).__name__, e)
            return False
        logger.info("kvferry store: reset removed %d keys of this model", removed)
        self.events.ready.append(AllBlocksCleared())
        return True

    def request_finished(self, request: Any, block_ids: "list[list[int]]") -> "tuple[bool, None]":
        rid = request.request_id
        self._hashes.pop(rid, None)
        self._growing.pop(rid, None)
        try:
            return self._native.request_finished(rid, [list(g) for g in block_ids]), None
        except kvferry.Error as e:
            self._fall_back(rid, e, "finishing")
            return False, None

    def update_connector_output(self, out: Any) -> None:
        self._native.loads_finished(
            list(out.finished_recving or ()), list(getattr(out, "failed_recving", None) or ())
        )
        events = getattr(out, "kv_cache_events", None)
        if isinstance(events, KvferryStoreKVEvents):
            self.events.take(events)

    def stats(self) -> Optional[KvferryStats]:
        now = dict(self._native.stats())
        now["store_fallbacks"] = self.fallbacks
        now["store_events_unmatched_dropped"] = self.events.dropped
        delta = {f"store_{k}" if not k.startswith("store_") else k: v - self._reported.get(k, 0)
                 for k, v in now.items() if k != "lookups_out"}
        self._reported = now
        stats = KvferryStats(data=delta)
        return None if stats.is_empty() else stats


class _WorkerSide:
    def __init__(self, vllm_config: Any, extra: "dict[str, Any]", kv_cache_config: Any):
        from vllm.distributed import parallel_state as ps

        pc = vllm_config.parallel_config
        if ps.model_parallel_is_initialized():
            tp_rank = ps.get_tensor_model_parallel_rank()
            tp_size = ps.get_tensor_model_parallel_world_size()
            pp_rank = ps.get_pp_group().rank_in_group
        else:  # outside vLLM's worker processes (tests): the rank is given
            tp_rank, tp_size, pp_rank = int(extra.get("tp_rank", 0)), pc.tensor_parallel_size, 0
        settings = _settings(vllm_config, extra, kv_cache_config)
        settings.update(tp_size=tp_size, tp_rank=tp_rank, pp_size=pc.pipeline_parallel_size,
                        pp_rank=pp_rank)
        self.native = _native.StoreWorker(json.dumps(settings))
        self.model = vllm_config.model_config
        self.cache = vllm_config.cache_config
        self.kv_cache_config = kv_cache_config
        self.pp_size = pc.pipeline_parallel_size
        self.drain_s = float(extra.get("shutdown_drain_ms", 5000)) / 1000.0
        #: vLLM's KV tensors, kept alive as long as the worker.
        self.memory: "list[torch.Tensor]" = []
        #: Requests the scheduler could not give a load, to report failed.
        self.failed: "set[str]" = set()
        self._reported: "dict[str, int]" = {}

    def register_kv_caches(self, kv_caches: "dict[str, torch.Tensor]") -> None:
        plan = register_plan(kv_caches, self.kv_cache_config, self.model, self.cache, self.pp_size)
        if plan.ratio != 1:
            raise kvferry.MisuseError(
                f"the attention backend splits each block into {plan.ratio} kernel blocks; "
                "kvferry's store keeps whole blocks"
            )
        self.native.register(**plan.registration())
        self.memory.extend(kv_caches.values())

    def start_load_kv(self, meta: KvferryStoreMetadata) -> None:
        assert isinstance(meta, KvferryStoreMetadata)
        self.failed.update(meta.failed)
        self.native.start_loads(meta.data)

    def wait_for_save(self, meta: KvferryStoreMetadata) -> None:
        # Starts the step's saves without waiting: each holds its blocks
        # until the scheduler's delayed free is reported.
        assert isinstance(meta, KvferryStoreMetadata)
        self.native.start_saves(meta.data)

    def handle_preemptions(self, meta: Any) -> None:
        # vLLM hands a preempted request's blocks to others in this very
        # step: no save of it may still read them.
        if isinstance(meta, KvferryStoreMetadata) and not self.native.preempt(meta.data):
            logger.warning("kvferry store: a preempted request's save outlived its bound")

    def kv_events(self) -> Optional[KvferryStoreKVEvents]:
        records, shards = self.native.take_events()
        return KvferryStoreKVEvents(records, shards) if records else None

    def transfer_results(self) -> "tuple[set[str], set[str], set[str]]":
        """``(finished sending, loaded, failed loads)`` request ids since
        the last call, the loads the scheduler could not plan among the
        failed."""
        sent, received, failed = self.native.transfer_results()
        failed_all, self.failed = set(failed) | self.failed, set()
        return set(sent), set(received), failed_all

    def stats(self) -> Optional[KvferryStats]:
        now = dict(self.native.stats())
        delta = {f"store_{k}": v - self._reported.get(k, 0) for k, v in now.items()}
        self._reported = now
        stats = KvferryStats(data=delta)
        return None if stats.is_empty() else stats

    def shutdown(self) -> None:
        if not self.native.drain(self.drain_s):
            logger.warning("kvferry store: saves still running after %.1f s at shutdown", self.drain_s)
        self.native.close_lookups()
