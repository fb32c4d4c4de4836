"""SGLang 0.5.23's HiCache controller and host pool (CPU memory) over
kvferry's HiCache storage backend, loaded as SGLang loads a ``dynamic``
backend. One process per engine::

    python sglang_hicache.py write URL LAYOUT     backs up a prompt's pages
                                                  (LAYOUT: an MHA host pool's, or
                                                  mla:LAYOUT for an MLA model's)
    python sglang_hicache.py read URL LAYOUT      prefetches them, every byte compared
    python sglang_hicache.py clear URL LAYOUT     clears the store, then finds nothing
    python sglang_hicache.py read-killed URL LAYOUT PID
                                                  prefetches with the store
                                                  process PID killed between
                                                  the hit query and the pages

Each prints one line starting with ``ok`` and exits 0, or fails. With
``SGLANG_HICACHE_TP=RANK,PORT`` the process is TP rank RANK of two (a world
of two on gloo, rendezvous at PORT; both ranks run the same command at
once): each rank's pages are its own, an MLA model's the same on both, and
an MHA pool's ``clear`` on rank 1 alone leaves rank 0's pages, which
SGLang's minimum over ranks then does not use.

What is stood in (SGLang's scheduler and tree cache, not its storage
path): the device-to-host copy that fills the host pool (the writer sets
its pages through the host pool's own ``set_from_flat_data_page``), and
the tree cache's handling of a hit (``UnifiedRadixCache``: allocate host
memory for the hit, hand the operation to ``prefetch_buffer``). Plus the
CUDA-only substitutions of ``sglang_sched`` (pinned host memory).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from queue import Empty

import torch

import sglang_sched  # noqa: F401  (SGLang set up for CPU, CUDA-only calls substituted)
from sglang_sched import MODEL, no_nccl_for_groups_of_two, process_groups
from sglang.srt import runtime_context as rc
from sglang.srt.managers.cache_controller import HiCacheController
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.utils import get_storage_hash_str
from sglang.srt.runtime_context import SpawnRanks
from sglang.srt.server_args import ServerArgs

PAGE = 4
PAGES = 6
LAYERS, HEADS, HEAD_DIM = 4, 2, 16
MLA_RANK, MLA_ROPE = 16, 8
TOKENS = list(range(500, 500 + PAGE * PAGES))
DEVICE_TOKENS = 128
WAIT_S = 30


def expected_page(i: int, like: torch.Tensor, layout: str) -> torch.Tensor:
    """The writer's flat page `i`: a function of `i` and the TP rank (of
    `i` alone for an MLA model, whose pages every rank holds alike)."""
    rank = 0 if layout.startswith("mla:") else rc.get_parallel().tp_rank
    g = torch.Generator().manual_seed(4242 + i + 1000 * rank)
    return torch.randn(like.shape, generator=g).to(like.dtype)


def scheduler_context():
    """One scheduler rank's SGLang context, its process groups on gloo:
    TP rank r of two with `SGLANG_HICACHE_TP=r,PORT`, else TP 1."""
    tp = os.environ.get("SGLANG_HICACHE_TP")
    rank, port = map(int, tp.split(",")) if tp else (0, 0)
    sa = ServerArgs(model_path=MODEL, device="cpu", page_size=PAGE, dtype="float16",
                    host="127.0.0.1", tp_size=2 if tp else 1)
    context = rc.create_context(sa, role="scheduler",
                                ranks=SpawnRanks(world_rank=rank, dp_rank=None, gpu_id=0))
    if tp:
        no_nccl_for_groups_of_two()
    process_groups(context, (2, rank, port) if tp else (1, 0, None))
    return context


def barrier() -> None:
    """Both TP ranks got here (nothing with one rank)."""
    parallel = rc.get_parallel()
    if parallel.tp_size > 1:
        torch.distributed.barrier(group=parallel.tp_group.cpu_group)


def pools(layout: str):
    """A device KV pool and its host pool as SGLang's tree cache pairs
    them; `mla:LAYOUT` for an MLA model's."""
    info = lambda d: d.get_device_pool_infos()[0].buffer_info  # noqa: E731
    common = dict(start_layer=0, end_layer=LAYERS)
    if layout.startswith("mla:"):
        device = MLATokenToKVPool(DEVICE_TOKENS, PAGE, torch.float16, MLA_RANK, MLA_ROPE,
                                  LAYERS, "cpu", False, **common)
        host = MLATokenToKVPoolHost(info(device), 2, 0, PAGE, layout[4:],
                                    device_capacity_tokens=device.size,
                                    target_layer_num=LAYERS, **common)
        return device, host
    device = MHATokenToKVPool(
        size=DEVICE_TOKENS, page_size=PAGE, dtype=torch.float16, head_num=HEADS,
        head_dim=HEAD_DIM, layer_num=LAYERS, device="cpu", enable_memory_saver=False,
        enable_alt_stream=False, **common,
    )
    host = MHATokenToKVPoolHost(info(device), 2, 0, PAGE, layout,
                                device_capacity_tokens=device.size,
                                write_back_staging=device.hicache_write_back_staging, **common)
    return device, host


