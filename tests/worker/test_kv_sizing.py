"""Sizing the KV cache: the arithmetic of a memory profile, the errors that name their fix, the configuration's
checks, the profile's batch, and the profile run itself on the CPU with a stand-in for the device's memory."""
from __future__ import annotations

import os
import random

import pytest
import torch

from heads import save_eagle_head
from specserve import LLM, SamplingParams
from specserve.config import EngineConfig, parse_memory_size
from specserve.errors import ConfigError
from specserve.worker.cudagraph_mode import CUDAGraphMode as M
from specserve.worker.graph_recorder import EagerRecorder
from specserve.worker.kv_layout import KVCacheLayout
from specserve.worker.kv_sizing import (GiB, DeviceMemory, KVCachePlan, MemoryProfile, plan_from_bytes,
                                        plan_from_profile, profile_batch, profile_memory, weight_bytes)

BLOCK = 16
BLOCK_BYTES = 2 * BLOCK * 8 * 128 * 2 * 32  # Llama-3-8B's layers in bfloat16: 128 KiB a token


def profile(**kw) -> MemoryProfile:
    values = dict(total=80 * GiB, free_at_start=64 * GiB, weights=16 * GiB, growth=GiB // 2,
                  peak_activations=3 * GiB, cuda_graphs=GiB, late_allocations=GiB // 4)
    return MemoryProfile(**{**values, **kw})


def test_the_cache_takes_what_the_share_leaves_after_the_rest_of_the_engine():
    p = profile()
    plan = plan_from_profile(p, 0.9, BLOCK_BYTES, BLOCK, max_model_len=8192)
    budget = int(80 * GiB * 0.9)
    assert p.non_kv == 16 * GiB + GiB // 2 + 3 * GiB + GiB + GiB // 4
    assert p.non_kv + plan.bytes <= budget < p.non_kv + plan.bytes + BLOCK_BYTES
    assert plan.bytes == (plan.num_blocks + 1) * BLOCK_BYTES  # the spare block counted
    assert plan.num_tokens == plan.num_blocks * BLOCK
    assert plan.max_concurrency(8192) == pytest.approx(plan.num_tokens / 8192)
    line = plan.describe(8192)
    assert "Maximum concurrency for 8,192 tokens per request" in line and f"{plan.num_tokens:,} tokens" in line


def test_a_lower_share_or_a_larger_engine_leaves_less():
    base = plan_from_profile(profile(), 0.9, BLOCK_BYTES, BLOCK, 8192).num_blocks
    assert plan_from_profile(profile(), 0.8, BLOCK_BYTES, BLOCK, 8192).num_blocks < base
    assert plan_from_profile(profile(cuda_graphs=3 * GiB), 0.9, BLOCK_BYTES, BLOCK, 8192).num_blocks < base
    # Memory other processes hold is not this engine's: only what was free for it at the start must cover the share.
    assert plan_from_profile(profile(free_at_start=60 * GiB), 0.9, BLOCK_BYTES, BLOCK, 8192).num_blocks == base


@pytest.mark.parametrize("kw,util,max_len,says", [
    (dict(peak_activations=60 * GiB), 0.9, 8192, "holds nothing"),  # the rest of the engine takes the whole share
    (dict(), 0.27, 8192, "fewer than one request of max_model_len=8192"),  # room, but not one request's worth
    (dict(), 0.9, 10_000_000, "fewer than one request"),
])
def test_too_small_a_share_names_the_fix(kw, util, max_len, says):
    with pytest.raises(ConfigError, match="gpu_memory_utilization") as e:
        plan_from_profile(profile(**kw), util, BLOCK_BYTES, BLOCK, max_len)
    assert says in str(e.value)
    assert "Raise --gpu-memory-utilization or lower --max-model-len / --max-num-seqs" in str(e.value)


def test_a_share_that_is_not_free_at_the_start_names_the_fix():
    with pytest.raises(ConfigError, match="only 40.00 GiB was free for this engine") as e:
        plan_from_profile(profile(free_at_start=24 * GiB), 0.9, BLOCK_BYTES, BLOCK, 8192)
    assert "lower --gpu-memory-utilization" in str(e.value)


def test_an_explicit_size_gets_every_block_that_fits_or_names_the_fix():
    plan = plan_from_bytes(4 * GiB, BLOCK_BYTES, BLOCK, 8192, source="s", field="kv_cache_memory_bytes", fix="F")
    assert plan.bytes <= 4 * GiB < plan.bytes + BLOCK_BYTES
    with pytest.raises(ConfigError, match=r"kv_cache_memory_bytes: s leaves 0.50 GiB .* holds 4,080 tokens .* F"):
        plan_from_bytes(GiB // 2, BLOCK_BYTES, BLOCK, 8192, source="s", field="kv_cache_memory_bytes", fix="F")
    with pytest.raises(ValueError):
        KVCachePlan(1, BLOCK, BLOCK_BYTES, "one block is no pool")
    with pytest.raises(ValueError):
        profile(growth=-1)


def test_a_block_holds_every_models_layers():
    target, head = KVCacheLayout(32, 8, 128), KVCacheLayout(1, 8, 128)
    assert target.block_bytes(BLOCK, torch.bfloat16) == BLOCK_BYTES
    assert head.block_bytes(BLOCK, torch.float32) == BLOCK_BYTES // 32 * 2
    assert target.allocate(3, BLOCK, torch.float32, torch.device("cpu")).shape == (32, 2, 4, BLOCK, 8, 128)


@pytest.mark.parametrize("text,size", [("4GiB", 4 << 30), ("512 MiB", 512 << 20), ("1.5GB", 1_500_000_000),
                                       ("4096", 4096), ("2gib", 2 << 30), ("3 KB", 3000)])
def test_memory_sizes_parse_as_written(text, size):
    assert parse_memory_size(text) == size


@pytest.mark.parametrize("text", ["", "lots", "4 GiBs", "-1", "0", "1.2.3", "0.1B"])
def test_bad_memory_sizes_say_how_to_write_one(text):
    with pytest.raises(ValueError, match="memory size|less than a byte"):
        parse_memory_size(text)


@pytest.mark.parametrize("kw,field", [
    (dict(gpu_memory_utilization=0.0), "gpu_memory_utilization"),
    (dict(gpu_memory_utilization=1.01), "gpu_memory_utilization"),
    (dict(gpu_memory_utilization=True), "gpu_memory_utilization"),
    (dict(kv_cache_memory_bytes=0), "kv_cache_memory_bytes"),
    (dict(kv_cache_memory_bytes=1.5), "kv_cache_memory_bytes"),
    (dict(kv_cache_memory_bytes=4 << 30, num_kv_blocks=64), "kv_cache_memory_bytes"),
])
def test_the_config_rejects_bad_sizes(kw, field):
    with pytest.raises(ConfigError, match=field):
        EngineConfig(device="cpu", **kw)


@pytest.mark.parametrize("drafts,max_len,seqs,tokens,want_reqs", [
    (0, 8192, 64, 2048, 64), (3, 8192, 64, 2048, 64), (3, 8192, 256, 2048, 512), (0, 100, 4, 2048, 4),
    (15, 8192, 64, 64, 4),
])
def test_the_profile_step_is_the_largest_the_scheduler_can_make(drafts, max_len, seqs, tokens, want_reqs):
    cfg = EngineConfig(device="cpu", max_num_seqs=seqs, max_num_batched_tokens=tokens, max_model_len=max_len)
    step = profile_batch(cfg, drafts, vocab_size=1000)
    reqs = len(step.scheduled)
    assert reqs == min(want_reqs, seqs)
    assert step.num_tokens == min(tokens, reqs * (max_len - 1))
    for s in step.scheduled:
        assert s.samples and len(s.spec_token_ids) == drafts and s.start == 0
        assert s.num_new_tokens == len(s.request.all_token_ids) + drafts <= max_len - 1
        assert len(s.block_ids) * cfg.block_size >= s.num_new_tokens + drafts
        p = s.request.params
        assert p.logprobs and p.top_k and p.top_p < 1 and p.min_p and p.temperature > 0
        assert p.uses_penalties == (drafts == 0)  # penalties sample without drafts


class ScriptedMemory:
    """A stand-in for CudaMemory: each read() adds what the profile allocated since the last, as the device
    would; the peak is a fixed growth over the reading before the step."""

    def __init__(self, runner, peak: int, graphs: int):
        self.runner, self.peak, self.graphs = runner, peak, graphs
        self.used, self.reserved = 10 * GiB, 9 * GiB
        self.reads: list[tuple[bool, bool]] = []  # (cache allocated, graphs captured) at each read

    def read(self) -> DeviceMemory:
        captured = self.runner.graphs is not None
        self.reads.append((self.runner.kv.stack is not None, captured))
        used = self.used + (self.graphs if captured else 0) + (GiB if self.runner.kv.stack is not None else 0)
        return DeviceMemory(80 * GiB, 80 * GiB - used, self.reserved)

    def reset_peak(self) -> None:
        pass

    def peak_reserved(self) -> int:
        return self.reserved + self.peak


@pytest.fixture(scope="module")
def head(tiny_llama, tmp_path_factory):
    return save_eagle_head(tmp_path_factory.mktemp("kv") / "eagle3", tiny_llama[1].config, "eagle3", seed=2)


def test_the_profile_leaves_the_engine_as_it_found_it(tiny_llama, head):
    """The profile's step, trial capture and release on the CPU (the graphs' stand-in, a stand-in for the
    device's memory): it measures what the readings say, then leaves no cache, no graph, no request and the
    generator where it was, and the engine then captures again and samples exactly as a fresh one."""
    path, hf = tiny_llama
    rng = random.Random(4)
    prompts = [[rng.randrange(3, hf.config.vocab_size) for _ in range(rng.randint(3, 40))] for _ in range(5)]
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}
    kw = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, cudagraph_capture_sizes=[1, 2, 4, 8],
              speculative_config=spec, seed=7)
    sampled = [SamplingParams(temperature=0.8, max_tokens=10, ignore_eos=True), SamplingParams(temperature=0)]

    def graphed(llm: LLM) -> LLM:
        llm.engine.runner.capture_graphs(M.FULL_AND_PIECEWISE, EagerRecorder(), llm.engine.attention_backend)
        return llm

    fresh = graphed(LLM(str(path), **kw))
    ref = [[o.outputs[0].token_ids for o in fresh.generate(prompts, p, use_tqdm=False)] for p in sampled]

    llm = LLM(str(path), **kw)
    engine, runner = llm.engine, llm.engine.runner
    num_blocks = runner.num_blocks
    runner.kv.free()
    runner.memory_at_start = DeviceMemory(80 * GiB, 70 * GiB, 9 * GiB)
    memory = ScriptedMemory(runner, peak=3 * GiB, graphs=GiB // 2)
    state = runner.sampler.default_generator.get_state()
    captures = []

    def capture():
        captures.append(runner.kv.num_blocks)
        graphed(llm)

    p = profile_memory(runner, capture, memory)
    assert captures and 0 < captures[0] < num_blocks  # over the profile's small cache
    assert (p.total, p.free_at_start, p.peak_activations, p.cuda_graphs) == (80 * GiB, 70 * GiB, 3 * GiB, GiB // 2)
    assert p.weights == weight_bytes(runner.model) > 0 and p.growth == 0  # the scripted device did not grow
    assert memory.reads[-1] == (False, False)  # the last reading: no cache, no graphs
    assert runner.kv.stack is None and runner.graphs is None and runner.speculator.prefill_graphs is None
    assert not runner.rows and len(runner.free_rows) == kw["max_num_seqs"]
    assert torch.equal(runner.sampler.default_generator.get_state(), state)

    runner.kv.allocate(num_blocks)
    graphed(llm)
    assert [[o.outputs[0].token_ids for o in llm.generate(prompts, p, use_tqdm=False)] for p in sampled] == ref


def test_a_drafter_layers_count_in_every_block_on_the_cpu(tiny_llama, head):
    path, hf = tiny_llama
    llm = LLM(str(path), max_model_len=128, kv_cache_memory_bytes=8 << 20,
              speculative_config={"method": "eagle3", "model": str(head), "num_speculative_tokens": 2})
    runner = llm.engine.runner
    layer = 2 * 16 * hf.config.num_key_value_heads * (hf.config.hidden_size // hf.config.num_attention_heads) * 4
    assert runner.kv.block_bytes == layer * (hf.config.num_hidden_layers + 1)
    caches = [runner.kv.stack, runner.speculator.kv_cache]
    assert sum(c.numel() * c.element_size() for c in caches) == (runner.num_blocks + 1) * runner.kv.block_bytes
    assert (runner.num_blocks + 2) * runner.kv.block_bytes > 8 << 20 >= (runner.num_blocks + 1) * runner.kv.block_bytes
    assert llm.engine.kv.num_blocks == runner.num_blocks
    with pytest.raises(ConfigError, match="kv_cache_memory_bytes.*Raise --kv-cache-memory"):
        LLM(str(path), max_model_len=128, kv_cache_memory_bytes=64 << 10)


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_a_cpu_cache_is_zeros_whose_pages_are_taken_only_when_written(dtype):
    """The CPU default pool (CPU_KV_CACHE_BYTES) must not cost its size in memory or time before it is used: an
    engine of a small model would otherwise write gigabytes at every start."""
    layout = KVCacheLayout(num_layers=4, num_kv_heads=2, head_dim=64)
    blocks = (1 << 30) // layout.block_bytes(16, dtype)
    before = _resident_bytes()
    cache = layout.allocate(blocks, 16, dtype, torch.device("cpu"))
    assert _resident_bytes() - before < (64 << 20)
    assert cache.shape == (4, 2, blocks + 1, 16, 2, 64) and cache.dtype == dtype and cache.is_contiguous()
    cache[1, 0, 7].fill_(1.0)
    assert cache[1, 0, 7].float().sum().item() == 16 * 2 * 64
    assert cache[1, 0, 6:9].float().sum().item() == 16 * 2 * 64 and cache[:, :, -1].float().abs().sum().item() == 0
