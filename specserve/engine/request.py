"""One request's state as the scheduler and runner see it."""
from __future__ import annotations

import enum
import time

import torch

from specserve.sampling_params import SamplingParams
from specserve.spec_decode.metrics import SpecDecodeStats
from specserve.structured_output.request_grammar import RequestGrammar


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        # A set built once: a lookup of RequestStatus's members on every call costs a step's grammar masks tens
        # of microseconds at large batches.
        return self in _FINISHED


_FINISHED = frozenset({RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED})


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_ids: set[int],
        max_model_len: int,
        device: str = "cpu",
        grammar: RequestGrammar | None = None,
    ):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.eos_token_ids = set() if params.ignore_eos else set(eos_token_ids)
        self.stop_token_ids = set(params.stop_token_ids)
        # Generation stops at max_tokens or when the context is full, whichever comes first.
        room = max_model_len - len(prompt_token_ids)
        self.max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        self.arrival_time = time.monotonic()
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        # Prompt tokens whose KV came from the prefix cache on first scheduling.
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        # Every token the model ran for this request, prompt and output, recomputation included.
        self.num_model_tokens = 0
        # Draft tokens proposed for verification in the next step (known on the host).
        self.spec_token_ids: list[int] = []
        # Asynchronous scheduling: tokens scheduled in a step still running on the device, and whether that
        # step samples new tokens for this request (it reaches the end of the known tokens).
        self.num_inflight_tokens = 0
        self.inflight_samples = False
        self.spec_stats = SpecDecodeStats()
        self.stop_reason: int | str | None = None
        # Seeded requests draw all their randomness from their own generator, on the model's device.
        self.generator: torch.Generator | None = None
        # The grammar state of a request with structured_output (structured_output/request_grammar.py).
        self.grammar = grammar
        if params.seed is not None:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(params.seed)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def needs_host_tokens(self) -> bool:
        """Whether sampling this request reads its generated tokens on the host (penalties, min_tokens), so
        its next step cannot be scheduled before the current one's tokens are back. A grammar's mask reads them
        too, but only once the next step's forward is enqueued (ModelRunner.launch), so it does not count."""
        return self.params.uses_penalties or self.params.min_tokens > 0

    def append_token(self, token_id: int) -> bool:
        """Append one generated token; True when it ends the request."""
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        n = len(self.output_token_ids)
        if self.grammar is not None and (not self.grammar.accept(token_id) or self.grammar.terminated):
            # Terminated: the grammar is complete and accepted a stop token. A token it refuses cannot come
            # from a masked step; were one to, the output would stop matching, so the request ends there.
            self.status = RequestStatus.FINISHED_STOPPED
            return True
        if n >= self.params.min_tokens:
            if token_id in self.eos_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                return True
            if token_id in self.stop_token_ids:
                self.status, self.stop_reason = RequestStatus.FINISHED_STOPPED, token_id
                return True
        if n >= self.max_tokens:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        return False
