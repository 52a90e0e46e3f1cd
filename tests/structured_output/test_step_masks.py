"""A request's masks along a chain of drafts (RequestGrammar.fill_masks, a walk of the chain as a tree) and a step's
masks (StepMasks.build, batched over the step's requests) equal its matcher's masks built one token at a time, and
leave the matcher where it was."""
from __future__ import annotations

import random

import pytest
import torch
import xgrammar as xgr
from transformers import AutoTokenizer

from schemas import SCHEMAS
from specserve.engine.request import Request, RequestStatus
from specserve.engine.scheduler import ScheduledRequest, SchedulerOutput
from specserve.sampling_params import SamplingParams
from specserve.structured_output.request_grammar import RequestGrammar
from specserve.structured_output.step_masks import StepMasks
from specserve.worker.input_buffers import TokenBitmaskBuffer


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


def scheduled(request_id: str, grammar_matcher, drafts: list[int]) -> ScheduledRequest:
    grammar = None if grammar_matcher is None else RequestGrammar(grammar_matcher)
    request = Request(request_id, [1], SamplingParams(temperature=0, max_tokens=8), set(), 4096, grammar=grammar)
    return ScheduledRequest(request, 1 + len(drafts), drafts, [], True, 1)


def reference_chain(ref, drafts: list[int], rows: torch.Tensor) -> None:
    """rows[j]: ref's mask after drafts 0..j-1, one token at a time, up to the first refused or ending draft."""
    if ref.is_terminated():
        return
    ref.fill_next_token_bitmask(rows, 0)
    for j, t in enumerate(drafts):
        if not ref.accept_token(t) or ref.is_terminated():
            return
        ref.fill_next_token_bitmask(rows, 1 + j)


