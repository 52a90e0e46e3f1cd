"""Trees of drafts at temperature > 0 (spec_decode/sampled_tree.py): children drawn from the head without
replacement, verified by recursive rejection sampling. Speculative decoding is run whole on a Markov target and
drafter over a vocabulary of 5, many requests at once, and the first three tokens each request emits are tested
against the target's own joint distribution (chi-square over all 125 outcomes)."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from distribution import P_MIN, p_value
from specserve.engine.request import Request
from specserve.sample.sampler import SamplingBatch
from specserve.sampling_params import SamplingParams
from specserve.spec_decode.sampled_tree import TreeDraws, sampled_tree_targets, walk_sampled_trees, walked_targets
from specserve.spec_decode.tree import DraftTree
from specserve.spec_decode.tree_drafting import level_scatter
from specserve.spec_decode.tree_verify import TreeTables, emitted_tokens, walk_tree

V = 5
TREE = DraftTree.build([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0)])
START = 3


def markov(seed: int, zeros: int = 0) -> torch.Tensor:
    """[V, V]: the next token's distribution after each token; `zeros` tokens of each row without mass."""
    g = torch.Generator().manual_seed(seed)
    probs = torch.rand(V, V, generator=g) ** 2 + 0.02
    for row in probs:
        row[torch.randperm(V, generator=g)[:zeros]] = 0
    return probs / probs.sum(dim=1, keepdim=True)


def requests(n: int, greedy_every: int = 0) -> list[Request]:
    def params(i: int) -> SamplingParams:
        return SamplingParams(temperature=0 if greedy_every and i % greedy_every == 0 else 1.0)

    return [Request(str(i), [1], params(i), set(), 64) for i in range(n)]


def draft_trees(reqs, draft: torch.Tensor, last: torch.Tensor, draws: TreeDraws, padded_to: int | None = None
                ) -> torch.Tensor:
    """[n, N + 1]: each request's tree after its last token (column 0), depth by depth as tree_drafting does,
    the drafter's logits after a node being log draft[its token]. padded_to: drawn as the sampled tree graph
    padded to that many requests draws (the rows past n after token 0), else as the eager passes do."""
    n, tables = len(reqs), draws.tables
    tree = tables.tree
    batch, rows = SamplingBatch.build(reqs, torch.device("cpu")), torch.arange(n)
    if padded_to is None:
        sampling, width = draws.eager(batch, rows), n
    else:
        draws.stage(batch, rows)
        sampling, width = draws.in_graph(padded_to, torch.tensor([n])), padded_to
        last = torch.cat([last, torch.zeros(padded_to - n, dtype=torch.int64)])
    drafts = torch.empty(width, tree.num_nodes, dtype=torch.int64)
    parents = last[:, None]
    for d in range(1, tree.depth + 1):
        logits = draft[parents.flatten()].log()
        guesses = sampling.guesses(logits, tree.top_k(d), tree.level(d - 1))
        parents = level_scatter(tables, d, width, drafts).apply(guesses)
    return torch.cat([last[:, None], drafts], dim=1)[:n]


def speculate(reqs, target: torch.Tensor, draft: torch.Tensor, tokens: int, seed: int, padded_to: int | None = None):
    """Speculative decoding from START until every request has `tokens` tokens: (each request's first `tokens`
    tokens, the mean drafts accepted a step)."""
    n = len(reqs)
    tables = TreeTables.build(TREE, torch.device("cpu"))
    gen = torch.Generator().manual_seed(seed)
    draws = TreeDraws(padded_to or n, tables, V, torch.device("cpu"), gen)
    greedy = SamplingBatch.build(reqs, torch.device("cpu")).greedy
    out = [[] for _ in range(n)]
    last = torch.full((n,), START)
    accepted_steps = []
    while min(map(len, out)) < tokens:
        nodes = draft_trees(reqs, draft, last, draws, padded_to)
        probs = target[nodes]  # [n, N + 1, V]: the target's distribution after each node
        num = torch.full((n,), TREE.num_nodes)
        walk = walk_sampled_trees(probs, nodes, num, draws.node_probs[:n], tables,
                                  torch.rand(n, TREE.num_nodes + 1, generator=gen),
                                  torch.empty(n, V).exponential_(generator=gen))
        # The table walked_targets makes walks tree_verify's way to the same path and tokens.
        table = walked_targets(walk, probs.argmax(dim=-1), greedy)
        accepted, path = walk_tree(table, nodes, num, tables)
        sampled = ~greedy
        assert torch.equal(accepted[sampled], walk.accepted[sampled])
        assert torch.equal(path[sampled], walk.path[sampled])
        assert torch.equal(emitted_tokens(table, path, accepted)[sampled], walk.tokens[sampled])
        emitted = emitted_tokens(table, path, accepted)
        for i, row in enumerate(emitted.tolist()):
            out[i].extend(t for t in row if t >= 0)
        last = emitted.gather(1, accepted[:, None]).squeeze(1)
        accepted_steps.append(accepted.float().mean().item())
    return [o[:tokens] for o in out], sum(accepted_steps) / len(accepted_steps)


