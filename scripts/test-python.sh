#!/usr/bin/env bash
# The Python package's checks (scripts/test.sh runs this): builds and
# installs python/ into a fresh virtual environment with pip, as a user
# would (the wheel scripts/build-wheel.sh made), and runs its pytest suite,
# the stub check and the type check there.
set -euo pipefail
cd "$(dirname "$0")/.."

# The same target directory as the workspace: these builds reuse its
# compiled dependencies (libzmq among them) instead of starting over.
export CARGO_TARGET_DIR="$PWD/target"
cargo fmt --manifest-path python/Cargo.toml --check
cargo clippy --manifest-path python/Cargo.toml -- -D warnings

venv=target/python-venv
rm -rf "$venv"
python3 -m venv "$venv"
"$venv/bin/pip" install --quiet --upgrade pip
"$venv/bin/pip" install --quiet pytest numpy hypothesis mypy
"$venv/bin/pip" install --quiet target/wheels/kvferry-*.whl
# From the repository root, so `import kvferry` finds the installed package
# and not the sources under python/.
"$venv/bin/python" -m pytest -q python/tests
"$venv/bin/python" -m mypy.stubtest kvferry._native
# The package's modules against one another and the stub stubtest just
# held to the module. The engines are not installed here: their modules
# are Any (python/pyproject.toml, [tool.mypy]).
"$venv/bin/python" -m mypy --config-file python/pyproject.toml --cache-dir target/mypy-cache python/kvferry
