"""kvferry as SGLang's HiCache storage backend, under SGLang 0.5.23's own
HiCache controller and host pool (CPU memory): one process backs a
prompt's pages up to `kvferry store serve`, another prefetches them and
compares every byte, a third clears the store and finds nothing, and
another sees the server killed between its hit query and its pages; the
same with two TP ranks. The processes are `sglang_hicache.py`, which
names what it stands in."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("sglang")

import sglang_hicache  # noqa: E402
from engines import StoreServer, free_port  # noqa: E402

import kvferry  # noqa: E402


def run(*args: object) -> str:
    return run_ranks(*args, ranks=None)[0]


def run_ranks(*args: object, ranks: "tuple[int, ...] | None" = (0, 1)) -> "list[str]":
    """`sglang_hicache.py ARGS...` once, or as each TP rank of `ranks` of
    two at once; each must exit 0. Their outputs."""
    # SGLang builds its page-hash extension with the environment's ninja.
    env = dict(os.environ, PATH=f"{os.path.dirname(sys.executable)}:{os.environ.get('PATH', '')}")
    port = free_port()
    procs = [
        subprocess.Popen([sys.executable, sglang_hicache.__file__, *map(str, args)],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=env if r is None else dict(env, SGLANG_HICACHE_TP=f"{r},{port}"))
        for r in (ranks or (None,))
    ]
    outs = []
    try:
        outs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, out in zip(procs, outs):
        assert p.returncode == 0, f"{args[0]} exited {p.returncode}:\n{out[-4000:]}"
    return outs


@pytest.mark.parametrize("layout", ["page_first", "layer_first", "mla:layer_first"])
def test_pages_one_engine_backed_up_are_prefetched_by_another_until_cleared(tmp_path, layout):
    server = StoreServer(free_port(), tmp_path / "store.log").start()
    try:
        assert "ok: 6 pages backed up" in run("write", server.url, layout)
        assert "every byte equal" in run("read", server.url, layout)
        assert server.stored() == 6
        assert "nothing left after clear" in run("clear", server.url, layout)
    finally:
        server.kill()


@pytest.mark.parametrize("layout", ["page_first", "mla:layer_first"])
def test_two_tp_ranks_back_up_and_prefetch_their_own_pages(tmp_path, layout):
    """TP 2 (a world of two on gloo): each rank's pages under its own keys
    (an MLA model's written once, by rank 0, and read by both), every byte
    equal on each rank; once rank 1 alone cleared an MHA pool, SGLang's
    minimum over the ranks' hits uses nothing, on rank 0 too."""
    mla = layout.startswith("mla:")
    server = StoreServer(free_port(), tmp_path / "store.log").start()
    try:
        backed = (6, 0) if mla else (6, 6)
        for n, out in zip(backed, run_ranks("write", server.url, layout)):
            assert f"ok: {n} pages backed up" in out, out[-3000:]
        assert server.stored() == (6 if mla else 12)
        assert all("every byte equal" in o for o in run_ranks("read", server.url, layout))
        assert all("nothing left after clear" in o for o in run_ranks("clear", server.url, layout))
    finally:
        server.kill()


def test_a_store_killed_mid_prefetch_is_a_miss_and_no_error(tmp_path):
    server = StoreServer(free_port(), tmp_path / "store.log").start()
    try:
        run("write", server.url, "page_first")
        out = run("read-killed", server.url, "page_first", server.proc.pid)
        assert "the killed store answered misses" in out
    finally:
        server.kill()


def test_the_backend_refuses_to_run_without_zero_copy_calls():
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    from kvferry.sglang_hicache import KvferryHiCacheStorage

    config = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
        model_name="m", extra_config={"url": "inproc://refused"},
    )
    with pytest.raises(kvferry.MisuseError, match="interface_v1"):
        KvferryHiCacheStorage(config)
