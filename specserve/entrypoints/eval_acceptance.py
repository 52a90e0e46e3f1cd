"""`specserve eval-acceptance`: how many tokens a speculator gets accepted, over temperatures and k.

Over one prompt file (--prompts), or per category of a suite (--suite,
acceptance_suite.py); --all-turns plays a line's later user turns too, each
after the model's own answer to the one before.

For each k one engine is built with the speculative config at
num_speculative_tokens = k, and every temperature runs the prompts through
it. Figures come from the engine's own acceptance statistics
(LLMEngine.spec_stats), taken as the difference across each run: mean
acceptance length (accepted drafts + the bonus token, per verification step),
acceptance rate per draft position, and output tokens per second, beside
the same prompts without speculation. With --repeats N every run is timed
N times over the same engine and tokens/s is the median repeat's, so that
an A/B can tell the spread inside a process from the spread between
processes; acceptance figures then count all N.

With --interleave every engine (no speculation and each k) is built first and
the timed runs go round robin, one of each per round: a host that slows down
during the process (a step's host time can grow from run to run, and differ
between processes) then slows every engine alike, and
each speculative run's speedup over the baseline run of its own round is
reported beside the ratio of the medians.
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import logging
import statistics
import sys
import time
from dataclasses import dataclass

from specserve.prompt_files import Dialogue
from specserve.spec_decode.metrics import SpecDecodeStats

logger = logging.getLogger(__name__)


@dataclass
class RunResult:
    temperature: float
    k: int | None  # None: no speculation
    output_tokens: int  # over every repeat
    seconds: float
    stats: SpecDecodeStats | None
    repeat_tokens_per_s: tuple[float, ...] = ()  # each timed repeat's, when repeated

    @property
    def tokens_per_s(self) -> float:
        """Output tokens per second; the median repeat's when repeated."""
        if self.repeat_tokens_per_s:
            return statistics.median(self.repeat_tokens_per_s)
        return self.output_tokens / self.seconds if self.seconds else 0.0

    def as_dict(self, baseline: "RunResult | None", paired: bool = False) -> dict:
        """paired: repeat i of this run and of baseline were timed in the same round (--interleave)."""
        out = {"temperature": self.temperature, "k": self.k, "output_tokens": self.output_tokens,
               "seconds": round(self.seconds, 3), "tokens_per_s": round(self.tokens_per_s, 1)}
        if self.repeat_tokens_per_s:
            out["repeat_tokens_per_s"] = [round(r, 1) for r in self.repeat_tokens_per_s]
        if self.stats is not None:
            out.update(self.stats.as_dict(), num_emitted=self.stats.num_emitted)
        if baseline is not None and baseline.tokens_per_s:
            out["speedup"] = round(self.tokens_per_s / baseline.tokens_per_s, 3)
            if paired and self.repeat_tokens_per_s:
                rounds = [r / b for r, b in zip(self.repeat_tokens_per_s, baseline.repeat_tokens_per_s)]
                out["round_speedups"] = [round(x, 3) for x in rounds]
                out["paired_speedup"] = round(statistics.median(rounds), 3)
        return out


def _combined(a: SpecDecodeStats, b: SpecDecodeStats, sign: int) -> SpecDecodeStats:
    """a + sign * b, field by field; per-position counts past the shorter list count as 0."""
    def by_position(x: list[int], y: list[int]) -> list[int]:
        return [(x[i] if i < len(x) else 0) + sign * (y[i] if i < len(y) else 0) for i in range(max(len(x), len(y)))]

    return SpecDecodeStats(
        num_steps=a.num_steps + sign * b.num_steps, num_drafted=a.num_drafted + sign * b.num_drafted,
        num_accepted=a.num_accepted + sign * b.num_accepted, num_emitted=a.num_emitted + sign * b.num_emitted,
        accepted_per_position=by_position(a.accepted_per_position, b.accepted_per_position),
        drafted_per_position=by_position(a.drafted_per_position, b.drafted_per_position),
    )


def stats_between(before: SpecDecodeStats, after: SpecDecodeStats) -> SpecDecodeStats:
    """The statistics of what happened between two snapshots of one engine's counters."""
    return _combined(after, before, -1)


def stats_sum(parts: list[SpecDecodeStats]) -> SpecDecodeStats:
    """The statistics of several runs of one engine together."""
    total = SpecDecodeStats()
    for p in parts:
        total = _combined(total, p, 1)
    return total


