#!/usr/bin/env bash
# SGLang drives kvferry's transfer backend (scripts/test.sh runs this; it
# installs the wheel scripts/build-wheel.sh made): a prefill and a decode
# scheduler of SGLang 0.5.23 in one process, through SGLang's own
# disaggregation queues and scheduler mixins, with SGLang's host-memory KV
# pools (python/tests/test_sglang_sched.py); and kvferry's HiCache storage
# backend under SGLang's HiCache controller and host pool, around
# `kvferry store serve` (python/tests/test_sglang_hicache.py; the debug
# build's binary, or KVFERRY_BIN); and real SGLang servers on the CPU, a
# prefill and a decode on two hosts (network namespaces, root) behind the
# stock sglang-router and smg (python/tests/test_sglang_cluster.py; KVFERRY_SKIP_HOSTS=1
# skips it where namespaces cannot be made). The environment comes from
# `scripts/engine-env.sh sglang` (reused when present); the test model is made once
# in target/bench-model (python/tests/engines.py).
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_NO_CACHE_DIR=1

venv=target/sglang-venv
bash scripts/engine-env.sh sglang "$venv"
"$venv/bin/pip" install --quiet --force-reinstall --no-deps target/wheels/kvferry-*.whl
# The routers operators run in front of SGLang's P/D servers.
"$venv/bin/pip" install --quiet --constraint scripts/engine-locks/sglang.txt sglang-router==0.3.2 smg==1.13.0
# From an empty directory, so `kvferry` is the installed wheel.
tests="$PWD/python/tests"
export KVFERRY_BIN="${KVFERRY_BIN:-$PWD/target/debug/kvferry}"
(cd "$(mktemp -d)" && "$OLDPWD/$venv/bin/python" -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning \
  --durations=3 "$tests/test_sglang_sched.py" "$tests/test_sglang_hicache.py" "$tests/test_sglang_cluster.py")
