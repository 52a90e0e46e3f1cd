"""Continuous batching under a token budget, with chunked prefill and preemption.

Every step, each running request gets the tokens it still needs computed
(one for a decode, 1 + k while verifying k drafts, a chunk of its prompt
while prefilling), then waiting requests are admitted while the budget, the
sequence limit and the KV pool allow. When the pool runs out, the most
recently admitted request is preempted: its blocks are freed and it is
recomputed later from its tokens (which the prefix cache often still holds).

Asynchronous scheduling: step N+1 may be scheduled while step N still runs on
the device. A request whose step N samples then gets 1 + k tokens whose ids
(the token step N samples, and its drafts) and positions (step N may reject
drafts) the runner takes from step N's device outputs; the host counts are
optimistic (every draft accepted) and are corrected when step N's results
arrive. A request whose blocks the device is still using is never preempted:
scheduling stops there and the engine waits for the step in flight.

With a speculator, the policy (spec_decode/policy.py) decides for each step
whether its requests propose drafts; a step that proposes none is followed by
steps without drafts to verify (docs/design.md, 'Dynamic speculation').
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from specserve.config import EngineConfig
from specserve.engine.kv_cache_manager import KVCacheManager
from specserve.engine.request import Request, RequestStatus
from specserve.spec_decode.metrics import SpecDecodeStats
from specserve.spec_decode.policy import SpeculationPolicy, StepKind
from specserve.spec_decode.tree import DraftTree


# Stands for a token the device supplies (asynchronous scheduling): never read on the host.
PLACEHOLDER_TOKEN_ID = -1


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # including the draft tokens below
    # Drafts to verify: their ids, or PLACEHOLDER_TOKEN_ID each where from_device.
    spec_token_ids: list[int]
    block_ids: list[int]
    # Whether this step reaches the request's last known token and so yields new tokens
    # (false for a prompt chunk that stops short of the prompt's end).
    samples: bool
    # Position of the first new token (optimistic where from_device).
    start: int
    # The first token and the drafts come from the previous step's device outputs, and the positions
    # move back by the drafts that step rejects.
    from_device: bool = False

    @property
    def decodes(self) -> bool:
        """Its tokens are a decode, or a verification of its drafts: no prompt token."""
        return self.samples and self.num_new_tokens == 1 + len(self.spec_token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    # Requests that finished since the last step: the runner drops their per-request state.
    finished: list[str] = field(default_factory=list)
    # Scheduling stopped early: the pool is full and the only requests left to preempt are still in use by
    # the step in flight. Wait for that step before scheduling again.
    stalled: bool = False
    # The requests that yield tokens propose drafts for the next step (the policy's decision); False without a
    # speculator, or when the step's drafter stays idle.
    propose_drafts: bool = False
    # The decisions of the steps before whose work this step's measurement holds, the latest first: the step before
    # (whose drafts this step verifies) and, under asynchronous scheduling, the one before that (whose drafts the
    # step before verified while this step's time waited for it); and the kind of step it is (None where no
    # request yields tokens): what the policy's measure of steps needs (spec_decode/measured_steps.py).
    earlier_drafts: tuple[bool, ...] = ()
    step_kind: StepKind | None = None
    # Every scheduled request decodes or verifies its drafts, and so did the step before's: no prompt chunk's time
    # is in this step's (with asynchronous scheduling its time holds the step before's wait). Only such steps are
    # measured, as a prompt chunk costs the same whichever the decision.
    steady: bool = False
    # When EngineCore.step began this step (time.perf_counter()), and the seconds the step took: under
    # asynchronous scheduling from the call that launched it to the next call (set as that one begins, before
    # the step's results are read), launch to results otherwise.
    started: float = 0.0
    seconds: float | None = None

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, num_lookahead_tokens: int = 0,
                 tree: DraftTree | None = None, policy: SpeculationPolicy | None = None):
        self.config = config
        self.kv = kv
        # Drafts per step (k, or a tree's nodes) when speculating; blocks are reserved for them ahead.
        self.num_lookahead = num_lookahead_tokens
        # Drafting a tree: acceptance is counted per depth of the tree (a step's drafts are a tree cut short).
        self.tree = tree
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []
        self.spec_stats = SpecDecodeStats()
        # Whether each step drafts; None without a speculator.
        self.policy = policy
        # Whether the last steps scheduled propose drafts, the latest first (the step in flight, whose drafts the
        # next step verifies), as many as a step's measurement holds.
        self._recent_proposals: deque[bool] = deque([False], maxlen=2 if config.async_scheduling else 1)
        # Whether the last step scheduled held decodes and verifications alone (SchedulerOutput.steady).
        self._inflight_decodes_only = False

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

    def drain_finished(self) -> list[str]:
        """The ids of requests finished since the last step (for the runner to drop their state), now cleared."""
        finished, self._finished_ids = self._finished_ids, []
        return finished

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished=self.drain_finished())
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            i += 1
            computed = req.num_computed_tokens + req.num_inflight_tokens
            if req.num_inflight_tokens and req.inflight_samples:
                # Its next tokens are still on the device. Skip it when sampling needs them on the host, or
                # when the step in flight ends it even if every draft is rejected.
                if req.needs_host_tokens or req.num_output_tokens + 1 >= req.max_tokens:
                    continue
                drafts = self._num_drafts(req, computed + 1) if self._recent_proposals[0] else 0
                spec = [PLACEHOLDER_TOKEN_ID] * min(drafts, budget - 1)
                num_new, from_device = 1 + len(spec), True
            else:
                num_new = min(req.num_tokens_with_spec - computed, budget)
                if num_new <= 0:
                    continue
                # Drafts past the budget are dropped rather than verified partially out of order.
                spec = req.spec_token_ids[:max(0, computed + num_new - req.num_tokens)]
                from_device = False
            if not self._allocate(req, num_new, computed, self.num_lookahead, out):
                break
            req.spec_token_ids = [] if from_device else spec
            samples = from_device or computed + num_new >= req.num_tokens + len(spec)
            scheduled.append(self._scheduled(req, num_new, spec, samples, computed, from_device))
            budget -= num_new

        while (self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs and not out.preempted
               and not out.stalled):
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
            if not self.kv.allocate_slots(req, num_new, req.num_computed_tokens, hits, num_lookahead=lookahead):
                break
            self.waiting.popleft()
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = len(hits) * self.kv.block_size
            req.num_computed_tokens = num_computed
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            spec = req.spec_token_ids
            samples = num_computed + num_new >= req.num_tokens + len(spec)
            scheduled.append(self._scheduled(req, num_new, list(spec), samples, num_computed, False))
            budget -= num_new

        out.scheduled = scheduled
        if self.policy is not None and (num_sampling := sum(s.samples for s in scheduled)):
            out.earlier_drafts = tuple(self._recent_proposals)
            yielding = [s.request for s in scheduled if s.samples]
            out.step_kind = StepKind.of(any(r.grammar is not None for r in yielding),
                                        all(r.params.greedy for r in yielding))
            out.propose_drafts = self.policy.choose(num_sampling, out.step_kind) > 0
        if scheduled:
            decodes_only = all(s.decodes for s in scheduled)
            out.steady = decodes_only and self._inflight_decodes_only
            self._inflight_decodes_only = decodes_only
            self._recent_proposals.appendleft(out.propose_drafts)
        else:
            # No step runs, so the runner hears of these requests with the next one that does.
            self._finished_ids[:0] = out.finished
            out.finished = []
        return out

    def _allocate(self, req: Request, num_new: int, computed: int, lookahead: int, out: SchedulerOutput) -> bool:
        """Blocks for a running request's step, preempting the newest requests while the pool is short.
        False when req itself was preempted, or when the next victim is still in use on the device
        (out.stalled)."""
        while not self.kv.allocate_slots(req, num_new, computed, num_lookahead=lookahead):
            victim = self.running[-1]
            if victim.num_inflight_tokens:
                out.stalled = True
                return False
            self._preempt(victim, out)
            if victim is req:
                return False
        return True

    def _scheduled(self, req: Request, num_new: int, spec: list[int], samples: bool, start: int,
                   from_device: bool) -> ScheduledRequest:
        req.num_inflight_tokens += num_new
        req.inflight_samples = samples
        return ScheduledRequest(req, num_new, spec, self.kv.block_ids(req.request_id), samples, start, from_device)

    def _num_drafts(self, req: Request, num_tokens: int) -> int:
        """Drafts the request may verify in a step after it has num_tokens tokens: none while penalties
        or min_tokens depend on each earlier token, else up to k within the context."""
        if not self.num_lookahead or req.params.uses_penalties or req.num_output_tokens < req.params.min_tokens:
            return 0
        return max(0, min(self.num_lookahead, self.config.max_model_len - num_tokens))

    def update(self, out: SchedulerOutput, result) -> list[Request]:
        """Advance each request past the tokens computed this step (result: the runner's output);
        returns the requests that got new tokens."""
        updated = []
        # This step's acceptance, for a policy that learns from it (a dynamic one).
        step_stats = SpecDecodeStats() if self.policy is not None and self.policy.dynamic else None
        # A step whose requests had all finished before its results came (under asynchronous scheduling, one left
        # in flight when its caller stopped stepping) measured the caller's idle time, not the step's.
        all_running = all(s.request.status is RequestStatus.RUNNING for s in out.scheduled)
        emitted = 0
        for s in out.scheduled:
            req = s.request
            req.num_inflight_tokens -= s.num_new_tokens
            if req.status is not RequestStatus.RUNNING:
                continue  # finished or aborted while the step ran
            new_tokens = result.sampled.get(req.request_id, [])
            # Of the verified drafts only the accepted ones (len(new_tokens) - 1) count as computed.
            num_rejected = len(s.spec_token_ids) - max(len(new_tokens) - 1, 0) if s.samples else 0
            req.num_computed_tokens += s.num_new_tokens - num_rejected
            req.num_model_tokens += s.num_new_tokens
            if not s.samples:
                continue
            if s.spec_token_ids:
                n = len(s.spec_token_ids)
                positions = n if self.tree is None else self.tree.depth_of_prefix(n)
                req.spec_stats.record(positions, len(new_tokens) - 1)
                self.spec_stats.record(positions, len(new_tokens) - 1)
                if step_stats is not None:
                    step_stats.record(positions, len(new_tokens) - 1)
            before = req.num_output_tokens
            for t in new_tokens:
                if req.append_token(t):
                    break
            emitted += req.num_output_tokens - before
            # A request already scheduled again verifies these drafts from the device.
            if not req.is_finished and not req.num_inflight_tokens:
                drafts = result.drafts.get(req.request_id)
                req.spec_token_ids = drafts[: self._num_drafts(req, req.num_tokens)] if drafts else []
            updated.append(req)
        if step_stats is not None and step_stats.num_steps:
            self.policy.observe(step_stats)
        if (step_stats is not None and out.step_kind is not None and out.steady and out.seconds is not None
                and all_running):
            k = self.policy.max_drafts
            decisions = tuple(k if d else 0 for d in (out.propose_drafts, *out.earlier_drafts))
            self.policy.observe_step(out.step_kind, decisions, sum(s.samples for s in out.scheduled), emitted,
                                     out.seconds)
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
