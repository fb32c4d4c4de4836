#!/usr/bin/env bash
# The tests against the real Mooncake Transfer Engine (docs/mooncake.md):
# cli/tests/e2e_mooncake_real.rs with MOONCAKE_TE_LIB set to the library
# given, inside a private network namespace with only `lo` up (Mooncake's
# engine listens on every interface). Needs root (unshare -n).
#
# Usage: scripts/test-mooncake.sh /path/to/libtransfer_engine.so
set -euo pipefail
cd "$(dirname "$0")/.."
lib="$(cd "$(dirname "${1:?the path of libtransfer_engine.so}")" && pwd)/$(basename "$1")"
[ -f "$lib" ] || { echo "no library at $lib" >&2; exit 2; }
# Build outside the namespace (crates.io is not reachable inside it).
cargo test -p kvferry-cli --test e2e_mooncake_real --no-run
exec unshare -n bash -c '
  ip link set lo up
  MOONCAKE_TE_LIB="$0" cargo test --offline -p kvferry-cli --test e2e_mooncake_real -- --nocapture
' "$lib"
