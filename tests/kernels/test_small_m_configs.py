"""Which launch configuration a projection gets: its shape class (by weight size, K and token count) and the
class's tile on the device, from the device's data file (small_m_configs.py, kernels/configs/)."""
import json

import pytest
import torch

from specserve.kernels import small_m_configs
from specserve.kernels.small_m_configs import (FALLBACK_DEVICE, INTERPRETER, INTERPRETER_QKV, SmallMConfig, config_path,
                                               linear_class, linear_config, load_configs, qkv_class, qkv_config,
                                               write_configs)

H100 = "NVIDIA H100 80GB HBM3"
# The H100's tile of every class: (block_n, block_k, num_warps, num_stages, compact, split_k).
H100_TILES = {
    "small": (16, 512, 4, 3, False, 1),
    "small_short_k": (32, 128, 4, 4, False, 1),
    "small_long_k": (32, 128, 4, 4, False, 8),
    "large": (32, 256, 4, 4, False, 1),
    "large_wide": (32, 256, 4, 4, False, 1),
    "norm_small_one_token": (32, 256, 4, 3, True, 1),
    "norm_small": (32, 64, 4, 6, False, 1),
    "norm_medium": (64, 64, 4, 4, False, 1),
    "norm_medium_one_acc": (128, 64, 4, 4, False, 1),
    "norm_tall_small": (16, 64, 4, 4, False, 1),
    "norm_tall_small_one_acc": (128, 64, 4, 4, False, 1),
    "norm_large_one_token": (32, 256, 4, 4, True, 1),
    "norm_large": (32, 256, 4, 4, False, 1),
    "qkv_small": (32, 256, 4, 3, False, 1),
    "qkv_tall_small": (16, 128, 4, 4, False, 1),
    "qkv_large": (16, 256, 4, 4, False, 1),
    "qkv_norm_small_one_token": (32, 256, 4, 3, True, 1),
    "qkv_norm_small": (32, 64, 4, 6, False, 1),
    "qkv_norm_tall_small": (16, 64, 4, 4, False, 1),
    "qkv_norm_large_one_token": (32, 256, 4, 4, False, 1),
    "qkv_norm_large": (16, 256, 4, 4, False, 1),
    "qkv_norm_narrow_one_token": (32, 256, 4, 4, False, 1),
    "qkv_norm_narrow": (16, 256, 4, 4, False, 1),
}


def weight(n: int, k: int, dtype=torch.bfloat16) -> torch.Tensor:
    # On the meta device: a GPU weight's rules without a GPU, with FALLBACK_DEVICE's tiles (the CPU gets the
    # interpreter's).
    return torch.empty(n, k, dtype=dtype, device="meta")


def tile(shape_class: str) -> SmallMConfig:
    return SmallMConfig(*H100_TILES[shape_class])


def test_the_h100_file_holds_every_class_and_other_devices_take_it():
    assert config_path(H100).exists() and FALLBACK_DEVICE == H100
    assert load_configs(H100) == {name: tile(name) for name in H100_TILES}
    assert load_configs("Some Other GPU") == load_configs(H100)


def test_a_devices_file_overrides_the_fallback_class_by_class(tmp_path, monkeypatch):
    monkeypatch.setattr(small_m_configs, "CONFIG_DIR", tmp_path)
    write_configs(config_path(FALLBACK_DEVICE), {name: tile(name) for name in H100_TILES})
    (tmp_path / "Other_GPU.json").write_text(json.dumps({"small": {"block_n": 64, "block_k": 128, "num_warps": 8,
                                                                   "num_stages": 2}}))
    table = load_configs.__wrapped__("Other GPU")
    assert table["small"] == SmallMConfig(64, 128, 8, 2) and table["large"] == tile("large")
    assert load_configs.__wrapped__(FALLBACK_DEVICE) == {name: tile(name) for name in H100_TILES}


def test_qkv_of_a_large_weight_at_one_token_gets_its_own_tiles():
    llama_8b = weight(6144, 4096)
    assert qkv_class(llama_8b, norm=True, m=1) == "qkv_norm_large_one_token"
    assert qkv_config(llama_8b, norm=True, m=1) == tile("qkv_norm_large_one_token")
    assert qkv_config(llama_8b, norm=True, m=4) == tile("qkv_norm_large")


def test_a_ranks_qkv_under_tensor_parallelism_is_narrow():
    llama_8b_tp2, qwen_32b_tp2 = weight(3072, 4096), weight(3584, 5120)
    for w in (llama_8b_tp2, qwen_32b_tp2):
        assert qkv_class(w, norm=True, m=1) == "qkv_norm_narrow_one_token"
        assert qkv_class(w, norm=True, m=4) == "qkv_norm_narrow"
    assert qkv_class(weight(4097, 4096), norm=True, m=1) == "qkv_norm_large_one_token"


