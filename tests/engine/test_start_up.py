"""What an engine's start costs beyond its weights: nothing that a process pays for each engine it starts (a
server's core, every tensor-parallel rank), such as importing torch._dynamo, which torch does for an nn.Embedding
initialised on the meta device (models/parallel_layers.py, TargetEmbedding)."""
from __future__ import annotations

import subprocess
import sys

START = """
import sys
from specserve import LLM, SamplingParams
llm = LLM({path!r}, device="cpu", dtype="float32")
llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4), use_tqdm=False)
print("torch._dynamo" in sys.modules)
"""


def test_starting_an_engine_imports_no_dynamo(tiny_llama):
    done = subprocess.run([sys.executable, "-c", START.format(path=str(tiny_llama[0]))], capture_output=True,
                          text=True, timeout=300, check=True)
    assert done.stdout.split()[-1] == "False", done.stdout + done.stderr
