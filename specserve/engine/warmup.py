"""The start-up warm-up: the requests of warmup_plan.py, driven through the engine core's own step, then forgotten.

Triton compiles each kernel variant at its first launch, which would hold up the
first requests of a fresh server until their shapes had compiled. Running real requests through EngineCore.step hits
exactly the shapes the scheduler makes, graphs and eager steps, target and
drafter alike. Afterwards nothing of them remains that a later request could
see: the runner forgets every request and restores its generator
(ModelRunner.scratch_steps), the KV caches are zeroed and the prefix cache
emptied, and the engine's counters (prompt and generated tokens, acceptance
statistics) are as before, and the speculation policy starts afresh
(spec_decode/policy.py), so a seeded run gives the same output with and
without the warm-up. The step-time measurement of dynamic speculation
(step_costs_measure.py) runs its requests the same way (scratch_requests).
"""
from __future__ import annotations

import logging
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager

from tqdm import tqdm

from specserve.engine.messages import CoreRequest
from specserve.engine.warmup_plan import EngineShapes, Scenario, WarmupRequest, plan
from specserve.sampling_params import RequestOutputKind, SamplingParams
from specserve.spec_decode.metrics import SpecDecodeStats

logger = logging.getLogger(__name__)


def engine_shapes(engine) -> EngineShapes:
    """What decides the compiled variants of engine (warmup_plan.EngineShapes)."""
    cfg, runner = engine.config, engine.runner
    models = [runner.model] + (runner.speculator.models() if hasattr(runner.speculator, "models") else [])
    attention_shapes = sorted({(m.num_heads, m.num_kv_heads, m.head_dim) for model in models
                               for m in model.modules() if hasattr(m, "backend") and hasattr(m, "num_kv_heads")})
    backend, on_cpu = engine.attention_backend, runner.device.type == "cpu"

    def attention(num_reqs: int, max_query_len: int) -> tuple:
        return tuple(backend.launch_variant(num_reqs, max_query_len, *shape, on_cpu) for shape in attention_shapes)

    return EngineShapes(runner.dispatch, attention, cfg.max_num_batched_tokens, cfg.max_num_seqs, cfg.max_model_len,
                        cfg.block_size, runner.outputs.num_drafts, cfg.enable_chunked_prefill)


@contextmanager
def scratch_requests(engine, what: str) -> Iterator[RandomPrompts]:
    """Requests run inside (from the prompts it yields) leave nothing behind that a later request could see or
    that the engine reports (module docstring); the engine must have no request. what: the reason, for errors."""
    if engine.has_unfinished_requests():
        raise RuntimeError(f"{what} runs before any request: the engine has unfinished requests")
    scheduler, runner = engine.scheduler, engine.runner
    counters = (engine.num_prompt_tokens, engine.num_cached_prompt_tokens, engine.num_generated_tokens,
                scheduler.spec_stats)
    scheduler.spec_stats = SpecDecodeStats()
    with runner.scratch_steps():
        yield RandomPrompts(engine.arch.vocab_size)
        scheduler.drain_finished()
    (engine.num_prompt_tokens, engine.num_cached_prompt_tokens, engine.num_generated_tokens,
     scheduler.spec_stats) = counters
    if scheduler.policy is not None:
        scheduler.policy.reset()
    engine.kv.reset_prefix_cache()
    runner.kv.clear()


def warm_up(engine) -> None:
    """Run the warm-up's scenarios through engine (module docstring); the engine must have no request."""
    scenarios = plan(engine_shapes(engine))
    start, steps = time.perf_counter(), 0
    with scratch_requests(engine, "the warm-up") as prompts:
        for scenario in tqdm(scenarios, desc="Warming up", unit="scenario", leave=False):
            steps += _run(engine, scenario, prompts)
    logger.info("Warm-up: %d scenarios, %d requests in %d steps, %.1f s", len(scenarios), prompts.count, steps,
                time.perf_counter() - start)


def _run(engine, scenario: Scenario, prompts: RandomPrompts) -> int:
    """Run one scenario to completion; returns its steps."""
    for i, req in enumerate(scenario.first):
        engine.add_request(CoreRequest(prompts.next_id(), prompts.make(req), _params(req, i)))
    steps = 0
    if scenario.later:
        engine.step()
        steps += 1
        for i, req in enumerate(scenario.later, start=len(scenario.first)):
            engine.add_request(CoreRequest(prompts.next_id(), prompts.make(req), _params(req, i)))
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return steps


def _params(req: WarmupRequest, i: int) -> SamplingParams:
    """Greedy, or sampling with every filter and logprobs; every third sampled request with penalties (its tokens
    read on the host, no drafts), every fourth with its own seed."""
    common = dict(max_tokens=req.max_tokens, ignore_eos=True, detokenize=False,
                  output_kind=RequestOutputKind.FINAL_ONLY)
    if not req.sampled:
        return SamplingParams(temperature=0.0, **common)
    return SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, logprobs=2,
                          presence_penalty=0.5 if i % 3 == 2 else 0.0, seed=i if i % 4 == 3 else None, **common)


class RandomPrompts:
    """Random prompts from a generator of the warm-up's own (the engine's generators are not drawn from): they hit
    the prefix cache only through the shared prefix a request asks for (a hit takes a whole block alike)."""

    def __init__(self, vocab_size: int):
        self.rng = random.Random(0)
        self.vocab_size = vocab_size
        self.prefix: list[int] = []
        self.count = 0

    def next_id(self) -> str:
        self.count += 1
        return f"warmup-{self.count}"

    def make(self, req: WarmupRequest) -> list[int]:
        while len(self.prefix) < req.cached_prefix:
            self.prefix.append(self.rng.randrange(self.vocab_size))
        fresh = [self.rng.randrange(self.vocab_size) for _ in range(req.prompt_len - req.cached_prefix)]
        return self.prefix[:req.cached_prefix] + fresh