@dataclass(frozen=True)
class TimedRun:
    tokens: int
    seconds: float
    stats: SpecDecodeStats | None


@dataclass(frozen=True)
class PreparedDialogue:
    """A dialogue with its opening already tokenized, so that timed runs do not tokenize it again."""

    dialogue: Dialogue
    opening_ids: list[int]


def timed_run(llm, prompts: list[PreparedDialogue], temperature: float, max_tokens: int,
              speculative: bool) -> TimedRun:
    """One timed run over the prompts, with the acceptance statistics it added to the engine's: every
    dialogue's opening in one generate, then each round of later turns in another, each turn after the
    model's own answer to the one before. Only the generate calls are timed."""
    from specserve.prompt_files import prompt_token_ids
    from specserve.sampling_params import SamplingParams

    before = copy.deepcopy(llm.engine.spec_stats)
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens)
    histories = [list(p.dialogue.opening) for p in prompts]
    ids = [p.opening_ids for p in prompts]
    live, turn, tokens, seconds = list(range(len(prompts))), 0, 0, 0.0
    while live:
        start = time.perf_counter()
        outs = llm.generate([ids[i] for i in live], params, use_tqdm=False)
        seconds += time.perf_counter() - start
        tokens += sum(len(o.outputs[0].token_ids) for o in outs)
        going_on = []
        for i, out in zip(live, outs):
            later = prompts[i].dialogue.later_turns
            if turn < len(later):
                histories[i] += [{"role": "assistant", "content": out.outputs[0].text},
                                 {"role": "user", "content": later[turn]}]
                ids[i] = prompt_token_ids(llm, histories[i])
                going_on.append(i)
        live, turn = going_on, turn + 1
    stats = stats_between(before, llm.engine.spec_stats) if speculative else None
    return TimedRun(tokens, seconds, stats)


def collect(temperature: float, k: int | None, runs: list[TimedRun]) -> RunResult:
    """The result of one (k, temperature) over its timed runs."""
    rates = tuple(r.tokens / r.seconds for r in runs) if len(runs) > 1 else ()
    stats = stats_sum([r.stats for r in runs]) if k is not None else None
    return RunResult(temperature, k, sum(r.tokens for r in runs), sum(r.seconds for r in runs), stats, rates)


def run_prompts(llm, prompts: list[PreparedDialogue], temperature: float, max_tokens: int, k: int | None,
                repeats: int = 1) -> RunResult:
    return collect(temperature, k, [timed_run(llm, prompts, temperature, max_tokens, k is not None)
                                    for _ in range(repeats)])


def log_run(name: str, run: RunResult) -> None:
    """A line per finished run, so that a long evaluation shows its progress."""
    accept = f", mean acceptance length {run.stats.mean_acceptance_length:.2f}" if run.stats else ""
    logger.info("%s, %s, temperature %g: %d tokens in %.1f s%s", name,
                "no speculation" if run.k is None else f"k={run.k}", run.temperature, run.output_tokens,
                run.seconds, accept)


def prime_prefix_cache(llm, prompts: list[list[int]]) -> None:
    """Run the prompts once, so that every timed run finds their full blocks in the prefix cache, the first
    included, and prefills only what is past their last full block. Kernel shapes need no such run: the engine's
    start-up warm-up has launched them all (engine/warmup.py), and leaves the prefix cache empty."""
    from specserve.sampling_params import SamplingParams

    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)


