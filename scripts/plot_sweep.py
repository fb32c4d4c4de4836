#!/usr/bin/env python3
"""Plots of `kvferry bench transport --sweep`: throughput against block size,
and the latency distribution of single-descriptor 4 KiB batches.

Setup, once (matplotlib in a virtual environment):

    python3 -m venv /tmp/plotvenv && /tmp/plotvenv/bin/pip install matplotlib

Regenerate docs/img/sweep_throughput.png and docs/img/sweep_latency_4k.png
(runs the sweep, about two minutes, then plots):

    /tmp/plotvenv/bin/python scripts/plot_sweep.py --run

Without --run it plots the CSV files of an earlier sweep (--csv, --samples).
"""

import argparse
import csv
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
STYLE = {
    "tcp": dict(color="tab:blue", marker="o"),
    "shm": dict(color="tab:purple", marker="D"),
    "local": dict(color="tab:green", marker="s"),
    "memcpy": dict(color="tab:gray", marker=".", linestyle=":"),
    "iperf3": dict(color="tab:red", marker="^", linestyle="--"),
}


def run_sweep(csv_path, samples_path):
    cmd = [
        "cargo", "run", "--release", "-q", "-p", "kvferry-cli", "--",
        "bench", "transport", "--sweep",
        "--csv", str(csv_path), "--samples", str(samples_path),
    ]
    print("+", " ".join(cmd), file=sys.stderr)
    subprocess.run(cmd, cwd=ROOT, check=True)


def size_label(n):
    for unit, div in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n // div} {unit}"
    return f"{n} B"


def plot_throughput(csv_path, out):
    series = defaultdict(list)
    with open(csv_path) as f:
        for r in csv.DictReader(f):
            if r["transport"] in ("tcp", "shm", "local") and r["batch"] == "1":
                continue  # the latency runs, plotted separately
            series[r["transport"]].append((int(r["block_bytes"]), float(r["gbps"]), int(r["batch"])))
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, pts in series.items():
        pts.sort()
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        label = {"iperf3": "iperf3 (-l block, one stream)",
                 "memcpy": "memcpy (one thread, same buffers)"}.get(name, f"kvferry {name}")
        ax.plot(xs, ys, label=label, **STYLE.get(name, {}))
        if name == "iperf3" and xs:
            # iperf3 takes at most 1 MiB per write: its 1 MiB figure is the
            # ceiling the larger blocks are compared with.
            top = max(p[0] for p in pts)
            largest = max(b for b, _, _ in sum(series.values(), []))
            if largest > top:
                ax.plot([top, largest], [ys[-1], ys[-1]], color="tab:red", alpha=0.4,
                        linestyle="--", label="iperf3 at 1 MiB (its largest -l)")
    blocks = sorted({b for pts in series.values() for b, _, _ in pts})
    batches = {b: n for pts in series.values() for b, _, n in pts}
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(blocks)
    ax.set_xticklabels([f"{size_label(b)}\n×{batches[b]}" for b in blocks], fontsize=8)
    ax.set_xlabel("block size × descriptors per batch")
    ax.set_ylabel("GB/s (10⁹ bytes/s)")
    ax.set_title("kvferry bench transport --sweep: throughput on loopback")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}", file=sys.stderr)


def plot_latency(samples_path, out):
    lat = defaultdict(list)
    with open(samples_path) as f:
        for r in csv.DictReader(f):
            lat[r["transport"]].append(float(r["latency_us"]))
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, xs in lat.items():
        xs.sort()
        n = len(xs)
        p50, p99 = xs[n // 2], xs[min(n - 1, int(n * 0.99))]
        ys = [(i + 1) / n for i in range(n)]
        ax.plot(xs, ys, label=f"kvferry {name}: p50 {p50:.1f} µs, p99 {p99:.1f} µs ({n} batches)",
                color=STYLE.get(name, {}).get("color"))
    ax.set_xscale("log")
    ax.set_xlabel("batch latency, submit to completion (µs)")
    ax.set_ylabel("fraction of batches at most")
    ax.set_title("one 4 KiB descriptor per batch: latency distribution (CDF)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}", file=sys.stderr)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", action="store_true", help="run the sweep first (cargo, release build)")
    ap.add_argument("--csv", type=Path, default=ROOT / "target" / "sweep.csv")
    ap.add_argument("--samples", type=Path, default=ROOT / "target" / "sweep_samples.csv")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "img")
    a = ap.parse_args()
    if a.run:
        a.csv.parent.mkdir(parents=True, exist_ok=True)
        run_sweep(a.csv, a.samples)
    a.out.mkdir(parents=True, exist_ok=True)
    plot_throughput(a.csv, a.out / "sweep_throughput.png")
    plot_latency(a.samples, a.out / "sweep_latency_4k.png")


if __name__ == "__main__":
    main()
