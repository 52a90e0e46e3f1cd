"""`specserve bench offline`: the engine's own throughput on a prompt set, with no server in the way.

The same prompts, chat template, token budget and batch limit as a `specserve bench serve` run give
the figure a server's throughput is measured against (the server's overhead is the difference).
"""
from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class OfflineResult:
    num_requests: int
    output_tokens: int
    duration_s: float
    mean_acceptance_length: float | None

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.duration_s


def run_offline(llm, prompts: list[str], chat: bool, max_tokens: int, temperature: float,
                ignore_eos: bool) -> OfflineResult:
    from specserve.sampling_params import SamplingParams

    inputs = [llm.apply_chat_template([{"role": "user", "content": p}]) if chat else p for p in prompts]
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=ignore_eos)
    # One pass first, so compilation and first-use costs stay out of the timed one.
    llm.generate(inputs[:8], SamplingParams(temperature=temperature, max_tokens=8), use_tqdm=False)
    spec_before = llm.engine.spec_stats.num_steps, llm.engine.spec_stats.num_emitted
    start = time.perf_counter()
    outs = llm.generate(inputs, params, use_tqdm=False)
    duration = time.perf_counter() - start
    steps = llm.engine.spec_stats.num_steps - spec_before[0]
    emitted = llm.engine.spec_stats.num_emitted - spec_before[1]
    return OfflineResult(len(outs), sum(len(o.outputs[0].token_ids) for o in outs), duration,
                         emitted / steps if steps else None)


def print_offline_report(r: OfflineResult) -> None:
    width = 50
    print(" Offline Benchmark Result ".center(width, "="))
    for label, value in (("Requests:", r.num_requests), ("Total generated tokens:", r.output_tokens),
                         ("Benchmark duration (s):", f"{r.duration_s:.2f}"),
                         ("Output token throughput (tok/s):", f"{r.output_throughput:.2f}"),
                         ("Mean acceptance length:", "-" if r.mean_acceptance_length is None
                          else f"{r.mean_acceptance_length:.2f}")):
        print(f"{label:<38}{value:>12}")
    print("=" * width)