def controller(url: str, layout: str) -> HiCacheController:
    """A HiCache controller of one rank as the tree cache builds it, with
    kvferry's backend through SGLang's `dynamic` storage factory."""
    parallel = rc.get_parallel()
    device, host = pools(layout)
    allocator = PagedTokenToKVPoolAllocator(size=DEVICE_TOKENS, page_size=PAGE,
                                            dtype=torch.float16, device="cpu",
                                            kvcache=device, need_sort=False)
    extra = {"backend_name": "kvferry", "module_path": "kvferry.sglang_hicache",
             "class_name": "KvferryHiCacheStorage", "interface_v1": 1, "url": url,
             "timeout_ms": 2000}
    return HiCacheController(
        allocator, host, PAGE, parallel.tp_group.cpu_group, threading.Event(),
        attn_cp_group=parallel.attn_cp_group.cpu_group,
        attn_tp_group=parallel.attn_tp_group.cpu_group,
        pp_group=parallel.pp_group.cpu_group,
        io_backend="direct", storage_backend="dynamic", model_name="kvferry-test",
        storage_backend_extra_config=extra,
    )


def write(url: str, layout: str) -> None:
    cc = controller(url, layout)
    host = cc.mem_pool_host
    indices = host.alloc(len(TOKENS))
    for i in range(PAGES):
        at = int(indices[i * PAGE])
        host.set_from_flat_data_page(at, expected_page(i, host.get_data_page(at), layout))
    hashes = get_storage_hash_str(TOKENS, None, page_size=PAGE)
    cc.write_storage(indices, TOKENS, hash_value=hashes)
    op = cc.ack_backup_queue.get(timeout=WAIT_S)
    assert cc.storage_backend.faults == {"exists": 0, "get": 0, "set": 0, "clear": 0}
    # An MLA page is written once, by its writer rank (SGLang's `backup_skip`).
    backed = sum(cc.storage_backend.get_stats().backup_pgs)
    if cc.backup_skip:
        assert backed == 0, f"{backed} pages backed up by a rank that does not write"
    else:
        assert op.completed_tokens == len(TOKENS), f"{op.completed_tokens} tokens backed up"
        assert backed == PAGES, backed
    barrier()  # the pages are stored before any rank reads
    print(f"ok: {backed} pages backed up", flush=True)


def prefetch(url: str, layout: str, kill_pid: int = 0) -> None:
    cc = controller(url, layout)
    host = cc.mem_pool_host
    op = cc.prefetch("r", TOKENS, None, None)
    hit = cc.prefetch_hit_queue.get(timeout=WAIT_S)
    assert hit is op
    if kill_pid:
        assert op.storage_hit_count == len(TOKENS), f"hit {op.storage_hit_count} before the kill"
        os.kill(kill_pid, signal.SIGKILL)
    # The tree cache's part: host memory for the hit, then the transfer.
    op.host_indices = host.alloc(op.storage_hit_count)
    op.hash_value = op.hash_value[: op.storage_hit_count // PAGE]
    cc.prefetch_buffer.put(op)
    done = wait_completed(cc, op)
    if kill_pid:
        assert done == 0, f"{done} tokens from a killed store"
        faults = cc.storage_backend.faults
        assert faults["get"] >= 1, faults
        print(f"ok: the killed store answered misses ({faults})", flush=True)
        return
    assert done == len(TOKENS), f"{done} of {len(TOKENS)} tokens prefetched"
    for i in range(PAGES):
        at = int(op.host_indices[i * PAGE])
        got = host.get_data_page(at)
        assert torch.equal(got, expected_page(i, got, layout)), f"page {i} differs"
    print(f"ok: {PAGES} pages prefetched, every byte equal", flush=True)


def clear(url: str, layout: str) -> None:
    """What SGLang's `clear_storage_backend` does on each rank, then a
    prefetch's hit query on every rank: nothing is used. With two ranks of
    an MHA pool only rank 1 clears: rank 0's own pages stay, and SGLang's
    minimum over the ranks' hits uses none of them. An MLA pool's pages,
    shared, go with the clear of their writer (rank 0)."""
    cc = controller(url, layout)
    last = rc.get_parallel().tp_rank == cc.storage_config.tp_size - 1
    if last or cc.storage_config.is_mla_model:
        cc.storage_backend.clear()
        assert cc.storage_backend.faults["clear"] == 0, cc.storage_backend.faults
    barrier()
    op = cc.prefetch("r", TOKENS, None, None)
    hit = cc.prefetch_hit_queue.get(timeout=WAIT_S)
    assert hit is op and op.storage_hit_count == 0, f"hit {op.storage_hit_count} after clear"
    print("ok: nothing left after clear", flush=True)


def wait_completed(cc: HiCacheController, op) -> int:
    """Tokens the prefetch completed (its progress acks, rank-reduced), once
    SGLang acknowledged the whole operation: `ack_prefetch_queue`, which
    its scheduler drains."""
    done = 0
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        try:
            ack = cc.ack_prefetch_queue.get(timeout=1)
        except Empty:
            continue
        if ack.operation is not op:
            continue
        if ack.completed_tokens is not None:
            done = max(done, ack.completed_tokens)
        if ack.completed_req:
            return done
    raise AssertionError("the prefetch was never acknowledged")


if __name__ == "__main__":
    what, url, layout = sys.argv[1:4]
    with rc.use_context(scheduler_context()):
        if what == "write":
            write(url, layout)
        elif what == "read":
            prefetch(url, layout)
        elif what == "clear":
            clear(url, layout)
        elif what == "read-killed":
            prefetch(url, layout, int(sys.argv[4]))
    sys.stdout.flush()
    os._exit(0)
