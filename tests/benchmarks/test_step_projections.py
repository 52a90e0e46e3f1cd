"""benchmarks/bench_step_projections.py on the CPU: its command line; the per-rank shapes it times, against the
slices the weight loader cuts for every rank, the layers rank 0's model holds and the Llama-3-8B TP=2 figures
by hand; the candidates each kernel takes; --write-config's table, which keeps the classes not measured."""
from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_step_projections import candidates, label, shape_class, updated_tiles  # noqa: E402
from step_projections_shapes import parse_args, rank_layer, step_projections, target_arch  # noqa: E402

from specserve.distributed.parallel_state import TPGroup  # noqa: E402
from specserve.kernels.small_m_configs import CANDIDATES, SmallMConfig  # noqa: E402
from specserve.models.llama import LlamaForCausalLM  # noqa: E402
from specserve.models.parallel_layers import shard_weight  # noqa: E402


def loader_slices(target: str, size: int, rank: int) -> dict[str, tuple[int, ...]]:
    """The shapes rank `rank` loads: the whole layer's weights, each part of a fused one cut by shard_weight."""
    arch = target_arch(target)
    _, layer = rank_layer(arch, 1)
    tp = TPGroup(rank, size)
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim

    def fused(name: str, tensor: torch.Tensor, sizes: list[int]) -> tuple[int, ...]:
        parts = [shard_weight(name, i, part, arch, tp) for i, part in enumerate(tensor.split(sizes))]
        return tuple(torch.cat(parts).shape)

    attn, mlp = layer.self_attn, layer.mlp
    out = {"target qkv": fused("model.layers.0.self_attn.qkv_proj.weight", attn.qkv_proj.weight, [q, kv, kv]),
           "target o_proj": tuple(shard_weight("model.layers.0.self_attn.o_proj.weight", None,
                                               attn.o_proj.weight, arch, tp).shape),
           "target gate_up": fused("model.layers.0.mlp.gate_up_proj.weight", mlp.gate_up_proj.weight,
                                   [arch.intermediate_size] * 2),
           "target down_proj": tuple(shard_weight("model.layers.0.mlp.down_proj.weight", None,
                                                  mlp.down_proj.weight, arch, tp).shape)}
    if attn.qkv_proj.bias is not None:
        out["target qkv bias"] = fused("model.layers.0.self_attn.qkv_proj.bias", attn.qkv_proj.bias, [q, kv, kv])
    return out


@pytest.mark.parametrize("target, size", [("llama3-8b", 2), ("llama3-8b", 16), ("qwen2.5-32b", 2),
                                          ("qwen2.5-32b", 8), ("smollm2-shape", 1)])
def test_rank_shapes_are_what_every_rank_loads(target, size):
    """16 ranks over Llama-3-8B's 8 KV heads: each rank keeps a copy of one."""
    timed = {p.name: p for p in step_projections(target, size) if p.name.startswith("target")}
    for rank in range(size):
        loaded = loader_slices(target, size, rank)
        assert {name: (p.n, p.k) for name, p in timed.items()} == {
            name: shape for name, shape in loaded.items() if name != "target qkv bias"}
        assert timed["target qkv"].bias == ("target qkv bias" in loaded)
        if timed["target qkv"].bias:
            assert loaded["target qkv bias"] == (timed["target qkv"].n,)
    assert all(p.per_step == target_arch(target).num_layers for p in timed.values())
    # The model the engine's rank 0 builds, on the meta device.
    with torch.device("meta"):
        model = LlamaForCausalLM(target_arch(target), backend=None, tp=TPGroup(0, size))
    layer = model.model.layers[-1]
    assert [tuple(linear.weight.shape) for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                      layer.mlp.gate_up_proj, layer.mlp.down_proj)] == [
        (p.n, p.k) for p in timed.values()]


def test_llama3_8b_at_tp2_by_hand():
    """hidden 4096, 32 heads of 128, 8 KV heads, FFN 14336 over two ranks: 16 q heads and 4 KV heads each."""
    by_name = {p.name: p for p in step_projections("llama3-8b", 2)}
    assert {name: (p.n, p.k) for name, p in by_name.items()} == {
        "target qkv": ((16 + 2 * 4) * 128, 4096), "target o_proj": (4096, 2048),
        "target gate_up": (2 * 7168, 4096), "target down_proj": (4096, 7168)}
    attention = by_name["target qkv"].attention
    assert (attention.heads, attention.kv_heads, attention.head_dim) == (16, 4, 128)
    assert [name for name, p in by_name.items() if p.norm] == ["target qkv", "target gate_up"]
    assert by_name["target gate_up"].silu_mul and not by_name["target qkv"].bias
    assert by_name["target gate_up"].weight_bytes == 2 * 7168 * 4096 * 2


