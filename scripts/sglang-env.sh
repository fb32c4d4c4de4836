#!/usr/bin/env bash
# Makes (or reuses) an SGLang 0.5.23 environment from PyPI without its GPU kernels:
#
#   bash scripts/sglang-env.sh [VENV]   default target/sglang-venv
#
# For tests that drive SGLang's own disaggregation queues and scheduler
# mixins with host-memory KV pools. sglang 0.5.23's requirements pin CUDA
# kernel packages that are useless without a GPU and large (sglang-kernel
# alone is 1.2 GB and cannot even be imported without the NVIDIA driver). So,
# as scripts/vllm-env.sh does: the wheel's other requirements (markers
# evaluated, no extras, the GPU kernels dropped), PyPI's torch (a CUDA build,
# which runs on the CPU), then the wheel itself with --no-deps. Plus pytest and
# numpy. About 7 GB and 2-3 minutes. There is no CPU build of sgl-kernel on
# PyPI, so this environment cannot serve a model (SGLANG_USE_CPU_ENGINE=1
# imports sgl_kernel's CPU ops).
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_NO_CACHE_DIR=1

DIST=sglang VERSION=0.5.23 TORCH=2.14.1
venv=${1:-target/sglang-venv}
if "$venv/bin/python" -c "import importlib.metadata as m; assert m.version('$DIST') == '$VERSION'" 2>/dev/null; then
  echo "$venv: $DIST $VERSION already"
  exit 0
fi
rm -rf "$venv"
python3 -m venv "$venv"
"$venv/bin/pip" install --quiet --upgrade pip packaging
wheels=$(mktemp -d)
trap 'rm -rf "$wheels"' EXIT
"$venv/bin/pip" download --quiet --no-deps "$DIST==$VERSION" -d "$wheels"
wheel=$(ls "$wheels"/*.whl)
# The requirements that apply here, torch's pin kept at PyPI's build.
"$venv/bin/python" - "$wheel" "$TORCH" >"$wheels/req.txt" <<'PY'
import sys, zipfile
from packaging.requirements import Requirement
# CUDA kernels, CUDA-only JIT/DSL compilers and GPU communication libraries:
# nothing that SGLang imports on the paths these tests use (it imports them
# only when it runs on CUDA). apache-tvm-ffi stays: xgrammar needs it.
GPU_ONLY = {
    "sglang-kernel",          # CUDA-only common_ops (sm90/sm100), ~1.2 GB; no CPU ops
    "flashinfer-python", "flash-attn-4", "sgl-flash-mla", "sgl-deep-gemm",
    "sgl-deep-ep", "humming-kernels", "quack-kernels", "tilelang",
    "nvidia-cutlass-dsl", "nvidia-mathdx", "nvshmem4py-cu13",
    "cuda-python",            # CUDA driver/runtime bindings
    "torch-memory-saver",     # LD_PRELOAD hook over cudaMalloc
}
wheel, torch = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    lines = z.read(meta).decode().splitlines()
print(f"torch=={torch}")
for line in lines:
    if not line.startswith("Requires-Dist:"):
        continue
    req = Requirement(line.split(":", 1)[1].strip())
    name = req.name.lower().replace("_", "-")
    if name == "torch" or name in GPU_ONLY:
        continue
    if req.marker and not req.marker.evaluate({"extra": ""}):
        continue
    req.extras = set()
    print(req)
PY
"$venv/bin/pip" install --quiet -r "$wheels/req.txt" pytest numpy
"$venv/bin/pip" install --quiet --no-deps "$wheel"
"$venv/bin/python" -c "import sglang, torch; print('sglang', sglang.__version__, 'torch', torch.__version__)"
