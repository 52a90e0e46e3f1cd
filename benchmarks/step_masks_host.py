"""Host time of a step's grammar masks (StepMasks.build) at a batch size, on this machine's CPU: the engine's way
(one batched xgrammar call into the runner's pinned bitmask buffer) beside a call per request into a fresh
bitmask (xgrammar's allocate_token_bitmask, then a copy), and xgrammar's batch filler on a pool of threads.

    python benchmarks/step_masks_host.py [--model smollm2-135m] [--batch 64] [--repeats 200] [--threads 2,4]

Each request of the batch is under structured_output_cost.py's JSON schema, at its own point of a JSON text
that follows it (its first i * 7 tokens accepted), so the rows come from varied grammar states. Prints the
median and the minimum over the repeats, per step and per row.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import xgrammar as xgr

from specserve.engine.request import Request
from specserve.engine.scheduler import ScheduledRequest, SchedulerOutput
from specserve.models.loader import load_tokenizer, open_model_source
from specserve.sampling_params import SamplingParams
from specserve.structured_output.manager import StructuredOutputManager
from specserve.structured_output.spec import StructuredOutput, StructuredOutputKind
from specserve.structured_output.step_masks import StepMasks
from specserve.worker.input_buffers import TokenBitmaskBuffer
from structured_output_cost import SCHEMA

ANSWER = {"topic": "the weather in spring", "score": 7, "kind": "opinion"}


def scheduled_batch(model: str, batch: int) -> tuple[SchedulerOutput, int]:
    source = open_model_source(model)
    tokenizer = load_tokenizer(source)
    vocab = source.hf_config["vocab_size"]
    manager = StructuredOutputManager(tokenizer, vocab, {tokenizer.eos_token_id})
    spec = StructuredOutput(StructuredOutputKind.JSON_SCHEMA, SCHEMA)
    text = tokenizer.encode(json.dumps({"answers": [ANSWER] * 40}), add_special_tokens=False)
    scheduled = []
    for i in range(batch):
        grammar = manager.grammar_for(spec)
        for token in text[:(i * 7) % len(text)]:
            if not grammar.accept(token):
                raise SystemExit(f"the JSON text's token {token} is refused: the schema and the text disagree")
        request = Request(f"r{i}", [1], SamplingParams(temperature=0, max_tokens=8), set(), 4096, grammar=grammar)
        scheduled.append(ScheduledRequest(request, 1, [], [], True, 1))
    return SchedulerOutput(scheduled), vocab


def timed(fn, repeats: int) -> list[float]:
    fn()
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--threads", default="2,4", help="thread counts of xgrammar's batch filler to measure")
    a = ap.parse_args()
    # The allocation of a fresh bitmask on torch's intra-op threads costs milliseconds on a busy machine.
    torch.set_num_threads(1)
    sched, vocab = scheduled_batch(a.model, a.batch)
    rows = list(range(a.batch))
    words = -(-vocab // 32)
    # One tensor for the host's and the device's buffer, as a CPU engine has: on a GPU the copy is a DMA from
    # pinned memory, which takes no host time, and here it would time torch's CPU copy instead.
    host = torch.full((a.batch, words), -1, dtype=torch.int32)
    buffer = TokenBitmaskBuffer(host, host, torch.ones(1, dtype=torch.int64))
    matchers = [s.request.grammar.matcher for s in sched.scheduled]

    def per_request():
        bitmask = xgr.allocate_token_bitmask(a.batch, vocab)
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, i)

    ways = {"StepMasks.build (batched call, pinned buffer)":
            lambda: StepMasks.build(sched, rows, [], buffer, lambda s: []),
            "a call per request, fresh bitmask": per_request}
    for n in (int(t) for t in a.threads.split(",") if t):
        filler = xgr.BatchGrammarMatcher(max_threads=n)
        ways[f"batch filler, {n} threads"] = lambda f=filler: f.batch_fill_next_token_bitmask(matchers, buffer.host)
    print(f"batch {a.batch}, vocabulary {vocab}, torch threads {torch.get_num_threads()}")
    for name, fn in ways.items():
        t = timed(fn, a.repeats)
        med, low = statistics.median(t), min(t)
        print(f"{name:50s} median {med * 1e6:8.1f} us ({med * 1e6 / a.batch:5.2f} a row), min {low * 1e6:8.1f} us")


if __name__ == "__main__":
    main()
