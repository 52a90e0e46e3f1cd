"""Building blocks shared by the decoder models: norm, rotary embedding, MLP.

Each block has two paths: plain torch, the exact reference the CPU tests
compare with Hugging Face, and fused Triton kernels (specserve/kernels/) for
the GPU. The kernel modules are imported only when the fused path first runs:
importing one defines its Triton kernels, and CPU tests need Triton's
interpreter switched on before that happens.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from specserve.kernels.small_m_configs import SMALL_WEIGHT_BYTES, weight_bytes


class FusableModule(nn.Module):
    """A module whose fused Triton path is on whenever its parameters live on a CUDA device.

    A flag decided when the module is moved, not a device check per call, so
    that tests can force the fused path on CPU tensors under Triton's
    interpreter, and turn it off on a GPU for a same-device comparison.
    """

    fused = False

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.fused = next(self.parameters()).is_cuda
        return self


# Up to this many tokens (decode at batch <= 32, verification of a small batch) a fused module runs its
# output projections (o_proj, down_proj) as the small-M Triton kernel (kernels/fused_linear.py): a
# matrix-vector product bound by reading the weight, faster there than cuBLAS (BENCHMARKS.md, 'Kernel
# choices'). A tree of drafts verifies up to 32 rows a request, which at 17 would
# otherwise fall back to cuBLAS and the separate norm, rotary and SiLU kernels; past 16 rows the tile
# doubles to 32, still bound by the weight read. 32 is the kernel's row limit (small_m_prologue.MAX_ROWS).
SMALL_M_MAX_TOKENS = 32
# Below this many weight bytes the norm in front of the qkv and gate/up projections (with the residual
# add) folds into their small-M kernels, rotary + KV-cache write and SiLU-and-mul in the epilogues: on a
# small weight the kernels saved outweigh rereading the input rows in every program (BENCHMARKS.md,
# 'Kernel choices').
FOLD_NORM_MAX_WEIGHT_BYTES = SMALL_WEIGHT_BYTES
# Up to this many tokens the norm folds whatever the weight: over a large weight (Llama-3-8B's qkv and
# gate/up) folding gains at one token and loses at four (BENCHMARKS.md, 'Kernel choices').
FOLD_NORM_ANY_WEIGHT_MAX_TOKENS = 1


def small_m(module: FusableModule, x: torch.Tensor) -> bool:
    """Whether a projection of module over x runs as a small-M kernel (the one place that decides)."""
    return module.fused and x.shape[0] <= SMALL_M_MAX_TOKENS


def small_m_linear(module: FusableModule, linear: nn.Module, x: torch.Tensor) -> bool:
    """Whether linear over x runs as the small-M kernel with its neighbours' work: an nn.Linear's (16/32-bit)
    weight only; any other projection (an FP8 one, quantization/fp8_linear.py) chooses its own kernel."""
    return isinstance(linear, nn.Linear) and small_m(module, x)


def output_projection(module: FusableModule, linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """linear(x), through the small-M kernel where it pays."""
    if small_m_linear(module, linear, x):
        from specserve.kernels.fused_linear import fused_linear

        return fused_linear(x, linear.weight)[0]
    return linear(x)


def fuses_neighbours(module: FusableModule, linear: nn.Module, x: torch.Tensor) -> bool:
    """Whether linear's small-M kernel over x also runs the kernels around it: the norm in front (prologue),
    rotary and the cache write after a qkv projection (epilogue). The one place that decides."""
    return small_m_linear(module, linear, x) and (weight_bytes(linear.weight) < FOLD_NORM_MAX_WEIGHT_BYTES
                                   or x.shape[0] <= FOLD_NORM_ANY_WEIGHT_MAX_TOKENS)


def folds_norm(module: FusableModule, norm: nn.Module, linear: nn.Module, x: torch.Tensor) -> bool:
    """Whether norm (and the residual add) runs in the prologue of linear's small-M kernel over x. norm may
    be nn.Identity (the EAGLE-1 head's layer has no input norm)."""
    return isinstance(norm, RMSNorm) and fuses_neighbours(module, linear, x)


def takes_fp8_rows(linear: nn.Module) -> bool:
    """Whether the kernel ahead of linear (RMSNorm with the residual add, SiLU-and-mul) writes its output as
    FP8 rows for it (quantization/fp8.Fp8Rows, Fp8Linear.forward_rows), saving the launch that would quantize
    linear's input: linear is an FP8 projection with dynamic per-token input scales on the fused path. The one
    place that decides."""
    from specserve.quantization.fp8_linear import Fp8Activation, Fp8Linear  # which imports this module

    return isinstance(linear, Fp8Linear) and linear.fused and linear.activation is Fp8Activation.DYNAMIC


def folds_fp8_norm(norm: nn.Module, linear: nn.Module) -> bool:
    """Whether norm (and the residual add) writes linear's input as FP8 rows (takes_fp8_rows); norm may be
    nn.Identity (the EAGLE-1 head's layer has no input norm)."""
    return isinstance(norm, RMSNorm) and norm.fused and takes_fp8_rows(linear)


def add_and_norm(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor | None):
    """(norm(x + residual), x + residual); with no residual yet (a first layer), (norm(x), x)."""
    if residual is None:
        return norm(x), x
    return norm(x, residual)


def prologue_args(norm: RMSNorm, residual: torch.Tensor | None) -> dict:
    """The keyword arguments that fold norm (after adding residual, given one) into a small-M kernel."""
    return dict(norm_weight=norm.weight, eps=norm.eps, residual=residual)


def set_fused_kernels(model: nn.Module, enabled: bool) -> None:
    """Force the fused Triton path of every block of model on or off."""
    for m in model.modules():
        if isinstance(m, FusableModule):
            m.fused = enabled


class RMSNorm(FusableModule):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); or, given the residual stream, (norm(x + residual), x + residual).

        x is a sublayer's fresh output and the sum may be written over it; the
        residual is never written, since the caller may still hold it (the
        embedding, an auxiliary hidden state, an EAGLE head's input).
        """
        if self.fused:
            from specserve.kernels.rmsnorm import fused_add_rms_norm, rms_norm

            if residual is None:
                return rms_norm(x, self.weight, self.eps)
            return fused_add_rms_norm(residual, x, self.weight, self.eps)
        if residual is None:
            return self._norm(x)
        x = residual + x
        return self._norm(x), x

    def forward_fp8_rows(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """(forward's norm output quantized per row, x + residual or x), in one kernel of the fused path; x and
        residual are treated as forward treats them."""
        from specserve.kernels.rmsnorm import rms_norm_fp8_rows

        if residual is None:
            return rms_norm_fp8_rows(x, None, self.weight, self.eps), x
        return rms_norm_fp8_rows(residual, x, self.weight, self.eps), x

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim))
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        # Llama 3.1: leave high frequencies, divide low ones by factor, blend the band between.
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(mid, blended, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (rotate halves), as in Hugging Face Llama."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict):
        super().__init__()
        self._spec = (head_dim, max_positions, theta, scaling)
        self._build(torch.device("cpu"))

    def _build(self, device: torch.device) -> None:
        head_dim, max_positions, theta, scaling = self._spec
        # Computed on the CPU in float64 whatever device context is active (meta during model construction).
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float64, device="cpu"), inv_freq)
        self.register_buffer("cos", freqs.cos().float().to(device), persistent=False)
        self.register_buffer("sin", freqs.sin().float().to(device), persistent=False)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        # Recomputed after every move or cast: the tables stay float32 (in bf16 large positions
        # alias) and are never left uninitialised by to_empty.
        self._build(self.cos.device)
        return self

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def rotate_and_cache(self, positions, q, k, v, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                         scales=None) -> None:
        """The fused path: rotate q and k in place and write the rotated k and v into kv_cache (an FP8 one
        quantized with the layer's scales, attention/kv_quant.KVScales)."""
        from specserve.kernels.rotary_cache import rotary_and_cache

        rotary_and_cache(positions, q, k, v, self.cos, self.sin, kv_cache, slot_mapping, scales)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class GatedMLP(FusableModule):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward_prenorm(self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None):
        """(self(norm(x + residual)), x + residual), as add_and_norm; at small M the norm folds into gate/up."""
        if folds_norm(self, norm, self.gate_up_proj, x):
            from specserve.kernels.fused_linear import fused_linear

            h, total = fused_linear(x, self.gate_up_proj.weight, silu_mul=True, **prologue_args(norm, residual))
            return output_projection(self, self.down_proj, h), x if total is None else total
        if folds_fp8_norm(norm, self.gate_up_proj):
            rows, residual = norm.forward_fp8_rows(x, residual)
            if self.fused and takes_fp8_rows(self.down_proj):
                return self.down_proj.forward_rows(self.gate_up_proj.silu_and_mul_rows(rows)), residual
            return self._down(self.gate_up_proj.forward_rows(rows)), residual
        x, residual = add_and_norm(norm, x, residual)
        return self(x), residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._down(self.gate_up_proj(x))

    def _down(self, gate_up: torch.Tensor) -> torch.Tensor:
        """down_proj(silu(gate) * up) of the gate/up projection's output."""
        if self.fused and takes_fp8_rows(self.down_proj):
            from specserve.kernels.activation import silu_and_mul_fp8_rows

            rows = silu_and_mul_fp8_rows(gate_up.reshape(-1, gate_up.shape[-1]))
            return self.down_proj.forward_rows(rows).reshape(*gate_up.shape[:-1], -1)
        if self.fused:
            from specserve.kernels.activation import silu_and_mul

            return output_projection(self, self.down_proj, silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
