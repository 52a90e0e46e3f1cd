# Nineteenth session, first round: the small-M projections at the tree step's row counts (16: the target's
# verify and the head's prefill; 4: the head's depth passes; 1: the head's top-k at the root).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p /var/tmp/g && cp .carry/g/part0$1 /var/tmp/g/
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u
shift
(cd benchmarks && timeout 500 python bench_step_projections.py --rounds 3 --top 4 "$@" 2>&1 | tee $OUT/s19_projections_$(echo "$@" | tr -c 'a-z0-9\n' '_').txt)
