"""The step times of dynamic speculation (spec_decode/step_costs.py), measured at start-up through the engine core's
own step, so each time is a whole step's as requests see it: the host's work, the graphs it replays (a step
without drafts runs the plain decode graphs) and, with asynchronous scheduling, the overlap of the two.

At each measured batch size, greedy requests on random prompts are prefilled, run a few steps to settle, then a
few timed steps, once with every step drafting and once with none (SpeculationPolicy.forced); they are then
aborted. A step's time is the median of the timed steps', so one host hiccup does not move it, and the smallest
batch runs once untimed first, which takes whatever the first steps of a process pay once. Like the warm-up's, these requests leave nothing behind (warmup.scratch_requests).
"""
from __future__ import annotations

import logging
import statistics
import time

from specserve.engine.messages import CoreRequest
from specserve.engine.warmup import RandomPrompts, scratch_requests
from specserve.engine.warmup_plan import WarmupRequest
from specserve.errors import ConfigError
from specserve.sampling_params import RequestOutputKind, SamplingParams
from specserve.spec_decode.step_costs import StepCosts

logger = logging.getLogger(__name__)

PROMPT_LEN = 8
SETTLE_STEPS = 2
TIMED_STEPS = 6


def measured_batch_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """Powers of two below max_num_seqs, and max_num_seqs; StepCosts interpolates between them."""
    sizes = [1 << i for i in range(max_num_seqs.bit_length()) if 1 << i < max_num_seqs]
    return tuple(sizes + [max_num_seqs])


def measure_step_costs(engine) -> StepCosts:
    """The engine's step times without drafts and with every request drafting (engine: an EngineCore with a
    speculation policy and no request)."""
    policy, cfg = engine.scheduler.policy, engine.config
    k = policy.max_drafts
    # Tokens a request may take: its prefill's, and k + 1 per later step, with room to spare.
    max_tokens = (SETTLE_STEPS + TIMED_STEPS + 3) * (k + 1)
    if PROMPT_LEN + max_tokens > cfg.max_model_len:
        raise ConfigError("speculative_config.dynamic", f"measuring the step times needs a context of "
                          f"{PROMPT_LEN + max_tokens} tokens, but max_model_len is {cfg.max_model_len}; raise it, "
                          "or give the step times in speculative_config.cost_table")
    sizes = measured_batch_sizes(cfg.max_num_seqs)
    seconds: dict[int, list[float]] = {0: [], k: []}
    start = time.perf_counter()
    try:
        with scratch_requests(engine, "the step-time measurement") as prompts:
            for i, batch in enumerate((sizes[0],) + sizes):
                for drafts in (0, k):
                    policy.forced = drafts
                    step = _step_seconds(engine, batch, max_tokens, prompts)
                    if i:  # the first run is untimed
                        seconds[drafts].append(step)
    finally:
        policy.forced = None
    spec = cfg.speculative_config
    costs = StepCosts(sizes, {d: tuple(t) for d, t in seconds.items()},
                      source=f"{cfg.model} on {cfg.device}, {spec.method} k={k}, {cfg.cudagraph_mode}")
    logger.info("Step times for dynamic speculation measured in %.1f s: %s", time.perf_counter() - start,
                ", ".join(f"batch {b}: {1e3 * t0:.2f} ms without drafts, {1e3 * tk:.2f} ms with {k}"
                          for b, t0, tk in zip(sizes, seconds[0], seconds[k])))
    return costs


def _step_seconds(engine, batch: int, max_tokens: int, prompts: RandomPrompts) -> float:
    """Seconds per step of `batch` requests in steady decoding, the policy's decision forced."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    ids = [prompts.next_id() for _ in range(batch)]
    for rid in ids:
        engine.add_request(CoreRequest(rid, prompts.make(WarmupRequest(PROMPT_LEN)), params))
    requests = [engine.scheduler.requests[rid] for rid in ids]
    while any(r.num_output_tokens == 0 for r in requests):
        engine.step()
    for _ in range(SETTLE_STEPS):
        engine.step()
    times = []
    for _ in range(TIMED_STEPS):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    for rid in ids:
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    return statistics.median(times)
