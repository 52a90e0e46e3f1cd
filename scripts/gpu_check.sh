#!/usr/bin/env bash
# The GPU suite and the decode benchmark (specserve bench decode) in one go, within 10 minutes:
#
#   scripts/gpu_check.sh [tests|bench|all] [extra `specserve bench decode` flags]
#
# tests: every GPU-marked test (tests/entrypoints needs the server's dependencies, which the GPU image lacks).
# bench: batch 1 and 64 without speculation and EAGLE-3 k=3/k=5 at forced acceptance 0.8 for the
# Llama-3-8B shape and the SmolLM2 shape (random weights: speed does not depend on them), in the
# default graph mode, beside transformers and the bandwidth limit. Logs and tables go to $OUT
# (default ./gpu-out).
set -uo pipefail
what=${1:-all}
shift || true
out=${OUT:-gpu-out}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
status=0
if [[ $what == tests || $what == all ]]; then
    python -m pytest -m gpu -q -p no:cacheprovider tests/gpu tests/attention tests/kernels tests/worker tests/train \
        tests/spec_decode tests/models 2>&1 | tee "$out/gpu_tests.log" | grep -E "passed|failed|error|FAILED|ERROR"
    status=${PIPESTATUS[0]}
fi
if [[ $what == bench || $what == all ]]; then
    python -m specserve.entrypoints.cli bench decode --models llama3-8b,smollm2-shape --modes "" \
        --batch-sizes 1,64 --spec 3:0.8,5:0.8 --spec-batch-sizes 1 --hf-batch-sizes 1,64 --time-budget 330 \
        --json "$out/bench.json" --markdown "$out/bench.md" "$@" 2> "$out/bench.log"
fi
exit "$status"
