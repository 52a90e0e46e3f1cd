"""Loading FP8 checkpoints in both hub layouts (tests/quantization/fp8_checkpoints.py writes them by hand), and
refusing the ones specserve cannot load with an error naming the fix."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import repetitive_prompts
from specserve import LLM, SamplingParams
from specserve.errors import ModelLoadError
from specserve.quantization.fp8_linear import Fp8Activation, Fp8Linear
from tests.quantization.fp8_checkpoints import write_fp8_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _llm(path, **kw) -> LLM:
    return LLM(str(path), max_model_len=128, num_kv_blocks=32, **kw)


def _tokens(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("method,per_channel", [("compressed-tensors", True), ("compressed-tensors", False),
                                                ("fp8", False)])
def test_weight_only_checkpoint_equals_its_dequantized_weights(tiny_llama, tmp_path, method, per_channel):
    """A weight-only FP8 model computes x @ (q * scale)^T: exactly the unquantized model holding q * scale."""
    path, hf = tiny_llama
    if method == "fp8":
        # quant_method fp8 has no weight-only scheme: check its layout loads, the inputs quantized per token.
        ckpt = write_fp8_checkpoint(path, tmp_path / "m", method, per_channel, "dynamic")
    else:
        ckpt = write_fp8_checkpoint(path, tmp_path / "m", method, per_channel, None)
    llm = _llm(ckpt)
    qkv = llm.engine.core.model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, Fp8Linear)
    want_activation = Fp8Activation.DYNAMIC if method == "fp8" else Fp8Activation.NONE
    assert qkv.activation is want_activation
    # The parts' scales, each over its own rows (one per tensor spread over the part's rows).
    cfg = hf.config
    q_rows = cfg.num_attention_heads * (cfg.hidden_size // cfg.num_attention_heads)
    w = hf.model.layers[0].self_attn.q_proj.weight.detach().double()
    want_q = (w.abs().amax(1) if per_channel else w.abs().amax().expand(q_rows)) / 448
    assert torch.allclose(qkv.weight_scale[:q_rows].double(), want_q, rtol=1e-6)
    if want_activation is Fp8Activation.NONE:
        prompts = repetitive_prompts(hf.config.vocab_size, n=4)
        assert _tokens(llm, prompts) == _tokens(_llm(f"{ckpt}-deq"), prompts)


@pytest.mark.parametrize("method", ["compressed-tensors", "fp8"])
def test_static_input_scales_load_and_the_largest_part_is_used(tiny_llama, tmp_path, method):
    path, hf = tiny_llama
    ckpt = write_fp8_checkpoint(path, tmp_path / "m", method, method == "compressed-tensors", "static")
    llm = _llm(ckpt)
    attn = llm.engine.core.model.model.layers[0].self_attn
    assert attn.qkv_proj.activation is Fp8Activation.STATIC
    assert torch.equal(attn.qkv_proj.input_scale, torch.tensor([0.03, 0.05, 0.04]))
    assert torch.equal(attn.o_proj.input_scale, torch.tensor([0.06]))
    x = torch.randn(3, hf.config.hidden_size)
    assert torch.equal(attn.qkv_proj.quantize_input(x)[1], torch.full((3, 1), 0.05))
    # Against the twin's float32 weights: the input rounded to e4m3 at the largest part's scale, times them.
    twin = _llm(f"{ckpt}-deq").engine.core.model.model.layers[0].self_attn.qkv_proj.weight.double()
    x_rounded = (x.double() / 0.05).clamp(-448, 448).float().to(torch.float8_e4m3fn).double() * 0.05
    assert torch.allclose(attn.qkv_proj(x).double(), x_rounded @ twin.T, rtol=1e-5, atol=1e-5)
    assert len(_tokens(llm, [[5, 6, 7]])[0]) == GREEDY.max_tokens


def _with_quantization(tmp_path, tiny_llama, quant: dict):
    ckpt = write_fp8_checkpoint(tiny_llama[0], tmp_path / "m", "compressed-tensors", True, None)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["quantization_config"] = {**cfg["quantization_config"], **quant}
    (ckpt / "config.json").write_text(json.dumps(cfg))
    return ckpt


@pytest.mark.parametrize("quant,error", [
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "block-wise weight scales"),
    ({"ignore": ["lm_head", "model.layers.0.mlp.down_proj"]}, "leaves 'model.layers.0.mlp.down_proj' unquantized"),
    ({"format": "pack-quantized"}, "format 'pack-quantized'"),
    ({"quant_method": "awq"}, "quant_method 'awq'"),
])
def test_checkpoints_it_cannot_load_are_refused(tiny_llama, tmp_path, quant, error):
    ckpt = _with_quantization(tmp_path, tiny_llama, quant)
    with pytest.raises(ModelLoadError, match=error) as e:
        _llm(ckpt)
    assert "quantization='fp8'" in str(e.value)


def test_a_config_that_disagrees_with_the_weights_is_refused(tiny_llama, tmp_path):
    """An unquantized checkpoint whose config claims FP8 weights: its bf16 weights are not cast silently."""
    ckpt = _with_quantization(tmp_path, tiny_llama, {})
    json_cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt.parent / "m-deq" / "config.json").write_text(json.dumps({**json_cfg}))
    with pytest.raises(ModelLoadError, match="disagree"):
        _llm(ckpt.parent / "m-deq")
