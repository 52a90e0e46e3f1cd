"""Per-request sampling parameters, validated at construction."""
from __future__ import annotations

import enum
from dataclasses import dataclass

from specserve.errors import InvalidRequestError
from specserve.structured_output.spec import StructuredOutput

MAX_LOGPROBS = 20
# Most sequences one request may ask for (OpenAI's own bound on n).
MAX_N = 128
# A logit_bias value is added to a logit: OpenAI's range, where -100 bans a token and +100 forces it.
MAX_LOGIT_BIAS = 100.0


class RequestOutputKind(enum.Enum):
    """Which outputs a request yields (vLLM's names). Building a cumulative output copies everything generated
    so far, O(length) per request per step, which the other two kinds avoid."""

    CUMULATIVE = "cumulative"  # every step: everything so far
    DELTA = "delta"  # every step: only what is new since the request's previous output
    FINAL_ONLY = "final_only"  # once, when the request ends: everything


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop; the names follow vLLM's.

    Processing order (same as Hugging Face's generate): logit_bias, penalties,
    then temperature, top-k, top-p, min-p. temperature == 0 means greedy.
    """

    # Independent sequences generated for the prompt, each a CompletionOutput (index 0..n-1) of one
    # RequestOutput. They share the prompt's KV blocks (docs/design.md, 'Several sequences per request');
    # with a seed, sequence i draws from seed + i.
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # Token id -> a value in [-100, 100] added to its logit before anything else changes the logits
    # (penalties, temperature, top-k, top-p, min-p), as OpenAI's logit_bias.
    logit_bias: dict[int, float] | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # False: outputs carry token ids only (text stays empty), which saves a share of the host's time per
    # token at large batches; stop strings then cannot be matched.
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # The output must match this grammar (a JSON schema, a regex, ...); a dict is read as
    # StructuredOutput(**dict). Validated when set: a spec xgrammar cannot parse is refused here.
    structured_output: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if isinstance(self.structured_output, dict):
            self.structured_output = StructuredOutput(**self.structured_output)
        elif self.structured_output is not None and not isinstance(self.structured_output, StructuredOutput):
            raise InvalidRequestError("structured_output", "must be a StructuredOutput (or a dict of its fields), "
                                      f"got {type(self.structured_output).__name__}")
        if not isinstance(self.output_kind, RequestOutputKind):
            kinds = {k.value: k for k in RequestOutputKind}
            if not isinstance(self.output_kind, str) or self.output_kind not in kinds:
                raise InvalidRequestError("output_kind", f"must be a RequestOutputKind or one of {sorted(kinds)}, "
                                          f"got {self.output_kind!r}")
            self.output_kind = kinds[self.output_kind]
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()
        self.logit_bias = _checked_logit_bias(self.logit_bias)

    def _validate(self) -> None:
        def bad(name: str, msg: str) -> None:
            raise InvalidRequestError(name, msg)

        if not isinstance(self.n, int) or isinstance(self.n, bool) or not 1 <= self.n <= MAX_N:
            bad("n", f"must be an integer in [1, {MAX_N}], got {self.n!r}")
        if not 0.0 <= self.temperature <= 100.0:
            bad("temperature", f"must be in [0, 100], got {self.temperature}; use 0 for greedy decoding")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"must be in (0, 1], got {self.top_p}; use 1 to disable")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", f"must be a non-negative integer, got {self.top_k!r}; use 0 (or -1) to disable")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"must be in [0, 1], got {self.min_p}; use 0 to disable")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            bad("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            bad("repetition_penalty", f"must be in (0, 10], got {self.repetition_penalty}; use 1 to disable")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", f"every stop string must be a non-empty string, got {self.stop!r}")
        if self.stop and not self.detokenize:
            bad("stop", "stop strings are matched in the output text, which detokenize=False turns off; "
                "use stop_token_ids, or detokenize=True")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", f"must be non-negative token ids, got {self.stop_token_ids!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed", f"must be an integer, got {self.seed!r}")
        if self.structured_output is not None and self.min_tokens:
            bad("min_tokens", "cannot be combined with structured_output: the grammar decides where the output "
                "may end; use min_tokens=0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


def _checked_logit_bias(bias) -> dict[int, float] | None:
    """The bias as {token id: float}, None when empty; an entry that is not a token id with a value in
    [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS] is refused by its key. Whether an id is in the model's vocabulary is
    checked when the engine admits the request."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise InvalidRequestError("logit_bias", f"must be a map of token id to bias, got {type(bias).__name__}")
    out = {}
    for key, value in bias.items():
        if not isinstance(key, int) or isinstance(key, bool) or key < 0:
            raise InvalidRequestError("logit_bias", f"key {key!r} is not a token id (a non-negative integer)")
        if (not isinstance(value, (int, float)) or isinstance(value, bool)
                or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS):
            raise InvalidRequestError("logit_bias", f"the bias of token {key} must be a number in "
                                      f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {value!r}")
        out[key] = float(value)
    return out or None
