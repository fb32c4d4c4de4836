"""kvferry's store as SGLang's HiCache storage backend (its L3 tier, SGLang
0.5.x), over the store URLs of ``kvferry.STORE_URLS``::

    python -m sglang.launch_server ... --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "kvferry",
            "module_path": "kvferry.sglang_hicache",
            "class_name": "KvferryHiCacheStorage", "interface_v1": 1,
            "url": "kvferry://HOST:PORT"}'

SGLang hands the backend its host KV pool and calls page batches from its
prefetch and backup threads with the pages' hashes and host indices. A page
is one store value: its bytes in every buffer of the pool, the K buffers
before the V buffers (MLA: its one buffer). Keys name the model, the rank's
shard (an MLA page is the same on every TP rank, so one key serves all and
rank 0 writes it) and the page's byte order: ``layer_first`` and
``page_first_direct`` pools lay a page out layer by layer and share keys;
``page_first`` lays it out token by token. Calls move the pages
zero-copy (``interface_v1``), one round trip per batch, and never raise
into SGLang: a store that is down or slow answers misses, counted in
:attr:`KvferryHiCacheStorage.faults`.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, List, NoReturn

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
from sglang.srt.observability.metrics_collector import StorageMetrics

import kvferry
from kvferry import _native

logger = logging.getLogger("kvferry.sglang_hicache")

#: How long one store call may take, unless ``timeout_ms`` says otherwise:
#: SGLang's prefetch thread waits for it.
TIMEOUT_MS = 5000


#: A page's byte order in each host pool layout kvferry stores: by layer
#: (then token) or by token (then layer).
BYTE_ORDER = {"layer_first": "lt", "page_first_direct": "lt", "page_first": "tl"}


def key_prefix(config: HiCacheStorageConfig, layout: str) -> str:
    """What every key of this rank starts with: the model, the shard of it
    this rank holds and the pages' byte order (``extra_config`` may add a
    ``key_prefix``)."""
    extra = config.extra_config or {}
    shard = "mla" if config.is_mla_model else f"tp{config.tp_rank}of{config.tp_size}"
    stage = f"/pp{config.pp_rank}of{config.pp_size}" if config.pp_size > 1 else ""
    model = config.model_name or "model"
    return f"{extra.get('key_prefix', 'sglang')}/{model}/{shard}{stage}/{BYTE_ORDER[layout]}/"


class KvferryHiCacheStorage(HiCacheStorage):
    """One rank's L3 storage (see the module docs)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None):
        extra = dict(storage_config.extra_config or {})
        if not int(extra.get("interface_v1", 0)):
            raise kvferry.MisuseError(
                "kvferry's HiCache backend moves pages zero-copy: set \"interface_v1\": 1 "
                "in --hicache-storage-backend-extra-config"
            )
        if "url" not in extra:
            raise kvferry.MisuseError(
                f"--hicache-storage-backend-extra-config needs a store \"url\" ({_native.STORE_URLS})"
            )
        unsupported = [
            ("split heads (tp_lcm_size)", storage_config.should_split_heads),
            ("decode context parallelism", storage_config.dcp_size > 1),
        ]
        for what, on in unsupported:
            if on:
                raise kvferry.MisuseError(f"kvferry's HiCache backend does not support {what}")
        self.storage_config = storage_config
        #: Set with the host pool (it names the byte order).
        self.prefix = ""
        #: MLA pages are the same on every TP rank: rank 0 writes them.
        self.writer = not storage_config.is_mla_model or storage_config.tp_rank == 0
        self.store = _native.PageStore(str(extra["url"]), int(extra.get("timeout_ms", TIMEOUT_MS)))
        #: SGLang's host KV pool (``register_mem_pool_host``).
        self.mem_pool_host: Any = None
        #: Calls the store did not answer, by call: each answered misses.
        self.faults = {"exists": 0, "get": 0, "set": 0, "clear": 0}
        self._metrics = StorageMetrics()
        self._lock = threading.Lock()

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Registers the pool's buffers, as SGLang's own page pointers
        (``get_page_buffer_meta``) lay them out: each buffer a run of
        equally long pages."""
        if mem_pool_host.layout not in BYTE_ORDER:
            raise kvferry.MisuseError(
                f"kvferry's HiCache backend stores {', '.join(BYTE_ORDER)} host pools, "
                f"not {mem_pool_host.layout}"
            )
        super().register_mem_pool_host(mem_pool_host)
        self.prefix = key_prefix(self.storage_config, mem_pool_host.layout)
        page = mem_pool_host.page_size
        first, lens = mem_pool_host.get_page_buffer_meta(torch.arange(0, page))
        second, _ = mem_pool_host.get_page_buffer_meta(torch.arange(page, 2 * page))
        if any(b - a != n for a, b, n in zip(first, second, lens)):
            raise kvferry.MisuseError(
                f"the {mem_pool_host.layout} host pool's pages are not one run per buffer"
            )
        buffers = list(zip(first, lens))
        if not self.storage_config.is_mla_model:
            # K and V alternate in SGLang's pointers: K buffers first.
            buffers = buffers[0::2] + buffers[1::2]
        self.store.register(buffers, mem_pool_host.size // page)

    def batch_exists(self, keys: List[str], extra_info: Any = None) -> int:
        """How many of ``keys``, from the first, the store holds."""
        try:
            found = self.store.exists(self._keys(keys))
        except kvferry.Error as e:
            return self._fault("exists", e, 0)
        return next((i for i, f in enumerate(found) if not f), len(found))

    def batch_get_v1(
        self, keys: List[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> List[bool]:
        return self._move(self.store.get, "get", "prefetch", keys, host_indices)

    def batch_set_v1(
        self, keys: List[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> List[bool]:
        if not self.writer:
            return [True] * len(keys)
        return self._move(self.store.put, "set", "backup", keys, host_indices)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(self, key: Any, target_location: Any = None, target_sizes: Any = None) -> NoReturn:
        raise kvferry.MisuseError(_V1_ONLY)

    def batch_get(
        self, keys: Any, target_locations: Any = None, target_sizes: Any = None
    ) -> NoReturn:
        raise kvferry.MisuseError(_V1_ONLY)

    def set(
        self, key: Any, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> NoReturn:
        raise kvferry.MisuseError(_V1_ONLY)

    def batch_set(
        self, keys: Any, values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> NoReturn:
        raise kvferry.MisuseError(_V1_ONLY)

    def clear(self) -> None:
        """Removes this rank's keys (the model's shard) from the store."""
        if not self.writer:
            return
        try:
            removed = self.store.remove_prefix(self.prefix)
        except kvferry.Error as e:
            self._fault("clear", e, None)
            return
        logger.info("kvferry HiCache: removed %d pages under %s", removed, self.prefix)

    def get_stats(self) -> StorageMetrics:
        """Pages and bandwidth of each prefetch and backup batch since the
        last call."""
        with self._lock:
            metrics, self._metrics = self._metrics, StorageMetrics()
        return metrics

    def close(self) -> None:
        pass

    def _keys(self, keys: List[str]) -> List[str]:
        return [self.prefix + k for k in keys]

    def _pages(self, host_indices: torch.Tensor, count: int) -> List[int]:
        page = self.mem_pool_host.page_size
        starts = host_indices.reshape(count, page)[:, 0]
        return [int(i) // page for i in starts.tolist()]

    def _move(
        self,
        call: "Callable[[list[str], list[int]], list[bool]]",
        fault: str,
        kind: str,
        keys: List[str],
        host_indices: torch.Tensor,
    ) -> List[bool]:
        """Moves the pages of `host_indices` by `call` (the store's get or
        put), counted under `kind` in the stats; a failed call is misses."""
        started = time.perf_counter()
        try:
            done = call(self._keys(keys), self._pages(host_indices, len(keys)))
        except kvferry.Error as e:
            return self._fault(fault, e, [False] * len(keys))
        self._record(kind, sum(done), started)
        return done

    def _fault(self, call: str, error: Exception, answer: Any) -> Any:
        with self._lock:
            self.faults[call] += 1
        logger.warning("kvferry HiCache: store %s failed (%s); answering misses", call, error)
        return answer

    def _record(self, kind: str, pages: int, started: float) -> None:
        page_bytes = self.mem_pool_host.get_size_per_token() * self.mem_pool_host.page_size
        seconds = max(time.perf_counter() - started, 1e-9)
        with self._lock:
            getattr(self._metrics, f"{kind}_pgs").append(pages)
            getattr(self._metrics, f"{kind}_bandwidth").append(pages * page_bytes / seconds / 1e9)


_V1_ONLY = (
    "kvferry's HiCache backend moves pages zero-copy (interface_v1); SGLang calls the "
    "tensor methods only without it, which the backend refuses at start"
)
