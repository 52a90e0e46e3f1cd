"""The OpenAI wire format's requests: pydantic models of what clients send (responses.py holds the answers).

Requests only check types (and ranges that must hold before a value reaches a
tensor); the value checks live in SamplingParams so that the offline API and
the server reject the same things with the same messages. Every sampling field
is optional: null means "the default", as in OpenAI's API.
"""
from __future__ import annotations

import json
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from specserve.entrypoints.openai.structured_fields import ResponseFormat, StructuredOutputs
from specserve.entrypoints.openai.tool_fields import FunctionTool, MessageToolCall, ToolChoice
from specserve.entrypoints.openai.unicode_text import Text
from specserve.errors import InvalidRequestError
from specserve.sampling_params import RequestOutputKind, SamplingParams
from specserve.structured_output import StructuredOutput

# Bounds that keep integers inside the int64 tensors and generators they end up in.
TopK = Annotated[int, Field(ge=-1, lt=2**31)]
Seed = Annotated[int, Field(ge=-(2**63), lt=2**63)]
TokenId = Annotated[int, Field(ge=0, lt=2**31)]

# Fields OpenAI defines that this server does not implement yet. A request that sets one is refused with a
# message that says so (errors.py), never answered as if the field had been honoured.
NOT_SUPPORTED = frozenset({
    "functions", "function_call",  # the deprecated forms of tools and tool_choice
    "best_of", "suffix", "audio", "modalities", "prediction", "web_search_options",
    "reasoning_effort", "verbosity", "service_tier", "prompt_cache_key",
    "refusal",  # in messages
    "include_obfuscation",  # in stream_options
})
# Why some of them are refused, where the generic message would not say enough.
NOT_SUPPORTED_BECAUSE = {
    "best_of": "is not supported: it would generate best_of sequences and return the n most likely; use n, "
               "which returns every sequence it generates",
}
# Roles a message may have. "developer" is OpenAI's newer name for "system" and reaches the chat template as
# "system", as OpenAI maps it for models without a developer role; "tool" messages answer tool calls.
ROLES = ("system", "developer", "user", "assistant", "tool")


class _Request(BaseModel):
    """A field this server does not know is refused, by name (errors.py), rather than dropped unseen."""

    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingRequest(_Request):
    """The fields /v1/completions and /v1/chat/completions share."""

    model: Text
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: Text | list[Text] | None = None
    seed: Seed | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Token id (a JSON object's key is a string) -> bias. Keys are checked in _logit_bias and values in
    # SamplingParams, so that an error names the key it is about.
    logit_bias: dict[Text, object] | None = None
    # Extensions, as in vLLM.
    top_k: TopK | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    # Accepted, and without effect, as OpenAI documents them: `user` and `safety_identifier` identify the end
    # user for OpenAI's abuse monitoring and `metadata` tags stored completions; neither changes an answer,
    # and this server monitors and stores nothing. `store: true` asks for the completion to be kept, which
    # this server cannot do, so only false passes.
    user: Text | None = None
    safety_identifier: Text | None = None
    metadata: dict[Text, Text] | None = None
    store: bool | None = None
    # vLLM's grammar-constrained decoding: json, json_object, regex, choice or grammar.
    structured_outputs: StructuredOutputs | None = None

    @field_validator("store")
    @classmethod
    def _stores_nothing(cls, store: bool | None) -> bool | None:
        if store:
            raise PydanticCustomError("unsupported_value", "this server does not store completions; remove store "
                                      "or set it to false")
        return store

    def param_name(self, engine_field: str) -> str:
        """An engine field (as InvalidRequestError names it) under this endpoint's parameter name."""
        return engine_field

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _structured_output(self) -> StructuredOutput | None:
        return None if self.structured_outputs is None else self.structured_outputs.structured_output()

    def _logit_bias(self) -> dict[int, float] | None:
        """logit_bias with its keys read as token ids."""
        if self.logit_bias is None:
            return None
        for key in self.logit_bias:
            if not (key.isascii() and key.isdigit()):
                raise InvalidRequestError("logit_bias", f"key {key!r} is not a token id; keys are token ids "
                                          'written as strings of digits, such as "50256"')
        return {int(key): value for key, value in self.logit_bias.items()}

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None,
                         structured_output: StructuredOutput | None) -> SamplingParams:
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options", "is only allowed when stream is true; remove it or stream")
        given = dict(n=self.n, logit_bias=self._logit_bias(), temperature=self.temperature, top_p=self.top_p,
                     stop=self.stop, seed=self.seed,
                     presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                     top_k=self.top_k, min_p=self.min_p, repetition_penalty=self.repetition_penalty,
                     min_tokens=self.min_tokens, ignore_eos=self.ignore_eos, stop_token_ids=self.stop_token_ids,
                     include_stop_str_in_output=self.include_stop_str_in_output,
                     skip_special_tokens=self.skip_special_tokens, structured_output=structured_output)
        # A stream sends what is new at each step; a whole answer needs only the end.
        kind = RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, output_kind=kind,
                              **{k: v for k, v in given.items() if v is not None})


