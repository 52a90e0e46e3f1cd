"""KV-cache scales from checkpoints (quantization/kv_cache_scales.py): every hub layout loads into each layer's
KVScales, the engine's FP8 cache then stores keys and values with them (against transformers with its keys and
values rounded to e4m3 by an independent float64 reference), a cache in the model's dtype leaves them unused, and
malformed scales or schemes are refused naming the tensor or field."""
from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import repetitive_prompts
from e4m3 import e4m3_reference
from specserve import LLM, SamplingParams
from specserve.errors import ModelLoadError
from tests.quantization.fp8_checkpoints import KV_CACHE_SCHEME, KV_SCALE_LAYOUTS, add_kv_scales, write_fp8_checkpoint

# Per layer (k_scale, v_scale), near amax / 448 of the tiny model's keys and values (about 2.3): layer 1's
# v_scale saturates its largest values at 448 x 0.0042.
SCALES = [(0.0051, 0.0093), (0.0137, 0.0042)]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _llm(path, **kw) -> LLM:
    return LLM(str(path), max_model_len=128, num_kv_blocks=32, **kw)


def _attention_layers(llm):
    return [layer.self_attn for layer in llm.engine.core.model.model.layers]


def _checkpoint(tiny_llama, tmp_path, layout: str, weights: str = "unquantized"):
    """The tiny model with SCALES in `layout`; weights: "unquantized", or the FP8 method whose checkpoints carry
    that layout ("fp8", "compressed-tensors")."""
    if weights == "unquantized":
        ckpt = tmp_path / "m"
        shutil.copytree(tiny_llama[0], ckpt)
    elif weights == "fp8":
        ckpt = write_fp8_checkpoint(tiny_llama[0], tmp_path / "m", "fp8", False, "dynamic")
    else:
        ckpt = write_fp8_checkpoint(tiny_llama[0], tmp_path / "m", "compressed-tensors", True, None)
    return add_kv_scales(ckpt, layout, SCALES)


def _file_scales(ckpt, layout: str) -> list[tuple[float, float]]:
    """Each layer's (k_scale, v_scale) as the checkpoint's file holds them, read back with safetensors."""
    k_name, v_name, _ = KV_SCALE_LAYOUTS[layout]
    tensors = load_file(str(ckpt / "model.safetensors"))
    out = []
    for i in range(len(SCALES)):
        k = tensors[f"model.layers.{i}.self_attn.{k_name}"].item()
        out.append((k, k if v_name is None else tensors[f"model.layers.{i}.self_attn.{v_name}"].item()))
    return out


@pytest.mark.parametrize("layout,weights", [("fp8", "fp8"), ("kv_scale", "fp8"), ("vllm", "unquantized"),
                                            ("modelopt", "unquantized"), ("compressed-tensors", "compressed-tensors"),
                                            ("compressed-tensors", "unquantized")])
def test_checkpoint_scales_load_into_every_layer(tiny_llama, tmp_path, layout, weights):
    ckpt = _checkpoint(tiny_llama, tmp_path, layout, weights)
    llm = _llm(ckpt, kv_cache_dtype="fp8")
    want = _file_scales(ckpt, layout)
    assert want[0] != (1.0, 1.0)
    for attn, (k, v) in zip(_attention_layers(llm), want, strict=True):
        assert attn.kv_scales.k_scale.dtype == torch.float32
        assert attn.kv_scales.k_scale.tolist() == [k] and attn.kv_scales.v_scale.tolist() == [v]
    out = llm.generate(repetitive_prompts(tiny_llama[1].config.vocab_size, n=3), GREEDY, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in out)


