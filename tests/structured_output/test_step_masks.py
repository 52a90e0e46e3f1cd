"""A request's masks along a chain of drafts (RequestGrammar.fill_masks, a walk of the chain as a tree) equal its
matcher's masks built one token at a time, and leave the matcher where it was."""
from __future__ import annotations

import random

import pytest
import torch
import xgrammar as xgr
from transformers import AutoTokenizer

from schemas import SCHEMAS
from specserve.structured_output.request_grammar import RequestGrammar


def allowed(bitmask: torch.Tensor, row: int, vocab: int) -> list[int]:
    bits = bitmask[row]
    return [t for t in range(vocab) if (int(bits[t // 32]) >> (t % 32)) & 1]


@pytest.fixture(scope="module")
def compiled(tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    vocab = len(tok)
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=[tok.eos_token_id])
    compiler = xgr.GrammarCompiler(info)
    return vocab, [compiler.compile_json_schema(s) for s in SCHEMAS[:6]]


def walk(matcher, vocab: int, rng: random.Random, n: int) -> list[int]:
    """n grammatical tokens from the matcher's state (it ends there), chosen at random."""
    taken, mask = [], xgr.allocate_token_bitmask(1, vocab)
    for _ in range(n):
        if matcher.is_terminated():
            break
        matcher.fill_next_token_bitmask(mask, 0)
        token = rng.choice(allowed(mask, 0, vocab))
        assert matcher.accept_token(token)
        taken.append(token)
    return taken


def test_chain_masks_equal_each_matchers_own(compiled):
    vocab, grammars = compiled
    rng = random.Random(0)
    matchers, drafts, references = [], [], []
    for i in range(12):
        grammar = grammars[i % len(grammars)]
        m, ref = xgr.GrammarMatcher(grammar), xgr.GrammarMatcher(grammar)
        prefix = walk(m, vocab, rng, rng.randrange(0, 12))
        for t in prefix:
            assert ref.accept_token(t)
        d = walk(m, vocab, rng, rng.randrange(0, 5))
        m.rollback(len(d))
        if d and i % 3 == 0:
            d[rng.randrange(len(d))] = rng.randrange(vocab)  # a draft the grammar likely refuses
        matchers.append(m)
        drafts.append(d)
        references.append(ref)
    width = 6
    got = xgr.allocate_token_bitmask(len(matchers) * width, vocab)
    for i, (m, d) in enumerate(zip(matchers, drafts)):
        RequestGrammar(m).fill_masks(got, i * width, d)
    want = xgr.allocate_token_bitmask(len(matchers) * width, vocab)
    for i, (ref, d) in enumerate(zip(references, drafts)):
        ref.fill_next_token_bitmask(want, i * width)
        walked = 0
        for j, t in enumerate(d):
            if ref.is_terminated() or not ref.accept_token(t):
                break
            walked += 1
            if ref.is_terminated():
                break
            ref.fill_next_token_bitmask(want, i * width + 1 + j)
        ref.rollback(walked)
    assert torch.equal(got, want)
    # Every matcher is back where it started: its next mask is its reference's.
    a, b = xgr.allocate_token_bitmask(1, vocab), xgr.allocate_token_bitmask(1, vocab)
    for m, ref in zip(matchers, references):
        m.fill_next_token_bitmask(a, 0)
        ref.fill_next_token_bitmask(b, 0)
        assert torch.equal(a, b)
