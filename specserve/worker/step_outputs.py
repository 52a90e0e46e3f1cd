"""What each step produced, by the step's batch row, in one persistent device buffer.

Columns: accepted drafts | the tokens emitted (accepted drafts, then the bonus or recovered token; one
for a plain decode) | the next step's drafts. The next step reads them on the device when it was
scheduled before this one's results were back (asynchronous scheduling); the host gets all of them in
one copy into pinned memory, alternating between two host buffers because a step's copy may land while
the host still reads the previous step's.
"""
from __future__ import annotations

import torch


class StepOutputs:
    def __init__(self, max_num_reqs: int, num_drafts: int, device: torch.device):
        k = num_drafts
        self.num_drafts = k
        self.device = device
        self.packed = torch.zeros(max_num_reqs, 2 + 2 * k, dtype=torch.int64, device=device)
        self.accepted = self.packed[:, 0]
        self.tokens = self.packed[:, 1:k + 2]
        self.drafts = self.packed[:, k + 2:]
        pin = device.type == "cuda"
        self._host = [torch.zeros(self.packed.shape, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._next = 0

    def copy_to_host(self, num_rows: int) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Start copying rows [0, num_rows) to the host; the copy is complete once the event is."""
        host = self._host[self._next][:num_rows]
        self._next ^= 1
        host.copy_(self.packed[:num_rows], non_blocking=True)
        if self.device.type != "cuda":
            return host, None
        event = torch.cuda.Event()
        event.record()
        return host, event
