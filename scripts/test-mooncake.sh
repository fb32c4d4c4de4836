#!/usr/bin/env bash
# The tests against the real Mooncake libraries (docs/mooncake.md), inside
# a private network namespace with only `lo` up (Mooncake's engine listens
# on every interface). Needs root (unshare -n).
#
#   1. cli/tests/it/e2e_mooncake_real.rs: a `kvferry prefill` and a `kvferry
#      decode` process over Mooncake's tcp, push and pull, every byte
#      verified (MOONCAKE_TE_LIB=PREFIX/lib/libtransfer_engine.so);
#   2. `kvferry demo --store mooncake://…` against a mooncake_master from
#      PREFIX/bin (MOONCAKE_STORE_LIB=PREFIX/lib/libmooncake_store.so):
#      saves, dedup, lookup, loads, every byte verified;
#   3. `kvferry bench transport` over mooncake (its tcp) and over kvferry's
#      own tcp, 1 MiB x 32, one line each.
#
# Usage: scripts/test-mooncake.sh PREFIX   (what build_mooncake_te.sh installed)
set -euo pipefail
cd "$(dirname "$0")/.."
prefix="$(cd "${1:?the install prefix of the Mooncake build}" && pwd)"
te="$prefix/lib/libtransfer_engine.so" store="$prefix/lib/libmooncake_store.so"
master="$prefix/bin/mooncake_master"
for f in "$te" "$store" "$master"; do [ -e "$f" ] || { echo "missing $f" >&2; exit 2; }; done
# Build outside the namespace (crates.io is not reachable inside it).
cargo test -p kvferry-cli --test it --no-run
cargo build --release -p kvferry-cli
exec unshare -n bash -s "$te" "$store" "$master" <<'INNER'
set -euo pipefail
te=$1 store=$2 master=$3
ip link set lo up
export MC_TCP_BIND_ADDRESS=127.0.0.1
echo "==> prefill and decode processes over the real transfer engine"
MOONCAKE_TE_LIB="$te" cargo test --offline -p kvferry-cli --test it e2e_mooncake_real -- --nocapture

echo "==> kvferry demo --store mooncake:// against mooncake_master"
rpc=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
adm=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
"$master" --rpc_address=127.0.0.1 --rpc_port="$rpc" --metrics_host=127.0.0.1 \
  --metrics_port="$adm" --enable_metric_reporting=false --enable_http_metadata_server=false \
  --http_metadata_server_host=127.0.0.1 > /tmp/kvferry-mooncake-master.log 2>&1 &
mpid=$!
trap 'kill "$mpid" 2>/dev/null || true' EXIT
for _ in $(seq 100); do (exec 3<>"/dev/tcp/127.0.0.1/$rpc") 2>/dev/null && break; sleep 0.1; done
MOONCAKE_STORE_LIB="$store" MOONCAKE_TE_LIB="$te" target/release/kvferry demo \
  --store "mooncake://127.0.0.1:$rpc" --requests 16 --json | tee /tmp/kvferry-mooncake-demo.json
python3 -c 'import json,sys; r=json.load(open("/tmp/kvferry-mooncake-demo.json")); sys.exit(0 if r["verify_errors"]==0 and r["load_errors"]==0 and r["loaded_blocks"]>0 else 1)'

echo "==> kvferry bench transport: mooncake (tcp) and kvferry's tcp, 1 MiB x 32"
MOONCAKE_TE_LIB="$te" target/release/kvferry bench transport --transport mooncake \
  --mooncake-protocol tcp --seconds 5 --json
target/release/kvferry bench transport --transport tcp --seconds 5 --json
INNER
