"""Continuous batching under a token budget, with chunked prefill and preemption.

Every step, each running request gets the tokens it still needs computed
(one for a decode, 1 + k while verifying k drafts, a chunk of its prompt
while prefilling), then waiting requests are admitted while the budget, the
sequence limit and the KV pool allow. When the pool runs out, the most
recently admitted request is preempted: its blocks are freed and it is
recomputed later from its tokens (which the prefix cache often still holds).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from specserve.config import EngineConfig
from specserve.engine.kv_cache_manager import KVCacheManager
from specserve.engine.request import Request, RequestStatus
from specserve.spec_decode.metrics import SpecDecodeStats


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # including the draft tokens below
    spec_token_ids: list[int]
    block_ids: list[int]
    # Whether this step reaches the request's last known token and so yields new tokens
    # (false for a prompt chunk that stops short of the prompt's end).
    samples: bool

    @classmethod
    def of(cls, req: Request, num_new_tokens: int, block_ids: list[int]) -> "ScheduledRequest":
        samples = req.num_computed_tokens + num_new_tokens >= req.num_tokens_with_spec
        return cls(req, num_new_tokens, list(req.spec_token_ids), block_ids, samples)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    # Requests that finished since the last step: the runner drops their per-request state.
    finished: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, num_lookahead_tokens: int = 0):
        self.config = config
        self.kv = kv
        self.num_lookahead = num_lookahead_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []
        self.spec_stats = SpecDecodeStats()

    def add_request(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.waiting.append(req)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        self.running.remove(victim)
        self.kv.reset_for_recompute(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.spec_token_ids = []
        victim.num_preemptions += 1
        self.waiting.appendleft(victim)
        out.preempted.append(victim.request_id)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished=self._finished_ids)
        self._finished_ids = []
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens_with_spec - req.num_computed_tokens, budget)
            if num_new <= 0:
                i += 1
                continue
            while not self.kv.allocate_slots(req, num_new, num_lookahead=self.num_lookahead):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is req:
                    break
            if req.status is RequestStatus.PREEMPTED:
                break
            # Drafts past the budget are dropped rather than verified partially out of order.
            num_spec = max(0, min(len(req.spec_token_ids), req.num_computed_tokens + num_new - req.num_tokens))
            req.spec_token_ids = req.spec_token_ids[:num_spec]
            scheduled.append(ScheduledRequest.of(req, num_new, self.kv.block_ids(req.request_id)))
            budget -= num_new
            i += 1

        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs and not out.preempted:
            req = self.waiting[0]
            hits = self.kv.get_computed_blocks(req) if req.num_computed_tokens == 0 else []
            num_computed = req.num_computed_tokens + len(hits) * self.kv.block_size
            num_new = req.num_tokens - num_computed
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    break
                num_new = budget
            # Reserve room for drafts only once the prompt is done, as that is when they start.
            lookahead = self.num_lookahead if num_computed + num_new >= req.num_tokens else 0
            if not self.kv.allocate_slots(req, num_new, hits, num_lookahead=lookahead):
                break
            self.waiting.popleft()
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = len(hits) * self.kv.block_size
            req.num_computed_tokens = num_computed
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append(ScheduledRequest.of(req, num_new, self.kv.block_ids(req.request_id)))
            budget -= num_new

        out.scheduled = scheduled
        return out

    def update(self, out: SchedulerOutput, result) -> list[Request]:
        """Advance each request past the tokens computed this step (result: the runner's output);
        returns the requests that got new tokens."""
        updated = []
        for s in out.scheduled:
            req = s.request
            if req.is_finished:
                continue
            new_tokens = result.sampled.get(req.request_id, [])
            # Of the verified drafts only the accepted ones (len(new_tokens) - 1) count as computed.
            num_rejected = len(s.spec_token_ids) - max(len(new_tokens) - 1, 0) if s.samples else 0
            req.num_computed_tokens += s.num_new_tokens - num_rejected
            req.num_model_tokens += s.num_new_tokens
            req.spec_token_ids = []
            if not s.samples:
                continue
            if s.spec_token_ids:
                req.spec_stats.record(len(s.spec_token_ids), len(new_tokens) - 1)
                self.spec_stats.record(len(s.spec_token_ids), len(new_tokens) - 1)
            for t in new_tokens:
                if req.append_token(t):
                    break
            if not req.is_finished:
                req.spec_token_ids = result.drafts.get(req.request_id, [])
            updated.append(req)
        return updated

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Free a request's blocks and forget it (stopped, out of length, or aborted)."""
        if req.request_id not in self.requests:
            return
        req.status = status
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)
        del self.requests[req.request_id]
        self._finished_ids.append(req.request_id)
