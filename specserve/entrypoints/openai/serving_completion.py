"""POST /v1/completions: a prompt (text or token ids), or a batch of them, in; each one's continuation out.

A batch's prompts run as requests of their own, all admitted or none (a refused prompt aborts the others and is
named, prompt[i]); prompt i's n choices are indices i * n .. i * n + n - 1, as in OpenAI's API, and the usage
counts every prompt's tokens.
"""
from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator

from fastapi import Request

from specserve.entrypoints.openai.errors import to_openai_error
from specserve.entrypoints.openai.logprobs import completion_logprobs
from specserve.entrypoints.openai.protocol import CompletionRequest
from specserve.entrypoints.openai.responses import CompletionChoice, CompletionResponse
from specserve.entrypoints.openai.serving import ChunkWriter, OpenAIServing, Outputs, all_or_none, merged, sse, usage
from specserve.errors import InvalidRequestError
from specserve.outputs import RequestOutput


async def create_completion(serving: OpenAIServing, body: CompletionRequest, request: Request):
    serving.check_model(body.model)
    try:
        params = body.to_sampling_params()
    except InvalidRequestError as e:
        raise to_openai_error(e, body.param_name) from e
    prompts = body.prompts
    waiting = len(prompts) * params.n
    if len(prompts) > 1 and waiting > serving.engine.max_waiting:
        # Each sequence waits for admission as a request of its own (as AsyncLLM.generate checks n alone).
        raise to_openai_error(InvalidRequestError(
            "prompt", f"holds {len(prompts)} prompts of {params.n} sequences each, {waiting} requests, but at most "
            f"{serving.engine.max_waiting} may wait (the server's --max-waiting); send fewer at a time"))
    request_id = f"cmpl-{uuid.uuid4().hex}"
    request_ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
    streams = await serving.start_batch(request, prompts, params, request_ids,
                                        [body.prompt_param_name(i) for i in range(len(prompts))])
    if body.stream:
        return sse(_chunks(serving, body, request_id, streams))
    finals = await all_or_none([serving.finish(request, outputs) for outputs in streams])
    n, choices = params.n, []
    for i, final in enumerate(finals):
        echoed = _echo(serving, body, final)
        for c in final.outputs:
            logprobs = None
            if body.logprobs is not None:
                logprobs, _ = completion_logprobs(serving.tokenizer, c.token_ids, c.logprobs, 0)
            choices.append(CompletionChoice(index=i * n + c.index, text=echoed + c.text, logprobs=logprobs,
                                            finish_reason=c.finish_reason))
    return CompletionResponse(id=request_id, model=serving.model_name, choices=choices, usage=usage(*finals))


async def _chunks(serving: OpenAIServing, body: CompletionRequest, request_id: str,
                  streams: list[Outputs]) -> AsyncIterator[bytes]:
    writer = ChunkWriter(request_id, "text_completion", serving.model_name)
    n = body.n or 1
    text_offsets = [0] * (n * len(streams))  # per choice: where the text of the tokens whose logprobs went out ends
    last = [None] * len(streams)  # each prompt's latest output, whose counts are its request's so far
    async with contextlib.aclosing(merged(streams)) as outputs:
        async for i, out in outputs:
            if last[i] is None and body.echo:  # each choice's first chunk: its prompt's text
                echoed = _echo(serving, body, out)
                yield writer.chunk([{"index": i * n + j, "text": echoed, "logprobs": None, "finish_reason": None}
                                    for j in range(n)])
            last[i] = out
            # Each sequence that advanced, with its new tokens since the previous output (RequestOutputKind.DELTA).
            for c in out.outputs:
                index = i * n + c.index
                logprobs = None
                if body.logprobs is not None:
                    logprobs, text_offsets[index] = completion_logprobs(serving.tokenizer, c.token_ids, c.logprobs,
                                                                        text_offsets[index])
                # Steps whose text is held back (a possible stop string, an unfinished character) send nothing.
                if c.text or c.finish_reason is not None or (logprobs and logprobs.tokens):
                    yield writer.chunk([{"index": index, "text": c.text,
                                         "logprobs": None if logprobs is None else logprobs.model_dump(),
                                         "finish_reason": c.finish_reason}])
    if body.include_usage:
        yield writer.chunk([], usage(*last))


def _echo(serving: OpenAIServing, body: CompletionRequest, out: RequestOutput) -> str:
    """What echo puts before a prompt's choices: the prompt's text, or its token ids' decoding."""
    if not body.echo:
        return ""
    return out.prompt if out.prompt is not None else serving.tokenizer.decode(out.prompt_token_ids)
