"""The P/D connector's two sides: the scheduler side (``kvferry.Scheduler``)
and the worker side (a ``kvferry.Node`` per rank), the settings they read
and where the bootstrap service is. ``kvferry.vllm.KvferryConnector``
puts them together."""

from __future__ import annotations

import logging
import os
import re
import time
from typing import TYPE_CHECKING, Any, Iterable, Optional

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
)
from vllm.v1.request import RequestStatus

import kvferry
import kvferry._adapters as adapters
from kvferry.vllm._base import (
    KvferryStats,
    _dp_layout,
    _engine_device,
    _rank_index,
    _windows,
    register_plan,
)

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("kvferry.vllm")

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


def _settings(extra: "dict[str, Any]") -> "dict[str, Any]":
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


def _bootstrap(vllm_config: Any, extra: "dict[str, Any]") -> str:
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


def _serve_bootstrap_at(extra: "dict[str, Any]", bootstrap: str) -> "str | None":
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


class _SchedulerSide:
    def __init__(self, vllm_config: Any, extra: "dict[str, Any]", kv_cache_config: Any):
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

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> "tuple[int, bool]":
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

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
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
        while (abort := self._sched.poll_abort()) is not None:
            aborts.append(abort)
        failed, self._failed = self._failed, []
        return KvferryMetadata(meta, names, aborts, failed)

    def request_finished(
        self, request: Any, block_ids: "list[list[int]]"
    ) -> "tuple[bool, Optional[dict[str, Any]]]":
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


class _LoadTimes:
    """Seconds from each load's start on this worker to its report, for
    vLLM's ``vllm:kvferry_load_seconds`` histogram (what MooncakeConnector
    records as ``transfer_duration``). Bounded by the loads in flight and
    by `MAX_REPORTED` samples between two stats reports; past that, the
    samples of the interval are dropped."""

    MAX_REPORTED = 4096

    def __init__(self) -> None:
        self.started: "dict[int, float]" = {}
        self.done: "list[float]" = []

    def start(self, ids: Iterable[int]) -> None:
        now = time.perf_counter()
        for t in ids:
            self.started.setdefault(t, now)

    def end(self, loaded: Iterable[int], failed: Iterable[int]) -> None:
        now = time.perf_counter()
        for t in loaded:
            began = self.started.pop(t, None)
            if began is not None and len(self.done) < self.MAX_REPORTED:
                self.done.append(now - began)
        for t in failed:
            self.started.pop(t, None)

    def take(self) -> "list[float]":
        out, self.done = self.done, []
        return out


class _WorkerSide:
    def __init__(self, vllm_config: Any, extra: "dict[str, Any]", kv_cache_config: Any):
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
        adapters.with_detected_host(settings, _vllm_host)
        settings.setdefault("pp_size", self.pp_size)
        settings.setdefault("pp_rank", pp_rank)
        adapters.with_rank_ports(settings, _rank_index(pc, tp_rank, pp_rank))
        adapters.with_engine_knobs(settings, VLLM_KNOBS)
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
        self.load_times = _LoadTimes()

    def register_kv_caches(self, kv_caches: "dict[str, torch.Tensor]") -> None:
        cache = register_plan(
            kv_caches, self.kv_cache_config, self.model, self.cache, self.pp_size, self.node.device
        )
        self.ratio = cache.ratio
        self.node.register_kv_caches(**cache.registration())
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
        refused = {t for t, _ in loads}
        self.load_times.start(t for t in meta.meta.transfer_ids()[0] if t not in refused)
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
        self.load_times.end(received, failed)

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
        stats = KvferryStats(data={**delta, "load_seconds": self.load_times.take()})
        return None if stats.is_empty() else stats
