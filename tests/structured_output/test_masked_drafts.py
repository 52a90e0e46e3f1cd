"""With mask_drafts, the drafter's logits of a grammar request are masked along each draft path (chains and trees):
every draft it proposes is one the grammar allows after the tokens and drafts before it, sampled drafts are verified against
the masked, renormalised draft distribution they were drawn from, and acceptance under a grammar rises over an
unmasked drafter's while the output stays the target's own."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import xgrammar as xgr

from heads import save_eagle_head, save_perturbed_copy
from schemas import SCHEMAS
from specserve import LLM, SamplingParams
from specserve.worker.model_runner import ModelRunner

TREE = "[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]"
PROMPTS = ["Give me JSON:", "Numbers: 1 2 3", "The quick brown fox"]


@pytest.fixture(scope="module")
def models(tiny_llama, tmp_path_factory):
    """The target; a random EAGLE-3 head (unmasked, its drafts are almost never grammatical), as a chain and as
    a tree, and a perturbed copy of the target as a draft model, each with its drafts masked."""
    path, hf = tiny_llama
    root = tmp_path_factory.mktemp("masked_drafts")
    head = str(save_eagle_head(root / "eagle3", hf.config, "eagle3", seed=2))
    return {
        "path": path,
        "eagle3": {"method": "eagle3", "num_speculative_tokens": 3, "model": head, "mask_drafts": True},
        "eagle3_tree": {"method": "eagle3", "model": head, "speculative_token_tree": TREE, "mask_drafts": True},
        "near": {"method": "draft_model", "num_speculative_tokens": 3, "mask_drafts": True,
                 "model": str(save_perturbed_copy(root / "near", path))},
    }


def make_llm(models, spec: str, **extra) -> LLM:
    return LLM(str(models["path"]), max_model_len=256, speculative_config=models[spec] | extra)


def schema_params(schema: dict, **kw) -> SamplingParams:
    return SamplingParams(structured_output={"kind": "json_schema", "value": schema},
                          **{"temperature": 0, "max_tokens": 48, **kw})


def allowed_tokens(matcher, vocab_size: int) -> torch.Tensor:
    """[vocab_size] bool: the tokens the matcher allows next."""
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    bits = ((bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()
    return bits[:vocab_size].bool()


@dataclasses.dataclass
class DraftCheck:
    """Every draft of a grammar request on a path the grammar allows, checked against an independent walk of
    the request's own matcher (accepted, then rolled back)."""

    checked: int = 0  # drafts on a reachable path
    legal: int = 0
    # Drafts the grammar refuses although their rank among their parent's guesses is below the number of tokens
    # it allows there (a masked drafter never proposes one).
    unexplained: list = dataclasses.field(default_factory=list)
    # Sampled chain drafts: q rows with mass on a refused token, or not summing to 1, or not covering the draft.
    bad_q: list = dataclasses.field(default_factory=list)


def check_drafts(runner: ModelRunner, handle, out, check: DraftCheck) -> None:
    tree = runner.tree
    vocab = runner.arch.vocab_size
    for i in handle.sampling:
        req = handle.sched.scheduled[i].request
        drafts = out.drafts.get(req.request_id, [])
        if req.grammar is None or not drafts:
            continue
        m = req.grammar.matcher
        parents = tree.parents if tree is not None else list(range(-1, len(drafts)))
        ranks = tree.ranks if tree is not None else [0] * (len(drafts) + 1)
        walked = 0
        for t in out.sampled[req.request_id]:
            if m.is_terminated() or not m.accept_token(t):
                break
            walked += 1
        else:
            if not m.is_terminated():
                _check_request(runner, req, drafts, parents, ranks, vocab, check)
        m.rollback(walked)


