"""The acceptance suite: its categories, their sizes, and its separation from the trainer's data.

Separation is measured in shared word 8-grams (specserve/train/overlap.py). A prompt whose document or
question went into training shares most of its 8-grams with the training text (the planted one below
shares nearly all); phrases both sides happen to use share a few. So no prompt may share more than
MAX_PROMPT_SHARE of its 8-grams, and no category more than MAX_CATEGORY_SHARE of all of its own.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from specserve.entrypoints.acceptance_suite import load_suite
from specserve.train.documents import DOCUMENT_MODULES, module_help
from specserve.train.overlap import suite_overlap, training_texts

SUITE = Path(__file__).resolve().parents[1] / "benchmarks" / "acceptance_suite"
CATEGORIES = ["chat", "code", "extraction", "math", "rag", "summarization", "translation"]
LONG = {"summarization": (1000, 4000), "rag": (2000, 4000), "extraction": (1000, 4100)}
MAX_PROMPT_SHARE = 0.02
MAX_CATEGORY_SHARE = 0.005


@pytest.fixture(scope="module")
def training():
    return training_texts()


def test_every_category_is_there_with_enough_prompts_and_sources():
    categories = load_suite(SUITE)
    assert [c.name for c in categories] == CATEGORIES
    for c in categories:
        assert len(c.dialogues) >= (20 if c.name in LONG else 40), c.name
        rows = [json.loads(line) for line in c.path.read_text().splitlines()]
        assert all(r.get("source") for r in rows), c.name
    chat = next(c for c in categories if c.name == "chat")
    assert all(d.later_turns for d in chat.dialogues), "chat is multi-turn"
    assert (SUITE / "MANIFEST.md").is_file()


@pytest.mark.parametrize("name", sorted(LONG))
def test_long_categories_hold_prompts_of_thousands_of_tokens(name):
    rows = [json.loads(line) for line in (SUITE / f"{name}.jsonl").read_text().splitlines()]
    lo, hi = LONG[name]
    # Counted with SmolLM2's tokenizer by scripts/build_acceptance_suite.py; characters bound them too.
    assert all(lo <= r["tokens"] <= hi and len(r["prompt"]) >= 2 * lo for r in rows), name


def test_the_suite_shares_almost_no_8_grams_with_the_training_data(training):
    rows = suite_overlap(SUITE, training)
    worst = max(rows, key=lambda r: r.share)
    assert worst.share <= MAX_PROMPT_SHARE, worst
    for name in CATEGORIES:
        mine = [r for r in rows if r.category == name]
        assert sum(r.shared for r in mine) <= MAX_CATEGORY_SHARE * sum(r.ngrams for r in mine), name


def test_a_prompt_taken_from_the_training_documents_is_caught(training, tmp_path):
    document = module_help(DOCUMENT_MODULES[0])[:6000]
    (tmp_path / "planted.jsonl").write_text(json.dumps({"prompt": f"Summarize this.\n\n{document}"}) + "\n")
    (planted,) = suite_overlap(tmp_path, training)
    assert planted.share > 0.9
