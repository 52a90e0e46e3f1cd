# Eighteenth session, fifth round: the tree of 15 in two more processes, the tree of 16 (depth 5) between them.
source .carry/jobs/env.sh
spec() { python -c "import json,sys; print(json.dumps({'method': 'eagle3', 'model': 'smollm2-135m-eagle3', 'speculative_token_tree': open(sys.argv[1]).read().strip()}))" $1; }
EVAL="python -m specserve.entrypoints.cli eval-acceptance --model smollm2-135m --prompts .carry/mt_bench.jsonl --max-tokens 128"
for t in 15d4 16 15d4; do
  k=5; [ $t = 15d4 ] && k=4
  timeout 170 $EVAL --speculative-config "$(spec .carry/jobs/tree$t.txt)" --temperature 0 --max-num-seqs 1 \
      --num-prompts 32 --k $k --repeats 3 --interleave --json $OUT/b1_tree${t}_$RANDOM.json 2>&1 \
      | grep -v "Captur\|it/s\|tok/s]\|Loading" | tail -2
done
