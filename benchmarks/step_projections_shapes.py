"""What benchmarks/bench_step_projections.py times, and its command line: the small-M projections of one step
on one tensor-parallel rank, at one or several tensor-parallel sizes (their target projections side by side, so
that a shape class shared by sizes is tuned over all of them).

The target's projections are the weights of one decoder layer as the model's own code builds it
(models/llama.DecoderLayer, on the meta device) from a shape preset of specserve.bench.models, sharded by
models/parallel_layers.shard_arch: qkv and gate_up column-parallel (by heads, KV heads replicated when fewer
than ranks; by columns), o_proj and down_proj row-parallel (split along K). The head's projections are
the shipped SmolLM2 EAGLE-3 head's, whole, as rank 0 holds it by default (draft_tensor_parallel_size 1;
docs/design.md, 'Tensor parallelism').
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from specserve.bench.models import SHAPES
from specserve.distributed.parallel_state import TPGroup
from specserve.errors import ConfigError
from specserve.models.arch_config import ArchConfig
from specserve.models.llama import DecoderLayer
from specserve.models.parallel_layers import shard_arch

# The one target with a shipped EAGLE-3 head, and that head's MLP width and draft vocabulary (its attention and
# hidden size are the target's).
HEAD_TARGET = "smollm2-shape"
HEAD_MLP, HEAD_DRAFT_VOCAB = 6144, 12288
# The weights' dtype: bf16, as the engine runs the targets benchmarked here.
WEIGHT_BYTES_PER_ELEMENT = 2


@dataclass(frozen=True)
class Attention:
    """The heads the qkv kernel splits its output into, and rotary's table."""

    heads: int
    kv_heads: int
    head_dim: int
    rope_theta: float
    rope_scaling: dict
    max_positions: int


@dataclass(frozen=True)
class Projection:
    """One small-M projection: its weight [n, k], what its kernel fuses, and how often a step runs it."""

    name: str
    n: int
    k: int
    norm: bool  # the add-and-RMSNorm prologue
    silu_mul: bool = False  # the gate/up kernel: two accumulators, SiLU-and-mul epilogue
    argmax: bool = False  # each program's best columns (lm_head with the draft argmax)
    bias: bool = False
    attention: Attention | None = None  # set for the qkv kernel (rotary and the KV-cache write)
    per_step: int = 1  # calls per step: the target's layer count, 1 for the head's
    tensor_parallel_size: int = 1  # the target's rank shard it is a weight of (the head's: 1, whole)

    @property
    def weight_bytes(self) -> int:
        return self.n * self.k * WEIGHT_BYTES_PER_ELEMENT

    @property
    def group(self) -> str:
        """'target' (at TP=N > 1: 'target TP=N') or 'head': the part of the step it belongs to."""
        tp = self.tensor_parallel_size
        return self.name.split()[0] + (f" TP={tp}" if tp > 1 else "")


def target_arch(target: str) -> ArchConfig:
    """The whole model's architecture of a shape preset (a Llama unless the preset names its own)."""
    return ArchConfig.from_hf_config({"architectures": ["LlamaForCausalLM"], **SHAPES[target]})


def rank_layer(arch: ArchConfig, tensor_parallel_size: int) -> tuple[ArchConfig, DecoderLayer]:
    """Rank 0's architecture and decoder layer (every rank's have the same shapes), on the meta device. Raises
    ConfigError where the size does not split the model."""
    tp = TPGroup(0, tensor_parallel_size)
    rank_arch = shard_arch(arch, tp) if tp.size > 1 else arch
    with torch.device("meta"):
        return rank_arch, DecoderLayer(rank_arch, backend=None, tp=tp)