def test_a_draft_model_uses_its_checkpoint_scales_and_speculation_stays_lossless(tiny_llama, tmp_path):
    """The drafter's cache is FP8 too: a draft model's checkpoint scales are set on its layers, and greedy output
    with its drafts equals the FP8 engine's without them."""
    ckpt = _checkpoint(tiny_llama, tmp_path, "fp8")
    prompts = repetitive_prompts(tiny_llama[1].config.vocab_size, n=3)
    plain = [o.outputs[0].token_ids for o in _llm(ckpt, kv_cache_dtype="fp8").generate(prompts, GREEDY,
                                                                                          use_tqdm=False)]
    llm = _llm(ckpt, kv_cache_dtype="fp8",
               speculative_config={"method": "draft_model", "model": str(ckpt), "num_speculative_tokens": 3})
    drafter = llm.engine.core.runner.speculator.model
    assert [layer.self_attn.kv_scales.values for layer in drafter.model.layers] == _file_scales(ckpt, "fp8")
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == plain
    assert llm.engine.spec_stats.num_drafted > 0


def _reference_logits(path, ids: list[int], scales: list[tuple[float, float]]) -> torch.Tensor:
    """transformers' logits (float32 weights, float64 logits) with each layer's keys (after rotary) and values
    rounded to e4m3 at that layer's scales by the float64 reference, as an FP8 cache stores them, then scaled
    back."""
    import transformers
    from transformers.masking_utils import AttentionMaskInterface, eager_mask
    from transformers.models.llama.modeling_llama import eager_attention_forward

    def attend(module, query, key, value, attention_mask, scaling, dropout=0.0, **kw):
        k_scale, v_scale = scales[module.layer_idx]
        key = (e4m3_reference(key, k_scale) * k_scale).to(key.dtype)
        value = (e4m3_reference(value, v_scale) * v_scale).to(value.dtype)
        return eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout, **kw)

    transformers.AttentionInterface.register("fp8_kv_reference", attend)
    AttentionMaskInterface.register("fp8_kv_reference", eager_mask)  # the additive mask eager attention takes
    hf = transformers.LlamaForCausalLM.from_pretrained(str(path), attn_implementation="fp8_kv_reference").eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].double()


