"""The drafter's inputs gathered in one kernel (Triton interpreter) and by the torch path, against a
plain-Python reference: the token after every position, each drafting request's last accepted index,
token, position and block-table row."""
from __future__ import annotations

import random

import pytest
import torch

from specserve.spec_decode.draft_inputs import gather_draft_inputs
from specserve.worker.staged_inputs import StagedExtra
from staging import staged_extras

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def scenario(seed: int, k: int):
    rng = random.Random(seed)
    num_sched, max_blocks = 6, 70
    requests, first, drafting = [], 0, 0
    for _ in range(num_sched):
        if rng.random() < 0.7:  # samples, verifying d drafts
            d = rng.randint(0, k)
            requests.append([first, d + 1 if rng.random() < 0.8 else d + 1 + rng.randint(1, 200), drafting, d, 0])
            drafting += 1
        else:  # a prompt chunk that does not sample; long ones span several loop iterations
            requests.append([first, rng.randint(1, 300), -1, 0, rng.randrange(1000, 2000)])
        first += requests[-1][1]
    t = first
    accepted = torch.tensor([rng.randint(0, r[3]) for r in requests])
    tokens = torch.randint(3000, 4000, (num_sched, k + 1))
    input_ids = torch.randint(0, 999, (t + 40,))
    positions = torch.randint(0, 5000, (t + 40,))
    block_table = torch.randint(0, 900, (num_sched, max_blocks), dtype=torch.int32)
    return torch.tensor(requests), accepted, tokens, input_ids, positions, block_table, t, drafting


def reference(requests, accepted, tokens, input_ids, positions, block_table, t, pad_to):
    nxt = [int(input_ids[(i + 1) % t]) for i in range(t)] + [0] * (pad_to - t)
    last, last_tokens, base, table = {}, {}, {}, {}
    for r, (first, count, slot, drafts, next_prompt) in enumerate(requests.tolist()):
        if slot < 0:
            nxt[first + count - 1] = next_prompt
            continue
        at = first + count - 1 - drafts + int(accepted[r])
        nxt[at] = int(tokens[r, accepted[r]])
        last[slot], last_tokens[slot], base[slot] = at, nxt[at], int(positions[at])
        table[slot] = block_table[r].tolist()
    return nxt, last, last_tokens, base, table


@pytest.mark.parametrize("use_triton", [True, False], ids=["triton", "torch"])
@pytest.mark.parametrize("seed", range(4))
def test_gathers_what_the_reference_says(use_triton, seed):
    requests, accepted, tokens, input_ids, positions, block_table, t, n = scenario(seed, k=3)
    num_sched, pad_to, pad_reqs = requests.shape[0], t + 37, 8
    outs = dict(next_ids=torch.full((t + 60,), -5), last=torch.full((9,), -5), last_tokens=torch.full((9,), -5),
                base_positions=torch.full((9,), -5), draft_block_table=torch.full((9, 70), -5, dtype=torch.int32))
    to = lambda x: x.to(DEVICE)  # noqa: E731
    outs = {name: to(x) for name, x in outs.items()}
    staged = staged_extras({StagedExtra.DRAFT_REQUESTS: requests.numpy()}, num_tokens=t, device=DEVICE)
    # A bound past the requests, as a graph recorded for a larger batch launches: the header's count rules.
    gather_draft_inputs(staged, to(accepted), to(tokens), to(input_ids), to(positions), to(block_table), pad_to,
                        pad_reqs, **outs, max_rows=num_sched + seed, use_triton=use_triton)
    nxt, last, last_tokens, base, table = reference(requests, accepted, tokens, input_ids, positions, block_table,
                                                    t, pad_to)
    outs = {name: x.cpu() for name, x in outs.items()}
    assert outs["next_ids"][:pad_to].tolist() == nxt and (outs["next_ids"][pad_to:] == -5).all()
    assert outs["last"][:n].tolist() == [last[i] for i in range(n)]
    assert outs["last_tokens"][:n].tolist() == [last_tokens[i] for i in range(n)]
    assert outs["base_positions"][:n].tolist() == [base[i] for i in range(n)]
    assert outs["draft_block_table"][:n].tolist() == [table[i] for i in range(n)]
    assert (outs["last"][n:num_sched] == -5).all() and (outs["draft_block_table"][n:] == -5).all()
    # A padded graph's rows past the scheduled requests index token 0 and draft from token 0.
    for name in ("last", "last_tokens"):
        assert outs[name][num_sched:pad_reqs].tolist() == [0] * (pad_reqs - num_sched) and outs[name][pad_reqs] == -5


@pytest.mark.gpu
def test_kernel_on_the_gpu():
    assert DEVICE == "cuda"
    for seed in range(4):
        test_gathers_what_the_reference_says(True, seed)