def joint(target: torch.Tensor, length: int) -> dict[tuple, float]:
    """P(the first `length` tokens after START), in float64, over the sequences that can occur."""
    target = target.double() / target.double().sum(dim=1, keepdim=True)
    probs = {(): 1.0}
    for _ in range(length):
        probs = {seq + (t,): p * float(target[seq[-1] if seq else START, t]) for seq, p in probs.items()
                 for t in range(V)}
    return {seq: p for seq, p in probs.items() if p > 0}


@pytest.mark.parametrize("padded_to", [None, 20_003], ids=["eager passes", "graph padded"])
@pytest.mark.parametrize("draft_zeros", [0, 3], ids=["full support", "drafter's support smaller than the tree"])
def test_emitted_tokens_are_distributed_as_the_targets(draft_zeros, padded_to):
    """Where the drafter gives two tokens no mass (three with mass for three children), the drafts past its
    support repeat the first, and the walk skips them. Drawn as the sampled tree graph draws, padded rows
    included (which write their distributions into the spare row, not a request's)."""
    target, draft = markov(0), markov(1, zeros=draft_zeros)
    out, accepted = speculate(requests(20_000), target, draft, tokens=3, seed=2, padded_to=padded_to)
    counts = Counter(map(tuple, out))
    assert p_value(counts, joint(target, 3)) > P_MIN
    assert p_value(counts, joint(draft, 3)) < P_MIN  # the test tells the drafter's distribution from the target's
    assert 0.3 < accepted < TREE.depth


def test_a_drafter_equal_to_the_target_has_its_first_children_accepted():
    """With q = p the first child is accepted (but for q's rounding to bfloat16): every step walks the tree's
    deepest line of first children, (0,), (0, 0), (0, 0, 0)."""
    target = markov(0)
    _, accepted = speculate(requests(2_000), target, target, tokens=6, seed=3)
    assert 2.98 < accepted <= 3.0


def test_greedy_rows_beside_sampled_ones_take_the_argmax_walk():
    """In a batch where every third request is greedy, those take the top guesses and the target's argmax at
    every node (the greedy sequence), the others are still distributed as the target's."""
    target, draft = markov(0), markov(1)
    reqs = requests(9_000, greedy_every=3)
    out, _ = speculate(reqs, target, draft, tokens=3, seed=4)
    argmax_path = [START]
    for _ in range(3):
        argmax_path.append(int(target[argmax_path[-1]].argmax()))
    assert all(out[i] == argmax_path[1:] for i in range(0, len(reqs), 3))
    counts = Counter(tuple(o) for i, o in enumerate(out) if i % 3)
    assert p_value(counts, joint(target, 3)) > P_MIN


def test_children_past_the_drafters_support_repeat_the_first():
    tables = TreeTables.build(TREE, torch.device("cpu"))
    draft = torch.zeros(V, V)
    draft[:, 1], draft[:, 4] = 0.5, 0.5  # two tokens with mass, three children after the root
    reqs = requests(50)
    draws = TreeDraws(50, tables, V, torch.device("cpu"), torch.Generator().manual_seed(0))
    nodes = draft_trees(reqs, draft, torch.full((50,), START), draws)
    first, second, third = nodes[:, 1], nodes[:, 2], nodes[:, 3]
    assert set(first.tolist()) == {1, 4} and torch.equal(third, first) and torch.equal(second, 5 - first)
    # q is kept for the nodes with children, in their slots: the root's in slot 0.
    assert torch.equal(draws.node_probs[:50, 0].float(), draft[START].expand(50, V))


