"""kvferry as vLLM KV connectors, for vLLM 0.32–0.34: ``KvferryConnector``
(P/D disaggregation) and ``KvferryStoreConnector`` (a shared KV store).

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
(``kvferry._adapters.with_detected_host``).
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

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

import kvferry.vllm._pd_store as _pd_store
from kvferry.vllm._base import (
    ANY_VERSION_ENV,
    TESTED_VLLM,
    KvCachePlan,
    KvferryPromMetrics,
    KvferryStats,
    Side,
    _KvferryConnectorBase,
    register_plan,
    share_kv_memory,
)
from kvferry.vllm._p2p import KvferryMetadata, _SchedulerSide, _settings, _WorkerSide
from kvferry.vllm._store import KvferryStoreConnector, KvferryStoreMetadata

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

__all__ = [
    "ANY_VERSION_ENV",
    "TESTED_VLLM",
    "KvCachePlan",
    "KvferryConnector",
    "KvferryMetadata",
    "KvferryPromMetrics",
    "KvferryStats",
    "KvferryStoreConnector",
    "KvferryStoreMetadata",
    "register_plan",
    "share_kv_memory",
]


# vLLM's MultiConnector rebuilds each child's stats from the child's class
# name (`KVConnectorFactory.get_connector_class_by_name`), which finds
# registered connectors only: this one, loaded by module path, registers
# its name too, or MultiConnector's stat logging raises once kvferry
# reports a counter.
try:
    KVConnectorFactory.register_connector("KvferryConnector", __name__, "KvferryConnector")
except ValueError:  # registered already
    pass


class KvferryConnector(_KvferryConnectorBase):
    """The scheduler role drives :class:`kvferry.Scheduler`; the worker
    role a :class:`kvferry.Node` per TP rank. Several KV-cache groups
    (vLLM's hybrid allocator) move together: every group's blocks in every
    layer's memory (groups alias the same bytes, a block belonging to one
    group at a time), sliding-window groups only their window's blocks.

    With a ``store`` setting the store joins in (``kvferry.vllm._pd_store``):
    a prefill engine saves what it computes there too, and a decode engine
    loads the prefix the store holds and only the rest from the prefill
    engine."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        sched: Side
        worker: Side
        if extra.get("store"):
            sched, worker = _pd_store._SchedulerSide, _pd_store._WorkerSide
        else:
            sched, worker, extra = _SchedulerSide, _WorkerSide, _settings(extra)
        super().__init__(vllm_config, role, kv_cache_config, sched, worker, extra)


try:
    KVConnectorFactory.register_connector("KvferryStoreConnector", __name__, "KvferryStoreConnector")
except ValueError:  # registered already
    pass
