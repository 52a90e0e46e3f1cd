"""The CPU path runs where Triton is not installed: the package imports, the offline API and the CLI generate.

Each check runs in a fresh process in which `import triton` fails (its sys.modules entry is None, as for a
module that is not installed), so nothing imported before the test can hide an import of Triton.
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NO_TRITON = "import sys; sys.modules['triton'] = None\n"


def run_without_triton(code: str) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", NO_TRITON + code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_the_blocker_makes_triton_unimportable():
    out = run_without_triton("try:\n    import triton\nexcept ImportError:\n    print('blocked')")
    assert out.strip() == "blocked"


def test_every_cpu_entry_point_imports():
    run_without_triton("import specserve, specserve.llm, specserve.entrypoints.cli\n"
                       "from specserve.entrypoints.cli import build_parser\n"
                       "build_parser()")


@pytest.mark.slow
def test_llm_and_cli_generate_on_cpu():
    out = run_without_triton(
        "from specserve import LLM, SamplingParams\n"
        "from specserve.entrypoints.cli import main\n"
        "llm = LLM('smollm2-135m', device='cpu', kv_cache_memory_bytes=2**30)\n"
        "out = llm.generate(['The capital of France is'], SamplingParams(temperature=0, max_tokens=8),\n"
        "                   use_tqdm=False)[0].outputs[0]\n"
        "print('LLM', len(out.token_ids), repr(out.text))\n"
        "del llm\n"
        "assert main(['generate', '--device', 'cpu', '--max-tokens', '8', 'The capital of France is']) == 0\n"
        "print('kernel modules', sorted(m for m in sys.modules if m.startswith('specserve.kernels.')))\n")
    llm_line = next(line for line in out.splitlines() if line.startswith("LLM "))
    count, text = llm_line.split(" ", 2)[1:]
    assert count == "8"
    # The CLI prints the same greedy continuation, and its token count.
    assert f"=== 'The capital of France is'\n{ast.literal_eval(text)}\n--- 8 tokens, finished: length" in out
    # Only the launch tables, plain data: no module that defines a Triton kernel.
    assert "kernel modules ['specserve.kernels.fp8_gemm_choice', 'specserve.kernels.small_m_configs']" in out
