"""The attention backend interface every model layer calls through."""
from __future__ import annotations

from typing import Protocol

import torch

from specserve.attention.kv_quant import KVScales
from specserve.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    name: str

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
        kv_scales: KVScales | None = None,  # the layer's, which an FP8 cache is written and read with
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Write k, v into the cache at slot_mapping, then attend causally over each request's cache."""
        ...

    def attend(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        kv_cache: torch.Tensor,  # already holding this step's keys and values
        metadata: AttentionMetadata,
        scale: float,
        kv_scales: KVScales | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Attend causally over each request's cache, for a model that wrote the cache itself
        (fused with its rotary embedding)."""
        ...

    def launch_variant(self, num_reqs: int, max_query_len: int, num_heads: int, num_kv_heads: int, head_dim: int,
                       on_cpu: bool) -> tuple | None:
        """The compile-time sizes a batch's attention launches with (each distinct value is a kernel compiled at
        its first launch), or None for a backend that compiles nothing. The start-up warm-up reads it."""
        ...


def get_attention_backend(name: str) -> AttentionBackend:
    if name == "torch":
        from specserve.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "triton":
        from specserve.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    from specserve.errors import ConfigError

    raise ConfigError("attention_backend", f"unknown backend {name!r}; choose 'torch' or 'triton'")
