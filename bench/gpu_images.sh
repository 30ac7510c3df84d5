#!/usr/bin/env bash
# Image generation on an NVIDIA GPU (issues 38 and 41), in one call of the device machine:
# stable-diffusion-cpp-python built from its sdist with CUDA, then bench/image_speed.py (the
# engine in one process) and bench/gpu_images_sandboxed.py (the worker's sandboxed image child)
# on the random-weight SDXS-512-DS test model. The payload is an ignored folder (carried):
#
#     .gpu-img/stable_diffusion_cpp_python-<version>.tar.gz   (pip download --no-binary :all:)
#     .gpu-img/whl/*.whl    cp312 wheels the image lacks: pydantic, pydantic-core, gguf, orjson,
#                           jsonschema and kin, pillow (from ../shared/gpu-check's payload)
#
# The image audit's band: the GPU's renders of bench/image_band.py's orders come back in
# $OUT/band; compare them here with the CPU's (about 2.5 min on 2 cores):
#     .venv/bin/python bench/image_band.py --write /tmp/band-cpu
#     .venv/bin/python bench/image_band.py --compare /tmp/band-cpu FILES_AT/band
#
#     bash bench/gpu_images.sh               # on the GPU machine: OUT is where results go
#     IMG_LOCAL=1 OUT=/tmp/o bash bench/gpu_images.sh   # a dry run here: a CPU build
set -u -o pipefail
PROJ="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PAY="$PROJ/.gpu-img"
OUT="${OUT:-/tmp/gpu-img-out}"
W=/tmp/gpu-img-work
SITE="$W/site"
PY="${PY:-python3}"
mkdir -p "$OUT" "$W"
SUM="$OUT/summary.txt"
T0=$SECONDS
summ() { echo "[+$((SECONDS - T0))s] $*" | tee -a "$SUM"; }
run() {  # run NAME LIMIT_S CMD...: logged to $OUT/NAME.log, its rc summarised
    local name=$1 limit=$2; shift 2
    local s=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    summ "$name: rc=$rc in $((SECONDS - s)) s"
    return $rc
}
summ "gpu_images: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null || echo 'no GPU'), python $($PY -V 2>&1), $(nproc) cores"
BUILD_FLAGS=(--no-build-isolation --no-index)
if [[ ${IMG_LOCAL:-0} == 1 ]]; then  # here: the registry gives the build its tools
    PY="$PROJ/.venv/bin/python"
    CMAKE_ARGS="-DGGML_NATIVE=OFF"
    BUILD_FLAGS=()
else
    CMAKE_ARGS="-DSD_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=OFF"
    run wheels 60 "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$PAY"/whl/*.whl
fi
export CMAKE_ARGS CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)"
sdist=$(ls "$PAY"/stable_diffusion_cpp_python-*.tar.gz | head -1)
rm -rf "$W/wheel" && mkdir -p "$W/wheel"
if run build "${IMG_BUILD_LIMIT:-300}" "$PY" -m pip wheel --no-deps "${BUILD_FLAGS[@]}" -w "$W/wheel" "$sdist"; then
    run install 60 "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" "$W"/wheel/*.whl
else
    tail -40 "$OUT/build.log" | while read -r l; do summ "build: $l"; done
    exit 1
fi
export PYTHONPATH="$SITE:$PROJ"
THREADS=$(( $(nproc) < 8 ? $(nproc) : 8 ))
run model 60 "$PY" -c "import sys; from pathlib import Path; from tests.support.diffusion_models import write_sdxs_model; write_sdxs_model(Path('$W/sdxs.gguf'))"
run speed 60 "$PY" "$PROJ/bench/image_speed.py" --model "$W/sdxs.gguf" --threads "$THREADS" --steps 20 --runs 3 --sides 512 1024
grep -E '^\||^load|^machine|identical|DIFFERENT|thread' "$OUT/speed.log" | while read -r l; do summ "speed: $l"; done
grep -i -E 'cuda|ggml_cuda|backend' "$OUT/speed.log" | head -5 | while read -r l; do summ "speed: $l"; done
run sandboxed 60 "$PY" "$PROJ/bench/gpu_images_sandboxed.py" "$W/sdxs.gguf" --side 512 --steps 20 --threads "$THREADS"
grep -E '^sandboxed|^in process' "$OUT/sandboxed.log" | while read -r l; do summ "$l"; done
tail -5 "$OUT/sandboxed.log" | while read -r l; do summ "sandboxed tail: $l"; done
# the audit's band: the GPU's renders of the band's orders (compared with the CPU's here, after)
run band 120 "$PY" "$PROJ/bench/image_band.py" --write "$OUT/band" --threads "$THREADS"
grep -E 'bytes in|wrote' "$OUT/band.log" | while read -r l; do summ "band: $l"; done
summ "done"
