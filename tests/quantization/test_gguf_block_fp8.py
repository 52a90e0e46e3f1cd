"""A GGUF's block-quantized projections held exactly as FP8 codes with block scales (quantization/gguf_blocks.py):
the codes against the gguf library's own dequantization, the layer against nn.Linear, and the real default
model (Q4_1) under quantization='fp8' against the unquantized model, with speculation."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from specserve import LLM, SamplingParams
from specserve.errors import ModelLoadError
from specserve.models.gguf_file import projection_block_type
from specserve.quantization.block_fp8_linear import BlockFp8Linear
from specserve.quantization.checkpoint import model_fp8_scheme
from specserve.quantization.fp8 import FP8_DTYPE
from specserve.quantization.fp8_linear import Fp8Activation
from specserve.quantization.gguf_blocks import GROUP, HELD_TYPES, decode_blocks, dequantize_blocks, has_offset


def _weights(rows: int, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    # Blocks of very different magnitudes, and one all-zero block (its scale 0).
    w = rng.standard_normal((rows, k)).astype(np.float32) * np.logspace(-3, 1, k, dtype=np.float32)
    w[0, :GROUP] = 0
    return w


@pytest.mark.parametrize("ggml_type", HELD_TYPES)
def test_codes_times_scales_are_the_gguf_librarys_weights_bit_for_bit(ggml_type):
    w = _weights(48, 256, seed=1)
    raw = quantize(w, GGMLQuantizationType[ggml_type])
    blocks = decode_blocks(raw, ggml_type, w.shape)
    assert blocks.codes.dtype == FP8_DTYPE and blocks.scale.dtype == torch.float16
    assert (blocks.offset is not None) == has_offset(ggml_type)
    codes = blocks.codes.float()
    assert torch.equal(codes, codes.round()) and codes.abs().max() <= 16  # integers e4m3 holds exactly
    expected = torch.from_numpy(np.asarray(dequantize(raw, GGMLQuantizationType[ggml_type])).reshape(w.shape))
    assert torch.equal(dequantize_blocks(blocks.codes, blocks.scale, blocks.offset), expected)


def test_the_layer_computes_what_nn_linear_computes_with_the_dequantized_weight():
    w = _weights(40, 96, seed=2)
    blocks = decode_blocks(quantize(w, GGMLQuantizationType.Q4_1), "Q4_1", w.shape)
    layer = BlockFp8Linear(96, 40, bias=True, has_offset=True)
    layer.weight.data.copy_(blocks.codes)
    layer.block_scale.data.copy_(blocks.scale)
    layer.block_offset.data.copy_(blocks.offset)
    layer.bias.data.normal_()
    layer = layer.to(torch.bfloat16)
    # The cast keeps the codes and the float16 scales (bfloat16 would drop three of their bits).
    assert (layer.weight.dtype, layer.block_scale.dtype, layer.block_offset.dtype) == (FP8_DTYPE, torch.float16,
                                                                                      torch.float16)
    linear = torch.nn.Linear(96, 40).to(torch.bfloat16)
    ref = torch.from_numpy(np.asarray(dequantize(quantize(w, GGMLQuantizationType.Q4_1), GGMLQuantizationType.Q4_1)))
    linear.weight.data.copy_(ref.reshape(40, 96))
    linear.bias.data.copy_(layer.bias)
    x = torch.randn(3, 5, 96, dtype=torch.bfloat16)
    assert torch.equal(layer(x), linear(x))


def test_an_input_of_partial_blocks_is_refused_with_the_fix():
    with pytest.raises(ModelLoadError, match="not a whole number of 32-weight blocks.*tensor-parallel size"):
        BlockFp8Linear(48, 16, bias=False, has_offset=True)


def test_only_a_file_of_one_held_type_loads_its_codes():
    def reader(*types):
        names = ["blk.0.attn_q.weight", "blk.0.ffn_down.weight", "token_embd.weight"]
        return SimpleNamespace(tensors=[SimpleNamespace(name=n, tensor_type=SimpleNamespace(name=t))
                                        for n, t in zip(names, (*types, "Q8_0"))])

    assert projection_block_type(reader("Q4_1", "Q4_1")) == "Q4_1"
    assert projection_block_type(reader("Q4_0", "Q4_1")) is None  # mixed
    assert projection_block_type(reader("Q4_K", "Q4_K")) is None  # scales of another shape
    assert projection_block_type(reader("Q8_0", "Q8_0")) is None  # codes past e4m3's integers
    scheme, per_channel = model_fp8_scheme({}, "fp8", "Q4_1")
    assert (scheme.activation, scheme.block_type, per_channel) == (Fp8Activation.NONE, "Q4_1", False)
    scheme, per_channel = model_fp8_scheme({}, "fp8", None)
    assert (scheme.activation, scheme.block_type, per_channel) == (Fp8Activation.DYNAMIC, None, True)
    assert model_fp8_scheme({}, None, "Q4_1") == (None, False)


CHATS = [[{"role": "user", "content": "What is the capital of France?"}],
         [{"role": "user", "content": "Write a haiku about the sea."}],
         [{"role": "user", "content": "Explain recursion to a child."}]]


def test_the_default_model_under_fp8_decodes_as_unquantized_with_speculation():
    """float32 on the CPU: the codes rebuild the unquantized weights bit for bit and both models multiply with
    F.linear, so FP8 greedy output equals the unquantized one token for token; with EAGLE-3 drafting it still
    does (speculation is lossless)."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM("smollm2-135m", max_model_len=512, dtype="float32", device="cpu")
    expected = [o.outputs[0].token_ids for o in plain.chat(CHATS, params, use_tqdm=False)]
    del plain
    fp8 = LLM("smollm2-135m", max_model_len=512, dtype="float32", device="cpu", quantization="fp8",
              speculative_config={"method": "eagle3", "model": "smollm2-135m-eagle3", "num_speculative_tokens": 3})
    layers = fp8.engine.core.model.model.layers
    for layer in layers:
        for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert isinstance(proj, BlockFp8Linear) and proj.weight.dtype == FP8_DTYPE
    outs = fp8.chat(CHATS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected


@pytest.mark.parametrize("ggml_type", HELD_TYPES)
def test_random_weights_round_to_the_types_codes(ggml_type):
    """block_codes_of (dummy weights' stand-in for a file's codes): codes on the type's levels, and the weight
    they rebuild within half a level of the original in every block."""
    from specserve.quantization.gguf_blocks import block_codes_of

    w = torch.from_numpy(_weights(24, 128, seed=4))
    b = block_codes_of(w, ggml_type)
    codes = b.codes.float()
    low, high = {"Q4_0": (-8, 7), "Q4_1": (0, 15), "Q5_0": (-16, 15)}[ggml_type]
    assert torch.equal(codes, codes.round()) and codes.min() >= low and codes.max() <= high
    error = (dequantize_blocks(b.codes, b.scale, b.offset) - w).abs().view(24, -1, GROUP)
    step = b.scale.float()[:, :, None]
    # Half a level, plus the float16 rounding of the scale and offset; Q4_0's and Q5_0's top code sits one level
    # short of the largest magnitude, clamped.
    largest = w.abs().view(24, -1, GROUP).amax(-1, keepdim=True)
    assert (error <= step * (0.51 if ggml_type == "Q4_1" else 1.01) + 1e-3 * largest).all()


def test_dummy_weights_take_the_block_layout():
    llm = LLM("smollm2-135m", max_model_len=256, dtype="float32", device="cpu", quantization="fp8",
              load_format="dummy")
    layer = llm.engine.core.model.model.layers[0]
    assert isinstance(layer.mlp.down_proj, BlockFp8Linear) and layer.mlp.down_proj.block_offset is not None
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
