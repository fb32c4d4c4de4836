#!/usr/bin/env bash
# vLLM's own scheduler drives kvferry's connector (python/tests/test_vllm.py),
# SGLang's base classes and plugin hook drive its backend (test_sglang.py),
# the package's own suite runs again with CPU torch tensors, and vLLM's KV
# event structs decode what kvferry's event publisher sends
# (tests/store_kv_events.rs, vllm_decodes_published_batches):
# installs vLLM 0.33 from PyPI into a virtual environment (about 10 GB; one
# whose vLLM is already that version is reused), installs python/ there, and
# runs the test on the CPU (VLLM_TARGET_DEVICE=cpu, a local model config, no
# weights). scripts/test.sh runs it.
set -euo pipefail
cd "$(dirname "$0")/.."
# pip's cache would keep a second copy of every wheel (several GB).
export PIP_NO_CACHE_DIR=1

VLLM_VERSION=0.34.0
SGLANG_VERSION=0.5.23
venv=${KVFERRY_VLLM_VENV:-target/vllm-venv}
have=$("$venv/bin/python" -c 'import vllm; print(vllm.__version__)' 2>/dev/null || true)
if [ "$have" != "$VLLM_VERSION" ]; then
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --upgrade pip
  "$venv/bin/pip" install --quiet "vllm==$VLLM_VERSION" pytest
fi
CARGO_TARGET_DIR="$PWD/target" "$venv/bin/pip" install --quiet --force-reinstall --no-deps ./python
# SGLang without its dependencies, and the two modules its disaggregation
# package imports beyond vLLM's: enough to drive the backend through its
# base classes and plugin hook.
"$venv/bin/pip" install --quiet --no-deps "sglang==$SGLANG_VERSION"
"$venv/bin/pip" install --quiet IPython gguf hypothesis
VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 "$venv/bin/python" -m pytest -q \
  python/tests/test_vllm.py python/tests/test_sglang.py python/tests/test_node.py
KVFERRY_VLLM_VENV="$(cd "$venv" && pwd)" cargo test --test store_kv_events -- --ignored