def step_projections(target: str, tensor_parallel_size: int) -> list[Projection]:
    """The target's projections on one rank, then (for HEAD_TARGET) the head's."""
    whole = target_arch(target)
    arch, layer = rank_layer(whole, tensor_parallel_size)
    attn, mlp = layer.self_attn, layer.mlp

    def attention(a: ArchConfig) -> Attention:
        return Attention(a.num_heads, a.num_kv_heads, a.head_dim, a.rope_theta, a.rope_scaling,
                         a.max_position_embeddings)

    def shape(linear: torch.nn.Linear) -> dict:
        return dict(n=linear.out_features, k=linear.in_features, per_step=arch.num_layers,
                    tensor_parallel_size=tensor_parallel_size)

    out = [Projection("target qkv", norm=True, bias=attn.qkv_proj.bias is not None, attention=attention(arch),
                      **shape(attn.qkv_proj)),
           Projection("target o_proj", norm=False, **shape(attn.o_proj)),
           Projection("target gate_up", norm=True, silu_mul=True, **shape(mlp.gate_up_proj)),
           Projection("target down_proj", norm=False, **shape(mlp.down_proj))]
    if target != HEAD_TARGET:
        return out
    hidden, head = whole.hidden_size, attention(whole)
    qkv_rows = (whole.num_heads + 2 * whole.num_kv_heads) * whole.head_dim
    return out + [
        # Its input is normed already, the embedding's beside the target's hidden state: K = 2 x hidden.
        Projection("head qkv", qkv_rows, 2 * hidden, norm=False, attention=head),
        Projection("head gate_up", 2 * HEAD_MLP, hidden, norm=True, silu_mul=True),
        Projection("head down_proj", hidden, HEAD_MLP, norm=False),
        Projection("head lm_head+argmax", HEAD_DRAFT_VOCAB, hidden, norm=True, argmax=True),
    ]


@dataclass(frozen=True)
class BenchArgs:
    target: str
    tensor_parallel_sizes: list[int]
    tokens: list[int]
    rounds: int
    top: int
    shapes: list[str]
    bandwidth_tbps: float | None
    write_config: str | None
    projections: list[Projection]  # those --shapes keeps


def parse_args(argv: list[str] | None, description: str) -> BenchArgs:
    """The command line, checked: a size that does not split the target, a word that keeps no projection or
    a count below 1 exits with the parser's error naming the option."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", choices=sorted(SHAPES), default=HEAD_TARGET,
                    help="the shape preset whose decoder layer is timed (specserve/bench/models.py)")
    ap.add_argument("--tensor-parallel-size", type=int, nargs="+", default=[1],
                    help="time one rank's shard of the target at each of these sizes")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 5])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--top", type=int, default=3, help="candidates listed after the chosen and the best")
    ap.add_argument("--shapes", nargs="+", default=[""])
    ap.add_argument("--bandwidth-tbps", type=float,
                    help="the device's bandwidth for %% of peak (default: measured by a device-to-device copy)")
    ap.add_argument("--write-config", nargs="?", const="", metavar="PATH",
                    help="write the device's tile data file (PATH, or the package's file for this device)")
    a = ap.parse_args(argv)
    for option, value in [("--tensor-parallel-size", min(a.tensor_parallel_size)), ("--rounds", a.rounds),
                          ("--tokens", min(a.tokens))]:
        if value < 1:
            ap.error(f"{option} must be at least 1, got {value}")
    if a.top < 0:
        ap.error(f"--top must be at least 0, got {a.top}")
    if max(a.tokens) > 32:
        ap.error(f"--tokens: the small-M kernels run up to 32 token rows, got {max(a.tokens)}")
    if a.bandwidth_tbps is not None and not a.bandwidth_tbps > 0:
        ap.error(f"--bandwidth-tbps must be > 0, got {a.bandwidth_tbps}")
    every = []
    for tp in dict.fromkeys(a.tensor_parallel_size):
        try:
            # The head is whole (draft_tensor_parallel_size 1) at every size: its projections once.
            every += [p for p in step_projections(a.target, tp) if not (every and p.group == "head")]
        except ConfigError as e:
            ap.error(f"--tensor-parallel-size {tp} for {a.target}: {e}")
    kept = [p for p in every if any(word in p.name for word in a.shapes)]
    if not kept:
        ap.error(f"--shapes {' '.join(a.shapes)} keeps none of {a.target}'s projections: "
                 f"{', '.join(p.name for p in every)}")
    return BenchArgs(a.target, list(dict.fromkeys(a.tensor_parallel_size)), a.tokens, a.rounds, a.top, a.shapes, a.bandwidth_tbps,
                     a.write_config, kept)
