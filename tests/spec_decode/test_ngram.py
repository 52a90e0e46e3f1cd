import time

import numpy as np
import pytest

from specserve.spec_decode.ngram import NgramProposer, propose_ngram


def naive_propose(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Reference: longest n first, then the earliest occurrence ending before the last token."""
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[len(tokens) - n:]
        for start in range(len(tokens) - n):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def test_match_returns_following_tokens():
    assert propose_ngram([1, 2, 3, 4, 5, 9, 2, 3], min_n=1, max_n=3, k=2) == [4, 5]


def test_no_match_returns_empty():
    assert propose_ngram([1, 2, 3, 4], min_n=1, max_n=3, k=3) == []
    assert propose_ngram([7, 8, 9, 1, 2], min_n=2, max_n=3, k=3) == []  # 2 occurs, but no 2-gram "1 2"


def test_short_contexts():
    assert propose_ngram([], 1, 3, 3) == []
    assert propose_ngram([5], 1, 3, 3) == []
    assert propose_ngram([5, 5], 1, 3, 3) == [5]


def test_longest_ngram_wins_over_earlier_shorter_match():
    # "3" alone first occurs at index 0 (followed by 10); the 2-gram "2 3" at index 4 (followed by 20).
    tokens = [3, 10, 11, 12, 2, 3, 20, 21, 2, 3]
    assert propose_ngram(tokens, min_n=1, max_n=2, k=2) == [20, 21]
    assert propose_ngram(tokens, min_n=1, max_n=1, k=2) == [10, 11]


def test_earliest_occurrence_is_used():
    tokens = [1, 2, 30, 1, 2, 40, 1, 2]
    assert propose_ngram(tokens, min_n=2, max_n=2, k=1) == [30]


def test_k_truncated_at_end_of_sequence():
    # vLLM's docstring example: the match "2 3" at index 1 is followed by only three tokens.
    assert propose_ngram([1, 2, 3, 4, 2, 3], min_n=2, max_n=3, k=4) == [4, 2, 3]
    assert propose_ngram([1, 2, 3, 4, 2, 3], min_n=2, max_n=3, k=0) == []


def test_overlapping_occurrence():
    assert propose_ngram([7, 7, 7, 7], min_n=2, max_n=3, k=5) == [7]


def test_accepts_numpy_and_rejects_bad_range():
    assert propose_ngram(np.array([4, 5, 6, 4, 5], dtype=np.int32), 1, 2, 3) == [6, 4, 5]
    with pytest.raises(ValueError):
        propose_ngram([1, 2], min_n=0, max_n=2, k=1)
    with pytest.raises(ValueError):
        NgramProposer(min_n=3, max_n=2, k=1)


def test_matches_naive_reference_on_random_sequences():
    rng = np.random.default_rng(0)
    for _ in range(500):
        length = int(rng.integers(0, 60))
        vocab = int(rng.integers(2, 6))  # small vocabularies make repeats likely
        tokens = rng.integers(0, vocab, size=length).tolist()
        min_n = int(rng.integers(1, 4))
        max_n = int(rng.integers(min_n, 6))
        k = int(rng.integers(1, 6))
        assert propose_ngram(tokens, min_n, max_n, k) == naive_propose(tokens, min_n, max_n, k), (
            tokens, min_n, max_n, k)


def test_proposer_batches_and_is_fast_on_long_contexts():
    rng = np.random.default_rng(1)
    # A large vocabulary (few candidates) and a small one (many candidates, long matches).
    contexts = [rng.integers(0, vocab, size=4096) for vocab in [32000] * 16 + [8] * 16]
    contexts[0][-3:] = contexts[0][100:103]  # plant a 3-gram match
    proposer = NgramProposer(min_n=1, max_n=4, k=5)
    start = time.perf_counter()
    drafts = proposer.propose(contexts)
    elapsed = time.perf_counter() - start
    assert elapsed < 0.1, f"{elapsed:.3f}s for 32 contexts of 4096 tokens"
    assert drafts[0] == contexts[0][103:108].tolist()
    for ctx, draft in zip(contexts, drafts):
        assert draft == naive_propose(ctx.tolist(), 1, 4, 5)
