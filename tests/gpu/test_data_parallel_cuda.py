"""Data parallelism on GPUs: each replica's core process sees one GPU of its own, a different one for each
replica, and every replica gives the CPU reference's greedy output in float32."""
from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.config import EngineConfig
from specserve.engine.async_llm import AsyncLLM
from specserve.engine.core import EngineCore

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("cuda_float32")]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, output_kind="final_only")
ENGINE = dict(max_model_len=256, kv_cache_memory_bytes=256 << 20, dtype="float32")
_REPORT_DIR = "SPECSERVE_TEST_REPLICA_GPUS"


class GpuReportingCore(EngineCore):
    """Writes which GPUs its process sees, and the UUID of the one it runs on, to a file named by its pid."""

    def __init__(self, config):
        torch.backends.cuda.matmul.allow_tf32 = False  # float32 matmuls exact, as the test process has them
        super().__init__(config)
        uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
        (Path(os.environ[_REPORT_DIR]) / str(os.getpid())).write_text(
            f"{os.environ.get('CUDA_VISIBLE_DEVICES')} {torch.cuda.device_count()} {uuid}")


def test_two_replicas_on_two_gpus_equal_cpu(tiny_llama, tmp_path, monkeypatch):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    monkeypatch.setenv(_REPORT_DIR, str(tmp_path))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    path = str(tiny_llama[0])
    prompts = [[5 + i, 17, 33 + 2 * i, 9] * (1 + i % 4) for i in range(16)]
    ref = [o.outputs[0].token_ids for o in LLM(path, max_model_len=256, device="cpu").generate(prompts, GREEDY,
                                                                                               use_tqdm=False)]
    engine = AsyncLLM(EngineConfig(model=path, device="cuda", data_parallel_size=2, **ENGINE),
                      core_factory=GpuReportingCore)

    async def run():
        await engine.start()

        async def one(ids):
            return [o async for o in engine.generate(ids, GREEDY)][-1].outputs[0].token_ids

        try:
            return await asyncio.gather(*map(one, prompts)), engine.replica_stats, engine.core_pids
        finally:
            await engine.shutdown()

    outs, stats, pids = asyncio.run(run())
    assert outs == ref
    assert all(s.num_prompt_tokens > 0 for s in stats), stats  # both replicas served
    reports = [(tmp_path / str(pid)).read_text().split() for pid in pids]
    assert [r[:2] for r in reports] == [["0", "1"], ["1", "1"]]
    assert reports[0][2] != reports[1][2]
