"""How many blocks the KV cache pool gets.

In order of precedence (EngineConfig): num_kv_blocks; kv_cache_memory_bytes;
on CUDA, gpu_memory_utilization; on the CPU, CPU_KV_CACHE_BYTES.

By utilization, as vLLM's determine_available_memory: this engine may use
total * utilization of the device, and the KV cache gets what the rest of
the engine leaves. The rest is measured once the weights are loaded (the
target's and a drafter's), with the caches' own memory left out:

- weights and growth: the target's weights, counted, and what the device's
  use grew by from the runner's start (ModelRunner.memory_at_start) to the
  end of profiling: a drafter's weights, persistent buffers, kernels loaded,
  library workspaces;
- peak activations: what the allocator grows by over the largest step the
  scheduler can produce (profile_batch: max_num_batched_tokens tokens over
  as many requests as fit, every one sampling with every filter and
  logprobs, verifying a full set of drafts and drafting the next);
- CUDA graphs: graphs record the caches' addresses, so they are captured
  after the cache is allocated; a trial capture over a small cache measures
  their memory first (the pool and the driver's share), then is dropped;
- LATE_ALLOCATION_BYTES for what is loaded after sizing (the warm-up
  compiles the kernels of the shapes it runs).

What other processes (or other engines of this process) hold does not
count against the share, but the share must be free when the runner starts.

The caching allocator keeps freed blocks for reuse, and with fixed-size
segments steps of ever larger shapes leave blocks too small for the next
one: over a run of mixed prefill and verification the memory held grows past
the profiled peak. Expandable segments grow in place and take no such toll,
so the runner turns them on (use_expandable_segments) unless the user's
PYTORCH_CUDA_ALLOC_CONF chose.

A block holds block_size tokens in every model's layers (kv_layout.py), and
the pool allocates one block more than it hands out (the spare block).
"""
from __future__ import annotations

import gc
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from specserve.engine.request import Request
from specserve.engine.scheduler import ScheduledRequest, SchedulerOutput
from specserve.errors import ConfigError
from specserve.sampling_params import MAX_LOGPROBS, SamplingParams

logger = logging.getLogger(__name__)

# Without a GPU there is nothing to profile: a fixed pool, whose pages the system maps on first write
# (kv_layout.zeroed).
CPU_KV_CACHE_BYTES = 2 << 30
# Room kept for memory taken after sizing: kernels the warm-up and later steps load, allocator rounding.
LATE_ALLOCATION_BYTES = 256 << 20
GiB = 2**30


