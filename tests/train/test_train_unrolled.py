"""Training-time test matches drafting: every unrolled step equals the drafter's step run through the
engine's paged reference attention, and the loss counts exactly the rows a drafter can stand on."""
from __future__ import annotations

import torch

from dense_unrolled_attention import dense_step_attention, output_and_gradients
from single_thread import one_thread  # noqa: F401  (autouse)
from specserve.attention.metadata import AttentionMetadata
from specserve.attention.torch_backend import TorchAttentionBackend
from specserve.models.arch_config import ArchConfig
from specserve.models.eagle3 import Eagle3Head
from specserve.train.attention import UnrolledAttention, unrolled_step_attention
from specserve.train.batches import Batch
from specserve.train.features import NextTokens
from specserve.train.ttt import unroll, unrolled_loss

BLOCK = 16
AUX = (0, 1, 2)


def arch(vocab: int = 50) -> ArchConfig:
    return ArchConfig(architecture="LlamaForCausalLM", vocab_size=vocab, hidden_size=32, intermediate_size=64,
                      num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0,
                      max_position_embeddings=128, tie_word_embeddings=False)


def heads(seed: int = 0, draft_vocab: int = 50) -> tuple[Eagle3Head, Eagle3Head]:
    """The same random head twice: under the training attention, and under the engine's paged attention."""
    torch.manual_seed(seed)
    train = Eagle3Head(arch(), UnrolledAttention(), draft_vocab, 32, AUX)
    with torch.no_grad():
        for p in train.parameters():
            p.normal_(0, 0.3) if p.dim() == 2 else p.normal_(1, 0.1)
    serve = Eagle3Head(arch(), TorchAttentionBackend(), draft_vocab, 32, AUX)
    serve.load_state_dict(train.state_dict())
    return train, serve


def metadata(positions: list[int]) -> AttentionMetadata:
    """One request writing `positions` (consecutive) into its cache, whose blocks are 0, 1, 2, ..."""
    n, seq_len = len(positions), positions[-1] + 1
    i32 = torch.int32
    return AttentionMetadata(
        num_reqs=1, num_tokens=n, max_query_len=n, max_seq_len=seq_len,
        query_start_loc=torch.tensor([0, n], dtype=i32), seq_lens=torch.tensor([seq_len], dtype=i32),
        block_table=torch.arange(8, dtype=i32)[None], slot_mapping=torch.tensor(positions),
        query_start_loc_cpu=torch.tensor([0, n], dtype=i32), seq_lens_cpu=torch.tensor([seq_len], dtype=i32))


@torch.no_grad()
def draft_chain(head: Eagle3Head, tokens: torch.Tensor, aux: torch.Tensor, p: int, steps: int) -> list[torch.Tensor]:
    """What the drafter computes for a request whose last accepted token is tokens[p]: the prefill over
    positions 0..p (fed the target's hidden states and the next tokens), then one token per step."""
    cache = torch.zeros(2, 8, BLOCK, 2, 8)
    fed_back, normed = head(tokens[1:p + 2], torch.arange(p + 1), aux[:p + 1], cache, metadata(list(range(p + 1))))
    out, hidden = [normed[p]], fed_back[p:p + 1]
    for j in range(1, steps):
        # Draft j - 1 is fed in; a kept draft equals the target's token there.
        pos = p + j
        hidden, normed = head(tokens[pos + 1:pos + 2], torch.tensor([pos]), hidden, cache, metadata([pos]))
        out.append(normed[0])
    return out


def test_every_unrolled_step_equals_the_drafter_at_every_position():
    train, serve = heads()
    n, steps = 20, 4
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 50, (n + steps + 1,), generator=g)
    aux = torch.randn(n, 3 * 32, generator=g)
    with torch.no_grad():
        unrolled = [x.view(1, n, -1)[0] for x in unroll(train, aux, tokens[:n][None], steps)]
    for p in range(n - steps):
        for j, want in enumerate(draft_chain(serve, tokens, aux, p, steps)):
            torch.testing.assert_close(unrolled[j][p], want, rtol=1e-4, atol=1e-5,
                                       msg=f"step {j} of the chain at {p}")


def test_rows_of_one_sequence_do_not_see_its_batch_neighbours():
    train, _ = heads()
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 50, (2, 12), generator=g)
    aux = torch.randn(2 * 12, 96, generator=g)
    with torch.no_grad():
        together = [x.view(2, 12, -1) for x in unroll(train, aux, ids, 3)]
        alone = [x.view(1, 12, -1) for x in unroll(train, aux[12:], ids[1:], 3)]
    for a, b in zip(together, alone):
        torch.testing.assert_close(a[1], b[0])


def test_counted_rows_are_those_a_drafter_stands_on():
    train, _ = heads()
    lengths, prompts, steps = [10, 7], [3, 2], 3
    ids = torch.randint(0, 50, (2, 10), generator=torch.Generator().manual_seed(3))
    batch = Batch(ids, torch.tensor(lengths), torch.tensor(prompts))
    identity = torch.arange(50)
    result = unrolled_loss(train, torch.randn(20, 96), batch, identity, identity, steps, 0.8)
    # Chains start at the last prompt token (P - 1) and need token i + j + 2 to exist.
    want = [sum(max(0, n - j - p - 1) for n, p in zip(lengths, prompts)) for j in range(steps)]
    assert result.counted.tolist() == want
    assert 0 <= result.correct.min() and (result.correct <= result.counted).all()