@pytest.mark.parametrize("use_triton", [False, True], ids=["torch ops", "draw kernels"])
def test_a_padded_graph_writes_the_padding_into_the_spare_row(use_triton):
    """Two requests in the drafter's rows 2 and 3, drawn as a graph padded to four requests whose padded rows
    still name row 0 (staged by an earlier step): each request's q lands in its own row, the padding's in the
    spare row, and rows 0 and 1 (other requests') are untouched."""
    tables = TreeTables.build(TREE, torch.device("cpu"))
    draft = markov(1)
    draws = TreeDraws(4, tables, V, torch.device("cpu"), torch.Generator().manual_seed(0))
    draws.rows[2:] = 0
    draws.stage(SamplingBatch.build(requests(2), torch.device("cpu")), torch.tensor([2, 3]))
    logits = draft[torch.tensor([START, START, 0, 0])].log()
    draws.in_graph(4, torch.tensor([2])).guesses(logits, TREE.top_k(1), TREE.level(0), use_triton=use_triton)
    kept = draws.node_probs[:, 0].float()
    rounded = draft.to(draws.node_probs.dtype).float()
    assert torch.equal(kept[2], rounded[START]) and torch.equal(kept[3], rounded[START])
    assert torch.equal(kept[draws.spare_row], rounded[0]) and not kept[:2].any()


def kernel_against_torch_ops(seed: int, n: int, vocab: int, device: str) -> None:
    """The kernel's table (kernels/sampled_tree.py) against the torch ops' on random distributions (some tokens
    without mass, so that residuals and q run out), trees cut short (and the target's columns with them), q kept
    in shuffled rows, and greedy requests (whose table is the argmax)."""
    gen = torch.Generator().manual_seed(seed)
    tables = TreeTables.build(TREE, torch.device(device))
    width = TREE.num_nodes + 1

    def distributions(*shape):
        x = torch.rand(*shape, vocab, generator=gen) ** 3 * (torch.rand(*shape, vocab, generator=gen) > 0.3)
        return x / x.sum(-1, keepdim=True).clamp_min(1e-9)

    # Drafted tokens among each node's likeliest under q, so that some are accepted.
    node_probs = distributions(n, tables.num_prob_slots).to(torch.bfloat16)
    target_probs = (distributions(n, width) + node_probs[:, :1].float()) / 2
    cut = width - 2  # the verified columns: trees cut to at most N - 2 drafts
    node_tokens = torch.randint(0, min(vocab, 4), (n, cut), generator=gen)
    node_tokens = node_probs[:, 0].float().argsort(dim=-1, descending=True).gather(1, node_tokens)
    # The verified tokens are the step's input ids, in shuffled positions.
    index = torch.randperm(n * cut, generator=gen).view(n, cut)
    input_ids = torch.empty(n * cut, dtype=torch.int64)
    input_ids[index.flatten()] = node_tokens.flatten()
    rows = torch.randperm(n, generator=gen)
    greedy = torch.rand(n, generator=gen) < 0.2
    num_drafts = torch.randint(0, cut, (n,), generator=gen)
    cpu = (target_probs[:, :cut], target_probs[:, :cut].argmax(-1), greedy, input_ids, index, num_drafts,
           node_probs[rows.argsort()], rows, tables, torch.rand(n, cut, generator=gen),
           torch.empty(n, vocab).exponential_(generator=gen))
    args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in cpu)
    want = sampled_tree_targets(*args, use_triton=False)
    got = sampled_tree_targets(*args, use_triton=True)
    assert torch.equal(got, want)
    def padded(x):  # to the tree's every index, as walk_tree reads them
        return torch.cat([x, x[:, -1:].expand(-1, width - cut)], dim=1)

    accepted, _ = walk_tree(padded(want.cpu()), padded(node_tokens), num_drafts, TreeTables.build(TREE, "cpu"))
    assert accepted.sum() > n // 4 and torch.equal(want.cpu()[greedy], target_probs[:, :cut].argmax(-1)[greedy])


@pytest.mark.parametrize("seed", [0, 1])
def test_the_kernel_writes_the_table_the_torch_ops_write(seed):
    kernel_against_torch_ops(seed, n=300, vocab=11, device="cpu")


@pytest.mark.gpu
def test_the_kernel_on_cuda_at_the_default_models_vocabulary():
    kernel_against_torch_ops(0, n=64, vocab=49_152, device="cuda")
