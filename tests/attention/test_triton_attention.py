"""Triton paged attention and KV-cache write against the torch reference and a
float64 dense computation from the un-paged keys and values.

Without a GPU, Triton runs in its interpreter (tests/conftest.py switches it on). With a GPU the
same tests run natively.
"""
import math
from dataclasses import dataclass

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytest.importorskip("triton")

from specserve.attention.metadata import PAD_SLOT_ID, AttentionMetadata  # noqa: E402
from specserve.attention.torch_backend import TorchAttentionBackend, write_kv_cache  # noqa: E402
from specserve.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from specserve.kernels.reshape_and_cache import write_kv_cache_triton  # noqa: E402

TOLERANCE = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.bfloat16: dict(atol=1e-2, rtol=1e-2),
    torch.float16: dict(atol=1e-2, rtol=1e-2),
}

# One batch mixing every kind of request: prefill behind a cached prefix, fresh
# prefill, decode, draft verification, and a single-token prompt.
MIXED_Q_LENS = [13, 9, 1, 4, 1]
MIXED_SEQ_LENS = [21, 9, 17, 11, 1]


@dataclass
class PagedBatch:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    kv_cache: torch.Tensor
    metadata: AttentionMetadata
    # Every request's whole key/value history [seq_len, num_kv_heads, head_dim]:
    # what the cache should hold, kept apart from it for the dense reference.
    history: list[tuple[torch.Tensor, torch.Tensor]]
    num_real_tokens: int


