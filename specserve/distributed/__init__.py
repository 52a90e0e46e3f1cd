"""Tensor parallelism over torch.distributed (docs/design.md, 'Tensor parallelism')."""
