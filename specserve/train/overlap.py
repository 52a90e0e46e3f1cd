"""How much of an evaluation suite the trainer's data already holds, as shared word 8-grams.

    python -m specserve.train.overlap benchmarks/acceptance_suite [--prompts TRAIN.jsonl ...]

A head that saw a suite's documents or questions in training drafts their
answers from memory, and its acceptance there overstates what it does on
prompts it never saw. The trainer's own text is what it builds prompts from:
the topics, openers and follow-ups of questions.py, the templated requests of
request_templates.py (every seed a recipe uses), and the documents of
documents.py (every module's help, whole); --prompts adds prompt files a run
was given (scripts/build_prompt_set.py's, a work directory's prompts.jsonl).
What the target writes itself is not known before it runs; its prompts.jsonl
can be checked afterwards the same way.

A prompt's overlap is the share of its distinct word 8-grams found in that
text. A few shared 8-grams are phrases both sides use ("what is the
difference between", a function's signature quoted in two documents); a
document or question taken into training shares most of its 8-grams.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from specserve.entrypoints.acceptance_suite import load_suite
from specserve.prompt_files import load_dialogues
from specserve.text_ngrams import ngrams, words
from specserve.train import documents, questions
from specserve.train.request_templates import templated_requests

# The seeds the recipes in README.md and scripts/train_smollm2_head.sh give train-eagle, and templated
# requests enough per seed for every template slot to come up.
TEMPLATE_SEEDS = tuple(range(12))
TEMPLATES_PER_SEED = 4000


@dataclass(frozen=True)
class PromptOverlap:
    category: str
    index: int
    ngrams: int
    shared: int

    @property
    def share(self) -> float:
        return self.shared / self.ngrams if self.ngrams else 0.0


def training_texts(prompt_files: list[Path] = ()) -> list[str]:
    """Every text the trainer builds prompts from, and the prompts of the given files."""
    texts = [*questions.TOPICS, *questions.TASK_OPENERS, *questions.FOLLOW_UPS, *questions.PASSAGE_TASKS]
    texts += [r for seed in TEMPLATE_SEEDS for r in templated_requests(TEMPLATES_PER_SEED, seed)]
    texts += [documents.module_help(m) for m in documents.DOCUMENT_MODULES]
    texts += [*documents.SUMMARY_ASKS, *documents.QUESTION_ASKS, *documents.EXTRACTION_ASKS,
              documents.RETRIEVAL_FORMAT]
    for path in prompt_files:
        texts += [m["content"] for d in load_dialogues(path) for m in d.opening] + [
            t for d in load_dialogues(path) for t in d.later_turns]
    return texts


def suite_overlap(suite: str | Path, training: list[str]) -> list[PromptOverlap]:
    """Each suite prompt's distinct 8-grams (every turn of it) and how many of them the training text holds."""
    seen = set().union(*(ngrams(words(t)) for t in training))
    out = []
    for category in load_suite(suite):
        for i, d in enumerate(category.dialogues):
            grams = set().union(*(ngrams(words(m["content"])) for m in d.opening),
                                *(ngrams(words(t)) for t in d.later_turns))
            out.append(PromptOverlap(category.name, i, len(grams), len(grams & seen)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("suite", help="the suite's directory")
    parser.add_argument("--prompts", type=Path, nargs="*", default=[], help="training prompt files to add")
    a = parser.parse_args()
    rows = suite_overlap(a.suite, training_texts(a.prompts))
    print(f"{'category':<14} {'prompts':>7} {'8-grams':>8} {'shared':>7} {'max share':>9}")
    for name in dict.fromkeys(r.category for r in rows):
        mine = [r for r in rows if r.category == name]
        total, shared = sum(r.ngrams for r in mine), sum(r.shared for r in mine)
        print(f"{name:<14} {len(mine):>7} {total:>8} {shared:>7} {max(r.share for r in mine):>9.1%}")


if __name__ == "__main__":
    main()
