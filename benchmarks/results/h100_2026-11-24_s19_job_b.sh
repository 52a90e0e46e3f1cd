# Nineteenth session, second round: batch 1 with the new small-M tiles (tree of 15 in two processes, chain of 4),
# then the tree step's kernels.
source .carry/jobs/env.sh
spec() { python -c "import json,sys; print(json.dumps({'method': 'eagle3', 'model': 'smollm2-135m-eagle3', 'speculative_token_tree': open(sys.argv[1]).read().strip()}))" $1; }
EVAL="python -m specserve.entrypoints.cli eval-acceptance --model smollm2-135m --prompts .carry/mt_bench.jsonl --max-tokens 128"
for run in a b; do
timeout 170 $EVAL --speculative-config "$(spec .carry/jobs/tree15d4.txt)" --temperature 0 --max-num-seqs 1 \
    --num-prompts 32 --k 4 --repeats 3 --interleave --json $OUT/b1_tree15d4_$TAG$run.json 2>&1 \
    | grep -v "Captur\|it/s\|tok/s]\|Loading" | tail -2
done
timeout 120 $EVAL --speculative-config '{"method": "eagle3", "model": "smollm2-135m-eagle3"}' --temperature 0 \
    --max-num-seqs 1 --num-prompts 32 --k 4 --repeats 3 --interleave --json $OUT/b1_chain4_$TAG.json 2>&1 \
    | grep -v "Captur\|it/s\|tok/s]\|Loading" | tail -2
[ -n "$PROFILE" ] && (cd benchmarks && timeout 150 python host_per_step.py --prompts ../.carry/mt_bench.jsonl --k 0 \
    --tree ../.carry/jobs/tree15d4.txt --repeats 1 --kernels 4 --num-prompts 16 2>&1 \
    | sed 's/.*\r//' | grep -v "Captur\|it/s\|Loading" > $OUT/profile_$TAG.txt; grep -A30 "kernels per engine step" $OUT/profile_$TAG.txt | cut -c1-130; grep "repeat" $OUT/profile_$TAG.txt | cut -c1-200)
true