def run_prompt_sets(model: str, spec_config: dict, sets: dict[str, list[Dialogue]], temperatures: list[float],
                    ks: list[int], max_tokens: int, baseline: bool, engine_kwargs: dict, repeats: int = 1,
                    interleave: bool = False) -> dict[str, list[RunResult]]:
    """Every (k, temperature), and the baseline, over each named set of prompts: one engine per k serves
    every set, so the sets' figures compare like with like."""
    from specserve.config import EngineConfig
    from specserve.llm import LLM
    from specserve.prompt_files import prompt_token_ids

    settings = ([None] if baseline else []) + list(ks)
    kwargs = dict(engine_kwargs)
    if interleave and kwargs.get("kv_cache_memory_bytes") is None:
        # The engines live side by side: each sizes its cache within its part of the GPU's share.
        share = kwargs.get("gpu_memory_utilization", EngineConfig.gpu_memory_utilization)
        kwargs["gpu_memory_utilization"] = share / len(settings)

    def ready(k: int | None):
        spec = None if k is None else {**spec_config, "num_speculative_tokens": k}
        llm = LLM(model, speculative_config=spec, **kwargs)
        prepared = {name: [PreparedDialogue(d, prompt_token_ids(llm, d.opening)) for d in dialogues]
                    for name, dialogues in sets.items()}
        prime_prefix_cache(llm, [p.opening_ids for ps in prepared.values() for p in ps])
        return llm, prepared

    if interleave:
        engines = [(k, *ready(k)) for k in settings]
        timed: dict[tuple, list[TimedRun]] = {(n, k, t): [] for n in sets for k in settings for t in temperatures}
        for _ in range(repeats):
            for k, llm, prepared in engines:
                for name, prompts in prepared.items():
                    for t in temperatures:
                        timed[name, k, t].append(timed_run(llm, prompts, t, max_tokens, k is not None))
                        log_run(name, collect(t, k, timed[name, k, t][-1:]))
        del engines
        gc.collect()
        return {n: [collect(t, k, timed[n, k, t]) for k in settings for t in temperatures] for n in sets}
    runs: dict[str, list[RunResult]] = {name: [] for name in sets}
    for k in settings:
        llm, prepared = ready(k)
        for name, prompts in prepared.items():
            for t in temperatures:
                runs[name].append(run_prompts(llm, prompts, t, max_tokens, k, repeats))
                log_run(name, runs[name][-1])
        # Free this engine's KV cache and graphs before the next one allocates its own.
        del llm
        gc.collect()
    return runs


def runs_report(runs: list[RunResult], interleave: bool) -> dict:
    """The baseline and speculative runs of one prompt set, JSON-ready, each speedup over its temperature's
    baseline."""
    base = {r.temperature: r for r in runs if r.k is None}
    return {"baseline": [r.as_dict(None) for r in runs if r.k is None],
            "results": [r.as_dict(base.get(r.temperature), paired=interleave) for r in runs if r.k is not None]}


def selected_turns(dialogues: list[Dialogue], all_turns: bool) -> list[Dialogue]:
    """The dialogues as played: every user turn with all_turns, else the opening alone."""
    return dialogues if all_turns else [Dialogue(d.opening) for d in dialogues]


def evaluate(model: str, spec_config: dict, prompt_file: str, temperatures: list[float], ks: list[int],
             max_tokens: int, num_prompts: int | None, baseline: bool, engine_kwargs: dict, repeats: int = 1,
             interleave: bool = False, all_turns: bool = False) -> dict:
    """Run every (k, temperature) and the baseline; returns the report as JSON-ready data."""
    from specserve.prompt_files import load_dialogues

    dialogues = selected_turns(load_dialogues(prompt_file, limit=num_prompts), all_turns)
    runs = run_prompt_sets(model, spec_config, {prompt_file: dialogues}, temperatures, ks, max_tokens, baseline,
                           engine_kwargs, repeats, interleave)[prompt_file]
    return {
        "model": model, "speculative_config": spec_config, "prompts": prompt_file, "num_prompts": len(dialogues),
        "max_tokens": max_tokens, "repeats": repeats, "interleaved": interleave, "all_turns": all_turns,
        **runs_report(runs, interleave),
    }


def format_table(report: dict) -> str:
    ks = [r["k"] for r in report["results"]]
    width = max(ks, default=1)
    head = (f"{'temp':>5} {'k':>3} {'accept len':>10} {'accept rate':>11}  "
            f"{'acceptance per position':<{6 * width}} {'tok/s':>8} {'speedup':>7}")
    lines = [head, "-" * len(head)]
    def repeats(r: dict) -> str:
        rates = r.get("repeat_tokens_per_s")
        paired = f"; speedup in each round {' '.join(f'{x:.2f}' for x in r['round_speedups'])}, median " \
                 f"{r['paired_speedup']:.2f}" if "round_speedups" in r else ""
        return "  (repeats: " + " ".join(f"{x:.0f}" for x in rates) + paired + ")" if rates else ""

    for r in report["baseline"]:
        lines.append(f"{r['temperature']:>5.2f} {'-':>3} {'':>10} {'':>11}  {'(no speculation)':<{6 * width}} "
                     f"{r['tokens_per_s']:>8.1f} {'1.00':>7}{repeats(r)}")
    for r in report["results"]:
        per_pos = " ".join(f"{p:.2f}" for p in r["acceptance_per_position"])
        speedup = f"{r['speedup']:.2f}" if "speedup" in r else "-"
        lines.append(f"{r['temperature']:>5.2f} {r['k']:>3} {r['mean_acceptance_length']:>10.2f} "
                     f"{r['acceptance_rate']:>10.1%}  {per_pos:<{6 * width}} {r['tokens_per_s']:>8.1f} {speedup:>7}"
                     f"{repeats(r)}")
    return "\n".join(lines)


