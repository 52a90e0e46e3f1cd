"""What the engine returns for a request."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One sequence's output: everything generated so far, or with RequestOutputKind.DELTA only what is new
    since the previous output (cumulative_logprob stays a total)."""

    index: int  # which of the request's n sequences (SamplingParams.n), from 0
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    # One dict per generated token: token id -> Logprob (the sampled token and the top-N).
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # of every sequence
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache (to the first sequence)
    num_model_tokens: int = 0  # tokens the model actually ran for this request (every sequence)
    num_preemptions: int = 0
    first_token_time: float | None = None
    finished_time: float | None = None
    arrival_time: float = 0.0
    spec: dict = field(default_factory=dict)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    # One per sequence, in index order; with RequestOutputKind.DELTA only the sequences that advanced.
    outputs: list[CompletionOutput]
    finished: bool  # every sequence is
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
