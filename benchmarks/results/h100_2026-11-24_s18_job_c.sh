# Eighteenth session, third round: batch-1 speed with the tree graph (tree of 15 and of 24, chain of 4), host split.
source .carry/jobs/env.sh
spec() { python -c "import json,sys; print(json.dumps({'method': 'eagle3', 'model': 'smollm2-135m-eagle3', 'speculative_token_tree': open(sys.argv[1]).read().strip()}))" $1; }
EVAL="python -m specserve.entrypoints.cli eval-acceptance --model smollm2-135m --prompts .carry/mt_bench.jsonl --max-tokens 128"
for t in 15d4 24; do
  k=5; [ $t = 15d4 ] && k=4
  timeout 110 $EVAL --speculative-config "$(spec .carry/jobs/tree$t.txt)" --temperature 0 --max-num-seqs 1 \
      --num-prompts 32 --k $k --repeats 3 --interleave --json $OUT/b1_tree$t.json 2>&1 \
      | grep -v "Captur\|it/s\|tok/s]\|Loading" | tail -2
done
timeout 100 $EVAL --speculative-config '{"method": "eagle3", "model": "smollm2-135m-eagle3"}' --temperature 0 \
    --max-num-seqs 1 --num-prompts 32 --k 4 --repeats 3 --interleave --json $OUT/b1_chain4.json 2>&1 \
    | grep -v "Captur\|it/s\|tok/s]\|Loading" | tail -2
(cd benchmarks && timeout 150 python host_per_step.py --prompts ../.carry/mt_bench.jsonl --k 0 \
    --tree ../.carry/jobs/tree15d4.txt --repeats 2 --num-prompts 16 2>&1 \
    | sed 's/.*\r//' | grep -v "Captur\|it/s\|Loading" > $OUT/s18_host_calls_after.txt; grep "repeat" $OUT/s18_host_calls_after.txt | grep -v calls | cut -c1-400)
