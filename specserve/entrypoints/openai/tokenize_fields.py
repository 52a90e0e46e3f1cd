"""The bodies of vLLM's /tokenize and /detokenize: a prompt or a chat's messages to token ids, and token ids to
text, as the generation endpoints make and read them. Types only; serving_tokenize.py answers them."""
from __future__ import annotations

from pydantic import BaseModel, Field, model_validator
from pydantic_core import PydanticCustomError

from specserve.entrypoints.openai.protocol import ChatMessage, TokenId, _Request
from specserve.entrypoints.openai.unicode_text import Text


class TokenizeRequest(_Request):
    """A prompt, tokenized as /v1/completions tokenizes it, or messages, rendered and tokenized as
    /v1/chat/completions does (with its template options): one of the two."""

    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise PydanticCustomError("prompt_or_messages", "give either prompt (as /v1/completions takes it) or "
                                      "messages (as /v1/chat/completions takes them), not {what}",
                                      {"what": "both" if self.prompt is not None else "neither"})
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: Text | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str
