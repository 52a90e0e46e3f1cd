"""The server's cost to the engine: with a core whose every step takes a fixed time, serving 16
concurrent streams over HTTP must deliver most of the tokens per second the same core gives offline
(RATIO). The step holds the interpreter for half its time, as a GPU step's host work does, so a
front end that shares the core's interpreter (and its GIL) shows up as lost steps.

Other processes on the machine slow the served run (three processes on the cores) more than the offline one, so
each attempt measures the two back to back and the test passes on the first attempt that keeps RATIO; a front end
that costs the engine steps loses them on every attempt and still fails. `benchmarks/compare_serving.py` measures
the share on a GPU."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from core_factories import FixedTimeCore
from live_server import LiveServer, one_torch_thread
from specserve import SamplingParams
from specserve.config import EngineConfig
from specserve.engine.engine import LLMEngine

CONCURRENCY, NUM_PROMPTS, MAX_TOKENS = 16, 64, 96
ATTEMPTS = 3
# Below what an idle machine keeps: the suite's other worker takes a core from the served run's three processes.
RATIO = 0.65
ENGINE = dict(max_model_len=512, num_kv_blocks=1024, max_num_seqs=CONCURRENCY)


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    with one_torch_thread():
        yield


def prompts() -> list[str]:
    return [f"Question {i}: what comes after the number {i}?" for i in range(NUM_PROMPTS)]


def offline_tokens_per_s(model: str) -> float:
    engine = LLMEngine(EngineConfig(model=model, **ENGINE), core_factory=FixedTimeCore)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, output_kind="final_only")
    start, tokens = time.perf_counter(), 0
    for p in prompts():
        engine.add_request(p, params)
    while engine.has_unfinished_requests():
        tokens += sum(len(o.outputs[0].token_ids) for o in engine.step())
    return tokens / (time.perf_counter() - start)


def served_tokens_per_s(model: str, dataset: Path) -> float:
    with LiveServer(model, core_factory=FixedTimeCore, **ENGINE) as server:
        # The load generator runs in a process of its own, as a real client would.
        out = subprocess.run([sys.executable, "-m", "specserve.entrypoints.cli", "bench", "serve", "--base-url",
                              server.url, "--endpoint", "completions", "--dataset", str(dataset), "--num-prompts",
                              str(NUM_PROMPTS), "--concurrency", str(CONCURRENCY), "--max-tokens", str(MAX_TOKENS),
                              "--ignore-eos"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert re.search(r"Failed requests: +0\n", out.stdout), out.stdout
    return float(re.search(r"Output token throughput \(tok/s\): +([\d.]+)", out.stdout).group(1))


def test_serving_keeps_most_of_offline_throughput(tiny_llama, tmp_path):
    model = str(tiny_llama[0])
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts()))
    ratios = []
    for _ in range(ATTEMPTS):
        offline = offline_tokens_per_s(model)
        served = served_tokens_per_s(model, dataset)
        ratios.append(served / offline)
        print(f"offline {offline:.0f} tok/s, served {served:.0f} tok/s ({served / offline:.0%})")
        if served >= RATIO * offline:
            return
    pytest.fail(f"served/offline throughput {', '.join(f'{r:.0%}' for r in ratios)}: below {RATIO:.0%} on every "
                "attempt")
