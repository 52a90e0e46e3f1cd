"""Which launch configuration a projection gets, by weight size, K and token count (small_m_configs.py)."""
import pytest
import torch

from specserve.kernels.small_m_configs import (NORM_FEW_TOKENS, NORM_LARGE, NORM_MEDIUM, NORM_MEDIUM_ONE_ACC,
                                               NORM_ONE_TOKEN, NORM_SMALL, QKV_NORM_ONE_TOKEN_LARGE, QKV_SMALL, SMALL,
                                               SMALL_SHORT_K, TALL_NORM_SMALL, TALL_NORM_SMALL_ONE_ACC, TALL_QKV_SMALL,
                                               SMALL_LONG_K, linear_config, qkv_config)


def weight(n: int, k: int) -> torch.Tensor:
    # On the meta device: a GPU weight's rules without a GPU (the CPU gets the interpreter's tiles).
    return torch.empty(n, k, dtype=torch.bfloat16, device="meta")


def test_qkv_of_a_large_weight_at_one_token_gets_its_measured_tiles():
    llama_8b = weight(6144, 4096)
    assert qkv_config(llama_8b, norm=True, m=1) == QKV_NORM_ONE_TOKEN_LARGE
    assert qkv_config(llama_8b, norm=True, m=4).block_n == NORM_LARGE.block_n // 2


@pytest.mark.parametrize("m", [1, 5, 16])
def test_small_weights_with_a_norm_take_the_compact_tiles_at_one_token_only(m):
    smollm2_qkv, smollm2_gate_up = weight(960, 576), weight(3072, 576)
    expected = NORM_SMALL if m == 1 else NORM_FEW_TOKENS
    assert qkv_config(smollm2_qkv, norm=True, m=m) == expected  # block_n counted in rotary pairs
    assert linear_config(smollm2_gate_up, wide=True, norm=True, m=m) == expected
    assert NORM_SMALL.compact and not NORM_FEW_TOKENS.compact


@pytest.mark.parametrize("m", [1, 4, 16])
def test_a_draft_heads_wide_mlp_and_lm_head_take_wider_tiles(m):
    assert linear_config(weight(12288, 576), wide=True, norm=True, m=m) == NORM_MEDIUM  # gate/up, 6144 wide
    assert linear_config(weight(12288, 576), wide=False, norm=True, m=m) == NORM_MEDIUM_ONE_ACC  # lm_head


def test_large_weights_with_a_norm_keep_their_tiles():
    llama_8b_gate_up = weight(28672, 4096)
    assert linear_config(llama_8b_gate_up, wide=True, norm=True, m=1) == NORM_ONE_TOKEN
    assert linear_config(llama_8b_gate_up, wide=True, norm=True, m=4) == NORM_LARGE


def test_plain_small_projections_split_on_k():
    assert linear_config(weight(576, 576), wide=False) == SMALL_SHORT_K  # o_proj, K = 576
    assert linear_config(weight(576, 1536), wide=False) == SMALL  # down_proj, K = 1536
    assert qkv_config(weight(960, 1152)) == QKV_SMALL  # an EAGLE-3 head's qkv, no norm


@pytest.mark.parametrize("m", [17, 32])
def test_tall_tiles_past_16_tokens_take_their_own_small_weight_tiles(m):
    # A tree's verification (17-32 rows a request) runs 32-row tiles; the prologue-free projections keep theirs.
    assert qkv_config(weight(960, 576), norm=True, m=m) == TALL_NORM_SMALL
    assert linear_config(weight(3072, 576), wide=True, norm=True, m=m) == TALL_NORM_SMALL
    assert linear_config(weight(12288, 576), wide=False, norm=True, m=m) == TALL_NORM_SMALL_ONE_ACC  # head lm_head
    assert qkv_config(weight(960, 1152), m=m) == TALL_QKV_SMALL
    assert linear_config(weight(576, 576), wide=False, m=m) == SMALL_SHORT_K
    assert linear_config(weight(28672, 4096), wide=True, norm=True, m=m) == NORM_LARGE
    assert qkv_config(weight(960, 576), norm=True, m=16) == NORM_FEW_TOKENS


@pytest.mark.parametrize("m", [1, 4, 16])
def test_few_columns_over_a_long_k_split_k_where_the_projection_is_plain(m):
    head_down_proj = weight(576, 6144)
    assert linear_config(head_down_proj, wide=False, m=m) == SMALL_LONG_K and SMALL_LONG_K.split_k > 1
    assert linear_config(head_down_proj, wide=True, m=m).split_k == 1  # SiLU-and-mul does not split
    assert linear_config(head_down_proj, wide=False, m=m, top=True).split_k == 1
    assert linear_config(weight(576, 1536), wide=False, m=m) == SMALL  # SmolLM2's down_proj measured faster whole
