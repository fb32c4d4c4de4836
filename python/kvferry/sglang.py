"""kvferry as SGLang's KV transfer backend (SGLang 0.5.x disaggregation).

SGLang has no registry of third-party transfer backends; it has a plugin
hook. Installing kvferry installs a ``sglang.srt.plugins`` entry point,
:func:`plugin`, and with ``KVFERRY_SGLANG=1`` in the environment of every
SGLang process the ``mooncake`` backend's classes are kvferry's::

    KVFERRY_SGLANG=1 python -m sglang.launch_server ... \\
        --disaggregation-mode prefill --disaggregation-transfer-backend mooncake

Each rank is a :class:`kvferry.Node`; the prefill engine's bootstrap
service is kvferry's (:class:`KvferryKVBootstrapServer`). A request's
``bootstrap_room`` is its transfer id. KV pages are kvferry blocks (one
region per K or V buffer of a layer, token-major pages: NHD), aux buffers
one ``aux`` pool and each state type one ``state`` pool.
"""

from __future__ import annotations

import os
from typing import Any, List, Optional

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
from kvferry import Phase

#: The engine id every prefill engine's ranks register under at its own
#: bootstrap service (SGLang runs one bootstrap service per prefill engine).
ENGINE_ID = "sglang"

_POLL = {
    Phase.Bootstrapping: KVPoll.Bootstrapping,
    Phase.WaitingForInput: KVPoll.WaitingForInput,
    Phase.Transferring: KVPoll.Transferring,
    Phase.Success: KVPoll.Success,
    Phase.Failed: KVPoll.Failed,
    Phase.Expired: KVPoll.Failed,
}


def plugin() -> None:
    """SGLang's plugin entry point: with ``KVFERRY_SGLANG=1``, the
    ``mooncake`` transfer backend's classes become kvferry's."""
    if os.environ.get("KVFERRY_SGLANG", "") not in ("1", "true", "yes"):
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(
        "sglang.srt.disaggregation.utils.get_kv_class", _get_kv_class, HookType.AROUND
    )


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


def _pool(kind: str, ptrs: List[int], lens: List[int], item_lens: List[int]):
    items = {n // i for n, i in zip(lens, item_lens) if i}
    if len(items) != 1:
        raise kvferry.MisuseError(f"the {kind} buffers of one pool need as many items each")
    return (kind, items.pop(), list(zip(ptrs, item_lens)))


class KvferryKVManager(BaseKVManager):
    """One rank's node, with its KV pages, aux and state buffers registered."""

    def __init__(
        self,
        args: KVArgs,
        disaggregation_mode: DisaggregationMode,
        server_args: Any,
        is_mla_backend: Optional[bool] = False,
    ):
        self.kv_args = args
        self.disaggregation_mode = disaggregation_mode
        prefill = disaggregation_mode == DisaggregationMode.PREFILL
        settings = {}
        if prefill:
            host = getattr(server_args, "host", "127.0.0.1")
            settings["bootstrap"] = f"{host}:{server_args.disaggregation_bootstrap_port}"
        self.node = kvferry.Node(
            role="prefill" if prefill else "decode",
            engine_id=ENGINE_ID,
            tp_size=server_args.tp_size,
            tp_rank=args.engine_rank % server_args.tp_size,
            dp_rank=getattr(args, "system_dp_rank", 0) or 0,
            **settings,
        )
        self.pools = self._register(args, bool(is_mla_backend))

    def _register(self, a: KVArgs, mla: bool) -> "list[str]":
        item = a.kv_item_lens[0]
        num_blocks = min(n // i for n, i in zip(a.kv_data_lens, a.kv_item_lens))
        regions = [(p, i, i) for p, i in zip(a.kv_data_ptrs, a.kv_item_lens)]
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
        heads = 1 if mla else a.kv_head_num
        self.node.register_kv_caches(
            regions=regions,
            num_blocks=num_blocks,
            layout="mla" if mla else (getattr(a, "kv_layout", None) or "nhd"),
            total_kv_heads=1 if mla else a.total_kv_head_num,
            block_tokens=a.page_size,
            head_bytes=item // (a.page_size * heads),
            pools=pools,
        )
        return [k for k, _, _ in pools]

    def register_to_bootstrap(self) -> None:
        # The node registers at its bootstrap service when it starts.
        pass

    def pool_lists(self, aux_index: Optional[int], state_indices: Optional[List]) -> list:
        """The index lists of this rank's pools for one request: the aux
        index, then each state type's indices."""
        states = list(state_indices or [])
        out = []
        for kind in self.pools:
            if kind == "aux":
                out.append([] if aux_index is None else [int(aux_index)])
            else:
                s = states.pop(0) if states else []
                out.append([int(s)] if np.isscalar(s) else [int(x) for x in s])
        return out


class _Transfer:
    """What a sender and a receiver share: poll, failure, abort."""

    handle: Any = None

    def poll(self) -> int:
        if self.handle is None:
            return KVPoll.Bootstrapping
        return _POLL[self.handle.poll()]

    def failure_exception(self):
        reason = self.handle.failure if self.handle is not None else "not started"
        raise kvferry.Error(f"KV transfer {self.room} failed: {reason}")

    def abort(self) -> None:
        if self.handle is not None:
            self.handle.abort()


class KvferryKVSender(_Transfer, BaseKVSender):
    def __init__(
        self,
        mgr: KvferryKVManager,
        bootstrap_addr: str,
        bootstrap_room: int,
        req_has_disagg_prefill_dp_rank: bool = False,
    ):
        self.mgr, self.room = mgr, int(bootstrap_room)
        self.handle = mgr.node.sender(self.room)
        self.total, self.sent, self.aux_index = None, 0, None

    def init(self, num_kv_indices: int, aux_index: Optional[int] = None):
        self.total, self.aux_index = int(num_kv_indices), aux_index

    def send(self, kv_indices: Any, state_indices: Optional[List] = None, num_kv_tokens=None):
        kv = [int(x) for x in kv_indices]
        self.sent += len(kv)
        last = self.total is None or self.sent >= self.total
        pools = self.mgr.pool_lists(self.aux_index, state_indices) if last else [
            [] for _ in self.mgr.pools
        ]
        self.handle.send([kv] + pools, is_last=last)

    def get_transfer_metric(self) -> KVTransferMetric:
        return KVTransferMetric()


class KvferryKVReceiver(_Transfer, BaseKVReceiver):
    def __init__(self, mgr: KvferryKVManager, bootstrap_addr: str, bootstrap_room: Optional[int] = None):
        self.mgr, self.bootstrap_addr = mgr, bootstrap_addr
        self.room = int(bootstrap_room or 0)
        self.dp_rank = 0

    def init(self, prefill_dp_rank: int):
        self.dp_rank = int(prefill_dp_rank or 0)

    def send_metadata(
        self,
        kv_indices: Any,
        aux_index: Optional[int] = None,
        state_indices: Optional[List] = None,
        decode_prefix_len: Optional[int] = None,
        destination: KVTransferDestination = KVTransferDestination.DEVICE,
    ):
        self.handle = self.mgr.node.receiver(
            self.room,
            prefill_engine_id=ENGINE_ID,
            bootstrap=self.bootstrap_addr,
            prefill_dp_rank=self.dp_rank,
        )
        lists = [[int(x) for x in kv_indices]] + self.mgr.pool_lists(aux_index, state_indices)
        self.handle.request(lists)
