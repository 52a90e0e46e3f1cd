"""What each step produced, by the step's batch row, in one persistent device buffer.

Columns: accepted drafts | the tokens emitted (accepted drafts, then the bonus or recovered token; one
for a plain decode) | the next step's drafts. At most max_accepted drafts are accepted: k for a chain of k
drafts, the depth for a tree of num_drafts. The next step reads them on the device when it was
scheduled before this one's results were back (asynchronous scheduling); the host gets all of them in
one copy into pinned memory, alternating between two host buffers because a step's copy may land while
the host still reads the previous step's. Under tensor parallelism with asynchronous scheduling every rank
holds rank 0's rows (share_from_rank0), since every rank reads its next step's in-flight inputs from them.
"""
from __future__ import annotations

import torch

from specserve.distributed.communication import broadcast_from_rank0


class StepOutputs:
    def __init__(self, max_num_reqs: int, num_drafts: int, device: torch.device, max_accepted: int | None = None):
        a = num_drafts if max_accepted is None else max_accepted
        self.num_drafts = num_drafts
        self.max_accepted = a
        self.device = device
        self.packed = torch.zeros(max_num_reqs, 2 + a + num_drafts, dtype=torch.int64, device=device)
        self.accepted = self.packed[:, 0]
        self.tokens = self.packed[:, 1:a + 2]
        self.drafts = self.packed[:, a + 2:]
        cuda = device.type == "cuda"
        self._host = [torch.zeros(self.packed.shape, dtype=torch.int64, pin_memory=cuda) for _ in range(2)]
        # One completion event per host buffer, recorded on the stream the runner launches on, looked up once:
        # looking the stream up costs as much host time as the copy's own launch.
        self._events = [torch.cuda.Event() for _ in range(2)] if cuda else None
        self._stream = torch.cuda.current_stream(device) if cuda else None
        self._next = 0

    def columns_written(self, verified: bool, drafted: bool) -> int:
        """The leading columns a step's rows hold: the accepted count and the tokens emitted (one a row where the
        step verified no drafts), then the drafts where it drafted on the device. The host reads no more, since
        turning each column of a row into Python costs host time every step."""
        if drafted:
            return self.packed.shape[1]
        return 2 + self.max_accepted if verified else 2

    def copy_to_host(self, num_rows: int) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Start copying rows [0, num_rows) to the host; the copy is complete once the event is."""
        i = self._next
        self._next ^= 1
        host = self._host[i][:num_rows]
        host.copy_(self.packed[:num_rows], non_blocking=True)
        if self._events is None:
            return host, None
        self._events[i].record(self._stream)
        return host, self._events[i]

    def share_from_rank0(self, num_rows: int) -> None:
        """Rank 0's rows [0, num_rows) on every rank, in the step's stream order (only rank 0 samples)."""
        broadcast_from_rank0(self.packed[:num_rows])
