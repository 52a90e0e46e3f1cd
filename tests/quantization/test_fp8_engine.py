"""FP8 weights end to end on the CPU: every projection FP8 and nothing else, greedy output close to the
unquantized model's, and speculative decoding lossless under FP8 (its output equals FP8 without speculation)."""
from __future__ import annotations

import pytest
from torch import nn

from conftest import repetitive_prompts
from heads import save_eagle_head
from specserve import LLM, SamplingParams
from specserve.quantization.fp8 import FP8_DTYPE
from specserve.quantization.fp8_linear import Fp8Activation, Fp8Linear

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
TREE = "[(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]"


def _tokens(llm: LLM, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def fp8_target(tiny_llama):
    path, hf = tiny_llama
    prompts = repetitive_prompts(hf.config.vocab_size)
    llm = LLM(str(path), max_model_len=256, quantization="fp8")
    return path, hf, prompts, llm, _tokens(llm, prompts)


@pytest.fixture(scope="module")
def eagle3_head(tmp_path_factory, tiny_llama):
    return save_eagle_head(tmp_path_factory.mktemp("fp8_head") / "eagle3", tiny_llama[1].config, "eagle3", seed=2)


def test_every_projection_and_nothing_else_is_fp8(fp8_target):
    model = fp8_target[3].engine.core.model
    layers = list(model.model.layers)
    for layer in layers:
        for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert isinstance(proj, Fp8Linear) and proj.weight.dtype == FP8_DTYPE
            assert proj.activation is Fp8Activation.DYNAMIC
    assert type(model.lm_head) is nn.Linear and model.model.embed_tokens.weight.dtype != FP8_DTYPE
    assert sum(p.dtype == FP8_DTYPE for p in model.parameters()) == 4 * len(layers)


def test_greedy_output_agrees_with_the_unquantized_model(fp8_target):
    """FP8 rounds every projection's operands by up to 2**-4, so greedy paths may part at a near-tie (and differ
    from there on), but most tokens agree; a wrong scale or layout would make them unrelated (a token in
    several hundred agrees by chance)."""
    path, _, prompts, _, fp8 = fp8_target
    plain = _tokens(LLM(str(path), max_model_len=256), prompts)
    agree = sum(a == b for want, got in zip(plain, fp8) for a, b in zip(want, got))
    total = sum(len(t) for t in plain)
    assert agree / total >= 0.6, f"{agree} of {total} tokens agree"


@pytest.mark.parametrize("head_quantization", [None, "fp8"])
@pytest.mark.parametrize("tree", [None, TREE])
def test_speculation_is_lossless_under_fp8(fp8_target, eagle3_head, tree, head_quantization):
    path, _, prompts, _, want = fp8_target
    spec = {"method": "eagle3", "model": str(eagle3_head), "quantization": head_quantization,
            **({"speculative_token_tree": tree} if tree else {"num_speculative_tokens": 3})}
    llm = LLM(str(path), max_model_len=256, quantization="fp8", speculative_config=spec, max_num_batched_tokens=48,
              num_kv_blocks=24, block_size=16)
    assert _tokens(llm, prompts) == want
    assert llm.engine.spec_stats.num_drafted > 0
    head = llm.engine.core.runner.speculator.head
    assert isinstance(head.layer.mlp.down_proj, Fp8Linear) == (head_quantization == "fp8")
    assert type(head.fc) is nn.Linear
