"""`specserve bench decode --tensor-parallel-size 2` on the CPU (gloo): each row's step collectives timed, the
weight bytes one GPU reads (its shard), and the shapes the lead benchmarks on two GPUs."""
from __future__ import annotations

import pytest
import torch

from specserve.bench.decode import run_decode_bench
from specserve.bench.decode_plan import preset_config
from specserve.bench.models import SHAPES, distinct_params, prepare_model
from specserve.distributed.parallel_state import TPGroup
from specserve.errors import ConfigError
from specserve.models.arch_config import ArchConfig
from specserve.models.parallel_layers import shard_arch
from specserve.models.loader import build_model, open_model_source
from specserve.attention.backend import get_attention_backend


def test_tiny_bench_at_tp2_times_each_steps_collectives(tmp_path):
    cfg = preset_config("tiny", tensor_parallel_size=2, hf_batch_sizes=[], batch_sizes=[1, 4], spec_batch_sizes=[1])
    results = run_decode_bench(cfg, tmp_path / "r.json", tmp_path / "r.md")
    assert {(r.spec, r.batch) for r in results.rows} == {("none", 1), ("none", 4), ("eagle3 k=2 p=0.8", 1)}
    # Every row measured after the probes of the rows before it: the ranks stayed in step.
    assert all(r.error is None and r.tok_s > 0 and r.collectives_ms > 0 for r in results.rows)
    whole = distinct_params(build_model(open_model_source(prepare_model("tiny", tmp_path, torch.float32).path),
                                        torch.float32, "cpu", get_attention_backend("torch"),
                                        load_format="dummy")[0])[1]
    shard = results.models["tiny"].weight_bytes
    assert whole / 2 < shard < 0.6 * whole  # half of every matrix, the norms whole
    assert results.models["tiny"].all_reduce == "nccl"  # the engine's choice on the CPU (gloo)
    assert "collectives ms/step" in (tmp_path / "r.md").read_text()
    assert "tensor parallel over 2 GPUs, nccl all-reduce" in (tmp_path / "r.md").read_text()


def test_the_two_gpu_shapes_split_over_two_ranks():
    for name, (heads, kv, ffn) in {"llama3-8b": (32, 8, 14336), "qwen2.5-32b": (40, 8, 27648)}.items():
        arch = ArchConfig.from_hf_config({"architectures": ["LlamaForCausalLM"], **SHAPES[name]})
        assert (arch.num_heads, arch.num_kv_heads, arch.intermediate_size) == (heads, kv, ffn)
        shard = shard_arch(arch, TPGroup(1, 2))
        assert (shard.num_heads, shard.num_kv_heads, shard.intermediate_size) == (heads // 2, kv // 2, ffn // 2)
    qwen = ArchConfig.from_hf_config(SHAPES["qwen2.5-32b"])
    assert (qwen.num_layers, qwen.hidden_size, qwen.vocab_size, qwen.attention_bias) == (64, 5120, 152064, True)


def test_tiny_bench_at_tp2_measures_the_head_sharded_like_the_target(tmp_path):
    cfg = preset_config("tiny", tensor_parallel_size=2, draft_tensor_parallel_size=2, hf_batch_sizes=[],
                        batch_sizes=[1], spec_batch_sizes=[1])
    results = run_decode_bench(cfg, tmp_path / "r.json", tmp_path / "r.md")
    spec = [r for r in results.rows if r.spec == "eagle3 k=2 p=0.8"]
    assert spec and all(r.error is None and r.tok_s > 0 and r.collectives_ms > 0 for r in spec)
    assert "EAGLE-3 head sharded over 2 GPUs" in (tmp_path / "r.md").read_text()


def test_bench_refuses_a_head_placement_the_engine_does_not_have():
    with pytest.raises(ConfigError, match="must be 1 .* or tensor_parallel_size") as e:
        preset_config("tiny", tensor_parallel_size=2, draft_tensor_parallel_size=3)
    assert e.value.field == "bench.draft_tensor_parallel_size"
