"""Where one decode step's time goes: the engine step's wall time beside the GPU's busy time in it, the
eager launches the host makes (outside graph replays), and the host functions that take the time.

    python benchmarks/profile_step.py [--model llama3-8b|smollm2-shape] [--batch 1] [--spec K:P] \
        [--tensor-parallel-size N [--all-reduce nccl|one_shot]] [--quantization fp8]

--spec K:P adds a random EAGLE-3 head drafting K tokens, each accepted with probability P. Under tensor
parallelism the profile is rank 0's (its host and its GPU): an all-reduce kernel that lasts far longer than
its time alone (benchmarks/allreduce_latency.py) waits there for a later rank.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from specserve.bench.decode_plan import SpecSetting
from specserve.bench.timing import make_prompts, time_engine
from specserve.bench.models import prepare_model, write_random_eagle3_head
from specserve.config import EngineConfig
from specserve.engine.engine import LLMEngine
from specserve.sampling_params import SamplingParams


def build_engine(name: str, batch: int, spec: SpecSetting | None, tp: int, all_reduce: str | None,
                 quantization: str | None) -> LLMEngine:
    root = Path(tempfile.mkdtemp())
    model = prepare_model(name, root, torch.bfloat16)
    speculative = None
    if spec is not None:
        head = write_random_eagle3_head(root / "head", model.hf_config, torch.bfloat16, "cuda")
        speculative = {"method": "eagle3", "model": str(head), "num_speculative_tokens": spec.k,
                       "forced_acceptance_prob": spec.p}
    return LLMEngine(EngineConfig(model=model.path, load_format=model.load_format, device="cuda", dtype="bfloat16",
                                  max_model_len=1024, max_num_seqs=max(batch, 8), enable_prefix_caching=False,
                                  speculative_config=speculative, tensor_parallel_size=tp, all_reduce=all_reduce,
                                  quantization=quantization))


def profile_steps(engine: LLMEngine, prompts: list[list[int]], steps: int, top: int) -> None:
    """Steady-state steps under the torch profiler: GPU busy time and host launches per step."""
    params = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    for _ in range(8):
        engine.step()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / steps
    for rid in ids:
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    busy, kernels, kernel_us, runtime = 0.0, Counter(), Counter(), Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            busy += e.device_time_total
            kernels[e.name] += 1
            kernel_us[e.name] += e.device_time_total
        elif e.name.startswith(("cuda", "cu")):
            runtime[e.name] += 1
    print(f"profiled steps: {1e3 * wall:.3f} ms wall per step; GPU busy {busy / steps / 1e3:.3f} ms per step; "
          f"{sum(kernels.values()) / steps:.0f} kernels per step")
    print("GPU time per step by kernel (top): " + ", ".join(
        f"{n[:60]} {us / steps:.1f} us ({kernels[n] / steps:.0f} x {us / kernels[n]:.1f})"
        for n, us in kernel_us.most_common(top)))
    print("host runtime calls per step: " + ", ".join(f"{n} {c / steps:.1f}" for n, c in runtime.most_common(8)))
    ops = Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("aten::"):
            ops[e.name] += 1
    print("aten ops per step (top): " + ", ".join(f"{n[6:]} {c / steps:.1f}" for n, c in ops.most_common(top)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2-shape")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--spec", type=SpecSetting.parse, default=None, help="K:P, e.g. 3:0.8")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--all-reduce", choices=["nccl", "one_shot"], help="default: the engine's choice")
    ap.add_argument("--quantization", choices=["fp8"], help="FP8 weights for the target (default: bfloat16)")
    a = ap.parse_args()
    engine = build_engine(a.model, a.batch, a.spec, a.tensor_parallel_size, a.all_reduce, a.quantization)
    try:
        profile_run(engine, a)
    finally:
        engine.core.close()  # stops the other tensor-parallel ranks, which would keep the process alive


def profile_run(engine, a: argparse.Namespace) -> None:
    """Times the engine, then profiles 50 steps under the torch profiler and a run under cProfile."""
    prompts = make_prompts(a.batch, 32, engine.core.arch.vocab_size, 0)
    time_engine(engine, prompts, 16)
    t = time_engine(engine, prompts, a.new_tokens)
    steps = (t.tokens / a.batch) / (t.accept_len or 1.0)
    print(f"{a.model} batch {a.batch} spec {a.spec.label if a.spec else 'none'}: {t.tok_s:.0f} tok/s, "
          f"{1e3 * t.seconds / steps:.3f} ms per engine step" + (f", {t.accept_len:.2f} tokens/step" if t.accept_len else ""))
    profile_steps(engine, prompts, 50, a.top)
    prof = cProfile.Profile()
    prof.enable()
    start = time.perf_counter()
    time_engine(engine, prompts, a.new_tokens)
    prof.disable()
    print(f"cProfiled run: {time.perf_counter() - start:.3f} s")
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(a.top)
    print(out.getvalue())


if __name__ == "__main__":
    main()
