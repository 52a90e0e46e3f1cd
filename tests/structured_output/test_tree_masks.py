"""A step's masks for trees of drafts (StepMasks.build with tree parents: xgrammar's traverse_draft_tree per request,
on threads) equal RequestGrammar.fill_masks' walk of each tree row for row, with drafts the grammar refuses, stop
tokens inside and at the end of a grammar, trees cut short and grammars already ended; every matcher is back where
it started."""
from __future__ import annotations

import random

import pytest
import torch
import xgrammar as xgr

from specserve.engine.scheduler import SchedulerOutput
from specserve.spec_decode.tree import DraftTree
from specserve.structured_output.request_grammar import RequestGrammar
from specserve.structured_output.step_masks import StepMasks
from specserve.worker.input_buffers import TokenBitmaskBuffer
from test_step_masks import allowed, compiled, scheduled, walk  # noqa: F401 (compiled: the fixture)

TREE = DraftTree.build("[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0), "
                       "(0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0), (0, 0, 0, 0, 0), (0, 0, 0, 0, 1)]")
EOS = 2  # the test tokenizer's </s>, the grammars' stop token


def tree_drafts(m, parents: tuple[int, ...], vocab: int, rng: random.Random) -> list[int]:
    """A token for each node after the root: one its parent's state allows (sibling picks may repeat), else EOS."""
    drafts: list[int] = []
    mask = xgr.allocate_token_bitmask(1, vocab)
    for j in range(1, len(parents)):
        path, node = [], parents[j]
        while node:
            path.append(drafts[node - 1])
            node = parents[node]
        taken = RequestGrammar(m).walk(path[::-1])
        if taken == len(path) and not m.is_terminated():
            m.fill_next_token_bitmask(mask, 0)
            drafts.append(rng.choice(allowed(mask, 0, vocab)))
        else:
            drafts.append(EOS)
        m.rollback(taken)
    return drafts


@pytest.mark.parametrize("threads", [1, 3])
def test_tree_masks_equal_each_trees_walk_row_by_row(compiled, monkeypatch, threads):  # noqa: F811
    import specserve.structured_output.fill_threads as fill_threads

    monkeypatch.setattr(fill_threads, "fill_threads", lambda rows: threads)
    vocab, grammars = compiled
    rng = random.Random(threads)
    parents = TREE.parents
    requests, references, homes = [], [], []
    for i in range(30):
        grammar = grammars[i % len(grammars)]
        m, ref, home = (xgr.GrammarMatcher(grammar) for _ in range(3))
        # Some walk until their grammar ends (a stop token taken), most stop short of it.
        for t in walk(m, vocab, rng, 400 if i % 10 == 9 else rng.randrange(0, 14)):
            assert ref.accept_token(t) and home.accept_token(t)
        drafts = tree_drafts(m, parents, vocab, rng)
        if i % 3 == 0:
            for j in rng.sample(range(len(drafts)), 3):
                drafts[j] = rng.choice([EOS, rng.randrange(vocab)])  # refused, or a stop token
        if i % 4 == 1:
            drafts = drafts[:rng.randrange(len(drafts))]  # the tree's first nodes only
        requests.append(scheduled(f"r{i}", m, drafts))
        references.append(ref)
        homes.append((m, home))
    assert any(ref.is_terminated() for ref in references)
    width = 1 + TREE.num_nodes
    host = torch.zeros(len(requests) * width, -(-vocab // 32), dtype=torch.int32)
    buffer = TokenBitmaskBuffer(host, host, torch.ones(1, dtype=torch.int64))
    StepMasks.build(SchedulerOutput(requests), [], list(range(len(requests))), buffer, lambda s: s.spec_token_ids,
                    parents)
    want = torch.full_like(host, -1)
    for i, (ref, s) in enumerate(zip(references, requests)):
        RequestGrammar(ref).fill_masks(want, i * width, s.spec_token_ids, parents)
    assert torch.equal(host, want)
    # Nodes whose parent was walked and filled but whose draft it refuses or that end the grammar: the rows xgrammar
    # leaves allowing nothing.
    stopped = sum(1 for i, s in enumerate(requests) for j, t in enumerate(s.spec_token_ids, start=1)
                  if not (want[i * width + parents[j]] == -1).all()
                  and (t == EOS or t not in allowed(want, i * width + parents[j], vocab)))
    assert stopped >= 10
    a, b = xgr.allocate_token_bitmask(1, vocab), xgr.allocate_token_bitmask(1, vocab)
    for m, home in homes:
        assert m.is_terminated() == home.is_terminated()
        if home.is_terminated():
            continue
        m.fill_next_token_bitmask(a, 0)
        home.fill_next_token_bitmask(b, 0)
        assert torch.equal(a, b)
