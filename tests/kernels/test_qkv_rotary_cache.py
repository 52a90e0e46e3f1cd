"""Triton small-M qkv projection with rotary and KV-cache write, against float64, whole or split over K.

The reference builds q, k and v from the definitions (sum, RMSNorm, matmul,
bias, rotate halves) and scatters k and v by slot; the cache starts as NaN,
and every slot no real token owns must still be NaN afterwards.
"""
import math
from dataclasses import replace

import pytest
import torch

from specserve.attention.metadata import PAD_SLOT_ID
from specserve.kernels.qkv_rotary_cache import qkv_rotary_cache
from specserve.kernels.small_m_configs import INTERPRETER_QKV
from specserve.models.layers import RotaryEmbedding

from .test_fused_linear import EPS, PROLOGUES, norm_weight_of
from .util import DEVICE, assert_close, poison_intact, poisoned_view

K = 100
BLOCK_SIZE = 4
MAX_POSITIONS = 64


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox rotary of [M, heads, head_dim] in float64: pair (d, d + half) turns by the angle of d."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos.double()[:, None, :], sin.double()[:, None, :]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


def check_qkv(m, num_heads, num_kv_heads, head_dim, dtype, prologue="add_norm", bias=False, num_slots=None, k=K,
              config=None):
    gen = torch.Generator().manual_seed(3)
    rows = (num_heads + 2 * num_kv_heads) * head_dim
    x = poisoned_view(m, k, dtype, seed=0)
    residual = poisoned_view(m, k, dtype, seed=1) if prologue == "add_norm" else None
    weight = poisoned_view(rows, k, dtype, seed=2)
    weight.mul_(k**-0.5)
    norm_weight = norm_weight_of(k, dtype) if prologue != "none" else None
    bias_t = (0.5 * torch.randn(rows, generator=gen)).to(DEVICE, dtype) if bias else None
    rotary = RotaryEmbedding(head_dim, MAX_POSITIONS, 10000.0, {}).to(DEVICE)
    positions = torch.randint(0, MAX_POSITIONS, (m,), generator=gen).to(DEVICE)

    num_blocks = -(-m // BLOCK_SIZE) + 2
    kv_cache = torch.full((2, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim), math.nan, dtype=dtype, device=DEVICE)
    num_slots = m if num_slots is None else num_slots
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=gen)[:num_slots]
    if num_slots > 2:
        slots[1] = PAD_SLOT_ID  # a padding token among real ones writes nothing
    slot_mapping = slots.to(DEVICE)

    q, total = qkv_rotary_cache(x, weight, positions, rotary.cos, rotary.sin, kv_cache, slot_mapping, num_heads,
                                bias=bias_t, norm_weight=norm_weight, eps=EPS, residual=residual, config=config)

    h = x.double() + (residual.double() if residual is not None else 0)
    if norm_weight is not None:
        h = h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * norm_weight.double()
    qkv = h @ weight.double().T + (bias_t.double() if bias else 0)
    q_ref, k_ref, v_ref = qkv.view(m, -1, head_dim).split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    cos, sin = rotary.cos[positions], rotary.sin[positions]
    q_ref, k_ref = rotate(q_ref, cos, sin), rotate(k_ref, cos, sin)

    assert q.shape == (m, num_heads, head_dim) and q.dtype == dtype
    assert_close(q, q_ref, terms=k)
    if residual is None:
        assert total is None
    else:
        assert_close(total, x.double() + residual.double())
        assert poison_intact(residual)
    assert poison_intact(x) and poison_intact(weight)
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
    owners = (slots != PAD_SLOT_ID).nonzero()[:, 0]
    written = slots[owners].to(DEVICE)
    assert_close(flat[0, written], k_ref[owners.to(DEVICE)], terms=k)
    assert_close(flat[1, written], v_ref[owners.to(DEVICE)], terms=k)
    untouched = torch.ones(flat.shape[1], dtype=torch.bool, device=DEVICE)
    untouched[written] = False
    assert flat[:, untouched].isnan().all(), "wrote a slot it should not have"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
# 17 and 32: the 32-row tile a tree's verification takes past 16 rows.
@pytest.mark.parametrize("m", [1, 3, 16, 17, 32])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("prologue", PROLOGUES)
def test_qkv_rotary_cache(prologue, bias, m, dtype):
    check_qkv(m, 4, 2, 16, dtype, prologue, bias)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m", [3, 24])
def test_full_tile_prologue(m, dtype):
    # The interpreter's default config is compact, as the GPU's on small weights (see test_fused_linear's).
    check_qkv(m, 4, 2, 8, dtype, config=replace(INTERPRETER_QKV, compact=False))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_tile_wider_than_a_head(dtype):
    # 32 rotary pairs a program (QKV_SMALL, NORM_SMALL on the GPU) over heads of 8 pairs: the rest is mask.
    check_qkv(3, 4, 2, 16, dtype, config=replace(INTERPRETER_QKV, block_n=32))
    check_qkv(3, 4, 2, 16, dtype, prologue="none", config=replace(INTERPRETER_QKV, block_n=32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_heads_wider_than_a_tile(dtype):
    # 24 pairs a head: two programs share each head, the second masked to 8 of its 16 pairs.
    check_qkv(5, 3, 1, 48, dtype, "norm")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m", [1, 17])
@pytest.mark.parametrize("prologue", PROLOGUES)
# 3 parts of K = 100 in chunks of 64: the third part starts past K, sums nothing and still counts in.
@pytest.mark.parametrize("split_k", [2, 3])
def test_split_k(split_k, prologue, m, dtype):
    config = replace(INTERPRETER_QKV, split_k=split_k)
    for _ in range(2):  # the second launch finds the counts back at zero
        check_qkv(m, 4, 2, 16, dtype, prologue, bias=True, config=config)
    check_qkv(m, 3, 1, 48, dtype, prologue, config=config)  # two programs share each head


@pytest.mark.parametrize("num_slots", [0, 2])
def test_tokens_past_slot_mapping_write_nothing(num_slots):
    check_qkv(4, 2, 1, 32, torch.float32, num_slots=num_slots)


def test_bad_operands_are_named():
    x, weight = torch.randn(2, 8), torch.randn((4 + 2 * 2) * 16, 8)
    cache = torch.zeros(2, 3, 4, 2, 16)
    table = torch.zeros(10, 8)
    args = (torch.zeros(2, dtype=torch.long), table, table, cache, torch.zeros(2, dtype=torch.long))
    qkv_rotary_cache(x, weight, *args, 4)
    with pytest.raises(ValueError, match="weight rows"):
        qkv_rotary_cache(x, weight, *args, 3)
    with pytest.raises(ValueError, match="cos and sin"):
        qkv_rotary_cache(x, weight, args[0], table.double(), table.double(), *args[3:], 4)
    with pytest.raises(ValueError, match="kv_cache dtype"):
        qkv_rotary_cache(x, weight, *args[:3], cache.half(), args[4], 4)
    with pytest.raises(ValueError, match="positions"):
        qkv_rotary_cache(x, weight, torch.zeros(1, dtype=torch.long), *args[1:], 4)
    with pytest.raises(ValueError, match="at most 32 rows"):
        qkv_rotary_cache(torch.randn(33, 8), weight, torch.zeros(33, dtype=torch.long), *args[1:], 4)
