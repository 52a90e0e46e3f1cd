"""FP8 weights sharded over two ranks (gloo): column-parallel layers split their per-channel scales with their
rows, row-parallel ones keep them whole, so two ranks give one rank's greedy tokens. Checkpoints whose inputs are
scaled alike on every rank (weight only, or one static scale) are used: dynamic per-token scales of a
row-parallel layer's input see only the rank's slice of it, which rounds differently from one rank."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import repetitive_prompts
from tests.distributed.greedy_tokens import greedy_tokens
from tests.quantization.fp8_checkpoints import write_fp8_checkpoint


@pytest.mark.parametrize("per_channel,activations", [(True, None), (False, "static")])
def test_tp2_fp8_equals_one_rank(tiny_llama, tmp_path, per_channel, activations):
    path, hf = tiny_llama
    ckpt = write_fp8_checkpoint(path, tmp_path / "m", "compressed-tensors", per_channel, activations)
    prompts = repetitive_prompts(hf.config.vocab_size, n=3, seed=5)
    one = greedy_tokens(ckpt, prompts, 8, max_model_len=128, num_kv_blocks=32)
    assert greedy_tokens(ckpt, prompts, 8, max_model_len=128, num_kv_blocks=32, tensor_parallel_size=2) == one


@pytest.mark.parametrize("quantization,checkpoint", [("fp8", False), (None, True)])
def test_a_rank_keeps_its_rows_scales(tiny_llama, tmp_path, quantization, checkpoint):
    """Rank 1's shard (built without a group: loading runs no collective) against one rank's model: the
    column-parallel scales are its rows' slice, the row-parallel ones whole. quantization='fp8' quantizes
    each weight whole before the rank slices it, so its row-parallel scales cover whole rows too."""
    from specserve.attention.torch_backend import TorchAttentionBackend
    from specserve.distributed.parallel_state import TPGroup
    from specserve.models.loader import build_model, open_model_source

    path = tiny_llama[0]
    if checkpoint:
        path = write_fp8_checkpoint(path, tmp_path / "m", "compressed-tensors", True, None)
    source = open_model_source(str(path))
    build = lambda tp: build_model(source, torch.float32, "cpu", TorchAttentionBackend(), tp=tp,
                                   quantization=quantization)[0].model.layers[0]
    one, rank1 = build(TPGroup(0, 1)), build(TPGroup(1, 2))
    assert torch.equal(rank1.mlp.gate_up_proj.weight_scale,
                       torch.cat([h.chunk(2)[1] for h in one.mlp.gate_up_proj.weight_scale.chunk(2)]))
    assert torch.equal(rank1.mlp.down_proj.weight_scale, one.mlp.down_proj.weight_scale)
    assert torch.equal(rank1.self_attn.o_proj.weight_scale, one.self_attn.o_proj.weight_scale)
    assert torch.equal(rank1.mlp.down_proj.weight.float(), one.mlp.down_proj.weight.float().chunk(2, 1)[1])


def test_tp2_fp8_kv_cache_with_checkpoint_scales_equals_one_rank(tiny_llama, tmp_path):
    """A per-tensor KV-cache scale is the same on every rank: each rank's heads are quantized alike, so two
    ranks give one rank's greedy tokens, and a rank's shard holds the checkpoint's scales in every layer."""
    import shutil

    from specserve.attention.torch_backend import TorchAttentionBackend
    from specserve.distributed.parallel_state import TPGroup
    from specserve.models.loader import build_model, open_model_source
    from tests.quantization.fp8_checkpoints import add_kv_scales

    path, hf = tiny_llama
    shutil.copytree(path, tmp_path / "m")
    scales = [(0.0051, 0.0093), (0.0137, 0.0042)]
    ckpt = add_kv_scales(tmp_path / "m", "compressed-tensors", scales)
    rank1, _ = build_model(open_model_source(str(ckpt)), torch.float32, "cpu", TorchAttentionBackend(),
                           tp=TPGroup(1, 2), kv_cache_dtype="fp8")
    assert [layer.self_attn.kv_scales.values for layer in rank1.model.layers] == [
        (torch.tensor(k).item(), torch.tensor(v).item()) for k, v in scales]
    prompts = repetitive_prompts(hf.config.vocab_size, n=3, seed=5)
    kw = dict(max_model_len=128, num_kv_blocks=32, kv_cache_dtype="fp8")
    one = greedy_tokens(ckpt, prompts, 8, **kw)
    assert greedy_tokens(ckpt, prompts, 8, tensor_parallel_size=2, **kw) == one