def _check_request(runner, req, drafts, parents, ranks, vocab, check: DraftCheck) -> None:
    m = req.grammar.matcher
    q = None
    if runner.tree is None and not req.params.greedy:
        q = runner.speculator.draft_probs[runner.rows[req.request_id], :len(drafts)].cpu()
    for j in range(1, len(drafts) + 1):
        path, node = [], parents[j]
        while node > 0:
            path.append(drafts[node - 1])
            node = parents[node]
        taken = 0
        for t in reversed(path):
            if m.is_terminated() or not m.accept_token(t):
                break
            taken += 1
        reachable = taken == len(path) and not m.is_terminated()
        if reachable:
            check.checked += 1
            allowed = allowed_tokens(m, vocab)
            if q is not None:
                row = q[j - 1]
                if (row[~allowed].sum() != 0 or abs(float(row.sum()) - 1) > 1e-4
                        or row[drafts[j - 1]] <= 0):
                    check.bad_q.append((req.request_id, j))
            if m.accept_token(drafts[j - 1]):
                check.legal += 1
                m.rollback(1)
            elif ranks[j] < int(allowed.sum()):
                check.unexplained.append((req.request_id, j, drafts[j - 1]))
        m.rollback(taken)


def generate_checking_drafts(llm: LLM, prompts, params) -> tuple[list, DraftCheck]:
    runner, check = llm.engine.runner, DraftCheck()
    original = runner.resolve

    def resolve(handle):
        out = original(handle)
        check_drafts(runner, handle, out, check)
        return out

    runner.resolve = resolve
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        del runner.resolve
    return outs, check


@pytest.mark.parametrize("spec", ["eagle3", "eagle3_tree", "near"])
def test_drafts_of_grammar_requests_are_grammatical(models, spec):
    """Greedy and sampled requests, JSON schemas; with a request without a grammar in the batch. A tree's guess
    may be refused only where the grammar allows fewer tokens than its rank."""
    llm = make_llm(models, spec)
    params = [schema_params(SCHEMAS[s], temperature=t, seed=s) for s in (0, 3, 5, 9, 14) for t in (0, 1.0)]
    free = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs, check = generate_checking_drafts(llm, PROMPTS[:1] * len(params) + PROMPTS[1:2], params + [free])
    assert check.checked > 50
    assert check.unexplained == []
    if spec != "eagle3_tree":
        assert check.legal == check.checked
    assert check.bad_q == []
    assert all(o.outputs[0].finish_reason == "stop" for o in outs[:-1])


@pytest.mark.parametrize("spec", ["eagle3", "eagle3_tree"])
def test_masked_drafts_raise_acceptance_and_keep_the_output(models, spec):
    """A random EAGLE-3 head unmasked proposes illegal JSON tokens almost always; masked, its drafts are
    grammatical and many are the target's own. The greedy output is the same either way."""
    params = [schema_params(s) for s in SCHEMAS for _ in PROMPTS[:2]]
    masked = make_llm(models, spec)
    with_masks = masked.generate(PROMPTS[:2] * len(SCHEMAS), params, use_tqdm=False)
    unmasked = make_llm(models, spec, mask_drafts=False)
    without = unmasked.generate(PROMPTS[:2] * len(SCHEMAS), params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in with_masks] == [o.outputs[0].token_ids for o in without]
    rate, baseline = masked.engine.spec_stats.acceptance_rate, unmasked.engine.spec_stats.acceptance_rate
    assert baseline < 0.05 and rate > 0.2 and rate >= baseline, (rate, baseline)


@pytest.mark.gpu
@pytest.mark.parametrize("spec", ["eagle3", "eagle3_tree"])
def test_cuda_masked_drafts_stay_exact_and_grammatical(models, spec, cuda_float32):
    """On a GPU in float32 (Triton attention, graphs recorded for the steps without a grammar): the CPU's greedy
    constrained output without speculation, and grammatical drafts (host copies and events on the device)."""
    params = [schema_params(s) for s in SCHEMAS]
    prompts = PROMPTS[:1] * len(SCHEMAS)
    cpu = LLM(str(models["path"]), max_model_len=256, device="cpu")
    ref = [o.outputs[0].token_ids for o in cpu.generate(prompts, params, use_tqdm=False)]
    llm = LLM(str(models["path"]), max_model_len=256, device="cuda", dtype="float32",
              kv_cache_memory_bytes=256 << 20, speculative_config=models[spec])
    outs, check = generate_checking_drafts(llm, prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert check.checked > 50 and check.unexplained == []
    assert llm.engine.spec_stats.acceptance_rate > 0.2
