"""The server's engine cores at TP=2 (non-daemonic processes that start their workers): each stops with its
workers, without a hang, on shutdown and on SIGTERM; and two such replicas (data parallelism) serve correctly."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import psutil

from specserve import SamplingParams
from specserve.config import EngineConfig
from specserve.engine.async_llm import AsyncLLM

SHORT = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, output_kind="delta")


def _engine(tiny_llama) -> AsyncLLM:
    return AsyncLLM(EngineConfig(model=str(tiny_llama[0]), device="cpu", max_model_len=128, num_kv_blocks=16,
                                 tensor_parallel_size=2))


async def _started(engine: AsyncLLM) -> list[psutil.Process]:
    """Start the engine, serve one request, and return the core's worker processes."""
    await engine.start()
    assert [o async for o in engine.generate([5, 6, 7], SHORT)]
    workers = psutil.Process(engine.replicas[0].process.pid).children()
    assert len(workers) == 1
    return workers


def _gone(processes: list[psutil.Process], timeout: float) -> bool:
    _, alive = psutil.wait_procs(processes, timeout=timeout)
    return not alive


def test_shutdown_stops_the_core_and_its_workers(tiny_llama):
    engine = _engine(tiny_llama)

    async def run():
        workers = await _started(engine)
        core = psutil.Process(engine.replicas[0].process.pid)
        start = time.monotonic()
        await engine.shutdown()
        # Within the 10 s AsyncLLM grants before it kills the core: the core stopped on its own.
        assert time.monotonic() - start < 10
        assert engine.replicas[0].process.exitcode == 0
        assert _gone([core, *workers], timeout=5)

    asyncio.run(run())


def test_sigterm_to_the_core_stops_its_workers(tiny_llama):
    engine = _engine(tiny_llama)

    async def run():
        workers = await _started(engine)
        os.kill(engine.replicas[0].process.pid, signal.SIGTERM)
        await asyncio.to_thread(engine.replicas[0].process.join, 30)
        assert engine.replicas[0].process.exitcode == 0  # unwound (sys.exit), not killed by the signal
        assert _gone(workers, timeout=5)
        await engine.shutdown()

    asyncio.run(run())


def test_two_replicas_of_two_ranks_each_serve_tp1s_tokens(tiny_llama):
    """Data parallelism over tensor-parallel replicas: each replica's core starts its own rank, meeting at a
    port of its own; concurrent requests spread over both give one engine's tokens."""
    from specserve import LLM

    prompts = [[5 + i, 6, 7, 8 + i] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ref = LLM(str(tiny_llama[0]), device="cpu", max_model_len=128, num_kv_blocks=16)
    want = [o.outputs[0].token_ids for o in ref.generate(prompts, params, use_tqdm=False)]
    engine = AsyncLLM(EngineConfig(model=str(tiny_llama[0]), device="cpu", max_model_len=128, num_kv_blocks=16,
                                   tensor_parallel_size=2, data_parallel_size=2))

    async def run():
        await engine.start()
        try:
            async def one(p):
                return [o async for o in engine.generate(p, params)][-1].outputs[0].token_ids

            got = await asyncio.gather(*(one(p) for p in prompts))
            assert list(got) == want
            assert all(len(psutil.Process(r.process.pid).children()) == 1 for r in engine.replicas)
        finally:
            await engine.shutdown()

    asyncio.run(run())
