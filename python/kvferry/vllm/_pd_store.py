"""P/D and the store in one vLLM connector: ``KvferryConnector`` with a
``store`` setting.

A prefill engine sends what it computed to the decode engine and saves it
to the store as well; a decode engine loads the prefix the store holds and
only the rest from the prefill engine: one request, two sources, one
completion. Requests without ``kv_transfer_params`` use the store alone.
vLLM's ``MultiConnector`` cannot do this (exactly one child loads a
request), hence one connector with both halves inside::

    --kv-transfer-config '{"kv_connector": "KvferryConnector",
                           "kv_connector_module_path": "kvferry.vllm",
                           "kv_role": "kv_consumer",
                           "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"store": "kvferry://10.0.0.5:7600"}}'

The store's settings (``kvferry.vllm._store``) and the node's
(``docs/config.md``) share ``kv_connector_extra_config``; ``kv_role``
gives both their part (a producer saves and sends, a consumer loads).

Each request's store hit is asked first; the prefill engine then provides
the tokens past it, as it provides the tokens past a local prefix-cache
hit. Where a request has a part from each, the workers report it once both
parts ended (a load that failed in either part fails the request), so no
part writes or reads blocks vLLM has taken back. A store that is down or
slow is a miss: the prefill engine provides the whole prompt.
"""

from __future__ import annotations

from typing import Any, Optional

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

import kvferry.vllm._p2p as p2p
import kvferry.vllm._store as store
from kvferry.vllm._base import KvferryStats


def _split(extra: "dict[str, Any]") -> "tuple[dict[str, Any], dict[str, Any]]":
    """``kv_connector_extra_config`` as the node's and the store's settings."""
    mine = store._STORE_KEYS | store._MOONCAKE_STORE_KEYS
    node = {k: v for k, v in extra.items() if k not in mine or k in p2p._CONNECTOR_KEYS}
    return p2p._settings(node), {k: v for k, v in extra.items() if k in mine}


class KvferryPdStoreMetadata(KVConnectorMetadata):
    """One step's metadata of each half, and the requests whose load or
    send has a part in each (reported once both ended)."""

    def __init__(
        self,
        node: p2p.KvferryMetadata,
        store: store.KvferryStoreMetadata,
        joined_loads: "list[str]",
        joined_sends: "list[str]",
    ):
        self.node = node
        self.store = store
        self.joined_loads = joined_loads
        self.joined_sends = joined_sends


class _SchedulerSide:
    def __init__(self, vllm_config: Any, extra: "dict[str, Any]", kv_cache_config: Any):
        node, stored = _split(extra)
        self.node = p2p._SchedulerSide(vllm_config, node, kv_cache_config)
        self.store = store._SchedulerSide(vllm_config, stored, kv_cache_config)
        #: Each waiting request's store hit in tokens, from
        #: `get_num_new_matched_tokens` to `update_state_after_alloc`.
        self._hit: "dict[str, int]" = {}
        self._joined_loads: "list[str]" = []
        self._joined_sends: "list[str]" = []

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> "tuple[Optional[int], bool]":
        # The prefill engine holds the whole prompt: a P/D request waits
        # for the store's answer at most `pd_lookup_wait_ms`.
        params = request.kv_transfer_params or {}
        found = self.store.get_num_new_matched_tokens(
            request, num_computed_tokens, other_source=bool(params.get("do_remote_prefill"))
        )
        hit = found[0]
        if hit is None:
            return found  # the store's answer is out: vLLM asks again
        # The prefill engine provides what follows the store's hit, as it
        # provides what follows a local prefix-cache hit.
        rest, _ = self.node.get_num_new_matched_tokens(request, num_computed_tokens + hit)
        self._hit[request.request_id] = hit
        if rest:
            return hit + rest, True
        return found

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        rid = request.request_id
        hit = self._hit.pop(rid, 0)
        if not num_external_tokens:
            hit = 0  # allocated without the external tokens: nothing loads
        self.store.update_state_after_alloc(request, blocks, hit)
        self.node.update_state_after_alloc(request, blocks, num_external_tokens - hit)
        if hit and num_external_tokens > hit:
            self._joined_loads.append(rid)

    def build_connector_meta(self, scheduler_output: Any) -> KvferryPdStoreMetadata:
        joined = (self._joined_loads, self._joined_sends)
        self._joined_loads, self._joined_sends = [], []
        return KvferryPdStoreMetadata(
            self.node.build_connector_meta(),
            self.store.build_connector_meta(scheduler_output),
            *joined,
        )

    def request_finished(
        self, request: Any, block_ids: "list[list[int]]"
    ) -> "tuple[bool, Optional[dict[str, Any]]]":
        self._hit.pop(request.request_id, None)
        sending, params = self.node.request_finished(request, block_ids)
        saving, _ = self.store.request_finished(request, block_ids)
        if sending and saving:
            self._joined_sends.append(request.request_id)
        return sending or saving, params

    def update_connector_output(self, out: Any) -> None:
        # Each half skips the requests whose loads were not its own.
        self.node.update_connector_output(out)
        self.store.update_connector_output(out)

    def take_events(self) -> "list[Any]":
        return self.store.take_events()

    def reset_cache(self) -> bool:
        return self.store.reset_cache()

    def stats(self) -> Optional[KvferryStats]:
        return _merge(self.node.stats(), self.store.stats())