def use_expandable_segments() -> None:
    """Expandable segments for this process's CUDA allocations from now on (module docstring), unless
    PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF names the setting; PyTorch has one allocator per
    process, so the setting holds for the caller's own tensors too."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + os.environ.get("PYTORCH_ALLOC_CONF", "")
    if "expandable_segments" in conf:
        return
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    (setter or torch.cuda.memory._set_allocator_settings)("expandable_segments:True")


@dataclass(frozen=True)
class DeviceMemory:
    """One reading of a device's memory, taken after releasing the allocator's unused cache."""

    total: int  # the device's memory
    free: int  # free on the device, every process's use counted
    reserved: int  # held by this process's torch allocator

    @property
    def used(self) -> int:
        return self.total - self.free


class CudaMemory:
    """Readings of one CUDA device's memory (profile_memory takes a stand-in in tests)."""

    def __init__(self, device: torch.device):
        self.device = device

    def read(self) -> DeviceMemory:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        return DeviceMemory(total, free, torch.cuda.memory_reserved(self.device))

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak_reserved(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_reserved(self.device)


@dataclass(frozen=True)
class MemoryProfile:
    """This engine's memory on the device besides its KV cache (module docstring), in bytes, and what was free
    for it when its runner started."""

    total: int
    free_at_start: int  # free on the device when the runner started, the target's weights loaded
    weights: int  # the target's
    growth: int  # the device's use from the runner's start to the end of profiling
    peak_activations: int
    cuda_graphs: int
    late_allocations: int = LATE_ALLOCATION_BYTES

    def __post_init__(self) -> None:
        if min(self.total, self.free_at_start, self.weights, self.growth, self.peak_activations, self.cuda_graphs,
               self.late_allocations) < 0:
            raise ValueError(f"a memory profile's sizes cannot be negative: {self}")

    @property
    def non_kv(self) -> int:
        return self.weights + self.growth + self.peak_activations + self.cuda_graphs + self.late_allocations

    def describe(self) -> str:
        return (f"target weights {self.weights / GiB:.2f} GiB, then drafter, buffers and kernels "
                f"{self.growth / GiB:.2f} GiB, peak activations {self.peak_activations / GiB:.2f} GiB, CUDA graphs "
                f"{self.cuda_graphs / GiB:.2f} GiB, kept for later {self.late_allocations / GiB:.2f} GiB")


@dataclass(frozen=True)
class KVCachePlan:
    """The pool's size: num_blocks blocks of block_size tokens, block_bytes each over every model's layers."""

    num_blocks: int
    block_size: int
    block_bytes: int
    source: str  # what decided it
    profile: MemoryProfile | None = None  # what the rest of the engine takes, where a profile decided it

    def __post_init__(self) -> None:
        if self.num_blocks < 2 or self.block_size < 1 or self.block_bytes < 1:
            raise ValueError(f"a KV cache needs at least 2 blocks of positive size, got {self}")

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def bytes(self) -> int:
        """The caches' memory, the spare block included."""
        return (self.num_blocks + 1) * self.block_bytes

    def max_concurrency(self, max_model_len: int) -> float:
        """How many requests of max_model_len tokens the pool holds at once."""
        return self.num_tokens / max_model_len

    def describe(self, max_model_len: int) -> str:
        return (f"KV cache: {self.num_tokens:,} tokens ({self.num_blocks:,} blocks of {self.block_size}), "
                f"{self.bytes / GiB:.2f} GiB, sized by {self.source}. Maximum concurrency for {max_model_len:,} "
                f"tokens per request: {self.max_concurrency(max_model_len):.2f}x")


def plan_from_bytes(nbytes: int, block_bytes: int, block_size: int, max_model_len: int, *, source: str, field: str,
                    fix: str) -> KVCachePlan:
    """The most blocks whose caches (spare block included) fit in nbytes. When they cannot hold one request of
    max_model_len tokens, a ConfigError on field says so and how to get more memory (fix)."""
    num_blocks = nbytes // block_bytes - 1
    if num_blocks < 2 or num_blocks * block_size < max_model_len:
        holds = f"holds {num_blocks * block_size:,} tokens" if num_blocks > 0 else "holds nothing"
        raise ConfigError(field, (
            f"{source} leaves {nbytes / GiB:.2f} GiB for the KV cache, which {holds} ({block_bytes:,} bytes a "
            f"block of {block_size} tokens): fewer than one request of max_model_len={max_model_len}. {fix}"))
    return KVCachePlan(num_blocks, block_size, block_bytes, source)


def plan_from_profile(profile: MemoryProfile, utilization: float, block_bytes: int, block_size: int,
                      max_model_len: int) -> KVCachePlan:
    """What total * utilization leaves for the KV cache after the rest of the engine (MemoryProfile)."""
    budget = int(profile.total * utilization)
    if profile.free_at_start + profile.weights < budget:
        raise ConfigError("gpu_memory_utilization", (
            f"{utilization:g} of the GPU's {profile.total / GiB:.2f} GiB is {budget / GiB:.2f} GiB, but only "
            f"{(profile.free_at_start + profile.weights) / GiB:.2f} GiB was free for this engine (other processes or "
            "engines hold the rest); lower --gpu-memory-utilization, or give --kv-cache-memory"))
    plan = plan_from_bytes(
        max(budget - profile.non_kv, 0), block_bytes, block_size, max_model_len,
        source=f"gpu_memory_utilization={utilization:g}", field="gpu_memory_utilization", fix=
        f"Of {budget / GiB:.2f} GiB ({utilization:g} of the GPU's {profile.total / GiB:.2f} GiB) the rest of the "
        f"engine takes {profile.non_kv / GiB:.2f} GiB: {profile.describe()}. Raise --gpu-memory-utilization or "
        "lower --max-model-len / --max-num-seqs (or --max-num-batched-tokens).")
    return replace(plan, profile=profile)


def plan_kv_cache(runner, capture: Callable[[], None] | None,
                  run_step: Callable[[SchedulerOutput], object]) -> KVCachePlan:
    """The pool's size for runner's config (module docstring). capture() records the runner's CUDA graphs (None
    without graphs); on CUDA sizing by utilization, a trial capture measures them, and run_step(step) runs the
    profile's step (runner.execute_model, or on ranks 1..N-1 following rank 0's)."""
    cfg = runner.config
    block = runner.kv.block_bytes
    if cfg.num_kv_blocks is not None:
        return KVCachePlan(cfg.num_kv_blocks, cfg.block_size, block, f"num_kv_blocks={cfg.num_kv_blocks}")
    if cfg.kv_cache_memory_bytes is not None:
        plan = plan_from_bytes(cfg.kv_cache_memory_bytes, block, cfg.block_size, cfg.max_model_len,
                               source=f"kv_cache_memory_bytes={cfg.kv_cache_memory_bytes}",
                               field="kv_cache_memory_bytes", fix="Raise --kv-cache-memory or lower --max-model-len.")
        if runner.device.type == "cuda":
            free = CudaMemory(runner.device).read().free
            if plan.bytes > free:
                raise ConfigError("kv_cache_memory_bytes", (
                    f"asks for {plan.bytes / GiB:.2f} GiB of KV cache but the GPU has {free / GiB:.2f} GiB free "
                    "after the weights; lower --kv-cache-memory, or leave it out to size the cache by "
                    "--gpu-memory-utilization"))
        return plan
    if runner.device.type != "cuda":
        return plan_from_bytes(CPU_KV_CACHE_BYTES, block, cfg.block_size, cfg.max_model_len,
                               source=f"the CPU default ({CPU_KV_CACHE_BYTES / GiB:g} GiB)", field="max_model_len",
                               fix="Give --kv-cache-memory for a larger cache.")
    profile = profile_memory(runner, capture, CudaMemory(runner.device), run_step)
    logger.info("Memory profile: %s; %.2f GiB free at the start of %.2f GiB", profile.describe(),
                profile.free_at_start / GiB, profile.total / GiB)
    return plan_from_profile(profile, cfg.gpu_memory_utilization, block, cfg.block_size, cfg.max_model_len)


def profile_memory(runner, capture: Callable[[], None] | None, memory: CudaMemory,
                   run_step: Callable[[SchedulerOutput], object] | None = None) -> MemoryProfile:
    """Measure the engine's memory besides the KV cache (module docstring), against runner.memory_at_start;
    leaves the runner without a cache, its graphs and its request state as it found them."""
    step = profile_batch(runner.config, runner.outputs.num_drafts, runner.arch.vocab_size)
    runner.kv.allocate(max(len(s.block_ids) for s in step.scheduled))
    before = memory.read()
    memory.reset_peak()
    with runner.scratch_steps():
        (run_step or runner.execute_model)(step)
        peak = memory.peak_reserved() - before.reserved
    graphs = 0
    if capture is not None:
        ready = memory.read()
        capture()
        graphs = memory.read().used - ready.used
        runner.release_graphs()
        gc.collect()
    runner.kv.free()
    start, end = runner.memory_at_start, memory.read()
    return MemoryProfile(end.total, start.free, weight_bytes(runner.model), max(end.used - start.used, 0),
                         max(peak, 0), max(graphs, 0))


def weight_bytes(model: torch.nn.Module) -> int:
    """The bytes of a model's parameters and buffers, each tensor's memory counted once (tied weights share)."""
    tensors = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
               for t in [*model.parameters(), *model.buffers()]}
    return sum(tensors.values())


