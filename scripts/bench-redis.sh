#!/usr/bin/env bash
# kvferry's Redis backends against redis-benchmark on this machine: one
# redis-server, then a Redis Cluster of three masters (no replicas), each
# on free 127.0.0.1 ports. Per round, against the same servers one after
# the other: `kvferry bench store` (1 MiB values in pipelined batches of
# 32, fresh keys, every byte verified, then the lookup of a 128k-token
# request at TP 8) and `redis-benchmark -t set,get -d 1048576 -P 32` (one
# connection per server, as kvferry has: `-c 1`, and `-c 3 --cluster`),
# once as it is (every GET of one key, its value hot in the server's
# caches) and once with `-r 32` (32 keys, as kvferry's batch of distinct
# values). Prints each round and the medians' ratios (kvferry /
# redis-benchmark, as it is and with -r 32).
# Not part of the test command; docs/performance.md records its output.
#
# Env: ROUNDS (default 3), SECONDS_PER_RUN (default 5), REQUESTS (per
# redis-benchmark test, default 640), KVFERRY (the binary, default
# target/release/kvferry, built if missing).
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS="${ROUNDS:-3}"
SECS="${SECONDS_PER_RUN:-5}"
REQUESTS="${REQUESTS:-640}"
KVFERRY="${KVFERRY:-target/release/kvferry}"
[[ -x "$KVFERRY" ]] || cargo build --release --quiet -p kvferry-cli
work="$(mktemp -d)"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

# N ports p, each with p + 10000 free too (a cluster node's bus port).
free_ports() {
  python3 - "$1" <<'PY'
import socket, sys
held, ports = [], []
while len(ports) < int(sys.argv[1]):
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]
    if p > 55535: continue
    b = socket.socket()
    try: b.bind(("127.0.0.1", p + 10000))
    except OSError: continue
    held += [s, b]; ports.append(p)
print(" ".join(map(str, ports)))
PY
}

# Starts a redis-server on port $1 with the rest as its options.
serve() {
  local port="$1"; shift
  redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no \
    --dir "$work" "$@" >"$work/redis-$port.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 200); do redis-cli -p "$port" ping >/dev/null 2>&1 && return; sleep 0.05; done
  echo "redis-server on $port did not start" >&2; exit 1
}

read -r single <<<"$(free_ports 1)"
serve "$single"
read -r -a nodes <<<"$(free_ports 3)"
for p in "${nodes[@]}"; do
  serve "$p" --cluster-enabled yes --cluster-config-file "$work/nodes-$p.conf"
done
redis-cli --cluster create $(printf '127.0.0.1:%s ' "${nodes[@]}") \
  --cluster-replicas 0 --cluster-yes >/dev/null
for p in "${nodes[@]}"; do
  for _ in $(seq 400); do
    redis-cli -p "$p" cluster info | grep -q 'cluster_state:ok' && break
    sleep 0.05
  done
done
cluster_url="redis+cluster://$(printf '127.0.0.1:%s,' "${nodes[@]}" | sed 's/,$//')"

# GB/s of one redis-benchmark test in its CSV output.
rb() {
  redis-benchmark "$@" -t set,get -d 1048576 -P 32 -n "$REQUESTS" --csv |
    python3 -c '
import csv, sys
rows = {r[0]: float(r[1]) for r in csv.reader(sys.stdin) if r and r[0] in ("SET", "GET")}
print("%.3f %.3f" % (rows["SET"] * 1048576 / 1e9, rows["GET"] * 1048576 / 1e9))'
}

for r in $(seq "$ROUNDS"); do
  "$KVFERRY" bench store --store "redis://127.0.0.1:$single" --value-bytes 1048576 --batch 32 \
    --seconds "$SECS" --json >"$work/kv1.$r.json"
  rb -p "$single" -c 1 >"$work/rb1.$r.txt"
  rb -p "$single" -c 1 -r 32 >"$work/rr1.$r.txt"
  "$KVFERRY" bench store --store "$cluster_url" --value-bytes 1048576 --batch 32 \
    --seconds "$SECS" --lookup-hashes 8192 --lookup-tp 8 --json >"$work/kvc.$r.json"
  rb --cluster -p "${nodes[0]}" -c "${#nodes[@]}" >"$work/rbc.$r.txt"
  rb --cluster -p "${nodes[0]}" -c "${#nodes[@]}" -r 32 >"$work/rrc.$r.txt"
  python3 - "$work" "$r" <<'PY'
import json, sys
w, r = sys.argv[1], sys.argv[2]
for name, kv, rb, rr in (("one server", "kv1", "rb1", "rr1"), ("cluster of 3", "kvc", "rbc", "rrc")):
    k = json.load(open(f"{w}/{kv}.{r}.json"))
    s, g = map(float, open(f"{w}/{rb}.{r}.txt").read().split())
    s32, g32 = map(float, open(f"{w}/{rr}.{r}.txt").read().split())
    print(f"round {r}, {name}: kvferry put {k['put_gbps']:.2f} get {k['get_gbps']:.2f} GB/s "
          f"(verify errors {k['verify_errors']}, key errors {k['key_errors']}; lookup {k['lookup_keys']} keys "
          f"p50 {k['lookup_ms_p50']:.1f} ms in {k['lookup_round_trips']:g} round trip(s)) | "
          f"redis-benchmark SET {s:.2f} GET {g:.2f} GB/s, with -r 32 SET {s32:.2f} GET {g32:.2f} GB/s")
PY
done
python3 - "$work" "$ROUNDS" <<'PY'
import json, statistics as st, sys
w, n = sys.argv[1], int(sys.argv[2])
def rates(name):
    return [list(map(float, open(f"{w}/{name}.{r}.txt").read().split())) for r in range(1, n + 1)]
for name, kv, rb, rr in (("one server", "kv1", "rb1", "rr1"), ("cluster of 3", "kvc", "rbc", "rrc")):
    k = [json.load(open(f"{w}/{kv}.{r}.json")) for r in range(1, n + 1)]
    b, b32 = rates(rb), rates(rr)
    kp, kg = st.median(x["put_gbps"] for x in k), st.median(x["get_gbps"] for x in k)
    bs, bg = st.median(x[0] for x in b), st.median(x[1] for x in b)
    bs32, bg32 = st.median(x[0] for x in b32), st.median(x[1] for x in b32)
    lk = st.median(x["lookup_ms_p50"] for x in k)
    print(f"medians, {name}: kvferry put {kp:.2f} get {kg:.2f} GB/s; redis-benchmark SET {bs:.2f} "
          f"GET {bg:.2f} GB/s (ratio put {kp / bs:.2f} get {kg / bg:.2f}), with -r 32 SET {bs32:.2f} "
          f"GET {bg32:.2f} GB/s (ratio put {kp / bs32:.2f} get {kg / bg32:.2f}); lookup p50 {lk:.1f} ms")
PY
