#!/usr/bin/env bash
# The project's test command (README "Run the tests"; .ci/run runs exactly this).
# Everything it needs is built from crates.io: libzmq is compiled from source by
# the zmq crate, so no system package is required.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n==> %s\n' "$*"; }

step "format"
cargo fmt --all --check

step "clippy"
cargo clippy --workspace --all-targets -- -D warnings

step "docs"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --quiet

step "no tokio in the dependency tree"
if cargo tree --workspace --edges normal,build,dev | grep -i tokio; then
  echo "tokio found in the dependency tree" >&2
  exit 1
fi

step "unit, property and integration tests"
cargo test --workspace

if [ -f reactor/tests/loom.rs ]; then
  step "loom models of the cross-thread pieces"
  # A separate target dir: --cfg changes every fingerprint, and sharing the
  # main one would rebuild the whole workspace twice per run.
  RUSTFLAGS="--cfg kvferry_loom" CARGO_TARGET_DIR=target/loom LOOM_MAX_PREEMPTIONS=2 \
    cargo test -p kvferry-reactor --release --test loom
fi