def profile_batch(cfg, num_drafts: int, vocab_size: int) -> SchedulerOutput:
    """The step of the most tokens the scheduler can produce, for the memory profile: max_num_batched_tokens
    over as many requests as each hold 1 + num_drafts tokens (within max_num_seqs and max_model_len), every
    one verifying num_drafts drafts and sampling with every filter, logprobs and (without drafts) penalties.
    The requests share block ids 0.. (their cache contents do not matter)."""
    per_request = 1 + num_drafts
    num_reqs = max(1, min(cfg.max_num_seqs, cfg.max_num_batched_tokens // per_request))
    longest = cfg.max_model_len - 1
    total = min(cfg.max_num_batched_tokens, num_reqs * longest)
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.05, logprobs=MAX_LOGPROBS,
                            presence_penalty=0.0 if num_drafts else 0.5, max_tokens=1, detokenize=False)
    scheduled = []
    for i in range(num_reqs):
        n = total // num_reqs + (i < total % num_reqs)
        prompt = [(7 * i + j) % vocab_size for j in range(max(n - num_drafts, 1))]
        req = Request(f"profile-{i}", prompt, params, set(), cfg.max_model_len, device=cfg.device)
        drafts = [(j + 1) % vocab_size for j in range(n - len(prompt))]
        blocks = list(range(-(-(n + num_drafts) // cfg.block_size)))
        scheduled.append(ScheduledRequest(req, n, drafts, blocks, samples=True, start=0))
    # Its requests draft too (with a speculator): the drafter's buffers count.
    return SchedulerOutput(scheduled=scheduled, propose_drafts=True)
