"""The mask worker (structured_output/mask_job.py): a grammar advanced ahead of its request hands out what accepting
each token would have, and under asynchronous scheduling a grammar step's masks are filled on the worker thread
while the engine thread appends the step before's tokens, with the step before read once. Output equality with
and without asynchronous scheduling, speculation, chunked prefill and preemption: test_constrained_decoding.py."""
from __future__ import annotations

import random
import threading

import pytest
import xgrammar as xgr
from transformers import AutoTokenizer

from schemas import SCHEMAS
from specserve import LLM, SamplingParams
from specserve.engine.scheduler import Scheduler
from specserve.structured_output.request_grammar import RequestGrammar
from specserve.structured_output.step_masks import StepMasks


@pytest.fixture(scope="module")
def compiled(tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok), stop_token_ids=[tok.eos_token_id])
    compiler = xgr.GrammarCompiler(info)
    return tok, [compiler.compile_json_schema(s) for s in SCHEMAS[:8]]


def grammatical_tokens(grammar, vocab: int, rng: random.Random, eos: int) -> list[int]:
    """A random walk to the grammar's end, its stop token included, then a token after it."""
    m, mask, out = xgr.GrammarMatcher(grammar), xgr.allocate_token_bitmask(1, vocab), []
    while not m.is_terminated() and len(out) < 200:
        m.fill_next_token_bitmask(mask, 0)
        bits = mask[0].tolist()
        allowed = [t for t in range(vocab) if (bits[t // 32] >> (t % 32)) & 1]
        token = eos if eos in allowed and rng.random() < 0.5 else rng.choice(allowed)
        assert m.accept_token(token)
        out.append(token)
    return out + [rng.randrange(vocab)]


def test_advanced_grammar_hands_out_what_accepting_each_token_would(compiled):
    tok, grammars = compiled
    rng = random.Random(0)
    for grammar in grammars:
        tokens = grammatical_tokens(grammar, len(tok), rng, tok.eos_token_id)
        # A refused token midway too: the walk's tokens with one swapped for a token the state refuses.
        refused = tokens[:3] + [tok.eos_token_id] + tokens[3:]
        for walk in (tokens, refused):
            plain, ahead = RequestGrammar(xgr.GrammarMatcher(grammar)), RequestGrammar(xgr.GrammarMatcher(grammar))
            cut = rng.randrange(1, len(walk))
            ahead.advance(walk[:cut])  # a step's tokens, advanced ahead; the rest accepted one at a time
            # `accepted` counts the matcher's tokens (what masks built ahead start from), the advanced ones too.
            taken, m = 0, xgr.GrammarMatcher(grammar)
            for token in walk[:cut]:
                if not m.accept_token(token):
                    break
                taken += 1
                if m.is_terminated():
                    break
            assert ahead.accepted == taken
            for token in walk:
                want = (plain.accept(token), plain.terminated)
                assert (ahead.accept(token), ahead.terminated) == want
                if not want[0] or want[1]:
                    break  # the request ends here, as Request.append_token does
            assert ahead.accepted <= plain.accepted


def test_appending_a_token_other_than_the_advanced_one_is_an_error(compiled):
    tok, grammars = compiled
    tokens = grammatical_tokens(grammars[0], len(tok), random.Random(1), tok.eos_token_id)
    grammar = RequestGrammar(xgr.GrammarMatcher(grammars[0]))
    grammar.advance(tokens[:2])
    assert grammar.accept(tokens[0])
    with pytest.raises(RuntimeError, match="advanced past token"):
        grammar.accept(tokens[0] + 1 if tokens[0] + 1 != tokens[1] else tokens[0] + 2)


def test_masks_fill_on_the_worker_while_the_engine_thread_appends_the_step_before(tiny_llama, monkeypatch):
    """Each grammar step's fill waits until the engine thread is appending the step before's tokens: were the fill
    on the engine thread, or after the append, it would wait out its timeout."""
    path, _ = tiny_llama
    llm = LLM(str(path), max_model_len=256, async_scheduling=True)
    runner = llm.engine.runner
    appending, fills, reads = threading.Event(), [], []
    fill, update, read = StepMasks.fill, Scheduler.update, runner._read_results

    def watched_fill(*args, **kwargs):
        fills.append((threading.current_thread() is not threading.main_thread(), appending.wait(timeout=2)))
        appending.clear()
        return fill(*args, **kwargs)

    def watched_update(self, out, result):
        appending.set()
        return update(self, out, result)

    def counted_read(handle):
        reads.append(handle)
        return read(handle)

    monkeypatch.setattr(StepMasks, "fill", staticmethod(watched_fill))
    monkeypatch.setattr(Scheduler, "update", watched_update)
    monkeypatch.setattr(runner, "_read_results", counted_read)
    params = [SamplingParams(temperature=0, max_tokens=12,
                             structured_output={"kind": "json_schema", "value": SCHEMAS[i]}) for i in range(4)]
    outs = llm.generate(["Give me JSON:", "Numbers: 1 2 3", "The quick brown fox", "Hello"], params, use_tqdm=False)
    assert all(o.outputs[0].token_ids for o in outs)
    assert fills and all(on_worker for on_worker, _ in fills)
    # Every grammar step after the first overlaps the engine thread's append of the step before.
    assert sum(overlapped for _, overlapped in fills) >= len(fills) - 1
    assert len(reads) == len({id(h) for h in reads}), "a step's results were read twice"
