"""Where one decode step's time goes on the GPU: the target graph's own GPU time beside the whole
engine step, and the host functions that take the rest (cProfile).

    python benchmarks/profile_step.py [--model llama3-8b|smollm2-shape] [--batch 1] [--spec-k 0]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import tempfile
import time
from pathlib import Path

import torch

from specserve.bench.decode import make_prompts, time_engine
from specserve.bench.gpu_timing import gpu_ms
from specserve.bench.models import prepare_model
from specserve.config import EngineConfig
from specserve.engine.engine import LLMEngine
from specserve.worker.cudagraph_mode import CUDAGraphMode

def graph_gpu_ms(engine, batch: int, iters: int = 200) -> float:
    """GPU time of one replay of the target's full decode graph for `batch` requests."""
    graphs = engine.runner.graphs
    desc = graphs.dispatch(batch, batch, 1)
    assert desc.mode is CUDAGraphMode.FULL, desc
    return gpu_ms(graphs.graphs[desc.key].replay, iters, warmup=10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2-shape")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--top", type=int, default=30)
    a = ap.parse_args()
    root = Path(tempfile.mkdtemp())
    model = prepare_model(a.model, root, torch.bfloat16)
    engine = LLMEngine(EngineConfig(model=model.path, load_format=model.load_format, device="cuda", dtype="bfloat16",
                                    max_model_len=1024, max_num_seqs=max(a.batch, 8), enable_prefix_caching=False))
    prompts = make_prompts(a.batch, 32, engine.arch.vocab_size, 0)
    time_engine(engine, prompts, 16)
    t = time_engine(engine, prompts, a.new_tokens)
    step_ms = 1e3 * t.seconds / (t.tokens / a.batch)
    graph_ms = graph_gpu_ms(engine, a.batch)
    print(f"{a.model} batch {a.batch}: engine step {step_ms:.3f} ms ({t.tok_s:.0f} tok/s); "
          f"target graph GPU time {graph_ms:.3f} ms; the rest {step_ms - graph_ms:.3f} ms")
    prof = cProfile.Profile()
    prof.enable()
    start = time.perf_counter()
    time_engine(engine, prompts, a.new_tokens)
    prof.disable()
    print(f"profiled run: {1e3 * (time.perf_counter() - start) / a.new_tokens:.3f} ms/step")
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(a.top)
    print(out.getvalue())


if __name__ == "__main__":
    main()
