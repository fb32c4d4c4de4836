#!/usr/bin/env bash
# The cost of authentication (docs/security.md, docs/performance.md
# "Authentication"): `kvferry demo` with and without a cluster key,
# alternating run by run with one binary, in two shapes: the default demo,
# 256 small requests in flight over tcp, and one small request at a time
# over tcp (its p50 is the latency authentication adds to a request). Prints each shape's median
# throughput and p50 latency per setting and their ratio.
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
small=(demo --json --transport tcp --concurrency 256 --requests 50000 --layers 1 --heads 1
  --head-bytes 64 --block-tokens 16 --blocks-per-request 1)
one=(demo --json --transport tcp --concurrency 1 --requests 3000 --layers 1 --heads 1
  --head-bytes 64 --block-tokens 16 --blocks-per-request 1)
for r in $(seq "$rounds"); do
  for shape in default small one; do
    declare -n args="$shape"
    # Alternate which setting goes first, so drift favours neither.
    order=(off on)
    ((r % 2 == 0)) && order=(on off)
    for auth in "${order[@]}"; do
      if [ "$auth" = on ]; then
        KVFERRY_CLUSTER_KEY_FILE="$dir/key" "$bin" "${args[@]}" 2>/dev/null | tail -1
      else
        env -u KVFERRY_CLUSTER_KEY_FILE "$bin" "${args[@]}" 2>/dev/null | tail -1
      fi >"$dir/$shape.$auth.$r.json"
    done
  done
done
python3 - "$dir" "$rounds" <<'PY'
import json, statistics, sys
d, rounds = sys.argv[1], int(sys.argv[2])
print(f"{'shape':8} {'auth':4} {'req/s (median)':>15} {'p50 ms':>8} {'failed':>6}")
for shape in ("default", "small", "one"):
    med = {}
    for auth in ("off", "on"):
        runs = [json.load(open(f"{d}/{shape}.{auth}.{r}.json")) for r in range(1, rounds + 1)]
        rps = statistics.median(x["requests_per_s"] for x in runs)
        p50 = statistics.median(x["p50_ms"] for x in runs)
        bad = sum(x["failed"] + x["expired"] + x["verify_errors"] for x in runs)
        med[auth] = (rps, p50)
        print(f"{shape:8} {auth:4} {rps:15.0f} {p50:8.3f} {bad:6}")
    (r0, l0), (r1, l1) = med["off"], med["on"]
    print(f"{shape:8} on/off throughput {r1 / r0:.3f}, p50 {1000 * (l1 - l0):+.0f} us")
PY
