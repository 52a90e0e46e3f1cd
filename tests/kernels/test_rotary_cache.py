"""Triton rotary embedding fused with the paged KV-cache write, against float64.

Everything the kernel must not touch is NaN: the cache outside this step's
slots, the q/k/v rows of padding tokens, the memory around the projection.
"""
import math

import pytest
import torch

from specserve.attention.metadata import PAD_SLOT_ID
from specserve.kernels.rotary_cache import rotary_and_cache
from specserve.models.layers import RotaryEmbedding

from .util import DEVICE, DTYPES, assert_close, poison_intact, poisoned_view

MAX_POSITIONS = 4096
BLOCK_SIZE = 16
SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 1024}


def rotate_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.double().chunk(2, dim=-1)
    cos, sin = cos.double()[:, None], sin.double()[:, None]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def check_rotary_and_cache(num_tokens, num_heads, num_kv_heads, head_dim, dtype, pad_tokens=2, num_slots=None,
                           seed=0):
    """num_tokens real tokens then pad_tokens padding (NaN rows, pad slots); slot_mapping
    covers the first num_slots tokens (all of them by default)."""
    gen = torch.Generator().manual_seed(seed)
    total = num_tokens + pad_tokens
    num_slots = total if num_slots is None else num_slots
    rotary = RotaryEmbedding(head_dim, MAX_POSITIONS, 500000.0, SCALING).to(DEVICE)
    qkv = poisoned_view(total, (num_heads + 2 * num_kv_heads) * head_dim, dtype, seed=seed)
    qkv[num_tokens:] = math.nan
    widths = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    q, k, v = (t.unflatten(1, (-1, head_dim)) for t in qkv.split(widths, dim=1))
    positions = torch.randint(0, MAX_POSITIONS, (total,), generator=gen)
    positions[num_tokens:] = 0

    num_blocks = -(-total // BLOCK_SIZE) + 2
    kv_cache = torch.full((2, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim), math.nan, dtype=dtype, device=DEVICE)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=gen)[:total]
    slots[num_tokens:] = PAD_SLOT_ID
    if num_tokens > 2:
        slots[1] = PAD_SLOT_ID  # a pad slot among real tokens writes nothing either
    slot_mapping = slots[:num_slots].to(DEVICE)

    cos, sin = rotary.cos[positions.to(DEVICE)], rotary.sin[positions.to(DEVICE)]
    q_ref, k_ref, v_before = rotate_reference(q, cos, sin), rotate_reference(k, cos, sin), v.clone()
    rotary_and_cache(positions.to(DEVICE), q, k, v, rotary.cos, rotary.sin, kv_cache, slot_mapping)

    assert_close(q[:num_tokens], q_ref[:num_tokens])
    assert_close(k[:num_tokens], k_ref[:num_tokens])
    assert torch.equal(v[:num_tokens], v_before[:num_tokens])
    assert poison_intact(qkv), "wrote outside q/k/v"
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
    owners = (slots[:num_slots] != PAD_SLOT_ID).nonzero()[:, 0].to(DEVICE)  # the tokens that own a slot
    written = slots.to(DEVICE)[owners]
    assert_close(flat[0, written], k_ref[owners])
    assert torch.equal(flat[1, written], v_before[owners])
    untouched = torch.ones(flat.shape[1], dtype=torch.bool, device=DEVICE)
    untouched[written] = False
    assert flat[:, untouched].isnan().all(), "wrote a slot it should not have"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (8, 2, 128)])
def test_rotary_and_cache(num_heads, num_kv_heads, head_dim, dtype):
    check_rotary_and_cache(7, num_heads, num_kv_heads, head_dim, dtype)


@pytest.mark.parametrize("num_tokens", [1, 5])
def test_tokens_past_slot_mapping_write_nothing(num_tokens):
    check_rotary_and_cache(num_tokens, 4, 1, 64, torch.float32, pad_tokens=0, num_slots=num_tokens - 1)


def test_head_dim_not_a_power_of_two():
    check_rotary_and_cache(3, 4, 2, 96, torch.bfloat16)


def test_only_padding_and_no_tokens():
    check_rotary_and_cache(0, 9, 3, 64, torch.bfloat16, pad_tokens=3)
    check_rotary_and_cache(0, 9, 3, 64, torch.bfloat16, pad_tokens=0)
