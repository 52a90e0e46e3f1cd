"""AsyncLLM without HTTP, its engine core in a process of its own: cancelled callers abort, shutdown
lets running requests finish within the grace period and aborts the rest, a core that fails or
dies fails its requests instead of hanging them."""
from __future__ import annotations

import asyncio
import os
import signal

import pytest

from core_factories import BrokenCore, FixedTimeCore
from specserve import LLM, SamplingParams
from specserve.config import EngineConfig
from specserve.engine.async_llm import AsyncLLM
from specserve.errors import EngineUnavailableError

SHORT = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, output_kind="delta")
LONG = SamplingParams(temperature=0, max_tokens=480, ignore_eos=True, output_kind="delta")


def make_engine(tiny_llama, **kwargs) -> AsyncLLM:
    return AsyncLLM(EngineConfig(model=str(tiny_llama[0]), max_model_len=512, num_kv_blocks=64), **kwargs)


async def wait_until(condition, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.01)


def test_cancel_aborts_and_shutdown_finishes_or_aborts(tiny_llama):
    # Steps of at least FixedTimeCore.STEP_S: the long request cannot finish within the grace period on any
    # machine, and the short one finishes within it however loaded the machine is.
    engine = make_engine(tiny_llama, core_factory=FixedTimeCore)

    async def run():
        await engine.start()
        # A caller that goes away (a cancelled task) aborts its request and frees its blocks.
        started = asyncio.Event()

        async def consume():
            async for _ in engine.generate([5, 6, 7], LONG):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        assert engine.stats.kv_cache_usage > 0
        task.cancel()
        await wait_until(lambda: engine.stats.kv_cache_usage == 0 and engine.stats.num_running == 0)
        assert engine.num_active_requests == 0

        # Shutdown: a short request finishes within the grace period, a long one is aborted.
        short = engine.generate([5, 6, 7], SHORT)
        long = engine.generate([8, 9, 10], LONG)
        tokens = len((await anext(short)).outputs[0].token_ids)
        await anext(long)
        finish = asyncio.create_task(engine.shutdown(grace_s=1.0))
        outs = [o async for o in short]
        assert outs[-1].outputs[0].finish_reason == "length"
        assert tokens + sum(len(o.outputs[0].token_ids) for o in outs) == 8
        with pytest.raises(EngineUnavailableError, match="shut down"):
            async for _ in long:
                pass
        await finish
        with pytest.raises(EngineUnavailableError):
            await anext(engine.generate([5], SHORT))

    asyncio.run(run())
    assert engine.core_exit_codes == [0] and engine.num_active_requests == 0


def test_core_failure_fails_requests_instead_of_hanging(tiny_llama):
    engine = make_engine(tiny_llama, core_factory=BrokenCore)
    died = []
    engine.on_core_death = lambda: died.append(True)

    async def run():
        await engine.start()
        with pytest.raises(EngineUnavailableError, match="injected step failure"):
            await anext(engine.generate([5, 6, 7], SHORT))
        assert not engine.is_healthy and engine.is_dead and died
        with pytest.raises(EngineUnavailableError):
            await anext(engine.generate([5, 6, 7], SHORT))
        await engine.shutdown()

    asyncio.run(run())


def test_killed_core_fails_running_and_new_requests(tiny_llama):
    engine = make_engine(tiny_llama)

    async def run():
        await engine.start()
        stream = engine.generate([5, 6, 7], LONG)
        await anext(stream)
        os.kill(engine.core_pids[0], signal.SIGKILL)
        with pytest.raises(EngineUnavailableError, match="exited unexpectedly"):
            async for _ in stream:
                pass
        with pytest.raises(EngineUnavailableError, match="dead"):
            await anext(engine.generate([5, 6, 7], SHORT))
        assert engine.num_active_requests == 0
        await asyncio.wait_for(engine.shutdown(), 10)

    asyncio.run(run())


def test_stream_interval_merges_tokens_and_keeps_the_text(tiny_llama):
    params = SamplingParams(temperature=0, max_tokens=37, ignore_eos=True, output_kind="delta")
    # Steps of at least FixedTimeCore.STEP_S leave the reader time to take the first output alone.
    engine = make_engine(tiny_llama, stream_interval=8, core_factory=FixedTimeCore)

    async def run() -> tuple[list[int], list[int], str]:
        await engine.start()
        sizes, ids, text = [], [], ""
        async for out in engine.generate("the cat sat on", params):
            sizes.append(len(out.outputs[0].token_ids))
            ids += out.outputs[0].token_ids
            text += out.outputs[0].text
        await engine.shutdown()
        return sizes, ids, text

    sizes, ids, text = asyncio.run(run())
    # The same tokens and text as the offline engine's whole output (every token a delta of its own is the
    # servers' default, test_openai_server.py::test_streamed_equals_non_streamed).
    whole = LLM(str(tiny_llama[0]), max_model_len=512, num_kv_blocks=64).generate(
        "the cat sat on", SamplingParams(temperature=0, max_tokens=37, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert (ids, text) == (list(whole.token_ids), whole.text) and len(ids) == 37
    # The first output at once (merged only with what came before its reader ran); then chunks of at least 8
    # until the last.
    assert sizes[0] < 8 and all(n >= 8 for n in sizes[1:-1]) and len(sizes) <= 1 + 36 // 8 + 1
