"""Long-document training requests: their sizes, kinds and sources, and their answers in the data."""
from __future__ import annotations

import re

import pytest

from specserve.errors import ConfigError
from specserve.train.config import TrainConfig
from specserve.train.documents import (DOCUMENT_MODULES, EXTRACTION_ASKS, SUITE_CODE_MODULES, SUMMARY_ASKS,
                                       document_requests, module_help)


def words(texts: list[str]) -> list[int]:
    return [len(t.split()) for t in texts]


@pytest.fixture(scope="module")
def requests():
    return document_requests(45, seed=0, count_tokens=words, max_prompt_tokens=1500)


def test_requests_fit_and_take_every_kind(requests):
    assert len(requests) == len(set(requests)) == 45
    assert all(300 <= n <= 1500 - 32 for n in words(requests))
    kinds = [("summary" if any(a in r for a in SUMMARY_ASKS) else "retrieval" if "Using the results above, answer:"
              in r else "extraction" if any(r.endswith(a) for a in EXTRACTION_ASKS) else None) for r in requests]
    assert kinds.count("summary") == kinds.count("retrieval") == kinds.count("extraction") == 15


def test_a_retrieval_question_asks_about_a_function_one_result_documents(requests):
    for r in (r for r in requests if "Using the results above, answer:" in r):
        results, question = r.split("\n\nUsing the results above, answer: ")
        modules = re.findall(r"^Result \d+ \(([\w.]+)\):$", results, re.MULTILINE)
        assert 1 <= len(modules) <= 5 and len(set(modules)) == len(modules)
        name = next(n for n in re.findall(r"\b([a-z_][a-z0-9_]{2,})\b", question) if f"    {n}(" in results
                    or f"|   {n}(" in results)
        assert name


def test_seeded_and_kept_apart_from_the_suites_code():
    assert document_requests(6, 1, words, 1500) == document_requests(6, 1, words, 1500)
    assert document_requests(6, 1, words, 1500) != document_requests(6, 2, words, 1500)
    assert not set(DOCUMENT_MODULES) & set(SUITE_CODE_MODULES)
    assert "FILE" not in module_help("json").split("\n\n")[-1] and "/json/" not in module_help("json")


def test_config_refuses_documents_without_room():
    with pytest.raises(ConfigError, match=r"document_prompts: need prompts of 364 tokens or more, and max_seq_len "
                                          r"512 leaves 128 beside max_new_tokens 384; raise --max-seq-len"):
        TrainConfig(target="t", out="o", max_seq_len=512, device="cpu")
    assert TrainConfig(target="t", out="o", max_seq_len=512, document_prompts=0, device="cpu").document_prompts == 0
    with pytest.raises(ConfigError, match="document_prompts: must be an integer >= 0"):
        TrainConfig(target="t", out="o", document_prompts=-1, device="cpu")
