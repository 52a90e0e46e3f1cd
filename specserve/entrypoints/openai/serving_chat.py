"""POST /v1/chat/completions: messages in, through the model's chat template, a reply out."""
from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

from fastapi import Request

from specserve.entrypoints.openai.chat_prompt import chat_prompt
from specserve.entrypoints.openai.errors import to_openai_error
from specserve.entrypoints.openai.logprobs import chat_logprobs
from specserve.entrypoints.openai.protocol import (ChatChoice, ChatCompletionRequest, ChatCompletionResponse,
                                                   ChatResponseMessage)
from specserve.entrypoints.openai.serving import ChunkWriter, OpenAIServing, Outputs, sse, usage
from specserve.errors import InvalidRequestError


async def create_chat_completion(serving: OpenAIServing, body: ChatCompletionRequest, request: Request):
    serving.check_model(body.model)
    try:
        params = body.to_sampling_params()
        prompt = await serving.engine.run_tokenizer(chat_prompt, body.messages)
    except InvalidRequestError as e:
        raise to_openai_error(e, body.param_name) from e
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    outputs = await serving.start(request, prompt, params, request_id, body.param_name)
    if body.stream:
        return sse(_chunks(serving, body, request_id, outputs))
    final = await serving.finish(request, outputs)
    choices = []
    for c in final.outputs:
        logprobs = None
        if body.logprobs:
            logprobs = chat_logprobs(serving.tokenizer, c.token_ids, c.logprobs, body.top_logprobs or 0)
        choices.append(ChatChoice(index=c.index, message=ChatResponseMessage(content=c.text), logprobs=logprobs,
                                  finish_reason=c.finish_reason))
    return ChatCompletionResponse(id=request_id, model=serving.model_name, choices=choices, usage=usage(final))


async def _chunks(serving: OpenAIServing, body: ChatCompletionRequest, request_id: str,
                  outputs: Outputs) -> AsyncIterator[bytes]:
    writer = ChunkWriter(request_id, "chat.completion.chunk", serving.model_name)
    # As OpenAI does, each choice's first chunk carries the role alone.
    for index in range(body.n or 1):
        yield writer.chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}])
    async for out in outputs:
        # Each sequence that advanced, with its new tokens since the previous output (RequestOutputKind.DELTA).
        for c in out.outputs:
            logprobs = None
            if body.logprobs:
                logprobs = chat_logprobs(serving.tokenizer, c.token_ids, c.logprobs, body.top_logprobs or 0)
            # Steps whose text is held back (a possible stop string, an unfinished character) send nothing.
            if c.text or c.finish_reason is not None or (logprobs and logprobs.content):
                yield writer.chunk([{"index": c.index, "delta": {"content": c.text},
                                     "logprobs": None if logprobs is None else logprobs.model_dump(),
                                     "finish_reason": c.finish_reason}])
    if body.include_usage:
        yield writer.chunk([], usage(out))
