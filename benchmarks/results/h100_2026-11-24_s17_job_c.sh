# After the n-specialisation fix: tree GPU tests, the tree step's kernels, batch-1 speed.
source .carry/jobs/env.sh
timeout 200 python -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_cudagraphs_cuda.py -k "tree" \
    tests/attention/test_tree_attention.py 2>&1 | tee $OUT/s17_tree_gpu_tests.log | tail -6
(cd benchmarks && timeout 150 python host_per_step.py --prompts ../.carry/mt_bench.jsonl --k 4 \
    --tree ../.carry/jobs/tree16.txt --repeats 1 --kernels 4 --num-prompts 16 2>&1 \
    | grep -v "Captur\|it/s\|Loading" > $OUT/s17_profile_after.txt; grep -A24 "k=tree: kernels" $OUT/s17_profile_after.txt | cut -c1-130; grep "repeat" $OUT/s17_profile_after.txt | cut -c1-120)
spec() { python -c "import json,sys; print(json.dumps({'method': 'eagle3', 'model': 'smollm2-135m-eagle3', 'speculative_token_tree': open(sys.argv[1]).read().strip()}))" $1; }
EVAL="python -m specserve.entrypoints.cli eval-acceptance --model smollm2-135m --prompts .carry/mt_bench.jsonl --max-tokens 128"
timeout 100 $EVAL --speculative-config "$(spec .carry/jobs/tree16.txt)" --temperature 0 --max-num-seqs 1 \
    --num-prompts 32 --k 5 --repeats 3 --interleave --json $OUT/b1_tree16.json 2>&1 \
    | grep -v "Captur\|it/s\|tok/s]\|Loading" | tail -6
