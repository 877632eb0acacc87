#!/usr/bin/env bash
# Every check that needs a CUDA GPU, in one run, from the repository root:
#   1. the GPU tests (pytest -m gpu): compiled kernels (attention, norms, rotary, store_kv, the
#      LoRA shrink/expand), bf16 included, and CUDA graphs (decode, one sequence's steps whole,
#      piecewise prefill) against the plain path; a step per test file, each with its own JUnit XML
#      (OUT_DIR/tests_paged_decode.xml for tests/kernels/test_paged_decode.py, ...);
#   2. kvswitch bench kernels --sweep (decode bandwidth, prefill against SDPA, store_kv, add_lora
#      (the adapters' shrink and expand: lora_bytes_per_s), and the
#      tile sweep that tells which defaults to keep);
#   3. the worker's time to first token on the GPU, prompt mostly cached against cold, and a
#      profile of each (torch ops and kernels launched, host and device time), without CUDA
#      graphs (ttft_plain.json) and with them (their default on a GPU);
#   4. a local cluster serving a random 1B-class model on the GPU (graphs on), its greedy output
#      checked against the torch references (bf16 and fp32), cold and cached; and bf16 again at
#      4,096-token prompts, so that decode graphs are checked at long contexts;
#   5. the router's overhead (kvswitch bench router), for the figure on a many-core machine;
#   6. the host time of an engine step on the GPU (kvswitch bench step: 256 decodes at 4K), and
#      decode throughput at batch 1, 32 and 256 (kvswitch bench decode), each without
#      (--no-cuda-graphs, *_plain.json) and with graphs.
# Usage: benchmarks/gpu_check.sh [OUT_DIR]      (default out/gpu)
# PYTHON picks the interpreter (default python3); it must hold torch with CUDA, triton and the
# project's dependencies; kvswitch itself is installed (pip install -e . --no-deps, which needs
# setuptools >= 77 there) if it is not yet. Every step runs even if one before it fails;
# the exit status is 1 if any failed. Each step has a time limit (STEP_TIMEOUT_S, default 300 s),
# so one that hangs cannot take the others' time.
set -uo pipefail

out=${1:-out/gpu}
python=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if ! "$python" -c "import kvswitch.router" 2>/dev/null; then
    # The folders install under kvswitch through pyproject.toml's package-dir map, so the project
    # must be installed; editable, so that the checkout's own kvswitch/ does not hide the rest.
    "$python" -m pip install --quiet --no-deps --no-build-isolation -e . || exit 1
fi
unset TRITON_INTERPRET
status=0
step_timeout=${STEP_TIMEOUT_S:-300}

step() {
    local name=$1
    shift
    echo "== $name: $*" >&2
    if ! timeout "$step_timeout" "$@"; then
        echo "== $name FAILED" >&2
        status=1
    fi
}

step gpu nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
step versions "$python" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
# The GPU tests a file at a time, so that one slow compile costs only its own file's results:
# every file of tests/kernels and tests/worker/test_cuda_graphs.py that has gpu-marked tests
# (pytest -m gpu selects nothing in the others, and exits 5 for it).
echo "== tests: the files with GPU tests" >&2
test_files=$(timeout "$step_timeout" "$python" -m pytest -m gpu --collect-only -q -p no:cacheprovider \
    tests/kernels tests/worker/test_cuda_graphs.py | grep -o '^tests/[^:]*\.py' | sort -u)
if [ -z "$test_files" ]; then
    echo "== tests FAILED: no GPU tests collected" >&2
    status=1
fi
for file in $test_files; do
    name=$(basename "$file" .py)
    step "tests-${name#test_}" "$python" -m pytest -m gpu "$file" -q -p no:cacheprovider \
        --junitxml="$out/tests_${name#test_}.xml"
done
step kernels "$python" -m kvswitch bench kernels --sweep --json "$out/kernels.json"
# CUDA graphs are on by default on a GPU; each timing runs without them (_plain) and with them.
for graphs in --no-cuda-graphs ""; do
    name=${graphs:+_plain}
    step "ttft$name" "$python" -m kvswitch bench ttft --model random:llama-1b --device cuda \
        --dtype bfloat16 $graphs --profile --json "$out/ttft$name.json"
done
for dtype in bfloat16 float32; do
    step "serve-$dtype" "$python" -m kvswitch bench serve --model random:llama-1b --device cuda \
        --dtype "$dtype" --json "$out/serve_$dtype.json"
done
# Decode graphs at long contexts: 4,096-token prompts (half shared), 32 tokens decoded from each.
step serve-4k "$python" -m kvswitch bench serve --model random:llama-1b --device cuda \
    --dtype bfloat16 --num-prompt-tokens 4096 --num-shared-tokens 2048 --json "$out/serve_4k.json"
step router "$python" -m kvswitch bench router --json "$out/router.json"
for graphs in --no-cuda-graphs ""; do
    name=${graphs:+_plain}
    step "step$name" "$python" -m kvswitch bench step --model random:llama-1b --device cuda \
        --dtype bfloat16 $graphs --json "$out/step$name.json"
    step "decode$name" "$python" -m kvswitch bench decode --model random:llama-1b --device cuda \
        --dtype bfloat16 --batch-sizes 1,32,256 $graphs --json "$out/decode$name.json"
done
exit $status
