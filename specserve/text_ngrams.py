"""Word n-grams of text, for telling whether two sets of prompts share text (evaluation kept apart from
training: scripts/build_prompt_set.py, specserve/train/overlap.py)."""
from __future__ import annotations

import re

NGRAM = 8
WORD = re.compile(r"[a-z0-9]+(?:'[a-z]+)?")


def words(text: str) -> list[str]:
    return WORD.findall(text.lower())


def normalized(text: str) -> str:
    return " ".join(words(text))


def ngrams(tokens: list[str], n: int = NGRAM) -> set[tuple[str, ...]]:
    return {tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)}
