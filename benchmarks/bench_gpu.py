"""GPU benchmark: `specserve bench decode` (specserve/bench/decode.py) as a script.

    python benchmarks/bench_gpu.py [--preset full] [--json results.json] [--markdown results.md] [...]
    python benchmarks/bench_gpu.py --preset tiny --device cpu      # seconds, on a CPU
"""
import sys

from specserve.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "decode", *sys.argv[1:]]))
