#!/usr/bin/env python3
"""Two kvferry binaries on the configurations that must not get slower.

    python3 scripts/compare_binaries.py NEW_BINARY OLD_BINARY [--rounds N] [--all]
        [--syscalls]

Each round runs every configuration once with each binary, the two binaries
alternating (which goes first alternates too), so that drift of a shared
machine falls on both. Prints one line per run, then a Markdown table of
medians. The store configuration starts a `store serve` of the binary under
test on a free 127.0.0.1 port for each run.

`--all` adds the rest of docs/performance.md's demo table (pull mode, TP
4 -> 2, large requests, a small request on core 0, with the bare ZeroMQ
round trip beside it); `--syscalls` ends with system calls and context
switches per small request on core 0 (`perf stat`, 5 000 requests).
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
ONE_SMALL = f"demo --requests 3000 --concurrency 1 {SMALL}"
MORE = [
    ("one small at a time, core 0", f"taskset -c 0 {ONE_SMALL} --zmq-baseline",
     ["p50_ms", "zmq_rtt_p50_ms"]),
    ("large", "demo --requests 100 --concurrency 16 --layers 32 --blocks-per-request 64 --json",
     ["gbps", "p50_ms"]),
    ("tp 4 -> 2", "demo --json --prefill-tp 4 --decode-tp 2", ["gbps", "p50_ms"]),
    ("pull defaults", "demo --json --mode pull", ["gbps", "p50_ms"]),
    ("pull, one small at a time", f"{ONE_SMALL} --mode pull", ["p50_ms"]),
    ("pull, 256 small in flight",
     f"demo --requests 20000 --concurrency 256 {SMALL} --mode pull", ["requests_per_s", "p50_ms"]),
]
SYSCALL_EVENTS = ["raw_syscalls:sys_enter", "syscalls:sys_enter_io_uring_enter",
                  "context-switches"]


def serve(binary):
    """A `store serve` of `binary` on a free port, and its URL."""
    p = subprocess.Popen([binary, "store", "serve", "--listen", "127.0.0.1:0",
                          "--capacity-bytes", str(1 << 30)],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = p.stdout.readline().strip()
    return p, line.removeprefix("listening on ")


def argv(binary, command):
    """`binary command`, behind a leading `taskset -c N` if the command has one."""
    words = command.split()
    if words[0] == "taskset":
        return words[:3] + [binary] + words[3:]
    return [binary] + words


def run(binary, command):
    server = None
    if "{url}" in command:
        server, url = serve(binary)
        command = command.format(url=url)
    try:
        out = subprocess.run(argv(binary, command), capture_output=True, text=True,
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
    ap.add_argument("--all", action="store_true", help="the whole demo table")
    ap.add_argument("--syscalls", action="store_true", help="perf stat per small request")
    a = ap.parse_args()
    configs = CONFIGS + (MORE if a.all else [])
    seen = {(name, which): [] for name, _, _ in configs for which in ("new", "old")}
    for r in range(a.rounds):
        for name, command, fields in configs:
            order = [("new", a.new), ("old", a.old)]
            for which, binary in order if r % 2 == 0 else order[::-1]:
                got = run(binary, command)
                seen[(name, which)].append({f: got[f] for f in fields})
                print(r, name, which, json.dumps(seen[(name, which)][-1]), flush=True)
    print("\n| configuration | command | runs each | new (median) | old (median) |")
    print("|---|---|---|---|---|")
    for name, command, fields in configs:
        def med(which):
            runs = seen[(name, which)]
            return ", ".join(f"{f} {statistics.median(x[f] for x in runs):.4g}" for f in fields)
        print(f"| {name} | `{command}` | {a.rounds} | {med('new')} | {med('old')} |")
    if a.syscalls:
        for which, binary in (("new", a.new), ("old", a.old)):
            print(which, syscalls_per_request(binary, 5000))


def syscalls_per_request(binary, requests):
    """Each of SYSCALL_EVENTS per small request, the whole process on core 0."""
    events = [w for e in SYSCALL_EVENTS for w in ("-e", e)]
    out = subprocess.run(
        ["taskset", "-c", "0", "perf", "stat", "-x,", *events,
         *argv(binary, f"demo --requests {requests} --concurrency 1 {SMALL}")],
        capture_output=True, text=True, timeout=600)
    counts = {}
    for line in out.stderr.splitlines():
        cols = line.split(",")
        if len(cols) > 2 and cols[2] in SYSCALL_EVENTS and cols[0].isdigit():
            counts[cols[2]] = round(int(cols[0]) / requests, 1)
    return counts


if __name__ == "__main__":
    main()