class _Join:
    """Requests with a part in each half: the first part's outcome is held
    until the second ends."""

    def __init__(self) -> None:
        #: Each joined request: None until a part ended, then whether it
        #: succeeded.
        self.waiting: "dict[str, Optional[bool]]" = {}

    def expect(self, rids: "list[str]") -> None:
        self.waiting.update(dict.fromkeys(rids))

    def ended(self, parts: "list[tuple[str, bool]]") -> "tuple[set[str], set[str]]":
        """The requests whose every part ended among ``parts`` (request id,
        succeeded), as (succeeded, failed)."""
        ok: "set[str]" = set()
        failed: "set[str]" = set()
        for rid, good in parts:
            if rid in self.waiting:
                first = self.waiting.pop(rid)
                if first is None:
                    self.waiting[rid] = good
                    continue
                good = good and first
            (ok if good else failed).add(rid)
        return ok, failed


class _WorkerSide:
    def __init__(self, vllm_config: Any, extra: "dict[str, Any]", kv_cache_config: Any):
        node, stored = _split(extra)
        self.node = p2p._WorkerSide(vllm_config, node, kv_cache_config)
        self.store = store._WorkerSide(vllm_config, stored, kv_cache_config)
        self.loads = _Join()
        self.sends = _Join()

    def register_kv_caches(self, kv_caches: "dict[str, Any]") -> None:
        self.node.register_kv_caches(kv_caches)
        self.store.register_kv_caches(kv_caches)

    def start_load_kv(self, meta: KvferryPdStoreMetadata) -> None:
        assert isinstance(meta, KvferryPdStoreMetadata)
        # Before any part starts: no part may be reported unjoined.
        self.loads.expect(meta.joined_loads)
        self.sends.expect(meta.joined_sends)
        self.node.start_load_kv(meta.node)
        self.store.start_load_kv(meta.store)

    def wait_for_save(self, meta: KvferryPdStoreMetadata) -> None:
        self.store.wait_for_save(meta.store)

    def handle_preemptions(self, meta: Any) -> None:
        if isinstance(meta, KvferryPdStoreMetadata):
            self.store.handle_preemptions(meta.store)

    def kv_events(self) -> Any:
        return self.store.kv_events()

    def transfer_results(self) -> "tuple[set[str], set[str], set[str]]":
        """``(finished sending, loaded, failed loads)`` request ids since
        the last call, each once every part of it ended."""
        node_sent, node_loaded, node_failed = self.node.transfer_results()
        store_sent, store_loaded, store_failed = self.store.transfer_results()
        sent, _ = self.sends.ended([(r, True) for r in (*node_sent, *store_sent)])
        loaded, failed = self.loads.ended(
            [(r, True) for r in (*node_loaded, *store_loaded)]
            + [(r, False) for r in (*node_failed, *store_failed)]
        )
        return sent, loaded, failed

    def stats(self) -> Optional[KvferryStats]:
        return _merge(self.node.stats(), self.store.stats())

    def shutdown(self) -> None:
        self.store.shutdown()
        self.node.shutdown()


def _merge(*parts: Optional[KvferryStats]) -> Optional[KvferryStats]:
    data: "dict[str, Any]" = {}
    for part in parts:
        if part is not None:
            data.update(part.data)
    return KvferryStats(data=data) if data else None
