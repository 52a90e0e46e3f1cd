"""What the engine core and its front end say to each other.

The core knows token ids only; the front end (the offline LLMEngine in the same process, or the API
server across a ZMQ socket) owns text: tokenization, detokenization, stop strings and output objects.
Both directions use these msgspec structs: in one process they are plain objects, across processes
they travel as msgpack with no pickling. The core answers each step with one CoreOutputs message
carrying every request's new tokens, so the cost per message is paid per step, not per token.
"""
from __future__ import annotations

import msgspec

from specserve.outputs import Logprob
from specserve.sampling_params import SamplingParams


# ---- front end -> core --------------------------------------------------------------------------

class CoreRequest(msgspec.Struct, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


class CoreAbort(msgspec.Struct, tag=True):
    request_ids: list[str]


class CoreShutdown(msgspec.Struct, tag=True):
    pass


# ---- core -> front end --------------------------------------------------------------------------

class CoreError(msgspec.Struct):
    """Why the core refused a request; `kind` picks the exception the front end raises."""

    kind: str  # "invalid" (InvalidRequestError on `field`), "queue_full" or "internal"
    message: str
    field: str = ""


class CoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """One request's progress in one step."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length" or "abort"; None while it runs
    stop_reason: int | str | None = None  # the stop token id that ended it
    new_logprobs: list[dict[int, Logprob]] | None = None  # one dict per new token, if asked for
    num_cached_tokens: int = 0
    num_model_tokens: int = 0
    num_preemptions: int = 0
    spec: dict | None = None  # the request's speculative-decoding statistics, on its last output
    error: CoreError | None = None  # set when the core refused the request (it was never admitted)


class EngineStats(msgspec.Struct, frozen=True):
    """A snapshot of engine state after a step, for metrics and load balancing; reading it never touches the
    engine. Every field is a count, so the state of several replicas is their field-wise sum (`total`) and
    its ratios are the ratios of the sums."""

    num_running: int = 0
    num_waiting: int = 0
    num_kv_blocks_used: int = 0
    num_kv_blocks: int = 0
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    spec_num_drafted: int = 0
    spec_num_accepted: int = 0
    spec_drafted_per_position: tuple[int, ...] = ()
    spec_accepted_per_position: tuple[int, ...] = ()
    num_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    # Steps of a speculating engine whose requests proposed drafts, and those the policy kept from drafting
    # (spec_decode/policy.py).
    spec_steps_drafting: int = 0
    spec_steps_without_drafts: int = 0

    @property
    def kv_cache_usage(self) -> float:
        return self.num_kv_blocks_used / self.num_kv_blocks if self.num_kv_blocks else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        queried = self.prefix_cache_queried_tokens
        return self.prefix_cache_hit_tokens / queried if queried else 0.0

    @property
    def spec_acceptance_per_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.spec_accepted_per_position, self.spec_drafted_per_position)]

    @classmethod
    def total(cls, parts: list["EngineStats"]) -> "EngineStats":
        """The field-wise sum of several engines' snapshots (per-position counts summed position by position)."""
        sums = {}
        for name in cls.__struct_fields__:
            values = [getattr(p, name) for p in parts]
            if name.endswith("_per_position"):
                width = max(map(len, values), default=0)
                sums[name] = tuple(sum(v[i] for v in values if i < len(v)) for i in range(width))
            else:
                sums[name] = sum(values)
        return cls(**sums)


class CoreOutputs(msgspec.Struct, tag=True):
    outputs: list[CoreOutput]
    stats: EngineStats
    # Requests the core has read since it started, refused ones included. The front end balances replicas by
    # load: a request it sent that is not read yet is in no snapshot, so it counts as one more waiting.
    num_requests_read: int


class CoreReady(msgspec.Struct, tag=True):
    """The core's first message: it has loaded the model, and these are the limits it settled on."""

    max_model_len: int
    num_kv_blocks: int
    block_size: int


class CoreFailed(msgspec.Struct, tag=True):
    """The core could not start or stopped on an error; `message` says why."""

    message: str


ToCore = CoreRequest | CoreAbort | CoreShutdown
FromCore = CoreOutputs | CoreReady | CoreFailed
