# Eighteenth session, first round: the tree step's kernels and idle time, batch-1 speed (tree of 15, chain of 4),
# the small-M projections at the tree step's row counts.
source .carry/jobs/env.sh
(cd benchmarks && timeout 170 python host_per_step.py --prompts ../.carry/mt_bench.jsonl --k 0 \
    --tree ../.carry/jobs/tree15d4.txt --repeats 1 --kernels 4 --num-prompts 16 2>&1 \
    | sed 's/.*\r//' | grep -v "Captur\|it/s\|Loading" > $OUT/s18_profile.txt; grep -A22 "kernels per engine step" $OUT/s18_profile.txt | cut -c1-140; grep -A14 "idle between" $OUT/s18_profile.txt | cut -c1-140; grep "repeat" $OUT/s18_profile.txt | cut -c1-200)
spec() { python -c "import json,sys; print(json.dumps({'method': 'eagle3', 'model': 'smollm2-135m-eagle3', 'speculative_token_tree': open(sys.argv[1]).read().strip()}))" $1; }
EVAL="python -m specserve.entrypoints.cli eval-acceptance --model smollm2-135m --prompts .carry/mt_bench.jsonl --max-tokens 128"
timeout 110 $EVAL --speculative-config "$(spec .carry/jobs/tree15d4.txt)" --temperature 0 --max-num-seqs 1 \
    --num-prompts 32 --k 4 --repeats 3 --interleave --json $OUT/b1_tree15d4.json 2>&1 \
    | grep -v "Captur\|it/s\|tok/s]\|Loading" | tail -3
timeout 100 $EVAL --speculative-config '{"method": "eagle3", "model": "smollm2-135m-eagle3"}' --temperature 0 \
    --max-num-seqs 1 --num-prompts 32 --k 4 --repeats 3 --interleave --json $OUT/b1_chain4.json 2>&1 \
    | grep -v "Captur\|it/s\|tok/s]\|Loading" | tail -3
(cd benchmarks && timeout 120 python bench_step_projections.py --tokens 4 16 --rounds 3 --top 3 > $OUT/s18_projections.txt 2>&1; tail -40 $OUT/s18_projections.txt)
