"""Triton paged attention compiled for a real GPU: realistic sizes and CUDA
graph capture. Run with `pytest -m gpu`.

The helpers come from the CPU test module, which leaves Triton's interpreter
off whenever a GPU is present.
"""
import random

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

pytest.importorskip("triton")

from test_triton_attention import assert_matches, make_batch  # noqa: E402

from specserve.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from specserve.attention.triton_backend import TritonAttentionBackend  # noqa: E402


def mixed_lengths(num_reqs: int, max_seq_len: int, seed: int) -> tuple[list[int], list[int]]:
    """(q_lens, seq_lens) cycling through prefill behind a cached prefix, fresh
    prefill, decode and verification of 3 or 5 drafts."""
    rng = random.Random(seed)
    q_lens, seq_lens = [], []
    for i in range(num_reqs):
        seq_len = rng.randint(1, max_seq_len)
        kind = i % 4
        if kind == 0:
            q_len = rng.randint(1, min(seq_len, 512))
        elif kind == 1:
            seq_len = q_len = rng.randint(1, 512)
        elif kind == 2:
            q_len = 1
        else:
            q_len = min(seq_len, rng.choice([4, 6]))
        q_lens.append(q_len)
        seq_lens.append(seq_len)
    return q_lens, seq_lens


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,dtype",
    [(32, 8, 128, torch.bfloat16), (9, 3, 64, torch.bfloat16), (32, 8, 128, torch.float16), (9, 3, 64, torch.float32)],
)
def test_large_mixed_batch(num_heads, num_kv_heads, head_dim, dtype):
    q_lens, seq_lens = mixed_lengths(32, 2048, seed=0)
    batch = make_batch(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, dtype, block_size=16)
    assert_matches(batch, head_dim**-0.5)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(32, 8, 128), (9, 3, 64)])
def test_small_decode_batches_split_their_keys(num_heads, num_kv_heads, head_dim):
    # Batch 1 at a long context, and decode beside verification with a padded request row: each
    # request's keys split over several programs (4 to 32 parts), padding tokens still exact zeros.
    from specserve.attention.triton_backend import num_kv_splits

    for q_lens, seq_lens, pad_reqs in (([1], [4000], 0), ([6, 1], [2500, 1], 1)):
        batch = make_batch(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, torch.bfloat16, block_size=16,
                           pad_reqs=pad_reqs, pad_tokens=2 * pad_reqs)
        assert num_kv_splits(batch.metadata.num_reqs, num_kv_heads, 1, False) >= 4
        out, _ = assert_matches(batch, head_dim**-0.5)
        assert torch.all(out[batch.num_real_tokens:] == 0)


def test_cuda_graph_replay_reads_metadata_at_replay():
    # Two padded verify batches of identical shapes; the second permutes the
    # sequence lengths and reshuffles the blocks. A graph captured on the first
    # and replayed on the second's data must give the second's attention.
    q_lens = [4] * 6
    shape = dict(num_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, block_size=16,
                 pad_reqs=2, pad_tokens=3)
    captured = make_batch(q_lens, [5, 700, 64, 1500, 33, 260], seed=0, **shape)
    replayed = make_batch(q_lens, [1500, 33, 700, 260, 5, 64], seed=1, **shape)
    scale = 128**-0.5
    backend = TritonAttentionBackend()
    cache = captured.kv_cache.clone()
    backend.forward(captured.q, captured.k, captured.v, cache.clone(), captured.metadata, scale)  # compile first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(captured.q, captured.k, captured.v, cache, captured.metadata, scale)

    for name in ("q", "k", "v"):
        getattr(captured, name).copy_(getattr(replayed, name))
    for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"):
        getattr(captured.metadata, name).copy_(getattr(replayed.metadata, name))
    cache.copy_(replayed.kv_cache)
    graph.replay()

    expected_cache = replayed.kv_cache.clone()
    expected = TorchAttentionBackend().forward(
        replayed.q, replayed.k, replayed.v, expected_cache, replayed.metadata, scale)
    n = replayed.num_real_tokens
    torch.testing.assert_close(out[:n], expected[:n], atol=1e-2, rtol=1e-2)
    assert torch.all(out[n:] == 0)
    torch.testing.assert_close(cache, expected_cache, atol=0, rtol=0, equal_nan=True)
