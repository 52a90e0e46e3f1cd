# Batch-1 speed: trees of 16 and 24 (depth 5), the 16 cut to depth 4 (15 nodes), the chain of 4; host split.
source .carry/jobs/env.sh
spec() { python -c "import json,sys; print(json.dumps({'method': 'eagle3', 'model': 'smollm2-135m-eagle3', 'speculative_token_tree': open(sys.argv[1]).read().strip()}))" $1; }
EVAL="python -m specserve.entrypoints.cli eval-acceptance --model smollm2-135m --prompts .carry/mt_bench.jsonl --max-tokens 128"
for t in 24 15d4; do
  k=5; [ $t = 15d4 ] && k=4
  timeout 100 $EVAL --speculative-config "$(spec .carry/jobs/tree$t.txt)" --temperature 0 --max-num-seqs 1 \
      --num-prompts 32 --k $k --repeats 3 --interleave --json $OUT/b1_tree$t.json 2>&1 \
      | grep -v "Captur\|it/s\|tok/s]\|Loading" | tail -3
done
timeout 100 $EVAL --speculative-config '{"method": "eagle3", "model": "smollm2-135m-eagle3"}' --temperature 0 \
    --max-num-seqs 1 --num-prompts 32 --k 4 --repeats 3 --interleave --json $OUT/b1_chain4.json 2>&1 \
    | grep -v "Captur\|it/s\|tok/s]\|Loading" | tail -3
(cd benchmarks && timeout 100 python host_per_step.py --prompts ../.carry/mt_bench.jsonl --k 4 \
    --tree ../.carry/jobs/tree16.txt --repeats 1 --num-prompts 16 > $OUT/s17_host_split.txt 2>&1; grep "repeat" $OUT/s17_host_split.txt)
