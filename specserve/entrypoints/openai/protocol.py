"""The OpenAI wire format: pydantic models of requests and responses.

Requests only check types (and ranges that must hold before a value reaches a
tensor); the value checks live in SamplingParams so that the offline API and
the server reject the same things with the same messages. Every sampling field
is optional: null means "the default", as in OpenAI's API.
"""
from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import BaseModel, Field

from specserve.errors import InvalidRequestError
from specserve.sampling_params import RequestOutputKind, SamplingParams

# Bounds that keep integers inside the int64 tensors and generators they end up in.
TopK = Annotated[int, Field(ge=-1, lt=2**31)]
Seed = Annotated[int, Field(ge=-(2**63), lt=2**63)]


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingRequest(BaseModel):
    """The fields /v1/completions and /v1/chat/completions share."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    seed: Seed | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Extensions, as in vLLM.
    top_k: TopK | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None

    def param_name(self, engine_field: str) -> str:
        """An engine field (as InvalidRequestError names it) under this endpoint's parameter name."""
        return engine_field

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        if self.n not in (None, 1):
            raise InvalidRequestError("n", f"only n=1 is supported, got {self.n}; send separate requests instead")
        given = dict(temperature=self.temperature, top_p=self.top_p, stop=self.stop, seed=self.seed,
                     presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                     top_k=self.top_k, min_p=self.min_p, repetition_penalty=self.repetition_penalty,
                     min_tokens=self.min_tokens, ignore_eos=self.ignore_eos)
        # A stream sends what is new at each step; a whole answer needs only the end.
        kind = RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, output_kind=kind,
                              **{k: v for k, v in given.items() if v is not None})


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int]
    logprobs: int | None = None

    def param_name(self, engine_field: str) -> str:
        return "prompt" if engine_field == "prompt_token_ids" else engine_field

    def to_sampling_params(self) -> SamplingParams:
        # OpenAI's default for completions is 16 tokens.
        return self._sampling_params(16 if self.max_tokens is None else self.max_tokens, self.logprobs)


class ContentPart(BaseModel):
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self, index: int) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        bad = [p.type for p in self.content if p.type != "text" or p.text is None]
        if bad:
            raise InvalidRequestError(f"messages[{index}].content", f"only text parts are supported, got {bad}")
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None

    def param_name(self, engine_field: str) -> str:
        if engine_field == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return {"prompt": "messages", "logprobs": "top_logprobs"}.get(engine_field, engine_field)

    def to_sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs", "needs logprobs set to true")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        # No limit by default: a chat reply runs until it stops or fills the context.
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._sampling_params(max_tokens, logprobs)


# ---- responses ----------------------------------------------------------------------------


def _now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    """Both the whole answer and, streamed, each chunk of it (OpenAI uses one shape for both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "specserve"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
