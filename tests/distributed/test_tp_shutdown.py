"""The server's engine core at TP=2 (a non-daemonic process that starts its workers) stops with its workers,
without a hang: on shutdown, and on SIGTERM to the core."""
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
    workers = psutil.Process(engine._process.pid).children()
    assert len(workers) == 1
    return workers


def _gone(processes: list[psutil.Process], timeout: float) -> bool:
    _, alive = psutil.wait_procs(processes, timeout=timeout)
    return not alive


def test_shutdown_stops_the_core_and_its_workers(tiny_llama):
    engine = _engine(tiny_llama)

    async def run():
        workers = await _started(engine)
        core = psutil.Process(engine._process.pid)
        start = time.monotonic()
        await engine.shutdown()
        # Within the 10 s AsyncLLM grants before it kills the core: the core stopped on its own.
        assert time.monotonic() - start < 10
        assert engine._process.exitcode == 0
        assert _gone([core, *workers], timeout=5)

    asyncio.run(run())


def test_sigterm_to_the_core_stops_its_workers(tiny_llama):
    engine = _engine(tiny_llama)

    async def run():
        workers = await _started(engine)
        os.kill(engine._process.pid, signal.SIGTERM)
        await asyncio.to_thread(engine._process.join, 30)
        assert engine._process.exitcode == 0  # unwound (sys.exit), not killed by the signal
        assert _gone(workers, timeout=5)
        await engine.shutdown()

    asyncio.run(run())
