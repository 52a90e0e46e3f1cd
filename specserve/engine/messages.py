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
    """A snapshot of engine state after a step, for metrics; reading it never touches the engine."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_hit_rate: float = 0.0
    spec_num_drafted: int = 0
    spec_num_accepted: int = 0
    spec_acceptance_per_position: tuple[float, ...] = ()
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0


class CoreOutputs(msgspec.Struct, tag=True):
    outputs: list[CoreOutput]
    stats: EngineStats


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