# What a completion prompt's list may hold, by the JSON values' Python types, as its error names them.
_PROMPT_KINDS = {int: "a token id", str: "a text", list: "a list of token ids"}


class CompletionRequest(_SamplingRequest):
    # A text, token ids, or a batch of either (OpenAI's array forms): each prompt of a batch is a request of its
    # own, and its choices come at indices prompt * n + 0 .. n - 1.
    prompt: Text | list[int] | list[Text] | list[list[int]]
    logprobs: int | None = None
    # Each choice's text starts with its prompt's (token ids: their decoded text).
    echo: bool = False
    # Only equal to n, which returns every sequence it generates, as n alone does (NOT_SUPPORTED_BECAUSE).
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_kind_of_prompt(cls, prompt):
        """A list mixing texts, token ids and token-id lists is refused as such (pydantic's error for the union
        would name one of its members' complaints about one element)."""
        if not isinstance(prompt, list):
            return prompt
        kinds = [_PROMPT_KINDS.get(type(x)) for x in prompt]
        if None not in kinds and len(set(kinds)) > 1:
            j = next(j for j, kind in enumerate(kinds) if kind != kinds[0])
            raise PydanticCustomError(
                "mixed_prompt", "mixes {first} (prompt[0]) with {other} (prompt[{j}]); give one text, a list of "
                "token ids, a list of texts or a list of token-id lists", {"first": kinds[0], "other": kinds[j], "j": j})
        return prompt

    @property
    def is_batch(self) -> bool:
        """A list of texts or of token-id lists (an empty list is one prompt of no token ids, which the engine
        refuses)."""
        p = self.prompt
        return isinstance(p, list) and bool(p) and not isinstance(p[0], int)

    @property
    def prompts(self) -> list[str | list[int]]:
        return list(self.prompt) if self.is_batch else [self.prompt]

    def param_name(self, engine_field: str) -> str:
        return "prompt" if engine_field == "prompt_token_ids" else engine_field

    def prompt_param_name(self, index: int):
        """param_name for the engine's errors about prompt `index`: in a batch, the prompt's place in it."""
        if not self.is_batch:
            return self.param_name
        return lambda field: f"prompt[{index}]" if field in ("prompt", "prompt_token_ids") else field

    def to_sampling_params(self) -> SamplingParams:
        n = 1 if self.n is None else self.n
        if self.echo and self.logprobs is not None:
            raise InvalidRequestError("echo", "with logprobs would need the prompt's logprobs, which this server does "
                                      "not compute; ask for echo or for logprobs")
        if self.best_of is not None and self.best_of != n:
            raise InvalidRequestError("best_of", f"{NOT_SUPPORTED_BECAUSE['best_of']}; best_of equal to n is "
                                      f"accepted, got best_of={self.best_of} and n={n}")
        # OpenAI's default for completions is 16 tokens.
        return self._sampling_params(16 if self.max_tokens is None else self.max_tokens, self.logprobs,
                                     self._structured_output())


