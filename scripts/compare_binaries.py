#!/usr/bin/env python3
"""Two kvferry binaries on the configurations that must not get slower.

    python3 scripts/compare_binaries.py NEW_BINARY OLD_BINARY [--rounds N]

Each round runs every configuration once with each binary, the two binaries
alternating (which goes first alternates too), so that drift of a shared
machine falls on both. Prints one line per run, then a Markdown table of
medians. The store configuration starts a `store serve` of the binary under
test on a free 127.0.0.1 port for each run.
"""

import argparse
import json
import statistics
import subprocess
import sys

SMALL = "--layers 1 --blocks-per-request 1 --heads 1 --head-bytes 8 --json"
CONFIGS = [
    ("defaults", "demo --json", ["gbps", "p50_ms", "p99_ms"]),
    ("256 small in flight",
     f"demo --requests 20000 --concurrency 256 {SMALL}", ["requests_per_s", "p50_ms"]),
    ("one small at a time", f"demo --requests 3000 --concurrency 1 {SMALL}", ["p50_ms"]),
    ("bench transport", "bench transport --seconds 3 --json", ["gbps", "p50_us"]),
    ("bench store", "bench store --store {url} --seconds 3 --lookup-hashes 0 --json",
     ["put_gbps", "get_gbps"]),
]


def serve(binary):
    """A `store serve` of `binary` on a free port, and its URL."""
    p = subprocess.Popen([binary, "store", "serve", "--listen", "127.0.0.1:0",
                          "--capacity-bytes", str(1 << 30)],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = p.stdout.readline().strip()
    return p, line.removeprefix("listening on ")


def run(binary, command):
    server = None
    if "{url}" in command:
        server, url = serve(binary)
        command = command.format(url=url)
    try:
        out = subprocess.run([binary] + command.split(), capture_output=True, text=True,
                             timeout=600)
    finally:
        if server:
            server.terminate()
            server.wait()
    if out.returncode != 0:
        sys.exit(f"{binary} {command}: exit {out.returncode}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("new")
    ap.add_argument("old")
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    seen = {(name, which): [] for name, _, _ in CONFIGS for which in ("new", "old")}
    for r in range(a.rounds):
        for name, command, fields in CONFIGS:
            order = [("new", a.new), ("old", a.old)]
            for which, binary in order if r % 2 == 0 else order[::-1]:
                got = run(binary, command)
                seen[(name, which)].append({f: got[f] for f in fields})
                print(r, name, which, json.dumps(seen[(name, which)][-1]), flush=True)
    print("\n| configuration | command | runs each | new (median) | old (median) |")
    print("|---|---|---|---|---|")
    for name, command, fields in CONFIGS:
        def med(which):
            runs = seen[(name, which)]
            return ", ".join(f"{f} {statistics.median(x[f] for x in runs):.4g}" for f in fields)
        print(f"| {name} | `{command}` | {a.rounds} | {med('new')} | {med('old')} |")


if __name__ == "__main__":
    main()
