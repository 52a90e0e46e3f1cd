"""`specserve eval-acceptance --suite DIR`: acceptance per category of an evaluation suite.

A suite is a directory of prompt files (prompt_files.py), one per category,
named by its stem (`chat.jsonl` is the category "chat"); the project's own is
`benchmarks/acceptance_suite/` (its MANIFEST.md says where each category comes
from). Every line is played whole: a dialogue's later user turns follow the
model's own answers, so a multi-turn category measures what a chat's later
turns draft. One engine per k serves every category (eval_acceptance.py,
run_prompt_sets), and each category gets its own figures: a head that drafts
chat well and long documents poorly shows it here, where one prompt file's
mean would hide it.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specserve.errors import ConfigError
from specserve.prompt_files import Dialogue, load_dialogues


@dataclass(frozen=True)
class SuiteCategory:
    name: str
    path: Path
    dialogues: list[Dialogue]


def load_suite(directory: str | Path, categories: list[str] | None = None,
               limit: int | None = None) -> list[SuiteCategory]:
    """The suite's categories (all, or those named, in that order), each with at most `limit` dialogues."""
    root = Path(directory).expanduser()
    if not root.is_dir():
        raise ConfigError("suite", f"{root} is not a directory; give a directory of JSONL prompt files, one per "
                          "category, e.g. benchmarks/acceptance_suite")
    files = {p.stem: p for p in sorted(root.glob("*.jsonl"))}
    if not files:
        raise ConfigError("suite", f"{root} holds no .jsonl prompt files; give a directory of them, one per category")
    names = categories or list(files)
    unknown = [n for n in names if n not in files]
    if unknown:
        raise ConfigError("categories", f"{unknown} are not categories of {root}; it has {sorted(files)}")
    return [SuiteCategory(n, files[n], load_dialogues(files[n], limit)) for n in dict.fromkeys(names)]


def evaluate_suite(model: str, spec_config: dict, suite: str, temperatures: list[float], ks: list[int],
                   max_tokens: int, num_prompts: int | None, baseline: bool, engine_kwargs: dict,
                   categories: list[str] | None = None, repeats: int = 1, interleave: bool = False) -> dict:
    """Every (k, temperature), and the baseline, per category; the report as JSON-ready data."""
    from specserve.entrypoints.eval_acceptance import run_prompt_sets, runs_report

    loaded = load_suite(suite, categories, num_prompts)
    runs = run_prompt_sets(model, spec_config, {c.name: c.dialogues for c in loaded}, temperatures, ks,
                           max_tokens, baseline, engine_kwargs, repeats, interleave)
    return {
        "model": model, "speculative_config": spec_config, "suite": str(suite), "max_tokens": max_tokens,
        "repeats": repeats, "interleaved": interleave, "all_turns": True,
        "categories": [{"category": c.name, "prompts": str(c.path), "num_prompts": len(c.dialogues),
                        "num_turns": sum(1 + len(d.later_turns) for d in c.dialogues),
                        **runs_report(runs[c.name], interleave)} for c in loaded],
    }


def format_suite_table(report: dict) -> str:
    """Each category's full table, then the mean acceptance length of every category at each (k, temperature)."""
    from specserve.entrypoints.eval_acceptance import format_table

    parts = []
    for c in report["categories"]:
        parts += [f"== {c['category']}: {c['num_prompts']} prompts, {c['num_turns']} turns", format_table(c), ""]
    columns = [(r["k"], r["temperature"]) for r in report["categories"][0]["results"]]
    width = max(len(c["category"]) for c in report["categories"] + [{"category": "category"}])
    head = f"{'category':<{width}} " + " ".join(f"{f'k={k} T={t:g}':>10}" for k, t in columns)
    lines = ["mean acceptance length per category", head, "-" * len(head)]
    for c in report["categories"]:
        by_column = {(r["k"], r["temperature"]): r["mean_acceptance_length"] for r in c["results"]}
        lines.append(f"{c['category']:<{width}} " + " ".join(f"{by_column[col]:>10.2f}" for col in columns))
    return "\n".join(parts + lines)