@pytest.mark.parametrize("m", [1, 5, 16])
def test_small_weights_with_a_norm_take_the_compact_tiles_at_one_token_only(m):
    smollm2_qkv, smollm2_gate_up = weight(960, 576), weight(3072, 576)
    suffix = "_one_token" if m == 1 else ""
    assert qkv_config(smollm2_qkv, norm=True, m=m) == tile("qkv_norm_small" + suffix)  # block_n in rotary pairs
    assert linear_config(smollm2_gate_up, wide=True, norm=True, m=m) == tile("norm_small" + suffix)
    assert tile("norm_small_one_token").compact and not tile("norm_small").compact


@pytest.mark.parametrize("m", [1, 4, 16])
def test_a_draft_heads_wide_mlp_and_lm_head_take_wider_tiles(m):
    assert linear_class(weight(12288, 576), wide=True, norm=True, m=m) == "norm_medium"  # gate/up, 6144 wide
    assert linear_class(weight(12288, 576), wide=False, norm=True, m=m, top=True) == "norm_medium_one_acc"  # lm_head
    assert linear_config(weight(12288, 576), wide=False, norm=True, m=m) == tile("norm_medium_one_acc")


def test_large_weights_with_a_norm_keep_their_tiles():
    llama_8b_gate_up = weight(28672, 4096)
    assert linear_config(llama_8b_gate_up, wide=True, norm=True, m=1) == tile("norm_large_one_token")
    assert linear_config(llama_8b_gate_up, wide=True, norm=True, m=4) == tile("norm_large")


def test_plain_projections_by_weight_size_and_k():
    assert linear_config(weight(576, 576), wide=False) == tile("small_short_k")  # o_proj, K = 576
    assert linear_config(weight(576, 1536), wide=False) == tile("small")  # down_proj, K = 1536
    assert linear_config(weight(4096, 4096), wide=False) == tile("large")  # Llama-3-8B's o_proj
    assert linear_config(weight(28672, 4096), wide=True) == tile("large_wide")
    assert qkv_config(weight(960, 1152)) == tile("qkv_small")  # an EAGLE-3 head's qkv, no norm
    assert qkv_config(weight(6144, 4096)) == tile("qkv_large")


@pytest.mark.parametrize("m", [17, 32])
def test_tall_tiles_past_16_tokens_take_their_own_small_weight_tiles(m):
    # A tree's verification (17-32 rows a request) runs 32-row tiles; the prologue-free projections keep theirs.
    assert qkv_config(weight(960, 576), norm=True, m=m) == tile("qkv_norm_tall_small")
    assert linear_config(weight(3072, 576), wide=True, norm=True, m=m) == tile("norm_tall_small")
    assert linear_config(weight(12288, 576), wide=False, norm=True, m=m) == tile("norm_tall_small_one_acc")
    assert qkv_config(weight(960, 1152), m=m) == tile("qkv_tall_small")
    assert linear_config(weight(576, 576), wide=False, m=m) == tile("small_short_k")
    assert linear_config(weight(28672, 4096), wide=True, norm=True, m=m) == tile("norm_large")
    assert qkv_config(weight(960, 576), norm=True, m=16) == tile("qkv_norm_small")


@pytest.mark.parametrize("m", [1, 4, 16])
def test_few_columns_over_a_long_k_split_k_where_the_projection_is_plain(m):
    head_down_proj = weight(576, 6144)
    assert linear_config(head_down_proj, wide=False, m=m) == tile("small_long_k") and tile("small_long_k").split_k > 1
    assert linear_config(head_down_proj, wide=True, m=m).split_k == 1  # SiLU-and-mul does not split
    assert linear_config(head_down_proj, wide=False, m=m, top=True).split_k == 1
    assert linear_config(weight(576, 1536), wide=False, m=m) == tile("small")


def test_float32_weights_take_half_the_k_chunk_and_the_cpu_the_interpreters_tiles():
    assert linear_config(weight(576, 576, torch.float32), wide=False).block_k == tile("small_short_k").block_k // 2
    cpu = torch.empty(576, 576)
    assert linear_config(cpu, wide=False) == INTERPRETER and linear_config(cpu, wide=True, norm=True).compact
    assert qkv_config(cpu) == INTERPRETER_QKV and qkv_config(cpu, norm=True).compact


def test_a_weight_of_exactly_the_small_limit_takes_the_large_tiles():
    """A rank's o_proj at tensor-parallel size 2 (4096 x 2048 bfloat16, 16 MiB) reads faster in the large
    tiles (BENCHMARKS.md, 'Tensor parallelism')."""
    from specserve.kernels.small_m_configs import SMALL_WEIGHT_BYTES, linear_class

    at_limit = torch.empty(4096, 2048, dtype=torch.bfloat16, device="meta")
    assert at_limit.numel() * 2 == SMALL_WEIGHT_BYTES
    assert linear_class(at_limit, wide=False, m=1) == "large"
    assert linear_class(torch.empty(4096, 2047, dtype=torch.bfloat16, device="meta"), wide=False, m=1) != "large"
