"""The cost of grammar-constrained decoding: output tokens/s with every request under a JSON schema beside the same
requests unconstrained, at each batch size, with and without speculation, and the host time spent building the
steps' grammar masks: the target's (StepMasks.build) and, with speculation, the drafter's (each draft depth's
DraftMasks._build, once its drafts are back).

    python benchmarks/structured_output_cost.py --model smollm2-135m --dataset mt_bench.jsonl \
        [--spec '{"method": "eagle3", "model": "smollm2-135m-eagle3", "num_speculative_tokens": 3}' [--spec ...]] \
        [--batch-sizes 1,64] [--max-tokens 256] [--json OUT.json]
    python benchmarks/structured_output_cost.py --model llama3-8b --tokenizer smollm2-135m --dataset ... \
        [--spec '{"method": "eagle3", "model": "random", "num_speculative_tokens": 3, "forced_acceptance_prob": 0.8}']

A shape name (specserve/bench/models.py) as --model is that shape with random weights and the vocabulary of
--tokenizer, whose grammar masks it then applies: the cost of the masks beside a larger model's step. With a shape,
a --spec whose model is "random" drafts with a random EAGLE-3 head of the shape's size; its drafts are masked like
a trained head's, and forced_acceptance_prob stands in for the acceptance a trained head would reach.

Each batch size runs --rounds rounds of both arms, alternating, and reports each arm's median round (a small model's
unconstrained arm is host-bound and varies from run to run), with the rounds' range.
Both arms generate exactly --max-tokens tokens per request, so their batches stay full equally long: the
unconstrained arm ignores EOS, and the schema (an array of at least SCHEMA_MIN_ITEMS objects) cannot be complete
in fewer tokens. Greedy, the model's own chat template, the same prompts in both arms. The table goes to stdout.
The schema bounds no string's length: xgrammar's masks inside a string with maxLength cost some 50 times more
host time (each length is a grammar state of its own), a cost of the grammar and not of the engine.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specserve.bench.models import SHAPES, prepare_model, write_random_eagle3_head
from specserve.entrypoints.openai.bench_serve import load_prompts
from specserve.llm import LLM
from specserve.models.loader import load_tokenizer, open_model_source
from specserve.sampling_params import SamplingParams
from specserve.spec_decode.tree import DraftTree
from specserve.structured_output.spec import StructuredOutput, StructuredOutputKind
from specserve.structured_output.draft_masks import DraftMasks
from specserve.structured_output.step_masks import StepMasks

SCHEMA_MIN_ITEMS = 200
SCHEMA = {
    "type": "object",
    "properties": {"answers": {"type": "array", "minItems": SCHEMA_MIN_ITEMS, "items": {
        "type": "object",
        "properties": {"topic": {"type": "string"},
                       "score": {"type": "integer", "minimum": 0, "maximum": 10},
                       "kind": {"enum": ["fact", "opinion", "question"]}},
        "required": ["topic", "score", "kind"]}}},
    "required": ["answers"],
}
INSTRUCTION = "\n\nAnswer as JSON: a list of answers, each with a topic, a score from 0 to 10 and its kind."


@dataclass
class ArmResult:
    output_tokens: int
    duration_s: float
    steps: int
    mask_build_s: float
    draft_mask_build_s: float
    mean_acceptance_length: float | None

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.duration_s


class MaskTimer:
    """Accumulates the host time of one function that builds masks (the part of a step that grammars add on
    the host): StepMasks.build (the target's) or DraftMasks._build (a draft depth's, after its drafts are
    back)."""

    def __init__(self, owner: type, name: str) -> None:
        self.seconds = 0.0
        build = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return build(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        setattr(owner, name, staticmethod(timed) if isinstance(owner.__dict__[name], staticmethod) else timed)


class StepCounter:
    def __init__(self, runner) -> None:
        self.steps = 0
        launch = runner.launch

        def counted(sched, *args):
            self.steps += 1
            return launch(sched, *args)

        runner.launch = counted


def run_arm(llm: LLM, inputs: list[list[int]], params: SamplingParams, repeats: int, masks: MaskTimer,
            draft_masks: MaskTimer, counter: StepCounter) -> ArmResult:
    stats = llm.engine.spec_stats
    before = (stats.num_steps, stats.num_emitted, masks.seconds, counter.steps, draft_masks.seconds)
    tokens, start = 0, time.perf_counter()
    for _ in range(repeats):
        outs = llm.generate(inputs, params, use_tqdm=False)
        for o in outs:
            n = len(o.outputs[0].token_ids)
            if n != params.max_tokens:
                raise SystemExit(f"a request stopped after {n} of {params.max_tokens} tokens "
                                 f"({o.outputs[0].finish_reason}); the arms would not be comparable")
            tokens += n
    duration = time.perf_counter() - start
    spec_steps, emitted = stats.num_steps - before[0], stats.num_emitted - before[1]
    return ArmResult(tokens, duration, counter.steps - before[3], masks.seconds - before[2],
                     draft_masks.seconds - before[4], emitted / spec_steps if spec_steps else None)


def median_round(results: list[ArmResult]) -> dict:
    """The round of median tok/s (the lower middle one of an even count), with every round's tok/s."""
    ranked = sorted(results, key=lambda r: r.tok_s)
    median = ranked[(len(ranked) - 1) // 2]
    return asdict(median) | {"tok_s": median.tok_s, "tok_s_rounds": [r.tok_s for r in results]}


RANDOM_HEAD = "random"


def engine_source(model: str, tokenizer: str | None) -> tuple[str, dict]:
    """The model path and the LLM's extra arguments: a shape gets random weights and the tokenizer's vocabulary."""
    if model not in SHAPES:
        return model, {} if tokenizer is None else {"tokenizer": tokenizer}
    if tokenizer is None:
        raise SystemExit(f"--model {model} is a shape without a real vocabulary; give --tokenizer (e.g. smollm2-135m)")
    path = Path(prepare_model(model, Path(tempfile.mkdtemp()), torch.bfloat16).path)
    vocab = len(load_tokenizer(open_model_source(str(path)), tokenizer))
    config = json.loads((path / "config.json").read_text()) | {"vocab_size": vocab}
    (path / "config.json").write_text(json.dumps(config))
    return str(path), {"tokenizer": tokenizer, "load_format": "dummy"}


def spec_label(spec: dict) -> str:
    forced = spec.get("forced_acceptance_prob")
    tree = spec.get("speculative_token_tree")
    drafts = f"k={spec.get('num_speculative_tokens')}" if tree is None else f"tree of {DraftTree.build(tree).num_nodes}"
    return (f"{spec['method']} {drafts}"
            + ("" if forced is None else f" forced p={forced:g}")
            + (" unmasked drafts" if spec.get("mask_drafts") is False else ""))


def speculative_config(spec: dict, model: str, model_path: str) -> dict:
    """spec, its head written where it names RANDOM_HEAD (a random EAGLE-3 head of the shape model_path holds)."""
    if spec.get("model") != RANDOM_HEAD:
        return spec
    if model not in SHAPES:
        raise SystemExit(f"--spec's model {RANDOM_HEAD!r} is a random head for a shape; {model} has weights of its "
                         "own, so name its trained head")
    target = json.loads((Path(model_path) / "config.json").read_text())
    head = write_random_eagle3_head(Path(tempfile.mkdtemp()) / "head", target, torch.bfloat16,
                                    "cuda" if torch.cuda.is_available() else "cpu")
    return spec | {"model": str(head)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokenizer", help="the tokenizer, in place of the model's own; needed for a shape")
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--spec", action="append", default=[],
                    help="a speculative_config JSON measured besides no speculation; repeat for more")
    ap.add_argument("--batch-sizes", default="1,64")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--min-tokens-per-size", type=int, default=4096,
                    help="each batch size repeats its batch until it generates at least this many tokens")
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds of both arms, alternating; each arm's figures are its median round's (by tok/s)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    if a.rounds < 1:
        raise SystemExit(f"--rounds must be at least 1, got {a.rounds}")
    sizes = [int(x) for x in a.batch_sizes.split(",")]
    prompts = load_prompts(a.dataset, max(sizes))
    masks, draft_masks = MaskTimer(StepMasks, "build"), MaskTimer(DraftMasks, "_build")
    constrained = SamplingParams(temperature=0.0, max_tokens=a.max_tokens,
                                 structured_output=StructuredOutput(StructuredOutputKind.JSON_SCHEMA, SCHEMA))
    free = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
    model, extra = engine_source(a.model, a.tokenizer)
    rows = []
    for spec in [None] + [speculative_config(json.loads(s), a.model, model) for s in a.spec]:
        llm = LLM(model, max_num_seqs=max(sizes), speculative_config=spec, **extra)
        counter = StepCounter(llm.engine.core.runner)
        inputs = [llm.apply_chat_template([{"role": "user", "content": p + INSTRUCTION}]) for p in prompts]
        warm = SamplingParams(temperature=0.0, max_tokens=16, structured_output=constrained.structured_output)
        llm.generate(inputs, warm, use_tqdm=False)  # compiles the grammar, captures, warms every batch size
        for b in sizes:
            repeats = max(1, -(-a.min_tokens_per_size // (b * a.max_tokens)))
            runs: dict[str, list[ArmResult]] = {"free": [], "json_schema": []}
            for _ in range(a.rounds):
                for name, params in (("free", free), ("json_schema", constrained)):
                    runs[name].append(run_arm(llm, inputs[:b], params, repeats, masks, draft_masks, counter))
            row = dict(spec="none" if spec is None else spec_label(spec),
                       batch=b, **{name: median_round(r) for name, r in runs.items()})
            rows.append(row)
            print(json.dumps(row), flush=True)
            if a.json:
                a.json.write_text(json.dumps(rows, indent=1))
        del llm
    print(f"\n(median of {a.rounds} rounds, arms alternating)")
    print("| speculation | batch | free tok/s | json_schema tok/s | constrained / free | rounds' range free / json "
          "| mask build ms/step | drafter's mask build ms/step | steps free / json | mean acceptance free / json |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        f, c = r["free"], r["json_schema"]
        acc = " / ".join("-" if a["mean_acceptance_length"] is None else f"{a['mean_acceptance_length']:.2f}"
                         for a in (f, c))
        spread = " / ".join(f"{min(a['tok_s_rounds']):,.0f}-{max(a['tok_s_rounds']):,.0f}" for a in (f, c))
        print(f"| {r['spec']} | {r['batch']} | {f['tok_s']:,.0f} | {c['tok_s']:,.0f} | {c['tok_s'] / f['tok_s']:.0%} "
              f"| {spread} "
              f"| {1e3 * c['mask_build_s'] / max(c['steps'], 1):.3f} "
              f"| {1e3 * c['draft_mask_build_s'] / max(c['steps'], 1):.3f} | {f['steps']} / {c['steps']} | {acc} |")


if __name__ == "__main__":
    main()
