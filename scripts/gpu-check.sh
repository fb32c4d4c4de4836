#!/usr/bin/env bash
# kvferry's device-memory paths on a GPU, from binaries built elsewhere:
# the GPU tests against CUDA device 0 and `kvferry bench device` (a copy
# stream and IPC into a second process against cudaMemcpy device to
# device, staged tcp against host tcp), every byte verified; under 5
# minutes on one GPU.
#
#   bash scripts/gpu-check.sh --build     # on any machine: target/gpu-carry/
#   bash scripts/gpu-check.sh [OUT]       # on the GPU machine, repository root,
#                                         # target/gpu-carry/ carried there
#
# It first says whether what it needs works there: an NVIDIA driver,
# io_uring (glommio's executors), CUDA IPC between two processes. Results
# go to OUT (default target/gpu-out): gpu-check.txt and bench-device.json.
set -uo pipefail
cd "$(dirname "$0")/.."
carry=target/gpu-carry

if [ "${1:-}" = --build ]; then
  set -e
  export CARGO_TARGET_DIR="$PWD/target" CARGO_INCREMENTAL=0
  # Stripped, without debug info (profile `gpu`): what is carried stays
  # well under the 64 MiB a device machine takes.
  cargo build --profile gpu -p kvferry-cli --features cuda
  it=$(cargo test --profile gpu --features kvferry-transport/cuda -p kvferry --test it \
         --no-run --message-format=json \
       | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("executable") and m.get("target", {}).get("name") == "it":
        print(m["executable"])')
  rm -rf "$carry" && mkdir -p "$carry"
  cp target/gpu/kvferry "$carry/kvferry"
  cp "$it" "$carry/it"
  du -sh "$carry"/*
  exit 0
fi

out=${1:-target/gpu-out}
mkdir -p "$out"
report="$out/gpu-check.txt"
: > "$report"
say() { echo "$*" | tee -a "$report"; }
started=$SECONDS

say "== kvferry gpu-check, $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
for f in "$carry/kvferry" "$carry/it"; do
  [ -x "$f" ] || { say "missing $f: run 'bash scripts/gpu-check.sh --build' and carry $carry"; exit 2; }
done

say "== driver"
if command -v nvidia-smi > /dev/null; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | tee -a "$report"
else
  say "no nvidia-smi on this machine"
fi

say "== io_uring (a tcp transport benchmark on loopback)"
if timeout 60 "$carry/kvferry" bench transport --seconds 0.5 > "$out/io_uring.txt" 2>&1; then
  say "io_uring: works"
else
  say "io_uring: does not work here (glommio's executors cannot start); nothing else can run:"
  tail -5 "$out/io_uring.txt" | tee -a "$report"
  exit 1
fi

say "== CUDA IPC between two processes (a small bench device run)"
if timeout 90 "$carry/kvferry" bench device --device cuda:0 --bytes $((16 << 20)) --rounds 1 --json \
     > "$out/ipc-probe.json" 2> "$out/ipc-probe.err"; then
  if grep -o '"ipc":{[^}]*}' "$out/ipc-probe.json" | grep -q '"opened":true'; then
    say "CUDA IPC: works (the peer's allocation opened in this process)"
  else
    say "CUDA IPC: the peer's handle did not open here; same-host bytes go staged over tcp"
  fi
else
  say "the device bench failed:"
  tail -5 "$out/ipc-probe.err" | tee -a "$report"
fi

say "== GPU tests (CUDA device 0)"
KVFERRY_GPU_TESTS=1 timeout 150 "$carry/it" --ignored --test-threads 1 transport_gpu 2>&1 \
  | tee "$out/gpu-tests.txt" | grep -E '^test |test result' | tee -a "$report"
tests_rc=${PIPESTATUS[0]}
say "== stand-in device tests on this machine"
timeout 120 "$carry/it" --test-threads 2 transport_device e2e_device 2>&1 \
  | tee "$out/standin-tests.txt" | grep -E 'test result' | tee -a "$report"
standin_rc=${PIPESTATUS[0]}

say "== bench device (256 MiB batches of 2 MiB descriptors, medians of 5)"
timeout 180 "$carry/kvferry" bench device --device cuda:0 --json > "$out/bench-device.json" 2> "$out/bench-device.err"
bench_rc=$?
cat "$out/bench-device.json" | tee -a "$report"
[ $bench_rc -eq 0 ] || tail -5 "$out/bench-device.err" | tee -a "$report"

say "== done in $((SECONDS - started)) s: gpu tests rc=$tests_rc, stand-in tests rc=$standin_rc, bench rc=$bench_rc"
[ $tests_rc -eq 0 ] && [ $standin_rc -eq 0 ] && [ $bench_rc -eq 0 ]
