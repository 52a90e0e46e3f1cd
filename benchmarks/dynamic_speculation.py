"""Dynamic speculation on a real model and head: output tokens/s without speculation, always drafting, and with the
dynamic policy (docs/design.md, 'Dynamic speculation'), at each batch size and temperature, in one process.

    python benchmarks/dynamic_speculation.py --model smollm2-135m --prompts mt_bench.jsonl \
        --speculative-config '{"method": "eagle3", "model": "smollm2-135m-eagle3", "speculative_token_tree": TREE}' \
        [--batch-sizes 1,8,32,64,128] [--temperatures 0,1] [--max-tokens 256] [--rounds 3] [--json OUT.json]

The three engines are built first (each with max_num_seqs the largest batch size), then every round runs every
(batch, temperature) through each of them in turn, so a host that slows during the process slows them alike. A run
at batch B generates B prompts at once, all to --max-tokens tokens (EOS ignored, so the batch stays full), and
repeats with the next B prompts of the file until it has --min-tokens tokens. Round 0 is a warm-up, untimed: the
dynamic policy measures its decisions online, and what it keeps is what serving it for a while gets. The engines
run in turn, in the opposite order every other round, so each engine's run sits beside no speculation's of the
same round. Reported: each engine's median round; its speedup over no speculation, the median over rounds of the
round's ratio (the host's speed drifts between rounds far more than within one, so paired ratios cancel most of
it) with the least and the most in brackets; the share of the dynamic engine's steps that drafted; and what its
policy measured last in each batch bucket. The table goes to stdout.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass, field

from specserve.llm import LLM
from specserve.prompt_files import load_prompt_file, prompt_token_ids
from specserve.sampling_params import SamplingParams

ENGINES = ("none", "always", "dynamic")


@dataclass
class Cell:
    """One (batch, temperature): tokens/s of each engine in each timed round, and the dynamic engine's steps."""

    batch: int
    temperature: float
    rounds: dict[str, list[float]] = field(default_factory=lambda: {e: [] for e in ENGINES})
    steps_drafting: int = 0
    steps_without_drafts: int = 0

    def median(self, engine: str) -> float:
        return statistics.median(self.rounds[engine])

    def ratios(self, engine: str) -> list[float]:
        """Each timed round's tokens/s of engine over no speculation's in the same round."""
        return [r / n for r, n in zip(self.rounds[engine], self.rounds["none"])]

    def against_none(self, engine: str) -> str:
        if not self.rounds[engine]:
            return "-"
        ratios = self.ratios(engine)
        return (f"{self.median(engine):,.0f} ({statistics.median(ratios):.2f}x; "
                f"{min(ratios):.2f}-{max(ratios):.2f})")

    def row(self) -> str:
        steps = self.steps_drafting + self.steps_without_drafts
        share = f"{self.steps_drafting / steps:.0%}" if steps else "-"
        return (f"| {self.batch} | {self.temperature:g} | {self.median('none'):,.0f} | {self.against_none('always')} "
                f"| **{self.against_none('dynamic')}** | {share} |")


def build(model: str, spec: dict | None, max_num_seqs: int, kv_bytes: int) -> LLM:
    return LLM(model, max_num_seqs=max_num_seqs, kv_cache_memory_bytes=kv_bytes, speculative_config=spec)


def timed(llm: LLM, prompts: list[list[int]], start: int, batch: int, params: SamplingParams,
          min_tokens: int) -> float:
    """Output tokens/s of generating `batch` prompts at once from prompts[start:], again with the next ones, until
    min_tokens tokens."""
    waves = max(1, math.ceil(min_tokens / (batch * params.max_tokens)))
    tokens, began = 0, time.perf_counter()
    for w in range(waves):
        chosen = [prompts[(start + w * batch + i) % len(prompts)] for i in range(batch)]
        outs = llm.generate(chosen, params, use_tqdm=False)
        tokens += sum(len(o.outputs[0].token_ids) for o in outs)
    return tokens / (time.perf_counter() - began)


def measured_rates(policy) -> list[dict]:
    """What the dynamic policy measured, per kind of step and batch bucket: tokens/s of each decision (drafts a
    request) over its measured steps, and the decision in force."""
    return [{"kind": kind.name, "bucket": bucket, "decision": state.current,
             "rates": {d: {"tokens_per_s": round(r.tokens_per_second), "steps": r.count}
                       for d, r in state.rates.items()}}
            for kind, steps in policy.measured_steps.items() for bucket, state in sorted(steps.buckets.items())]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prompts", required=True, help="JSONL prompts (as eval-acceptance reads them)")
    p.add_argument("--speculative-config", required=True, help="JSON, without 'dynamic' (the script sets it)")
    p.add_argument("--batch-sizes", default="1,8,32,64,128")
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--min-tokens", type=int, default=2048, help="tokens a run generates at least")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds, after one untimed warm-up round")
    p.add_argument("--kv-cache-memory-gib", type=float, default=4.0)
    p.add_argument("--engines", default=",".join(ENGINES), help="of none,always,dynamic (none is always run)")
    p.add_argument("--json", help="write the raw rounds here")
    a = p.parse_args()
    spec = json.loads(a.speculative_config)
    if "dynamic" in spec:
        raise SystemExit("--speculative-config: leave out 'dynamic'; the script runs the config with it and without")
    batches = [int(b) for b in a.batch_sizes.split(",")]
    temperatures = [float(t) for t in a.temperatures.split(",")]
    kv_bytes = int(a.kv_cache_memory_gib * 2**30)
    specs = {"none": None, "always": spec, "dynamic": {**spec, "dynamic": True}}
    chosen = [e for e in ENGINES if e == "none" or e in a.engines.split(",")]
    engines = {name: build(a.model, specs[name], max(batches), kv_bytes) for name in chosen}
    conversations = load_prompt_file(a.prompts)
    prompts = [prompt_token_ids(engines["none"], c) for c in conversations]
    cells = [Cell(b, t) for b in batches for t in temperatures]
    policy = engines["dynamic"].engine.core.scheduler.policy if "dynamic" in engines else None
    for r in range(a.rounds + 1):
        for cell in cells:
            params = SamplingParams(temperature=cell.temperature, max_tokens=a.max_tokens, ignore_eos=True)
            start = r * cell.batch
            drafting, without = (policy.steps_drafting, policy.steps_without_drafts) if policy else (0, 0)
            for name in (list(engines) if r % 2 else list(engines)[::-1]):
                rate = timed(engines[name], prompts, start, cell.batch, params, a.min_tokens)
                if r:
                    cell.rounds[name].append(rate)
            if r and policy:
                cell.steps_drafting += policy.steps_drafting - drafting
                cell.steps_without_drafts += policy.steps_without_drafts - without
        print(f"round {r}{' (warm-up)' if r == 0 else ''} done", flush=True)
    print("| batch | T | no speculation tok/s | always drafting (x none: median; range of rounds) "
          "| dynamic (x none: median; range of rounds) | dynamic's steps drafting |")
    print("|---|---|---|---|---|---|")
    for cell in cells:
        print(cell.row())
    rates = measured_rates(policy) if policy else []
    for m in rates:
        print(f"measured {m['kind']} batch <= {m['bucket']}: deciding {m['decision']}; " + ", ".join(
            f"{d} drafts {r['tokens_per_s']:,} tok/s over {r['steps']} steps" for d, r in m["rates"].items()))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "cells": [asdict(c) for c in cells], "measured": rates}, f, indent=1)


if __name__ == "__main__":
    main()
