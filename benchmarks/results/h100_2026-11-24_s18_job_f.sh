# Eighteenth session, sixth round: batch 1 with cached prompts' tails as full graphs (tree of 15, chain of 4).
source .carry/jobs/env.sh
spec() { python -c "import json,sys; print(json.dumps({'method': 'eagle3', 'model': 'smollm2-135m-eagle3', 'speculative_token_tree': open(sys.argv[1]).read().strip()}))" $1; }
EVAL="python -m specserve.entrypoints.cli eval-acceptance --model smollm2-135m --prompts .carry/mt_bench.jsonl --max-tokens 128"
timeout 170 $EVAL --speculative-config "$(spec .carry/jobs/tree15d4.txt)" --temperature 0 --max-num-seqs 1 \
    --num-prompts 32 --k 4 --repeats 3 --interleave --json $OUT/b1_tree15d4_tails.json 2>&1 \
    | grep -v "Captur\|it/s\|tok/s]\|Loading" | tail -2
timeout 120 $EVAL --speculative-config '{"method": "eagle3", "model": "smollm2-135m-eagle3"}' --temperature 0 \
    --max-num-seqs 1 --num-prompts 32 --k 4 --repeats 3 --interleave --json $OUT/b1_chain4_tails.json 2>&1 \
    | grep -v "Captur\|it/s\|tok/s]\|Loading" | tail -2