@pytest.mark.parametrize("threads", [1, 2])
def test_step_masks_equal_a_fill_row_by_row(compiled, monkeypatch, threads):
    """StepMasks.build (batched fills, chains walked depth by depth over all requests, on `threads` threads) writes
    the masks a matcher of each request fills one row at a time; rows of requests that have no grammar or have
    ended allow everything; every matcher is back where it started."""
    import specserve.structured_output.fill_threads as fill_threads

    monkeypatch.setattr(fill_threads, "fill_threads", lambda rows: threads)
    vocab, grammars = compiled
    rng = random.Random(threads)
    k = 4
    groups = {"sample": [], "verify": []}
    references = {"sample": [], "verify": []}
    homes = []  # (a request's matcher, one that took its tokens and nothing else)
    for group in groups:
        for i in range(24):
            grammar = grammars[(i * 5) % len(grammars)]
            if i % 11 == 3:
                groups[group].append(scheduled(f"{group}{i}", None, [rng.randrange(vocab) for _ in range(k)]
                                               if group == "verify" else []))
                references[group].append(None)
                continue
            m, ref, home = (xgr.GrammarMatcher(grammar) for _ in range(3))
            for t in walk(m, vocab, rng, rng.randrange(0, 14)):
                assert ref.accept_token(t) and home.accept_token(t)
            homes.append((m, home))
            drafts = []
            if group == "verify":
                drafts = walk(m, vocab, rng, rng.randrange(0, k + 1))
                m.rollback(len(drafts))
                if drafts and i % 3 == 0:
                    drafts[rng.randrange(len(drafts))] = rng.randrange(vocab)  # a draft the grammar likely refuses
            s = scheduled(f"{group}{i}", m, drafts)
            if i % 7 == 5:
                s.request.status = RequestStatus.FINISHED_ABORTED
            groups[group].append(s)
            references[group].append(None if s.request.is_finished else ref)
    sched = SchedulerOutput(groups["sample"] + groups["verify"])
    n = len(groups["sample"])
    width = 1 + k
    words = -(-vocab // 32)
    host = torch.zeros(n + n * width, words, dtype=torch.int32)
    buffer = TokenBitmaskBuffer(host, host, torch.ones(1, dtype=torch.int64))
    masks = StepMasks.build(sched, list(range(n)), list(range(n, 2 * n)), buffer, lambda s: s.spec_token_ids)
    want = torch.full_like(host, -1)
    for i, ref in enumerate(references["sample"]):
        if ref is not None:
            ref.fill_next_token_bitmask(want, i)
    for i, (ref, s) in enumerate(zip(references["verify"], groups["verify"])):
        if ref is not None:
            reference_chain(ref, s.spec_token_ids, want[n + i * width:n + (i + 1) * width])
    assert torch.equal(host, want)
    assert masks.sample is not None and masks.verify is not None
    # Every matcher is back where it started: its next mask is that of a fresh matcher given its tokens.
    a, b = xgr.allocate_token_bitmask(1, vocab), xgr.allocate_token_bitmask(1, vocab)
    for m, home in homes:
        m.fill_next_token_bitmask(a, 0)
        home.fill_next_token_bitmask(b, 0)
        assert torch.equal(a, b)


@pytest.mark.parametrize("threads", [1, 2])
def test_draft_chain_masks_equal_a_fill_row_by_row(compiled, monkeypatch, threads):
    """DraftMasks over a chain (every request's node in one batched fill a depth, on `threads` threads) writes,
    before draft j, each request's mask after its step's tokens and drafts 0..j-1, as a matcher fills it one
    token at a time; a request without a grammar, or whose path is refused or ended, allows everything; close()
    brings every matcher back where it started, after every depth or after the first."""
    import specserve.structured_output.fill_threads as fill_threads
    from specserve.structured_output.draft_masks import DraftMasks

    monkeypatch.setattr(fill_threads, "fill_threads", lambda rows: threads)
    vocab, grammars = compiled
    rng = random.Random(10 + threads)
    k, n, max_accepted = 3, 20, 2
    words = -(-vocab // 32)
    grammar_of, references, homes, steps, paths = [], [], [], [], []
    for i in range(n):
        m, ref, home = (xgr.GrammarMatcher(grammars[i % len(grammars)]) for _ in range(3))
        for t in walk(m, vocab, rng, rng.randrange(0, 14)):
            assert ref.accept_token(t) and home.accept_token(t)
        # The step's tokens (its accepted drafts and the token after them), then the drafts of this step.
        path = walk(m, vocab, rng, 1 + max_accepted + k)
        m.rollback(len(path))
        path += [rng.randrange(vocab) for _ in range(1 + max_accepted + k - len(path))]
        if i % 4 == 1:
            path[rng.randrange(len(path))] = rng.randrange(vocab)  # a token the grammar likely refuses
        accepted = rng.randrange(max_accepted + 1)
        steps.append([accepted] + path[:1 + max_accepted])
        paths.append(path[:1 + accepted] + path[1 + max_accepted:])
        grammar_of.append(None if i % 7 == 3 else RequestGrammar(m))
        references.append(ref)
        homes.append((m, home))
    drafts = torch.tensor([p[-k:] for p in paths])
    host = torch.zeros(n * k, words, dtype=torch.int32)
    scratch = xgr.allocate_token_bitmask(1, vocab)

    def assert_home() -> None:
        for m, home in homes:
            m.fill_next_token_bitmask(scratch, 0)
            other = xgr.allocate_token_bitmask(1, vocab)
            home.fill_next_token_bitmask(other, 0)
            assert torch.equal(scratch, other)

    # Drafting that ends after its first depth (propose raised): close() still rolls the walk back.
    masks = DraftMasks(grammar_of, torch.tensor(steps), None, TokenBitmaskBuffer(host, host))
    masks.masks(range(0, 1))
    masks.follow(drafts[:, :1])
    masks.masks(range(1, 2))
    masks.close()
    assert_home()
    masks = DraftMasks(grammar_of, torch.tensor(steps), None, TokenBitmaskBuffer(host, host))
    with pytest.raises(RuntimeError, match="node after node"):
        masks.masks(range(1, 2))
    for j in range(k):
        got = masks.masks(range(j, j + 1)).clone()
        want = torch.full_like(got, -1)
        for i, (grammar, ref, path) in enumerate(zip(grammar_of, references, paths)):
            tokens = path[:len(path) - k + j]  # the step's tokens, then drafts 0..j-1
            walked = 0
            for t in tokens:
                if ref.is_terminated() or not ref.accept_token(t):
                    break
                walked += 1
            if grammar is not None and walked == len(tokens) and not ref.is_terminated():
                ref.fill_next_token_bitmask(want, i)
            ref.rollback(walked)
        assert torch.equal(got, want), f"depth {j}"
        masks.follow(drafts[:, j:j + 1])
    masks.close()
    assert_home()
    assert any(torch.equal(got[i], torch.full((words,), -1, dtype=torch.int32)) for i in range(n))


@pytest.mark.parametrize("memory", ["one", "separate"])
def test_verification_takes_the_drafters_masks_of_the_step_before(compiled, monkeypatch, memory):
    """A chain step's drafter masks, carried to the next step, give StepMasks.build the same verification masks
    as filling every position, with only what the drafter did not build filled (the position after the last
    draft); a request whose grammar did not take exactly the step's tokens, or whose verified drafts differ, is
    filled in full. With device rows apart from the host's (memory "separate", as on CUDA) the drafter's rows are
    taken on the device, after the host rows' copy, and the host rows there are left as they were."""
    import specserve.structured_output.step_masks as step_masks
    from specserve.structured_output.draft_masks import DraftMasks

    filled = []
    fill = step_masks.batch_fill
    monkeypatch.setattr(step_masks, "batch_fill", lambda m, host, rows: (filled.append(len(rows)), fill(m, host, rows)))
    vocab, grammars = compiled
    rng = random.Random(7)
    k, n = 3, 24
    words = -(-vocab // 32)
    requests, steps, drafts = [], [], []
    for i in range(n):
        m = xgr.GrammarMatcher(grammars[i % len(grammars)])
        walk(m, vocab, rng, rng.randrange(0, 14))
        accepted = rng.randrange(2)
        path = walk(m, vocab, rng, 1 + accepted + k)
        m.rollback(len(path))
        accepted = min(accepted, max(len(path) - 1, 0))
        prefix, d = path[:1 + accepted], path[1 + accepted:]
        d += [rng.randrange(vocab) for _ in range(k - len(d))]
        if i % 5 == 2:
            d[rng.randrange(k)] = rng.randrange(vocab)  # a draft the grammar likely refuses
        s = scheduled(f"r{i}", m if prefix and i % 9 != 4 else None, d)
        requests.append(s)
        steps.append([accepted] + prefix + [0] * (2 - len(prefix)))
        drafts.append(d)

    def buffer(rows: int) -> TokenBitmaskBuffer:
        host = torch.zeros(rows, words, dtype=torch.int32)
        return TokenBitmaskBuffer(host if memory == "one" else torch.zeros_like(host), host)

    masks = DraftMasks([s.request.grammar for s in requests], torch.tensor(steps), None, buffer(n * k))
    for j in range(k):
        masks.masks(range(j, j + 1))
        masks.follow(torch.tensor(drafts)[:, j:j + 1])
    masks.close()
    carried = masks.carried([s.request.request_id for s in requests])
    # The step's tokens reach the requests (Request.append_token), but one takes a token too few: one whose mask
    # after its last token differs from the mask before it. r7 verifies other drafts than those drafted.
    scratch, before = (xgr.allocate_token_bitmask(1, vocab) for _ in range(2))
    short = None
    for i, (s, row) in enumerate(zip(requests, steps)):
        if s.request.grammar is not None:
            for t in row[1:row[0] + 2]:
                s.request.grammar.matcher.fill_next_token_bitmask(before, 0)
                assert s.request.grammar.accept(t)
            s.request.grammar.matcher.fill_next_token_bitmask(scratch, 0)
            if short is None and i != 7 and not torch.equal(scratch, before):
                short = i
                s.request.grammar.matcher.rollback(1)
                s.request.grammar.accepted -= 1
    assert short is not None, "no request's last step token changes its mask; change the seed"
    requests[7].request.grammar.matcher.fill_next_token_bitmask(scratch, 0)
    other = [t for t in allowed(scratch, 0, vocab) if t != requests[7].spec_token_ids[0]]
    assert other, "r7 needs a state with two allowed tokens; change the seed"
    requests[7].spec_token_ids[0] = other[0]  # another grammatical draft than the drafter's
    sched = SchedulerOutput(requests)
    got, want = buffer(n * (k + 1)), buffer(n * (k + 1))
    StepMasks.build(sched, [], list(range(n)), want, lambda s: s.spec_token_ids)
    full, filled[:] = filled[:], []
    StepMasks.build(sched, [], list(range(n)), got, lambda s: s.spec_token_ids, None, carried)
    assert torch.equal(got.device, want.device)
    assert torch.equal(got.host, want.host) == (memory == "one")
    # Rows filled a depth (after the sampling rows' call): before the last only the short request's and r7's
    # (past its changed draft), at the last as many as without the drafter's rows.
    assert len(filled) == len(full) == 2 + k
    assert all(rows <= 2 for rows in filled[1:-1]) and filled[-1] == full[-1], (full, filled)
    assert sum(full) - sum(filled) >= sum(s.request.grammar is not None for s in requests), (full, filled)