def test_tokens_outside_the_draft_vocabulary_are_misses_without_loss():
    train, _ = heads(draft_vocab=5)
    ids = torch.full((1, 8), 40)  # every target token is outside the draft vocabulary 0..4
    batch = Batch(ids, torch.tensor([8]), torch.tensor([2]))
    target_to_draft = torch.full((50,), -1).index_copy_(0, torch.arange(5), torch.arange(5))
    result = unrolled_loss(train, torch.randn(8, 96), batch, target_to_draft, torch.arange(5), 2, 0.8)
    assert result.loss.item() == 0.0
    assert result.correct.tolist() == [0, 0] and result.counted.tolist() == [5, 4]


def test_loss_weights_later_steps_by_the_decay():
    train, _ = heads()
    ids = torch.randint(0, 50, (1, 9), generator=torch.Generator().manual_seed(4))
    batch, aux, identity = Batch(ids, torch.tensor([9]), torch.tensor([1])), torch.randn(9, 96), torch.arange(50)
    one = unrolled_loss(train, aux, batch, identity, identity, 1, 0.5).loss
    two = unrolled_loss(train, aux, batch, identity, identity, 2, 0.5).loss
    # Step 1 alone, from the same unrolled outputs: cross-entropy of its counted rows.
    normed = list(unroll(train, aux, ids, 2))[1]
    rows = torch.arange(0, 6)  # i >= 0 and i + 3 < 9
    ce = torch.nn.functional.cross_entropy(train.lm_head(normed[rows]).float(), ids[0, rows + 3])
    torch.testing.assert_close(two, one + 0.5 * ce)


def one_hot_teacher(ids: torch.Tensor, vocab: int) -> NextTokens:
    """A target certain of the data's next token at every position (the last position predicts token 0)."""
    nxt = torch.nn.functional.pad(ids[:, 1:], (0, 1)).flatten()
    return NextTokens(nxt, torch.nn.functional.one_hot(nxt, vocab).float())


def test_soft_labels_of_a_certain_target_are_the_hard_loss():
    train, _ = heads()
    ids = torch.randint(0, 50, (2, 11), generator=torch.Generator().manual_seed(5))
    batch, identity = Batch(ids, torch.tensor([11, 8]), torch.tensor([2, 3])), torch.arange(50)
    aux = torch.randn(22, 96, generator=torch.Generator().manual_seed(6))
    hard = unrolled_loss(train, aux, batch, identity, identity, 3, 0.8)
    soft = unrolled_loss(train, aux, batch, identity, identity, 3, 0.8, one_hot_teacher(ids, 50))
    torch.testing.assert_close(soft.loss, hard.loss)
    assert soft.correct.tolist() == hard.correct.tolist() and soft.counted.tolist() == hard.counted.tolist()


def test_soft_loss_is_kl_divergence_from_the_targets_distribution_in_float64():
    train, _ = heads(draft_vocab=40)
    g = torch.Generator().manual_seed(7)
    n, steps, prompt = 9, 2, 3
    ids = torch.randint(0, 50, (1, n), generator=g)
    aux = torch.randn(n, 96, generator=g)
    probs = torch.softmax(3 * torch.randn(n, 50, generator=g), dim=-1)
    greedy = probs.argmax(dim=-1)
    greedy[4] = 49  # outside the draft vocabulary 0..39 below: left out of the loss
    target_to_draft = torch.where(torch.arange(50) < 40, torch.arange(50), -1)
    draft_probs = probs[:, :40] / probs[:, :40].sum(dim=-1, keepdim=True)
    result = unrolled_loss(train, aux, Batch(ids, torch.tensor([n]), torch.tensor([prompt])), target_to_draft,
                           torch.arange(40), steps, 0.5, NextTokens(greedy, draft_probs))
    with torch.no_grad():
        normed = list(unroll(train, aux, ids, steps))
    want, correct = 0.0, []
    for j in range(steps):
        rows = [i for i in range(prompt - 1, n) if i + j + 2 < n]
        logp = torch.log_softmax(train.lm_head(normed[j][rows]).double(), dim=-1)
        teacher_rows = [i + j + 1 for i in rows]
        p = draft_probs[teacher_rows].double()
        ce = (p * (p.log() - logp)).sum(dim=-1)
        keep = torch.tensor([greedy[r] < 40 for r in teacher_rows])
        want += 0.5**j * ce[keep].mean().item()
        correct.append(int((logp.argmax(dim=-1) == greedy[teacher_rows]).sum()))
    assert abs(result.loss.item() - want) < 1e-4
    assert result.correct.tolist() == correct


def test_unrolled_step_attention_and_its_gradients_equal_a_dense_mask_in_float64():
    """The flash-and-diagonal split of step j against one softmax over every step's keys under the dense
    mask (the row's causal step-0 keys and its own keys of steps 1..j), outputs and all gradients."""
    torch.manual_seed(0)
    b, heads, kv_heads, n, d, j = 2, 4, 2, 7, 8, 3
    q = torch.randn(b, heads, n, d, dtype=torch.float64, requires_grad=True)
    keys = [torch.randn(b, kv_heads, n, d, dtype=torch.float64, requires_grad=True) for _ in range(j + 1)]
    values = [torch.randn(b, kv_heads, n, d, dtype=torch.float64, requires_grad=True) for _ in range(j + 1)]
    grad = torch.randn(b * n, heads, d, dtype=torch.float64)

    reference = output_and_gradients(lambda: dense_step_attention(q, keys, values, 0.4), q, keys, values, grad)
    split = output_and_gradients(lambda: unrolled_step_attention(q, keys, values, 0.4), q, keys, values, grad)
    for want, got in zip(reference, split):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
