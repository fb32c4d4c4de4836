#!/usr/bin/env bash
# kvferry store serve against Mooncake Store on this machine, alternated in
# one run: ROUNDS pairs, each a `kvferry bench store` run (1 MiB values in
# batches of 32, fresh keys, every byte verified) against a server process
# on 127.0.0.1 (the engine's memory shared with it: one copy through
# shared memory), then ../shared/bench/mooncake_store_baseline.sh (the same
# shape through Mooncake's own store, installed from PyPI). Prints each
# pair and the medians' ratios. Long (a minute per pair): not part of the
# test command; docs/performance.md records its output.
#
# Env: ROUNDS (default 3), SECONDS_PER_RUN (default 5), KVFERRY (the binary,
# default target/release/kvferry, built if missing), MOONCAKE_BASELINE
# (default ../shared/bench/mooncake_store_baseline.sh), STREAMS (default 4).
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS="${ROUNDS:-3}"
SECS="${SECONDS_PER_RUN:-5}"
KVFERRY="${KVFERRY:-target/release/kvferry}"
BASELINE="${MOONCAKE_BASELINE:-../shared/bench/mooncake_store_baseline.sh}"
STREAMS="${STREAMS:-4}"
[[ -x "$KVFERRY" ]] || cargo build --release --quiet -p kvferry-cli
work="$(mktemp -d)"
server_pid=""
cleanup() { [[ -n "$server_pid" ]] && kill "$server_pid" 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT

"$KVFERRY" store serve --listen 127.0.0.1:0 --capacity-bytes $((2 << 30)) \
  --streams "$STREAMS" >"$work/serve.out" 2>"$work/serve.err" &
server_pid=$!
for _ in $(seq 100); do grep -q '^listening on ' "$work/serve.out" 2>/dev/null && break; sleep 0.1; done
url="$(sed -n 's/^listening on //p' "$work/serve.out")"
[[ -n "$url" ]] || { echo "the store server did not start" >&2; cat "$work/serve.err" >&2; exit 1; }

for r in $(seq "$ROUNDS"); do
  "$KVFERRY" bench store --store "$url" --seconds "$SECS" --json >"$work/kv.$r.json"
  DURATION="$SECS" bash "$BASELINE" | tail -1 >"$work/mc.$r.txt"
  python3 - "$work/kv.$r.json" "$work/mc.$r.txt" "$r" <<'PY'
import json, re, sys
k = json.load(open(sys.argv[1])); m = open(sys.argv[2]).read()
mp = float(re.search(r"put_GBps_1MiB=([\d.]+)", m).group(1))
mg = float(re.search(r"get_GBps_1MiB=([\d.]+)", m).group(1))
print(f"round {sys.argv[3]}: kvferry put {k['put_gbps']:.2f} get {k['get_gbps']:.2f} GB/s "
      f"({k['put_ratio_to_memcpy']:.2f}x and {k['get_ratio_to_memcpy']:.2f}x memcpy {k['memcpy_gbps']:.2f}; "
      f"verify errors {k['verify_errors']}, lookup {k['lookup_keys']} keys {k['lookup_ms_p50']:.2f} ms "
      f"in {k['lookup_round_trips']:g} round trip) | mooncake put {mp:.2f} get {mg:.2f} GB/s")
PY
done
python3 - "$work" "$ROUNDS" <<'PY'
import json, re, statistics as st, sys
w, n = sys.argv[1], int(sys.argv[2])
k = [json.load(open(f"{w}/kv.{r}.json")) for r in range(1, n + 1)]
m = [open(f"{w}/mc.{r}.txt").read() for r in range(1, n + 1)]
g = lambda key: [float(re.search(key + r"=([\d.]+)", x).group(1)) for x in m]
kp, kg = st.median(x["put_gbps"] for x in k), st.median(x["get_gbps"] for x in k)
mp, mg = st.median(g("put_GBps_1MiB")), st.median(g("get_GBps_1MiB"))
km = st.median(x["memcpy_gbps"] for x in k)
print(f"medians: kvferry put {kp:.2f} get {kg:.2f} GB/s, mooncake put {mp:.2f} get {mg:.2f} GB/s; "
      f"ratio put {kp / mp:.2f} get {kg / mg:.2f}; memcpy {km:.2f} GB/s, "
      f"kvferry put {kp / km:.2f}x get {kg / km:.2f}x memcpy")
PY