def make_batch(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, dtype, block_size=8,
               pad_reqs=0, pad_tokens=0, device=DEVICE, seed=0) -> PagedBatch:
    """A paged batch whose requests' cached prefixes are already in the cache.

    Blocks are handed out in shuffled order. Everything the kernels must not
    read is NaN: unused blocks, the tails of partly filled blocks, the unused
    block-table entries (they point at a never-written block), and the q/k/v
    rows of the pad_tokens padding tokens. pad_reqs request rows are padded as
    a full CUDA graph pads them: empty queries, seq_len 0.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 1  # the last one in shuffled order is never written
    order = torch.randperm(num_blocks, generator=gen)
    never_written = int(order[-1])
    num_reqs = len(q_lens) + pad_reqs
    block_table = torch.full((num_reqs, max(blocks_per_req) + 1), never_written, dtype=torch.int32)
    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), math.nan, dtype=dtype)
    flat_cache = kv_cache.view(2, -1, num_kv_heads, head_dim)

    num_real_tokens = sum(q_lens)
    num_tokens = num_real_tokens + pad_tokens
    # q, k, v are views of one fused projection output, as the model produces them.
    qkv = torch.full((num_tokens, (num_heads + 2 * num_kv_heads) * head_dim), math.nan, dtype=dtype)
    widths = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]

    def split(qkv):
        return [t.unflatten(1, (-1, head_dim)) for t in qkv.split(widths, dim=1)]

    q, k, v = split(qkv)

    history, slot_mapping, next_block, start = [], [], 0, 0
    for i, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        block_table[i, : blocks_per_req[i]] = order[next_block : next_block + blocks_per_req[i]]
        next_block += blocks_per_req[i]
        pos = torch.arange(seq_len)
        slots = block_table[i, pos // block_size].long() * block_size + pos % block_size
        keys = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        values = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        cached = seq_len - q_len
        flat_cache[0, slots[:cached]] = keys[:cached]
        flat_cache[1, slots[:cached]] = values[:cached]
        q[start : start + q_len] = torch.randn(q_len, num_heads, head_dim, generator=gen).to(dtype)
        k[start : start + q_len] = keys[cached:]
        v[start : start + q_len] = values[cached:]
        slot_mapping += slots[cached:].tolist()
        history.append((keys.to(device), values.to(device)))
        start += q_len
    slot_mapping += [PAD_SLOT_ID] * pad_tokens

    query_start_loc = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    query_start_loc = torch.cat([query_start_loc, query_start_loc[-1:].repeat(pad_reqs)])
    seq_lens_t = torch.tensor(seq_lens + [0] * pad_reqs, dtype=torch.int32)
    metadata = AttentionMetadata(
        num_reqs=num_reqs,
        num_tokens=num_tokens,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_start_loc=query_start_loc.to(device),
        seq_lens=seq_lens_t.to(device),
        block_table=block_table.to(device),
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens_t,
    )
    return PagedBatch(*split(qkv.to(device)), kv_cache.to(device), metadata, history, num_real_tokens)


def dense_attention(batch: PagedBatch, scale: float) -> torch.Tensor:
    """float64 causal attention per request, straight from the key/value history."""
    out = torch.zeros(batch.num_real_tokens, *batch.q.shape[1:], dtype=torch.float64, device=batch.q.device)
    group = batch.q.shape[1] // batch.k.shape[1]
    qsl = batch.metadata.query_start_loc_cpu.tolist()
    for i, (keys, values) in enumerate(batch.history):
        start, end = qsl[i], qsl[i + 1]
        seq_len = keys.shape[0]
        keys = keys.double().repeat_interleave(group, dim=1)
        values = values.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", batch.q[start:end].double(), keys) * scale
        q_pos = torch.arange(seq_len - (end - start), seq_len, device=keys.device)
        visible = torch.arange(seq_len, device=keys.device)[None, :] <= q_pos[:, None]
        probs = scores.masked_fill(~visible, -math.inf).softmax(-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, values)
    return out


def run_both(batch: PagedBatch, scale: float):
    """Each backend on its own copy of the cache: (triton out, triton cache, torch out, torch cache)."""
    cache_ref = batch.kv_cache.clone()
    out_ref = TorchAttentionBackend().forward(batch.q, batch.k, batch.v, cache_ref, batch.metadata, scale)
    cache = batch.kv_cache.clone()
    out = TritonAttentionBackend().forward(batch.q, batch.k, batch.v, cache, batch.metadata, scale)
    return out, cache, out_ref, cache_ref


def assert_matches(batch: PagedBatch, scale: float):
    out, cache, out_ref, cache_ref = run_both(batch, scale)
    n = batch.num_real_tokens
    tol = TOLERANCE[batch.q.dtype]
    torch.testing.assert_close(out[:n], out_ref[:n], **tol)
    torch.testing.assert_close(out[:n].double(), dense_attention(batch, scale), **tol)
    torch.testing.assert_close(cache, cache_ref, atol=0, rtol=0, equal_nan=True)
    return out, cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 2), (9, 3)])
def test_mixed_batch_matches_references(num_heads, num_kv_heads, head_dim, dtype):
    batch = make_batch(MIXED_Q_LENS, MIXED_SEQ_LENS, num_heads, num_kv_heads, head_dim, dtype)
    assert_matches(batch, head_dim**-0.5)


@pytest.mark.parametrize("block_size", [4, 16])
def test_padded_graph_batch_reads_and_writes_nothing_out_of_range(block_size):
    # A uniform verify batch (1 + 2 drafts per request) padded the way a full
    # CUDA graph pads it: extra request rows and extra tokens with pad slots.
    batch = make_batch([3, 3, 3], [7, 19, 3], 9, 3, 64, torch.float32, block_size=block_size,
                       pad_reqs=3, pad_tokens=5)
    out, cache = assert_matches(batch, 0.125)
    n = batch.num_real_tokens
    assert torch.all(out[n:] == 0), "padding tokens must produce zeros"
    # The pad tokens' NaN keys went nowhere: exactly the real slots changed.
    written = torch.zeros(cache.shape[1] * cache.shape[2], dtype=torch.bool, device=cache.device)
    written[batch.metadata.slot_mapping[:n]] = True
    flat = cache.view(2, -1, *cache.shape[3:])
    assert not flat[:, written].isnan().any()
    torch.testing.assert_close(flat[:, ~written], batch.kv_cache.view_as(flat)[:, ~written], equal_nan=True)


@pytest.mark.parametrize("pad_tokens", [0, 1, 12])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_padding_tokens_get_exact_zeros_in_uninitialised_output(monkeypatch, pad_tokens, dtype):
    # The kernel zeros the padding itself, in more tokens than one tile of it covers: an
    # output allocated as NaN shows any row it missed.
    monkeypatch.setattr(torch, "empty_like", lambda t: torch.full_like(t, math.nan))
    batch = make_batch([3, 1], [7, 4], 9, 3, 64, dtype, pad_reqs=2, pad_tokens=pad_tokens)
    out = TritonAttentionBackend().forward(batch.q, batch.k, batch.v, batch.kv_cache.clone(), batch.metadata, 0.125)
    n = batch.num_real_tokens
    assert not out[:n].isnan().any()
    assert torch.equal(out[n:], torch.zeros_like(out[n:])), "padding tokens must produce exact zeros"


@pytest.mark.parametrize("min_chunk", [16, 32, 512])
@pytest.mark.parametrize("splits", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_keys_split_over_programs_merge_to_the_same_attention(monkeypatch, min_chunk, splits, dtype):
    # Decode and verification with parts of every kind: several key tiles (BLOCK_N is 16 under the
    # interpreter) and query tiles (7 tokens of 3 heads a KV head: two 16-row tiles), one, none (a 1-token context has one part; min_chunk 512 keeps every context whole);
    # padded requests and tokens, and an output allocated as NaN, so a row nobody wrote shows. Twice: the
    # last part to finish resets the counts for the next launch.
    import specserve.attention.triton_backend as triton_backend

    monkeypatch.setattr(triton_backend, "num_kv_splits", lambda *args: splits)
    monkeypatch.setattr(triton_backend, "MIN_CHUNK", min_chunk)
    monkeypatch.setattr(torch, "empty_like", lambda t: torch.full_like(t, math.nan))
    backend = TritonAttentionBackend()
    for seed in (0, 1):
        batch = make_batch([1, 3, 1, 7], [70, 33, 1, 17], 9, 3, 64, dtype, pad_reqs=2, pad_tokens=3, seed=seed)
        out = backend.forward(batch.q, batch.k, batch.v, batch.kv_cache.clone(), batch.metadata, 0.125)
        n = batch.num_real_tokens
        torch.testing.assert_close(out[:n].double(), dense_attention(batch, 0.125), **TOLERANCE[dtype])
        assert torch.equal(out[n:], torch.zeros_like(out[n:])), "padding tokens must produce exact zeros"
        assert not backend._counters(batch.q.device).any()


@pytest.mark.parametrize("num_reqs,num_kv_heads,query_tiles,on_cpu,expected", [
    (1, 8, 1, False, 16),  # Llama-3-8B decode at batch 1: 128 programs
    (1, 3, 1, False, 32),  # SmolLM2: 96 (at most MAX_SPLITS parts)
    (8, 8, 1, False, 2),
    (16, 8, 1, False, 1),  # 128 programs already
    (1, 3, 4, False, 8),  # verifying a tree of 16 drafts in 16-row tiles: 12 programs
    (1, 8, 2, False, 8),  # a short prefill
    (1, 8, 40, False, 1),  # a long one fills the GPU with its query tiles
    (1, 8, 1, True, 1),  # the interpreter
])
def test_split_count_fills_the_gpu_for_small_decode_batches(num_reqs, num_kv_heads, query_tiles, on_cpu, expected):
    from specserve.attention.triton_backend import num_kv_splits

    assert num_kv_splits(num_reqs, num_kv_heads, query_tiles, on_cpu) == expected


# Same dtype in and out: the interpreter truncates float32 -> bfloat16 where the GPU rounds.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_kv_cache_write_matches_torch(dtype):
    gen = torch.Generator().manual_seed(1)
    num_kv_heads, head_dim, block_size, num_blocks = 3, 64, 4, 6
    # Tokens past slot_mapping are ignored; pad slots are scattered among real ones.
    k = torch.randn(12, num_kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    v = torch.randn(12, num_kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:10]
    slots[[2, 5, 9]] = PAD_SLOT_ID
    slots = slots.to(DEVICE)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    expected = cache.clone()
    write_kv_cache(k, v, expected, slots)
    write_kv_cache_triton(k, v, cache, slots)
    torch.testing.assert_close(cache, expected, atol=0, rtol=0)
