#!/usr/bin/env bash
# Builds the Python package's wheel once into target/wheels (scripts/test.sh
# runs it; test-python.sh and test-vllm.sh install that wheel), with
# python/Cargo.lock enforced.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_NO_CACHE_DIR=1
# The workspace's target dir: the wheel's build reuses its compiled
# dependencies (libzmq among them).
export CARGO_TARGET_DIR="$PWD/target" MATURIN_PEP517_ARGS="--locked"
venv=target/wheel-venv
[ -x "$venv/bin/pip" ] || python3 -m venv "$venv"
rm -rf target/wheels
"$venv/bin/pip" wheel --quiet --no-deps ./python -w target/wheels
ls target/wheels/kvferry-*.whl
