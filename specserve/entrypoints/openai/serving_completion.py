"""POST /v1/completions: a prompt (text or token ids) in, its continuation out."""
from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

from fastapi import Request

from specserve.entrypoints.openai.errors import to_openai_error
from specserve.entrypoints.openai.logprobs import completion_logprobs
from specserve.entrypoints.openai.protocol import CompletionChoice, CompletionRequest, CompletionResponse
from specserve.entrypoints.openai.serving import ChunkWriter, OpenAIServing, Outputs, sse, usage
from specserve.errors import InvalidRequestError


async def create_completion(serving: OpenAIServing, body: CompletionRequest, request: Request):
    serving.check_model(body.model)
    try:
        params = body.to_sampling_params()
    except InvalidRequestError as e:
        raise to_openai_error(e, body.param_name) from e
    request_id = f"cmpl-{uuid.uuid4().hex}"
    outputs = await serving.start(request, body.prompt, params, request_id, body.param_name)
    if body.stream:
        return sse(_chunks(serving, body, request_id, outputs))
    final = await serving.finish(request, outputs)
    choices = []
    for c in final.outputs:
        logprobs = None
        if body.logprobs is not None:
            logprobs, _ = completion_logprobs(serving.tokenizer, c.token_ids, c.logprobs, 0)
        choices.append(CompletionChoice(index=c.index, text=c.text, logprobs=logprobs, finish_reason=c.finish_reason))
    return CompletionResponse(id=request_id, model=serving.model_name, choices=choices, usage=usage(final))


async def _chunks(serving: OpenAIServing, body: CompletionRequest, request_id: str,
                  outputs: Outputs) -> AsyncIterator[bytes]:
    writer = ChunkWriter(request_id, "text_completion", serving.model_name)
    text_offsets = [0] * (body.n or 1)  # per choice: where the text of the tokens whose logprobs went out ends
    async for out in outputs:
        # Each sequence that advanced, with its new tokens since the previous output (RequestOutputKind.DELTA).
        for c in out.outputs:
            logprobs = None
            if body.logprobs is not None:
                logprobs, text_offsets[c.index] = completion_logprobs(serving.tokenizer, c.token_ids, c.logprobs,
                                                                      text_offsets[c.index])
            # Steps whose text is held back (a possible stop string, an unfinished character) send nothing.
            if c.text or c.finish_reason is not None or (logprobs and logprobs.tokens):
                yield writer.chunk([{"index": c.index, "text": c.text,
                                     "logprobs": None if logprobs is None else logprobs.model_dump(),
                                     "finish_reason": c.finish_reason}])
    if body.include_usage:
        yield writer.chunk([], usage(out))