class ContentPart(BaseModel):
    """A part of a message's content. Each type of part has fields of its own (image_url, input_audio, file):
    they are allowed here and refused by ChatMessage.text, which takes text parts only."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: Text | None = None


class ChatMessage(_Request):
    role: str
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls
    tool_call_id: Text | None = None  # the call a tool message answers

    @field_validator("role")
    @classmethod
    def _known_role(cls, role: str) -> str:
        if role not in ROLES:
            raise PydanticCustomError("unknown_role", "must be one of {roles}, got {role}",
                                      {"roles": ", ".join(ROLES), "role": repr(role)})
        return role

    def for_template(self, index: int) -> dict:
        """The message as chat templates take it (transformers' shape); `name` is passed on for the templates
        that show it. A call's arguments go as the object they encode, which is what templates write out."""
        if self.tool_calls is not None and self.role != "assistant":
            raise InvalidRequestError(f"messages[{index}].tool_calls", f"only assistant messages make tool calls, "
                                      f"not {self.role} messages; remove tool_calls or make the role assistant")
        if self.role == "tool" and self.tool_call_id is None:
            raise InvalidRequestError(f"messages[{index}].tool_call_id", "a tool message needs it: give the id of "
                                      "the tool call whose result the message holds")
        if self.role != "tool" and self.tool_call_id is not None:
            raise InvalidRequestError(f"messages[{index}].tool_call_id", f"only tool messages answer a call, not "
                                      f"{self.role} messages; remove it")
        message = {"role": "system" if self.role == "developer" else self.role, "content": self.text(index)}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:  # an empty list (as some clients send a reply back) is no call
            message["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name,
                              "arguments": _arguments(c.function.arguments,
                                                      f"messages[{index}].tool_calls[{j}].function.arguments")}}
                for j, c in enumerate(self.tool_calls)]
        return message

    def text(self, index: int) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        for j, p in enumerate(self.content):
            if p.type != "text":
                raise InvalidRequestError(f"messages[{index}].content[{j}]",
                                          f"only text parts are supported, got a part of type {p.type!r}")
            if p.text is None:
                raise InvalidRequestError(f"messages[{index}].content[{j}].text", "a text part needs its text")
            if p.model_extra:
                raise InvalidRequestError(f"messages[{index}].content[{j}].{next(iter(p.model_extra))}",
                                          "is not a field of a text part; a text part has only type and text")
        return "".join(p.text for p in self.content)


def _arguments(text: str, field: str) -> dict:
    try:
        arguments = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidRequestError(field, f"is not valid JSON ({e}); give the call's arguments as a JSON object, "
                                  "as the model wrote them") from None
    if not isinstance(arguments, dict):
        raise InvalidRequestError(field, f"must be a JSON object, got {type(arguments).__name__}")
    return arguments


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    # Tool calling (tool_calling.py): tool_choice is "auto" when tools are given and it is not.
    tools: list[FunctionTool] | None = Field(default=None, min_length=1)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's extensions to the chat template: the assistant's turn opened after the messages (the template's
    # generation prompt), or else the final message left open for the model to continue (a reply's start given
    # by the client).
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def _structured_output(self) -> StructuredOutput | None:
        if self.response_format is not None and self.structured_outputs is not None:
            raise InvalidRequestError("response_format", "cannot be combined with structured_outputs; give one")
        if self.response_format is not None:
            return self.response_format.structured_output()
        return super()._structured_output()

    def param_name(self, engine_field: str) -> str:
        if engine_field == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        if engine_field == "structured_output" and self.tools and self.tool_choice not in (None, "none", "auto"):
            return "tool_choice"  # its grammar is the request's structured output (tool_calling.py)
        return {"prompt": "messages", "logprobs": "top_logprobs"}.get(engine_field, engine_field)

    def to_sampling_params(self, forced_calls: StructuredOutput | None = None) -> SamplingParams:
        """forced_calls: the grammar of the tool calls tool_choice requires (tool_calling.py), which takes the
        place of response_format and structured_outputs (never given with it)."""
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs", "needs logprobs set to true")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        # No limit by default: a chat reply runs until it stops or fills the context.
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._sampling_params(max_tokens, logprobs, forced_calls or self._structured_output())
