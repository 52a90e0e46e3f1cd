"""AsyncLLMEngine without HTTP: one thread owns the engine, cancelled callers abort, shutdown
lets running requests finish within the grace period and aborts the rest, a dying engine fails
its requests instead of hanging them."""
from __future__ import annotations

import asyncio
import threading

import pytest

from specserve import SamplingParams
from specserve.config import EngineConfig
from specserve.engine.async_engine import AsyncLLMEngine, EngineUnavailableError
from specserve.engine.engine import LLMEngine

SHORT = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=480, ignore_eos=True)


@pytest.fixture
def engine(tiny_llama):
    llm_engine = LLMEngine(EngineConfig(model=str(tiny_llama[0]), max_model_len=512, num_kv_blocks=64))
    # The engine is not thread-safe: every call into it must come from the engine thread.
    for name in ("add_request", "abort_request", "step"):
        method = getattr(llm_engine, name)

        def checked(*args, _method=method, **kwargs):
            assert threading.current_thread().name == "specserve-engine"
            return _method(*args, **kwargs)

        setattr(llm_engine, name, checked)
    return AsyncLLMEngine(llm_engine)


async def wait_until(condition, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.01)


def test_cancel_aborts_and_shutdown_finishes_or_aborts(engine):
    async def run():
        engine.start()
        # A caller that goes away (a cancelled task) aborts its request and frees its blocks.
        started = asyncio.Event()

        async def consume():
            async for _ in engine.generate([5, 6, 7], LONG):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        await wait_until(lambda: engine.stats.kv_cache_usage == 0 and engine.stats.num_running == 0)
        assert engine.num_active_requests == 0

        # Shutdown: a short request finishes within the grace period, a long one is aborted.
        short = engine.generate([5, 6, 7], SHORT)
        long = engine.generate([8, 9, 10], LONG)
        await anext(short)
        await anext(long)
        finish = asyncio.create_task(engine.shutdown(grace_s=0.5))
        outs = [o async for o in short]
        assert outs[-1].outputs[0].finish_reason == "length" and len(outs[-1].outputs[0].token_ids) == 8
        with pytest.raises(EngineUnavailableError, match="shut down"):
            async for _ in long:
                pass
        await finish
        with pytest.raises(EngineUnavailableError):
            await anext(engine.generate([5], SHORT))

    asyncio.run(run())
    assert not engine._thread.is_alive()
    assert engine.engine.num_unfinished_requests == 0 and engine.engine.kv.usage == 0


def test_engine_failure_fails_requests_instead_of_hanging(engine):
    def broken_step():
        raise RuntimeError("injected")

    engine.engine.step = broken_step

    async def run():
        engine.start()
        with pytest.raises(EngineUnavailableError, match="injected"):
            await anext(engine.generate([5, 6, 7], SHORT))
        assert not engine.is_healthy
        with pytest.raises(EngineUnavailableError):
            await anext(engine.generate([5, 6, 7], SHORT))
        await engine.shutdown()

    asyncio.run(run())
