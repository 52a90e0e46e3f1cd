"""Draft vocabulary against hand-computed references; the exported head's layout, shards and round trip."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from specserve.errors import ConfigError
from specserve.models.arch_config import ArchConfig
from specserve.models.eagle3 import Eagle3Head
from specserve.models.loader import safetensors_weights
from specserve.train.attention import UnrolledAttention
from specserve.train.config import TrainConfig
from specserve.train.export import check_exportable, export_head, head_arch, head_config
from specserve.train.vocab import build_draft_vocab


def test_most_frequent_tokens_sorted_by_id_with_offsets():
    vocab = build_draft_vocab([[5, 5, 3], [3, 7, 5], [9]], target_vocab_size=10, draft_vocab_size=3)
    # Counts: 5 -> 3, 3 -> 2, then 7 and 9 tie at 1 and the lower id wins.
    assert vocab.draft_to_target.tolist() == [3, 5, 7]
    assert vocab.d2t.tolist() == [3, 4, 5]  # target = draft + d2t[draft]
    assert vocab.t2d.nonzero().flatten().tolist() == [3, 5, 7]
    assert vocab.target_to_draft.tolist() == [-1, -1, -1, 0, -1, 1, -1, 2, -1, -1]
    assert vocab.coverage == pytest.approx(6 / 7)


def test_slots_no_token_filled_go_to_the_lowest_unused_ids():
    vocab = build_draft_vocab([[6, 6], [2]], target_vocab_size=8, draft_vocab_size=4)
    assert vocab.draft_to_target.tolist() == [0, 1, 2, 6]
    assert vocab.d2t.tolist() == [0, 0, 0, 3]
    assert vocab.coverage == 1.0


def target_arch(**kw) -> ArchConfig:
    base = dict(architecture="LlamaForCausalLM", vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=4,
                num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                max_position_embeddings=256, tie_word_embeddings=True, bos_token_id=1, eos_token_ids=[2])
    return ArchConfig(**{**base, **kw})


def random_head(target: ArchConfig, draft_vocab: int, aux=(2, 2, 1), seed: int = 0):
    vocab = build_draft_vocab([list(range(0, target.vocab_size, 3))], target.vocab_size, draft_vocab)
    config = head_config(target, vocab.size, aux)
    torch.manual_seed(seed)
    head = Eagle3Head(head_arch(config), UnrolledAttention(), vocab.size, target.hidden_size, aux)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.1)
    head.d2t.copy_(vocab.d2t)
    return head, vocab, config


def test_export_has_vllm_eagle3_layout_without_embedding(tmp_path):
    target = target_arch()
    head, vocab, config = random_head(target, 100)
    (f,) = export_head(tmp_path, head, vocab, config, max_shard_bytes=15_000_000)
    with safe_open(str(f), framework="pt") as st:
        shapes = {k: tuple(st.get_slice(k).get_shape()) for k in st.keys()}
    h, q, kv, inter = 64, 4 * 16, 2 * 16, 96
    assert shapes == {
        "fc.weight": (h, 3 * h), "norm.weight": (h,), "lm_head.weight": (100, h), "d2t": (100,), "t2d": (300,),
        "midlayer.input_layernorm.weight": (h,), "midlayer.hidden_norm.weight": (h,),
        "midlayer.post_attention_layernorm.weight": (h,),
        "midlayer.self_attn.q_proj.weight": (q, 2 * h), "midlayer.self_attn.k_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * h), "midlayer.self_attn.o_proj.weight": (h, q),
        "midlayer.mlp.gate_proj.weight": (inter, h), "midlayer.mlp.up_proj.weight": (inter, h),
        "midlayer.mlp.down_proj.weight": (h, inter),
    }
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert cfg["draft_vocab_size"] == 100 and cfg["vocab_size"] == 300 and cfg["target_hidden_size"] == 64
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 2, 1]


def test_sharded_export_loads_back_into_an_equal_head(tmp_path):
    target = target_arch()
    head, vocab, config = random_head(target, 100)
    files = export_head(tmp_path, head, vocab, config, max_shard_bytes=30_000)
    assert len(files) > 2
    assert all(f.stat().st_size < 30_000 + 4096 for f in files)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == sorted(f.name for f in files)
    loaded = Eagle3Head(head_arch(json.loads((tmp_path / "config.json").read_text())), UnrolledAttention(), 100,
                        64, (2, 2, 1))
    names = loaded.load_weights(safetensors_weights(tmp_path))
    assert "embed_tokens.weight" not in names
    for name, p in head.named_parameters():
        if not name.startswith("embed_tokens."):
            torch.testing.assert_close(dict(loaded.named_parameters())[name], p.to(torch.bfloat16).float())
    assert torch.equal(loaded.d2t, vocab.d2t)
    # A later export with fewer shards leaves no stale shard behind.
    export_head(tmp_path, head, vocab, config, max_shard_bytes=15_000_000)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]


def test_smollm2_sized_head_ships_in_shards_under_16_mb(tmp_path):
    smollm2 = target_arch(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                          num_kv_heads=3, head_dim=64, max_position_embeddings=8192)
    cfg = TrainConfig(target="smollm2-135m", out=str(tmp_path / "head"))
    head, vocab, config = random_head(smollm2, cfg.draft_vocab_size, aux=(2, 15, 27))
    check_exportable(config, (2, 15, 27), cfg.max_shard_bytes)
    files = export_head(tmp_path, head, vocab, config, cfg.max_shard_bytes)
    assert len(files) >= 2
    assert all(f.stat().st_size < 16_000_000 for f in files)
    total = sum(f.stat().st_size for f in files)
    assert total < 32_000_000, "the head must not carry the 49152 x 576 embedding"


def test_a_head_whose_lm_head_cannot_fit_a_shard_is_refused_up_front():
    smollm2 = target_arch(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                          num_kv_heads=3, head_dim=64, max_position_embeddings=8192)
    with pytest.raises(ConfigError, match=r"max_shard_mb: the head's lm_head.weight takes 18.9 MB.*draft-vocab-size"):
        check_exportable(head_config(smollm2, 16384, (2, 15, 27)), (2, 15, 27), 15_000_000)
