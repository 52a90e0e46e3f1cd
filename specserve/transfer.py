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


class HostCopy:
    """A device tensor on its way to the host: the copy is queued behind the work already on the device
    and the host goes on; wait() blocks until it has landed (on the CPU it is there at once)."""

    def __init__(self, t: torch.Tensor):
        if not t.is_cuda:
            self.host, self.event = t.clone(), None
            return
        self.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        self.host.copy_(t, non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record()

    def wait(self) -> torch.Tensor:
        if self.event is not None:
            self.event.synchronize()
        return self.host
