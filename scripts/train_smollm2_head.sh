#!/usr/bin/env bash
# Train the EAGLE-3 head for SmolLM2-135M-Instruct on one GPU, then measure its acceptance.
#
#   scripts/train_smollm2_head.sh HEAD_DIR EVAL_PROMPTS.jsonl|SUITE_DIR [more train-eagle flags]
#
# A SUITE_DIR (benchmarks/acceptance_suite) is evaluated per category with chains of 5; a prompt file with k = 1..6.
#
# Training prompts are written by the target itself from built-in topics (never the evaluation set).
# The shipped head (specserve/heads/smollm2_135m_eagle3) is five such runs, each continuing the last
# (BENCHMARKS.md, 'The shipped head'). The first three trained on two data sets joined, about 18 minutes on
# an H100: data-only runs (--data-only) on
#   A: --prompts human.jsonl --sampled-fraction 1.0 --data-seconds 170 (scripts/build_prompt_set.py:
#      8,240 prompts people wrote, from PyPI packages; each answered greedily and sampled)
#   B: --num-prompts 24000 --word-topic-fraction 0.6 --seed 1 --data-seconds 348 (prompts the target
#      wrote, and templated ones)
# each with --max-num-seqs 512 --kv-cache-memory 16GiB, then training on both (--data-from A.work B.work)
# with --draft-vocab-size 12288 --train-seconds 524. The
# next two runs used new seeds for A and B (3 and 2, then 5 and 4; A's budget 230 s in the last) and
# trained with --init-from smollm2-135m-eagle3 --lr 5e-4 --train-seconds 548, the head then shipped.
# The last two ran three data-only jobs at once on the one GPU, for 517 s: A as above
# (seeds 7, then 9 over 9,111 prompts), and two B-like jobs (--num-prompts 28000, seeds 6/10 and 8/11, the
# second with --templated-fraction 0.8), each --kv-cache-memory 14GiB (then 10GiB); then trained on all three
# with --init-from smollm2-135m-eagle3 --lr 5e-4 --train-seconds 505, the second also with
# --head-intermediate-size 6144: the head shipped now. All five trained against the data's tokens
# (--no-soft-labels).
# With the default budgets the training part takes about 7 minutes on an H100 (data <= 240 s,
# training <= 150 s, plus model loads); the evaluation runs 7 engines (no speculation, k = 1..6) at
# temperatures 0 and 1 over the evaluation prompts, a few minutes more. To split the two over
# separate commands, keep HEAD_DIR inside the repository and run once with SKIP_EVAL=1, then with
# SKIP_TRAIN=1.
#
# Beside HEAD_DIR (never inside it, so the head stays small enough to ship) it writes
# HEAD_DIR.train.log, HEAD_DIR.eval.log and HEAD_DIR.acceptance.json, and prints a summary of
# both at the end. Environment: WORK_DIR (data and checkpoints, default
# /tmp/smollm2-eagle3.work), EVAL_MAX_TOKENS (default 128), DEVICE (default cuda).
set -euo pipefail

if [[ $# -lt 2 ]]; then
    echo "usage: $0 HEAD_DIR EVAL_PROMPTS.jsonl|SUITE_DIR [train-eagle flags]" >&2
    exit 2
fi
head_dir=${1%/}
eval_prompts=$2
shift 2
work_dir=${WORK_DIR:-/tmp/smollm2-eagle3.work}
device=${DEVICE:-cuda}
mkdir -p "$(dirname "$head_dir")"

started=$SECONDS
if [[ -z ${SKIP_TRAIN:-} ]]; then
    python -m specserve.entrypoints.cli train-eagle --target smollm2-135m --out "$head_dir" \
        --work-dir "$work_dir" --device "$device" --no-progress "$@" 2>&1 | tee "$head_dir.train.log"
    echo "=== train-eagle: $((SECONDS - started)) s"
fi
if [[ -z ${SKIP_EVAL:-} ]]; then
    # A directory is a suite (benchmarks/acceptance_suite): acceptance per category with chains of 5.
    if [[ -d $eval_prompts ]]; then eval_set="--suite $eval_prompts --k 5"; else eval_set="--prompts $eval_prompts --k 1 2 3 4 5 6"; fi
    eval_started=$SECONDS
    python -m specserve.entrypoints.cli eval-acceptance --model smollm2-135m --device "$device" \
        --speculative-config "{\"method\": \"eagle3\", \"model\": \"$head_dir\"}" \
        $eval_set --temperature 0 1 \
        --max-tokens "${EVAL_MAX_TOKENS:-128}" --max-num-seqs 128 --json "$head_dir.acceptance.json" \
        2>&1 | tee "$head_dir.eval.log"
    echo "=== eval-acceptance: $((SECONDS - eval_started)) s"
fi

echo "=================== summary ==================="
if [[ -f $head_dir.train.log ]]; then
    # Progress bars end their lines with carriage returns.
    tr '\r' '\n' < "$head_dir.train.log" \
        | grep -E '^(===|data:|draft vocabulary|held-out|time per phase|epoch)|WARNING|steps fit in' || true
fi
if [[ -f $head_dir.eval.log ]]; then
    tr '\r' '\n' < "$head_dir.eval.log" | sed -n '/^ temp /,$p'
fi
echo "=== total: $((SECONDS - started)) s"
