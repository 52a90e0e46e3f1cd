# Trees of drafts on the H100: their GPU tests, acceptance on MT-bench, batch-1 speed beside the chain.
source .carry/jobs/env.sh
python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
spec() { python -c "import json,sys; print(json.dumps({'method': 'eagle3', 'model': 'smollm2-135m-eagle3', 'speculative_token_tree': open(sys.argv[1]).read().strip()}))" $1; }
EVAL="python -m specserve.entrypoints.cli eval-acceptance --model smollm2-135m --prompts .carry/mt_bench.jsonl --max-tokens 128"
timeout 170 python -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_cudagraphs_cuda.py -k tree \
    tests/attention/test_tree_attention.py 2>&1 | tee $OUT/tree_gpu_tests.log | tail -4
for t in 16 24; do
  timeout 100 $EVAL --speculative-config "$(spec .carry/jobs/tree$t.txt)" --temperature 0 1 --k 5 --max-num-seqs 128 \
      --no-baseline --json $OUT/tree${t}_mtbench.json 2>&1 | grep -v "Captur\|it/s\|tok/s]\|Loading" | tail -8
  timeout 90 $EVAL --speculative-config "$(spec .carry/jobs/tree$t.txt)" --temperature 0 --max-num-seqs 1 \
      --num-prompts 32 --k 5 --repeats 3 --interleave --json $OUT/b1_tree$t.json 2>&1 \
      | grep -v "Captur\|it/s\|tok/s]\|Loading" | tail -6
done
timeout 100 $EVAL --speculative-config '{"method": "eagle3", "model": "smollm2-135m-eagle3"}' --temperature 0 \
    --max-num-seqs 1 --num-prompts 32 --k 4 --repeats 3 --interleave --json $OUT/b1_chain4.json 2>&1 \
    | grep -v "Captur\|it/s\|tok/s]\|Loading" | tail -6
