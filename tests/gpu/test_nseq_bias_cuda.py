"""n > 1 and logit_bias on a GPU, under CUDA graphs, asynchronous scheduling and the Triton backend: the CPU
reference's greedy output, sequences sharing their prompt's blocks, and seeded sequences that repeat."""
from __future__ import annotations

import pytest

from heads import save_eagle_head
from specserve import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("cuda_float32")]
SMALL_KV = {"kv_cache_memory_bytes": 256 << 20}
PROMPTS = [list(range(3, 60)), list(range(100, 140)), [5, 9, 13] * 7]


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "eagle3"])
def test_cuda_n_and_logit_bias_equal_cpu(tiny_llama, tmp_path, spec):
    path, hf = tiny_llama
    config = None
    if spec:
        head = save_eagle_head(tmp_path / "head", hf.config, "eagle3", seed=2)
        config = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}
    greedy = SamplingParams(n=3, temperature=0, max_tokens=16, ignore_eos=True)
    biased = SamplingParams(n=2, temperature=0, max_tokens=16, ignore_eos=True, logit_bias={7: 2.5, 9: -1.5, 11: 100})
    cpu = LLM(str(path), max_model_len=256, device="cpu", speculative_config=config)
    gpu = LLM(str(path), max_model_len=256, device="cuda", **SMALL_KV, dtype="float32", attention_backend="triton",
              speculative_config=config)
    assert gpu.engine.config.async_scheduling
    params = [greedy, biased, greedy]
    expected = [[c.token_ids for c in o.outputs] for o in cpu.generate(PROMPTS, params, use_tqdm=False)]
    got = [[c.token_ids for c in o.outputs] for o in gpu.generate(PROMPTS, params, use_tqdm=False)]
    assert got == expected and all(len(set(map(tuple, seqs))) == 1 for seqs in got)
    assert got[1][0] == [11] * 16
    # The later sequences found the first one's prompt blocks.
    assert gpu.engine.kv.pool.hits >= 2 * 48 + 1 * 32 + 2 * 16
    sampled = SamplingParams(n=4, temperature=1.0, max_tokens=16, seed=3, ignore_eos=True, logit_bias={7: 1.0})
    first, again = (gpu.generate(PROMPTS[0], sampled, use_tqdm=False)[0] for _ in range(2))
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) == 4