def add_eval_parser(sub: argparse._SubParsersAction) -> None:
    from specserve.entrypoints.cli import add_engine_args

    p = sub.add_parser("eval-acceptance", help="measure a speculator's acceptance over temperatures and k")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompts", help="JSONL prompts: {'prompt'}, MT-bench {'turns'} (first turn), ShareGPT "
                        "{'conversations'}, OpenAI {'messages'}")
    source.add_argument("--suite", metavar="DIR", help="a directory of JSONL prompt files, one per category (e.g. "
                        "benchmarks/acceptance_suite): figures per category, every user turn played")
    p.add_argument("--categories", nargs="+", help="with --suite: only these categories (default: all)")
    p.add_argument("--all-turns", action="store_true",
                   help="with --prompts: play every user turn of a line, each after the model's own answer to the "
                        "one before (default: the first turn only)")
    p.add_argument("--temperature", type=float, nargs="+", default=[0.0, 1.0], help="temperatures to run")
    p.add_argument("--k", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6], help="numbers of speculative tokens")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens generated per prompt at most")
    p.add_argument("--num-prompts", type=int, help="use the first N prompts (default: all)")
    p.add_argument("--no-baseline", action="store_true", help="skip the run without speculation")
    p.add_argument("--repeats", type=int, default=1,
                   help="time every run N times over the same engine; tok/s is the median repeat's")
    p.add_argument("--interleave", action="store_true",
                   help="build every engine first and time their runs round robin (see --repeats), so that a host "
                        "that slows during the process slows them alike; adds each round's speedup")
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON to PATH ('-' for stdout)")
    add_engine_args(p)
    p.set_defaults(func=cmd_eval_acceptance)


def _parse_spec(text: str | None, ks: list[int]) -> dict:
    """The speculative config as a dict, checked with every k so that a mistake fails before any model loads."""
    from specserve.errors import ConfigError
    from specserve.spec_decode.config import SpeculativeConfig

    if not text:
        raise ConfigError("speculative_config", 'is required, e.g. \'{"method": "eagle3", "model": "path/to/head"}\' '
                          "(num_speculative_tokens comes from --k)")
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError("speculative_config", f"is not valid JSON ({e})") from e
    if not isinstance(spec, dict):
        raise ConfigError("speculative_config", f"must be a JSON object, got {type(spec).__name__}")
    for k in ks:
        SpeculativeConfig.parse({**spec, "num_speculative_tokens": k})
    return spec


def cmd_eval_acceptance(a: argparse.Namespace) -> None:
    from specserve.entrypoints.cli import engine_kwargs
    from specserve.errors import ConfigError

    spec = _parse_spec(a.speculative_config, a.k)
    if min(a.temperature) < 0:
        raise ConfigError("temperature", f"got {a.temperature}; temperatures must be >= 0 (0 is greedy)")
    for name, value in (("max_tokens", a.max_tokens), ("num_prompts", a.num_prompts), ("repeats", a.repeats)):
        if value is not None and value < 1:
            raise ConfigError(name, f"must be >= 1, got {value}")
    if a.categories and not a.suite:
        raise ConfigError("categories", "picks categories of a suite; give --suite DIR, or leave --categories out")
    if a.all_turns and a.suite:
        raise ConfigError("all_turns", "is for --prompts; --suite always plays every turn")
    kwargs = engine_kwargs(a)
    del kwargs["speculative_config"]
    if a.suite:
        from specserve.entrypoints.acceptance_suite import evaluate_suite, format_suite_table, load_suite

        load_suite(a.suite, a.categories)  # a wrong directory or category fails before any model loads
        report = evaluate_suite(a.model, spec, a.suite, a.temperature, a.k, a.max_tokens, a.num_prompts,
                                not a.no_baseline, kwargs, a.categories, a.repeats, a.interleave)
        print(format_suite_table(report))
    else:
        report = evaluate(a.model, spec, a.prompts, a.temperature, a.k, a.max_tokens, a.num_prompts,
                          not a.no_baseline, kwargs, a.repeats, a.interleave, a.all_turns)
        print(format_table(report))
    if a.json == "-":
        json.dump(report, sys.stdout, indent=2)
        print()
    elif a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=2)
