"""The Python API's cost against the Rust API's, measured in the same run.

    python python/bench/bench.py --kvferry target/release/kvferry

Runs each shape through the Python package (a prefill and a decode node in
this process, numpy buffers, every byte checked) and through `kvferry demo`
(the Rust API, same shape), alternating, and prints one JSON line per run
and the ratios of the medians:

* small: one request at a time, 256 bytes of KV (1 layer, 1 head, 16
  tokens of 8 bytes), latency from asking to decode's terminal phase;
* large: 512 KiB requests (4 layers, 8 heads, 16 tokens of 128 bytes, 4
  blocks), 64 in flight, GB/s.
"""

import argparse
import json
import statistics
import subprocess
import time

import numpy as np

import kvferry
from kvferry import Phase

SHAPES = {
    "small": dict(layers=1, heads=1, head_bytes=8, block_tokens=16, blocks=1, inflight=1),
    "large": dict(layers=4, heads=8, head_bytes=128, block_tokens=16, blocks=4, inflight=64),
}


def python_run(shape, requests):
    s = SHAPES[shape]
    model = dict(
        layout="hnd",
        total_kv_heads=s["heads"],
        block_tokens=s["block_tokens"],
        head_bytes=s["head_bytes"],
    )
    block_bytes = s["heads"] * s["block_tokens"] * s["head_bytes"]
    slots = s["inflight"]
    nblocks = slots * s["blocks"]
    with kvferry.Node(role="prefill", engine_id="p") as p, kvferry.Node(
        role="decode", engine_id="d"
    ) as d:
        pk = [np.zeros((nblocks, block_bytes), np.uint8) for _ in range(2 * s["layers"])]
        dk = [np.zeros((nblocks, block_bytes), np.uint8) for _ in range(2 * s["layers"])]
        p.register_kv_caches(pk, **model)
        d.register_kv_caches(dk, **model)
        channels = [p.side_channel_addr]
        live, latencies, bad = [], [], 0
        free = list(range(slots))
        started = time.perf_counter()
        for tid in range(1, requests + 1):
            if not free:
                wrong, slot = finish(live.pop(0), dk, latencies)
                bad += wrong
                free.append(slot)
            slot = free.pop()
            ids = list(range(slot * s["blocks"], (slot + 1) * s["blocks"]))
            for k in pk:
                k[ids[0] : ids[-1] + 1] = tid % 251
            t0 = time.perf_counter()
            rx = d.receiver(tid, side_channels=channels)
            rx.request(ids)
            tx = p.sender(tid)
            tx.send(ids)
            live.append((rx, tx, t0, ids, tid % 251, slot))
        while live:
            bad += finish(live.pop(0), dk, latencies)[0]
        wall = time.perf_counter() - started
        p.get_finished(), d.get_finished()
    bytes_moved = requests * s["blocks"] * block_bytes * 2 * s["layers"]
    latencies.sort()
    return {
        "api": "python",
        "shape": shape,
        "requests": requests,
        "verify_errors": bad,
        "p50_ms": 1e3 * latencies[len(latencies) // 2],
        "p99_ms": 1e3 * latencies[int(len(latencies) * 0.99)],
        "gbps": bytes_moved / wall / 1e9,
    }


def finish(entry, dk, latencies):
    """Waits for the oldest request; (1 if it failed or its bytes are
    wrong else 0, its slot)."""
    rx, tx, t0, ids, value, slot = entry
    phase = rx.wait(30.0)
    latencies.append(time.perf_counter() - t0)
    ok = phase is Phase.Success and all((k[ids[0] : ids[-1] + 1] == value).all() for k in dk)
    # The slot is free once prefill's side ended too.
    tx.wait(30.0)
    return (0 if ok else 1), slot


def rust_run(binary, shape, requests):
    s = SHAPES[shape]
    out = subprocess.run(
        [
            binary,
            "demo",
            "--json",
            "--requests",
            str(requests),
            "--concurrency",
            str(s["inflight"]),
            "--layers",
            str(s["layers"]),
            "--heads",
            str(s["heads"]),
            "--head-bytes",
            str(s["head_bytes"]),
            "--block-tokens",
            str(s["block_tokens"]),
            "--blocks-per-request",
            str(s["blocks"]),
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    d = json.loads(out)
    return {
        "api": "rust",
        "shape": shape,
        "requests": requests,
        "verify_errors": d["verify_errors"],
        "p50_ms": d["p50_ms"],
        "p99_ms": d["p99_ms"],
        "gbps": d["gbps"],
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kvferry", required=True, help="the kvferry binary (release)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--small-requests", type=int, default=3000)
    ap.add_argument("--large-requests", type=int, default=2000)
    a = ap.parse_args()
    runs = {k: {"python": [], "rust": []} for k in SHAPES}
    for _ in range(a.rounds):
        for shape, n in (("small", a.small_requests), ("large", a.large_requests)):
            for r in (python_run(shape, n), rust_run(a.kvferry, shape, n)):
                print(json.dumps(r), flush=True)
                assert r["verify_errors"] == 0, r
                runs[shape][r["api"]].append(r)
    med = lambda rs, k: statistics.median(r[k] for r in rs)  # noqa: E731
    small, large = runs["small"], runs["large"]
    print(
        json.dumps(
            {
                "small_p50_python_over_rust": med(small["python"], "p50_ms")
                / med(small["rust"], "p50_ms"),
                "large_gbps_python_over_rust": med(large["python"], "gbps")
                / med(large["rust"], "gbps"),
            }
        )
    )


if __name__ == "__main__":
    main()
