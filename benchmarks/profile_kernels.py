"""Which kernels a decode step runs and how long each takes: the target's full decode graph under the
torch profiler (kernels inside the replay), the GPU's idle time between engine steps, where the host's
time per step goes (a host-bound step waits little for the GPU), and cuBLAS GEMM efficiency at the
model's decode shapes against the measured bandwidth.

    python benchmarks/profile_kernels.py [--models llama3-8b smollm2-shape] [--batch 1] [--host-profile N]
                                         [--spec K:P [--head HEAD]]

With --spec the engine speculates with a random EAGLE-3 head (k drafts, forced acceptance p, as
`specserve bench decode --spec` runs it), and the replayed graph is the target's verification graph.
--head profiles that head instead (a directory or shipped name, e.g. smollm2-135m-eagle3 on
smollm2-shape): a trained head's draft vocabulary and MLP width set its drafting cost.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from specserve.bench.decode_plan import SpecSetting
from specserve.bench.timing import make_prompts, measure_bandwidth, time_engine
from specserve.bench.gpu_timing import gpu_ms
from specserve.bench.models import SHAPES, prepare_model, write_random_eagle3_head
from specserve.config import EngineConfig
from specserve.engine.engine import LLMEngine
from specserve.sampling_params import SamplingParams
from specserve.worker.cudagraph_mode import CUDAGraphMode

def kernel_table(prof, per: int, top: int) -> str:
    """Kernels aggregated by name: calls and microseconds per `per` (replays or steps)."""
    totals, counts = defaultdict(float), defaultdict(int)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            totals[e.name] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            counts[e.name] += 1
    rows = sorted(totals.items(), key=lambda kv: -kv[1])
    total = sum(totals.values()) / per
    lines = [f"  kernel time per unit: {total:.1f} us over {sum(counts.values()) / per:.0f} kernels"]
    for name, t in rows[:top]:
        lines.append(f"  {t / per:9.1f} us  {counts[name] / per:6.1f}x  {t / counts[name]:7.2f} us/call  {name[:90]}")
    return "\n".join(lines)


def idle_table(prof, per: int, top: int, longest_us: float = 100.0) -> str:
    """The GPU's idle time between consecutive kernels, per `per`, summed by the pair of kernels around each gap.
    Gaps longer than longest_us are left out: there the GPU waits for the host, not for the next launch."""
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    totals, counts = defaultdict(float), defaultdict(int)
    for before, after in zip(kernels, kernels[1:]):
        gap = after.time_range.start - before.time_range.end
        if 0 < gap <= longest_us:
            pair = f"{before.name[:45]} -> {after.name[:45]}"
            totals[pair] += gap
            counts[pair] += 1
    lines = [f"  idle between kernels per unit: {sum(totals.values()) / per:.1f} us over "
             f"{sum(counts.values()) / per:.0f} gaps of <= {longest_us:.0f} us"]
    for pair, t in sorted(totals.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"  {t / per:9.1f} us  {counts[pair] / per:6.1f}x  {t / counts[pair]:7.2f} us/gap  {pair}")
    return "\n".join(lines)


def profile_model(name: str, batch: int, top: int, host_profile: int, spec: SpecSetting | None = None,
                  head: str | None = None) -> None:
    root = Path(tempfile.mkdtemp())
    model = prepare_model(name, root, torch.bfloat16)
    # Requests long enough that no measured step finds them finished, whatever a step emits.
    tokens_per_step = 1 + (spec.k if spec else 0)
    speculative = None
    if spec is not None:
        head = head or write_random_eagle3_head(root / "head", model.hf_config, torch.bfloat16, "cuda")
        speculative = spec.speculative_config(head)
    engine = LLMEngine(EngineConfig(model=model.path, load_format=model.load_format, device="cuda", dtype="bfloat16",
                                    max_model_len=1024 * tokens_per_step, max_num_seqs=8, enable_prefix_caching=False,
                                    cudagraph_capture_sizes=[1, 2, 4, 8], speculative_config=speculative))
    prompts = make_prompts(batch, 64, engine.core.arch.vocab_size, 0)
    t = time_engine(engine, prompts, 64)
    label = f" {spec.label}" if spec else ""
    per_step = t.accept_len or 1.0
    print(f"\n=== {name}{label} batch {batch}: engine {1e3 * batch * per_step / t.tok_s:.3f} ms/step "
          f"({t.tok_s:.0f} tok/s, {per_step:.2f} tokens/step)")
    # Before the torch profiler: once it had run, this split read 1.16 ms a step where the engine's own timing
    # had read 0.83 before it (SmolLM2, H100).
    host_split(engine, prompts, host_profile, tokens_per_step)
    graphs = engine.runner.graphs
    q = tokens_per_step  # query tokens per request of the target's graph
    desc = graphs.dispatch(batch * q, batch, q)
    assert desc.mode is CUDAGraphMode.FULL, desc
    graph = graphs.graphs[desc.key]
    print(f"target full graph replay (query length {q}): {gpu_ms(graph.replay, 100):.3f} ms (events, back to back)")
    n = 10
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            graph.replay()
        torch.cuda.synchronize()
    print("kernels of one replay:")
    print(kernel_table(prof, n, top))
    # Engine steps: GPU busy time against wall time per step.
    params = SamplingParams(temperature=0.0, max_tokens=40 * tokens_per_step, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    for _ in range(8):
        engine.step()
    steps = 20
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        wall = gpu_ms(engine.step, steps, warmup=0)
    print(f"engine steps: {wall:.3f} ms per step (events); kernels per step:")
    print(kernel_table(prof, steps, top))
    while engine.has_unfinished_requests():
        engine.step()
    del engine
    torch.cuda.empty_cache()


def wrap_timed(owner, attr: str, name: str, spent: dict, calls: dict | None = None) -> None:
    """Replace owner.attr by a wrapper adding each call's host time to spent[name] (and one to calls[name]);
    `del owner.attr` restores an instance's method. A wrapper costs about 1 us a call."""
    fn = getattr(owner, attr)

    def run(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[name] += time.perf_counter() - start
            if calls is not None:
                calls[name] += 1
    setattr(owner, attr, run)


def launch_parts(runner) -> list[tuple[object, str]]:
    """The parts of runner.launch worth timing: (owner, method name)."""
    parts = [(runner, "_choose_path"), (runner, "_run_target"), (runner, "_verify"), (runner, "_sample"),
             (runner, "_propose"), (runner.buffers, "prepare"), (runner.buffers, "spread"),
             (runner.outputs, "copy_to_host")]
    if runner.whole_step_graphs is not None:
        parts.append((runner.whole_step_graphs, "run"))
    if runner.speculator is not None:
        parts.append((runner.speculator, "propose"))
    return parts


def host_split(engine: LLMEngine, prompts: list[list[int]], host_profile: int, tokens_per_step: int = 1,
               steps: int = 200) -> None:
    """Wall time per engine step, split into enqueueing the step on the device (runner.launch), reading a
    finished step's results (runner.resolve, which waits for the GPU) and the rest of the host's work
    (scheduling, outputs, detokenization); then, with host_profile > 0, the host functions that take
    the most time under cProfile (which slows Python, so compare the shares, not the times)."""
    runner, spent = engine.runner, defaultdict(float)
    wrap_timed(runner, "launch", "launch", spent)
    wrap_timed(runner, "resolve", "resolve (waits)", spent)
    # Parts of launch, timed on their own (nested, so they do not add up): one that takes far longer than
    # the work it enqueues is waiting for the GPU.
    inner = launch_parts(runner)
    for owner, attr in inner:
        wrap_timed(owner, attr, f"{type(owner).__name__}.{attr}", spent)
    params = SamplingParams(temperature=0.0, max_tokens=(2 * steps + 20) * tokens_per_step, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    for _ in range(10):
        engine.step()
    spent.clear()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = time.perf_counter() - start
    outer = {name: t for name, t in spent.items() if name in ("launch", "resolve (waits)")}
    parts = ", ".join(f"{name} {1e3 * t / steps:.3f}" for name, t in outer.items())
    print(f"host per engine step: wall {1e3 * wall / steps:.3f} ms = {parts}, "
          f"rest {1e3 * (wall - sum(outer.values())) / steps:.3f} ms")
    print("  inside launch: " + ", ".join(f"{name} {1e3 * t / steps:.3f}" for name, t in spent.items()
                                          if name not in outer))
    del runner.launch, runner.resolve
    for owner, attr in inner:
        delattr(owner, attr)
    if host_profile:
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(steps):
            engine.step()
        profiler.disable()
        print(f"host functions over {steps} engine steps under cProfile:")
        stats = pstats.Stats(profiler)
        stats.sort_stats("tottime").print_stats(host_profile)
        stats.sort_stats("cumulative").print_stats(host_profile)
    while engine.has_unfinished_requests():
        engine.step()


def gemm_table(shapes: dict[str, tuple[int, int]], ms: list[int], bandwidth: float) -> None:
    """cuBLAS (F.linear) for x[M, K] @ W[N, K]^T, weights rotated past the L2 cache."""
    print(f"\n=== cuBLAS GEMM at decode shapes (bandwidth {bandwidth / 1e12:.2f} TB/s)")
    print(f"  {'shape':28s} {'M':>4s} {'us':>8s} {'TB/s':>6s} {'floor us':>8s}")
    for label, (k, n) in shapes.items():
        nbytes = k * n * 2
        copies = max(1, -(-(256 << 20) // nbytes))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            reps = max(copies, 8)
            graph = torch.cuda.CUDAGraph()
            F.linear(x, weights[0])
            torch.cuda.synchronize()
            with torch.cuda.graph(graph):
                for i in range(reps):
                    F.linear(x, weights[i % copies])
            t_us = gpu_ms(graph.replay, 20) * 1e3 / reps
            print(f"  {label:28s} {m:4d} {t_us:8.2f} {nbytes / t_us / 1e6:6.2f} {nbytes / bandwidth * 1e6:8.2f}")
        del weights


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--models", nargs="+", default=["llama3-8b", "smollm2-shape"])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--host-profile", type=int, default=0, metavar="N",
                    help="print the N host functions with the most own time over engine steps (cProfile)")
    ap.add_argument("--spec", type=SpecSetting.parse, default=None, metavar="K:P",
                    help="speculate with a random EAGLE-3 head: K drafts, forced acceptance P")
    ap.add_argument("--head", help="with --spec: this EAGLE-3 head (directory or shipped name) instead of a random one")
    a = ap.parse_args()
    if a.head and not a.spec:
        ap.error("--head needs --spec K:P (the head only runs when the engine speculates)")
    bandwidth = measure_bandwidth("cuda")
    for name in a.models:
        profile_model(name, a.batch, a.top, a.host_profile, a.spec, a.head)
    shapes = {}
    for name in a.models:
        s = SHAPES[name]
        h, i = s["hidden_size"], s["intermediate_size"]
        kv = s["num_key_value_heads"] * h // s["num_attention_heads"]
        shapes |= {f"{name} qkv {h}x{h + 2 * kv}": (h, h + 2 * kv), f"{name} o {h}x{h}": (h, h),
                   f"{name} gate_up {h}x{2 * i}": (h, 2 * i), f"{name} down {i}x{h}": (i, h),
                   f"{name} lm_head {h}x{s['vocab_size']}": (h, s["vocab_size"])}
    gemm_table(shapes, [1, 4, 8], bandwidth)


if __name__ == "__main__":
    main()