def test_command_line():
    a = parse_args(["--target", "llama3-8b", "--tensor-parallel-size", "2", "--tokens", "1", "4",
                    "--shapes", "gate", "down", "--write-config"], "")
    assert (a.target, a.tensor_parallel_sizes, a.tokens, a.write_config) == ("llama3-8b", [2], [1, 4], "")
    assert [p.name for p in a.projections] == ["target gate_up", "target down_proj"]
    default = parse_args([], "")
    assert (default.target, default.tensor_parallel_sizes, default.write_config) == ("smollm2-shape", [1], None)
    assert [p.name.split()[0] for p in default.projections] == ["target"] * 4 + ["head"] * 4
    both = parse_args(["--target", "llama3-8b", "--tensor-parallel-size", "1", "2"], "")
    assert [(p.group, p.n) for p in both.projections if p.name.endswith("qkv")] == [("target", 6144),
                                                                                     ("target TP=2", 3072)]
    smollm2 = parse_args(["--tensor-parallel-size", "1", "3"], "")  # SmolLM2's 9 heads split over 3
    assert [p.group for p in smollm2.projections] == ["target"] * 4 + ["head"] * 4 + ["target TP=3"] * 4


@pytest.mark.parametrize("argv, message", [
    (["--target", "llama3-8b", "--tensor-parallel-size", "3"], "--tensor-parallel-size 3 for llama3-8b"),
    (["--tensor-parallel-size", "2"], "attention heads"),  # SmolLM2's 9
    (["--target", "llama3-8b", "--shapes", "head"], "keeps none of llama3-8b's projections"),
    (["--tokens", "1", "0"], "--tokens must be at least 1"),
    (["--tokens", "33"], "up to 32 token rows"),
    (["--bandwidth-tbps", "0"], "--bandwidth-tbps must be > 0"),
    (["--target", "llama3-70b"], "invalid choice"),
])
def test_bad_command_lines_name_the_option(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(argv, "")
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_candidates_fit_each_kernel():
    """The qkv kernel's block_n counts rotary pairs (at most half a head); split-K for plain projections and the
    qkv kernel only; the compact prologue only with a norm and fewer token rows than the tile's."""
    by_name = {p.name: p for p in step_projections("llama3-8b", 2)}
    qkv = candidates(by_name["target qkv"], 4, CANDIDATES[0])
    assert max(c.block_n for c in qkv) == 64 and any(c.split_k > 1 for c in qkv)
    assert any(c.compact for c in qkv)
    down = candidates(by_name["target down_proj"], 4, CANDIDATES[0])
    assert any(c.split_k > 1 for c in down) and not any(c.compact for c in down)
    gate_up = [c for c in CANDIDATES if c.split_k == 1]
    assert candidates(by_name["target gate_up"], 16, CANDIDATES[0]) == [CANDIDATES[0]] + gate_up
    assert candidates(by_name["target gate_up"], 1, CANDIDATES[0]) == [CANDIDATES[0]] + [
        replace(c, compact=compact) for c in gate_up for compact in (False, True)]
    assert shape_class(by_name["target qkv"], 1) == "qkv_norm_narrow_one_token"  # a rank's 3,072 rows
    assert shape_class(by_name["target down_proj"], 4) == "large"


def test_write_config_replaces_only_the_measured_classes():
    old, fast, slow = (SmallMConfig(16, 64, 4, 4), SmallMConfig(32, 256, 4, 4), SmallMConfig(16, 512, 4, 3))
    tiles = {"large": old, "large_wide": old, "qkv_large": old}
    by_label = {label(c): c for c in (old, fast, slow)}
    measured = {
        # fast wins over both runs though slow wins the second; a tie keeps the current tile (first label).
        "large": [{label(old): 10.0, label(fast): 5.0, label(slow): 9.0},
                  {label(old): 10.0, label(fast): 6.0, label(slow): 5.5}],
        "large_wide": [{label(old): 7.0, label(fast): 7.0}],
    }
    assert updated_tiles(tiles, measured, by_label) == {"large": fast, "large_wide": old, "qkv_large": old}