@pytest.mark.parametrize("layout,backend", [("fp8", "torch"), ("compressed-tensors", "torch"), ("fp8", "triton")])
def test_the_fp8_cache_uses_the_checkpoint_scales(tiny_llama, tmp_path, layout, backend):
    """A prefill's logits, whose every query reads its keys and values back from the FP8 cache, against
    transformers with the file's scales: equal to float32 rounding (an element on an e4m3 rounding boundary may
    round the other way), and far from the same reference with scales of 1.0. The Triton backend runs
    interpreted on the CPU."""
    if backend == "triton":
        pytest.importorskip("triton")
    ckpt = _checkpoint(tiny_llama, tmp_path, layout)
    llm = _llm(ckpt, kv_cache_dtype="fp8", attention_backend=backend)
    ids = repetitive_prompts(tiny_llama[1].config.vocab_size, n=1, seed=3)[0][:40] + list(range(3, 43))
    model = llm.engine.core.model
    captured = []
    handle = model.model.norm.register_forward_hook(lambda m, i, o: captured.append(o))
    try:
        llm.generate([ids], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    finally:
        handle.remove()
    ours = model.compute_logits(captured[0]).double()
    assert ours.shape[0] == len(ids)
    # transformers reads the weights from the checkpoint they were copied from, and the scales from the file.
    want = _reference_logits(tiny_llama[0], ids, _file_scales(ckpt, layout))
    unscaled = _reference_logits(tiny_llama[0], ids, [(1.0, 1.0)] * len(SCALES))
    error = ((ours - want).norm() / want.norm()).item()
    assert error < 1e-3, f"relative logits error {error:.2e} against the file's scales"
    assert ((unscaled - want).norm() / want.norm()).item() > 1e-2, "the scales make no difference"


def test_a_cache_in_the_model_dtype_leaves_the_scales_unused(tiny_llama, tmp_path, caplog):
    ckpt = _checkpoint(tiny_llama, tmp_path, "fp8")
    prompts = repetitive_prompts(tiny_llama[1].config.vocab_size, n=3)
    with caplog.at_level(logging.INFO, logger="specserve.quantization.kv_cache_scales"):
        llm = _llm(ckpt)
    assert "does not use them" in caplog.text and "kv_cache_dtype='fp8'" in caplog.text
    assert all(attn.kv_scales.values == (1.0, 1.0) for attn in _attention_layers(llm))
    # The same tokens as the checkpoint without scales: the scales change nothing.
    assert ([o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
            == [o.outputs[0].token_ids for o in _llm(tiny_llama[0]).generate(prompts, GREEDY, use_tqdm=False)])


def _rewrite(ckpt, change) -> None:
    tensors = load_file(str(ckpt / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(ckpt / "model.safetensors"))


@pytest.mark.parametrize("value,error", [
    (torch.tensor([0.01, 0.02]), r"'model.layers.1.self_attn.v_scale' has shape \(2,\)"),
    (torch.tensor(0.0), r"'model.layers.1.self_attn.v_scale' is 0; a scale must be positive"),
    (torch.tensor(-0.01), r"'model.layers.1.self_attn.v_scale' is -0.01"),
    (torch.tensor(float("nan")), r"'model.layers.1.self_attn.v_scale' is nan"),
    (torch.tensor(3, dtype=torch.int32), r"'model.layers.1.self_attn.v_scale' is torch.int32"),
])
def test_a_malformed_scale_is_refused_naming_it(tiny_llama, tmp_path, value, error):
    ckpt = _checkpoint(tiny_llama, tmp_path, "fp8")
    _rewrite(ckpt, lambda t: t.__setitem__("model.layers.1.self_attn.v_scale", value))
    with pytest.raises(ModelLoadError, match=error):
        _llm(ckpt, kv_cache_dtype="fp8")


@pytest.mark.parametrize("change,error", [
    (lambda t: t.pop("model.layers.0.self_attn.v_scale"), "holds 'model.layers.0.self_attn.k_scale' but no v_scale"),
    (lambda t: (t.pop("model.layers.1.self_attn.k_scale"), t.pop("model.layers.1.self_attn.v_scale")),
     "for 1 of 2 attention layers"),
    (lambda t: t.__setitem__("model.layers.0.self_attn.kv_scale", torch.tensor(0.01)), "two k_scale tensors"),
    (lambda t: t.__setitem__("model.layers.7.self_attn.k_scale", torch.tensor(0.01)),
     "'model.layers.7.self_attn.k_scale' does not belong"),
])
def test_incomplete_or_stray_scales_are_refused(tiny_llama, tmp_path, change, error):
    ckpt = _checkpoint(tiny_llama, tmp_path, "fp8")
    _rewrite(ckpt, change)
    with pytest.raises(ModelLoadError, match=error):
        _llm(ckpt, kv_cache_dtype="fp8")


@pytest.mark.parametrize("scheme,error", [
    ({"type": "int"}, "8-bit int"),
    ({"strategy": "attn_head"}, "strategy 'attn_head'"),
    ({"dynamic": True}, "dynamic KV-cache scales"),
    ({"symmetric": False}, "asymmetric"),
])
def test_kv_cache_schemes_it_cannot_honour_are_refused(tiny_llama, tmp_path, scheme, error):
    ckpt = _checkpoint(tiny_llama, tmp_path, "compressed-tensors", "compressed-tensors")
    config = json.loads((ckpt / "config.json").read_text())
    config["quantization_config"]["kv_cache_scheme"] = {**KV_CACHE_SCHEME, **scheme}
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=error) as e:
        _llm(ckpt, kv_cache_dtype="fp8")
    assert "kv_cache_scheme" in str(e.value)


def test_a_declared_scheme_without_scales_is_refused(tiny_llama, tmp_path):
    ckpt = _checkpoint(tiny_llama, tmp_path, "compressed-tensors")
    _rewrite(ckpt, lambda t: [t.pop(n) for n in list(t) if n.endswith("output_scale")])
    with pytest.raises(ModelLoadError, match="declares a kv_cache_scheme but the checkpoint holds no"):
        _llm(ckpt, kv_cache_dtype="fp8")
