"""Which launch configuration a projection gets, by weight size and token count (small_m_configs.py)."""
import torch

from specserve.kernels.small_m_configs import NORM_ONE_TOKEN, QKV_NORM_ONE_TOKEN_LARGE, qkv_config


def weight(n: int, k: int) -> torch.Tensor:
    # On the meta device: a GPU weight's rules without a GPU (the CPU gets the interpreter's tiles).
    return torch.empty(n, k, dtype=torch.bfloat16, device="meta")


def test_qkv_of_a_large_weight_at_one_token_gets_its_measured_tiles():
    llama_8b = weight(6144, 4096)
    assert qkv_config(llama_8b, norm=True, m=1) == QKV_NORM_ONE_TOKEN_LARGE
    assert qkv_config(llama_8b, norm=True, m=4) != QKV_NORM_ONE_TOKEN_LARGE
    smollm2 = qkv_config(weight(960, 576), norm=True, m=1)
    assert smollm2.compact and smollm2.block_n == NORM_ONE_TOKEN.block_n // 2
