#!/usr/bin/env bash
# The cost of authentication (docs/security.md, docs/performance.md
# "Authentication"): `kvferry demo` without a cluster key ("off"), with one
# ("on") and with one and payload tags ("payload", KVFERRY_PAYLOAD_MAC=1),
# one binary, the order rotating run by run, in four shapes: the default
# demo (shared memory within the process), the same over tcp ("bulk"),
# 256 small requests in flight over tcp, and one small request at a time
# over tcp (its p50 is the latency authentication adds to a request). Prints each shape's median throughput and p50 latency per
# setting and their ratios to "off".
#
#   bash scripts/bench-auth.sh [ROUNDS]    (default 7)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds="${1:-7}"
cargo build --release -p kvferry-cli >/dev/null 2>&1
bin="$PWD/target/release/kvferry"
dir="$(mktemp -d)"
trap 'rm -rf "$dir"' EXIT
head -c 32 /dev/urandom >"$dir/key"
chmod 600 "$dir/key"
default=(demo --json)
bulk=(demo --json --transport tcp)
small=(demo --json --transport tcp --concurrency 256 --requests 50000 --layers 1 --heads 1
  --head-bytes 64 --block-tokens 16 --blocks-per-request 1)
one=(demo --json --transport tcp --concurrency 1 --requests 3000 --layers 1 --heads 1
  --head-bytes 64 --block-tokens 16 --blocks-per-request 1)
settings=(off on payload)
run() { # setting, shape's arguments...
  local setting="$1"
  shift
  case "$setting" in
    off) env -u KVFERRY_CLUSTER_KEY_FILE -u KVFERRY_PAYLOAD_MAC "$bin" "$@" ;;
    on) env -u KVFERRY_PAYLOAD_MAC KVFERRY_CLUSTER_KEY_FILE="$dir/key" "$bin" "$@" ;;
    payload) KVFERRY_PAYLOAD_MAC=1 KVFERRY_CLUSTER_KEY_FILE="$dir/key" "$bin" "$@" ;;
  esac 2>/dev/null | tail -1
}
for r in $(seq "$rounds"); do
  for shape in default bulk small one; do
    declare -n args="$shape"
    # Rotate which setting goes first, so drift favours none.
    for k in 0 1 2; do
      setting="${settings[$(((r + k) % 3))]}"
      run "$setting" "${args[@]}" >"$dir/$shape.$setting.$r.json"
    done
  done
done
python3 - "$dir" "$rounds" <<'PY'
import json, statistics, sys
d, rounds = sys.argv[1], int(sys.argv[2])
print(f"{'shape':8} {'setting':8} {'req/s (median)':>15} {'GB/s':>6} {'p50 ms':>8} {'failed':>6}")
for shape in ("default", "bulk", "small", "one"):
    med = {}
    for setting in ("off", "on", "payload"):
        runs = [json.load(open(f"{d}/{shape}.{setting}.{r}.json")) for r in range(1, rounds + 1)]
        rps = statistics.median(x["requests_per_s"] for x in runs)
        p50 = statistics.median(x["p50_ms"] for x in runs)
        gbs = statistics.median(x["gbps"] for x in runs)
        bad = sum(x["failed"] + x["expired"] + x["verify_errors"] for x in runs)
        med[setting] = (rps, p50)
        print(f"{shape:8} {setting:8} {rps:15.0f} {gbs:6.2f} {p50:8.3f} {bad:6}")
    r0, l0 = med["off"]
    for setting in ("on", "payload"):
        r1, l1 = med[setting]
        print(f"{shape:8} {setting}/off throughput {r1 / r0:.3f}, p50 {1000 * (l1 - l0):+.0f} us")
PY
