"""One request's outputs on their way from the engine's output loop to the coroutine serving it.

Outputs that arrive while the reader is busy (sending the previous chunk) are merged into one, so a
slow reader gets fewer, larger pieces instead of a growing backlog; `stream_interval` asks for that
on purpose: a delta output is handed over once it holds that many tokens (the first output and the
last are handed over at once, so the time to the first token and the end are not delayed).
"""
from __future__ import annotations

import asyncio

from specserve.outputs import CompletionOutput, RequestOutput
from specserve.sampling_params import RequestOutputKind


def merge_deltas(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """The delta output covering a's tokens then b's: each sequence in either, in index order."""
    merged = {c.index: c for c in a.outputs}
    for cb in b.outputs:
        ca = merged.get(cb.index)
        if ca is None:
            merged[cb.index] = cb
            continue
        logprobs = None if ca.logprobs is None or cb.logprobs is None else ca.logprobs + cb.logprobs
        merged[cb.index] = CompletionOutput(cb.index, ca.text + cb.text, ca.token_ids + cb.token_ids,
                                            cb.cumulative_logprob, logprobs, cb.finish_reason, cb.stop_reason)
    return RequestOutput(b.request_id, b.prompt, b.prompt_token_ids, [merged[i] for i in sorted(merged)],
                         b.finished, b.metrics)


class RequestStream:
    def __init__(self, kind: RequestOutputKind, stream_interval: int = 1):
        self.kind = kind
        self.stream_interval = stream_interval
        self._pending: RequestOutput | BaseException | None = None
        self._ready = asyncio.Event()
        self._handed_over = False

    def put(self, item: RequestOutput | BaseException) -> None:
        """Called by the output loop; an exception ends the stream."""
        pending = self._pending
        if isinstance(item, BaseException) or pending is None or isinstance(pending, BaseException):
            self._pending = item if not isinstance(pending, BaseException) else pending
        elif self.kind is RequestOutputKind.DELTA:
            self._pending = merge_deltas(pending, item)
        else:
            self._pending = item  # cumulative and final outputs hold everything so far
        p = self._pending
        if (isinstance(p, BaseException) or p.finished or not self._handed_over
                or max(len(c.token_ids) for c in p.outputs) >= self.stream_interval):
            self._ready.set()

    async def get(self) -> RequestOutput:
        """The next output (possibly several merged); raises the exception that ended the stream."""
        await self._ready.wait()
        self._ready.clear()
        item, self._pending = self._pending, None
        self._handed_over = True
        if isinstance(item, BaseException):
            self._pending = item  # every later get() raises it too
            self._ready.set()
            raise item
        return item
