# Eighteenth session, second round: which steps of a batch-1 tree run are whole-step replays, and the host's time
# in the parts of the others.
source .carry/jobs/env.sh
(cd benchmarks && timeout 200 python host_per_step.py --prompts ../.carry/mt_bench.jsonl --k 0 \
    --tree ../.carry/jobs/tree15d4.txt --repeats 2 --num-prompts 16 2>&1 \
    | sed 's/.*\r//' | grep -v "Captur\|it/s\|Loading" > $OUT/s18_host_calls.txt; grep "repeat" $OUT/s18_host_calls.txt | cut -c1-600)
