"""The engine's host time per decode step, by part, at large batches (CPU).

The model is a one-layer stand-in whose forward and greedy sampling are replaced by stubs returning
zeros (on a GPU they run on the device, and their CPU compute would only add noise here): what is left is the Python
work every step does per request (scheduling, KV blocks, inputs, outputs and detokenization). On a GPU
that work overlaps the device's step under asynchronous scheduling, and a small target at a large
batch (train-eagle's data generation) waits on it once it is longer.

    python benchmarks/host_overhead.py --batch-sizes 64 256 --prompt-len 300
"""
from __future__ import annotations

import argparse
import functools
import json
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from specserve.bench.models import _save_tokenizer
from specserve.llm import LLM
from specserve.sampling_params import SamplingParams

STAND_IN = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=32, intermediate_size=64,
                num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, vocab_size=4096,
                max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True)
PARTS = (("scheduler", "schedule"), ("scheduler", "update"), ("processor", "process"), ("runner", "launch"))


def measure(root: Path, batch: int, prompt_len: int, steps: int, detokenize: bool, output_kind: str) -> dict[str, float]:
    """Milliseconds per step: in total and in each part of PARTS."""
    llm = LLM(str(root), device="cpu", max_model_len=2048, max_num_seqs=batch, load_format="dummy",
              num_kv_blocks=max(batch * (prompt_len + steps + 40) // 16, 2048 // 16) + 64)
    engine = llm.engine
    hidden = STAND_IN["hidden_size"]
    engine.runner._target_forward = lambda desc, metadata: (torch.zeros(desc.num_tokens, hidden), [])
    engine.runner.model.greedy_tokens = lambda h, mask=None: torch.zeros(h.shape[0], dtype=torch.int64)
    owners = {"scheduler": engine.scheduler, "processor": engine.processor, "runner": engine.runner}
    totals: dict[str, float] = defaultdict(float)
    for owner, name in PARTS:
        f = getattr(owners[owner], name)

        @functools.wraps(f)
        def timed(*a, _f=f, _key=f"{owner}.{name}", **kw):
            t = time.perf_counter()
            try:
                return _f(*a, **kw)
            finally:
                totals[_key] += time.perf_counter() - t

        setattr(owners[owner], name, timed)
    # Timed to the end of every request, so that what a request costs when it finishes (a FINAL_ONLY request's
    # output, decoded then) counts.
    params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True, detokenize=detokenize,
                            output_kind=output_kind)
    for i in range(batch):
        engine.add_request([3 + (i * 7 + j) % 4000 for j in range(prompt_len)], params)
    while any(r.num_output_tokens < 2 for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    totals.clear()
    start, timed_steps = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        engine.step()
        timed_steps += 1
    totals["step"] = time.perf_counter() - start
    return {k: 1000 * v / timed_steps for k, v in totals.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--prompt-len", type=int, default=300)
    ap.add_argument("--steps", type=int, default=100)
    a = ap.parse_args()
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp())
    (root / "config.json").write_text(json.dumps(STAND_IN))
    _save_tokenizer(root, STAND_IN["vocab_size"])
    print("us per request per step (host time; the model's forward and argmax are stubs)")
    keys = ["step"] + [f"{o}.{n}" for o, n in PARTS]
    print(f"{'batch':>5} {'detokenize':>10} {'output_kind':>11} " + " ".join(f"{k:>22}" for k in keys))
    for batch in a.batch_sizes:
        for detokenize, kind in ((True, "cumulative"), (True, "delta"), (True, "final_only"), (False, "final_only")):
            ms = measure(root, batch, a.prompt_len, a.steps, detokenize, kind)
            print(f"{batch:>5} {str(detokenize):>10} {kind:>11} "
                  + " ".join(f"{1000 * ms[k] / batch:>22.1f}" for k in keys))


if __name__ == "__main__":
    main()
