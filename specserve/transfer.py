"""Small host-to-device copies that never wait for the GPU.

torch.tensor(values, device="cuda") copies synchronously: it waits until every kernel queued before it
has finished, so one such call in a step stalls the host behind the forward, and with asynchronous
scheduling behind the whole previous step. Copying from pinned memory with non_blocking=True only
queues the transfer; PyTorch's pinned-memory cache keeps the host block until the copy is done.
"""
from __future__ import annotations

import torch


def to_device(values, device: torch.device | str, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """values (a list or array) as a tensor on device, queued behind the work already there."""
    host = torch.as_tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
