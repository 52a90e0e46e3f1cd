"""Training's CUDA paths: the unrolled steps' flash attention with its log-sum-exp, and the target's
features with the serving kernels' norms and SiLU, each against a reference computed apart."""
from __future__ import annotations

import pytest
import torch

from dense_unrolled_attention import dense_step_attention, output_and_gradients
from specserve.train.attention import unrolled_step_attention
from specserve.train.batches import collate
from specserve.train.data import Sequence
from specserve.train.features import TargetFeatures, plain_torch

pytestmark = pytest.mark.gpu


def test_unrolled_step_attention_on_cuda_in_bf16_matches_a_dense_mask_in_float32():
    """CUDA's flash kernels (forward and backward, with the log-sum-exp's gradient) at SmolLM2's head
    shape, against one float32 softmax over every step's keys under the dense mask."""
    torch.manual_seed(0)
    b, heads, kv_heads, n, d, j = 2, 9, 3, 200, 64, 5

    def leaf(*shape):
        return torch.randn(*shape, device="cuda").to(torch.bfloat16).requires_grad_()

    q = leaf(b, heads, n, d)
    keys = [leaf(b, kv_heads, n, d) for _ in range(j + 1)]
    values = [leaf(b, kv_heads, n, d) for _ in range(j + 1)]
    grad = torch.randn(b * n, heads, d, device="cuda")
    scale = d**-0.5

    reference = output_and_gradients(lambda: dense_step_attention(q, keys, values, scale), q, keys, values, grad)
    split = output_and_gradients(lambda: unrolled_step_attention(q, keys, values, scale), q, keys, values, grad)
    for want, got in zip(reference, split):
        # bf16 rounding of the output and of the gradients flash writes (about 2^-8 of their scale).
        want = want.float()
        torch.testing.assert_close(got.float(), want, atol=0.02 * want.abs().max().item(), rtol=0.02)


def test_target_features_with_the_serving_norms_match_plain_torch_on_cuda(tiny_llama):
    path, hf = tiny_llama
    g = torch.Generator().manual_seed(0)
    seqs = [Sequence(torch.randint(3, hf.config.vocab_size, (4,), generator=g).tolist(),
                     torch.randint(3, hf.config.vocab_size, (n,), generator=g).tolist(), 0.0) for n in (40, 9)]
    batch = collate(seqs).to("cuda")
    served = TargetFeatures(str(path), (0, 1), torch.float32, "cuda")
    assert any(getattr(m, "fused", False) for m in served.model.modules())
    plain = TargetFeatures(str(path), (0, 1), torch.float32, "cuda")
    plain_torch(plain.model)
    want, got = plain(batch), served(batch)
    torch.testing.assert_close(got.aux, want.aux, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.final, want.final, atol=1e-4, rtol=1e-4)
