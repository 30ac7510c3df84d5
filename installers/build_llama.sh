#!/usr/bin/env bash
# Install llama-cpp-python, and stable-diffusion-cpp-python (the image engine), built for one
# variant into the build environment (Linux, macOS).
#
#   installers/build_llama.sh cpu|cuda|vulkan|metal [VERSION]
#
# PYTHON picks the interpreter (default: .venv/bin/python of the checkout, else python3).
# VERSION defaults to the one installed now (else the newest). Compiling takes minutes (about
# 8 on 2 cores for cpu; CUDA much longer). The variants and the toolchain each needs:
#   cpu     CMAKE_ARGS none             a C/C++ compiler and CMake
#   cuda    -DGGML_CUDA=on              the CUDA toolkit (nvcc on PATH, CUDA_HOME/CUDA_PATH)
#   vulkan  -DGGML_VULKAN=on            the Vulkan SDK (glslc on PATH, VULKAN_SDK)
#   metal   -DGGML_METAL=on             macOS with Xcode's command line tools
# Every variant also gets -DGGML_RPC=on: llama.cpp's RPC backend, which model groups use (one
# model split over several workers, issue 19); the worker offers groups only when it is there.
# Extra CMake flags can be appended with LLAMA_EXTRA_CMAKE_ARGS (e.g. a CUDA architecture list:
# "-DCMAKE_CUDA_ARCHITECTURES=61;75;86;89").
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VARIANT="${1:-}"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi

case "$VARIANT" in
    cpu)    ARGS="" ;;
    cuda)   ARGS="-DGGML_CUDA=on"
            command -v nvcc >/dev/null || { echo "build_llama.sh: cuda needs nvcc (the CUDA toolkit) on PATH" >&2; exit 2; } ;;
    vulkan) ARGS="-DGGML_VULKAN=on"
            command -v glslc >/dev/null || { echo "build_llama.sh: vulkan needs glslc (the Vulkan SDK) on PATH" >&2; exit 2; } ;;
    metal)  ARGS="-DGGML_METAL=on"
            [[ "$(uname -s)" == "Darwin" ]] || { echo "build_llama.sh: metal builds only on macOS" >&2; exit 2; } ;;
    *) echo "usage: build_llama.sh cpu|cuda|vulkan|metal [VERSION]" >&2; exit 2 ;;
esac
if [[ "$(uname -s)" == "Darwin" && "$VARIANT" == "cpu" ]]; then
    ARGS="-DGGML_METAL=off"  # the plain build turns Metal on by itself on macOS
fi
ARGS="$ARGS -DGGML_RPC=on ${LLAMA_EXTRA_CMAKE_ARGS:-}"

VERSION="${2:-$("$PYTHON" - <<'PY'
from importlib.metadata import PackageNotFoundError, version
try:
    print(version("llama-cpp-python"))
except PackageNotFoundError:
    print("")
PY
)}"
SPEC="llama-cpp-python${VERSION:+==$VERSION}"

echo "==> $SPEC for $VARIANT: CMAKE_ARGS='${ARGS# }'"
# --no-cache-dir: pip's wheel cache would hand back a build of another variant.
CMAKE_ARGS="${ARGS# }" FORCE_CMAKE=1 "$PYTHON" -m pip install --force-reinstall --no-deps \
    --no-cache-dir --no-binary llama-cpp-python "$SPEC"
"$PYTHON" -m pip install "$SPEC"  # its dependencies, if this environment lacks them
"$PYTHON" - <<'PY'
import llama_cpp
from llama_cpp import llama_cpp as lib
print(f"llama-cpp-python {llama_cpp.__version__}: GPU offload supported = "
      f"{bool(lib.llama_supports_gpu_offload())}, RPC = {bool(lib.llama_supports_rpc())}")
PY

# The image engine (issue 38): stable-diffusion-cpp-python, built for the same variant (its own
# CMake switches, SD_CUDA / SD_VULKAN / SD_METAL), so that the app's image children use the GPU
# too. The cpu variant keeps the CPU build the worker's extra installs.
case "$VARIANT" in
    cuda)   SD_ARGS="-DSD_CUDA=ON" ;;
    vulkan) SD_ARGS="-DSD_VULKAN=ON" ;;
    metal)  SD_ARGS="-DSD_METAL=ON" ;;
    *)      SD_ARGS="" ;;
esac
if [[ -n "$SD_ARGS" ]]; then
    SD_SPEC="stable-diffusion-cpp-python$("$PYTHON" - <<'PY'
from importlib.metadata import PackageNotFoundError, version
try:
    print("==" + version("stable-diffusion-cpp-python"))
except PackageNotFoundError:
    print("")
PY
)"
    echo "==> $SD_SPEC for $VARIANT: CMAKE_ARGS='$SD_ARGS'"
    CMAKE_ARGS="$SD_ARGS" FORCE_CMAKE=1 "$PYTHON" -m pip install --force-reinstall --no-deps \
        --no-cache-dir --no-binary stable-diffusion-cpp-python "$SD_SPEC"
fi
