"""load_head beside a whole target, without an engine (how train-eagle's scripts and the benchmarks that score a head
load it): the head takes the checkpoint's weights and shares the target's embedding it does not carry, as the
engine's own copy of the same head does."""
from __future__ import annotations

import torch
from safetensors.torch import load_file

from heads import save_eagle_head
from specserve import LLM
from specserve.bench.unrolled_head import head_beside_target
from specserve.models.loader import build_model, open_model_source
from specserve.spec_decode.config import SpeculativeConfig
from specserve.spec_decode.factory import load_head
from specserve.train.attention import CausalAttention


def test_a_head_loads_beside_a_whole_target_without_an_engine(tiny_llama, tmp_path):
    path, hf = tiny_llama
    head_dir = save_eagle_head(tmp_path / "eagle3", hf.config, "eagle3", seed=4)
    config = {"method": "eagle3", "model": str(head_dir), "num_speculative_tokens": 2}
    spec = SpeculativeConfig.parse(config)
    target, arch = build_model(open_model_source(str(path)), torch.float32, "cpu", CausalAttention())
    head = load_head(spec, target, arch, CausalAttention())
    saved = load_file(str(head_dir / "model.safetensors"))
    assert torch.equal(head.fc.weight, saved["fc.weight"])
    assert torch.equal(head.lm_head.weight, saved["lm_head.weight"])
    assert head.embed_tokens.weight is target.model.embed_tokens.weight
    llm = LLM(str(path), speculative_config=config, max_model_len=128, kv_cache_memory_bytes=64 << 20)
    engines = llm.engine.core.runner.speculator.head
    for name, tensor in head.state_dict().items():
        assert torch.equal(tensor, engines.state_dict()[name]), name


def test_the_benchmarks_head_beside_its_targets_features_is_the_engines(tiny_llama, tmp_path):
    path, hf = tiny_llama
    head_dir = save_eagle_head(tmp_path / "eagle3", hf.config, "eagle3", seed=5)
    features, head = head_beside_target(str(path), str(head_dir))
    assert head.embed_tokens.weight is features.model.model.embed_tokens.weight
    assert not any(getattr(m, "fused", False) for m in head.modules())
    config = {"method": "eagle3", "model": str(head_dir), "num_speculative_tokens": 2}
    llm = LLM(str(path), speculative_config=config, max_model_len=128, kv_cache_memory_bytes=64 << 20)
    engines = llm.engine.core.runner.speculator.head
    for name, tensor in head.state_dict().items():
        assert torch.equal(tensor, engines.state_dict()[name]), name
