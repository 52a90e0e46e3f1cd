"""POST /v1/chat/completions: messages in, through the model's chat template, a reply out: text, or tool
calls read from the text by the server's tool-call parser (tool_calling.py)."""
from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

from fastapi import Request

from specserve.entrypoints.openai.chat_prompt import chat_prompt
from specserve.entrypoints.openai.errors import to_openai_error
from specserve.entrypoints.openai.logprobs import chat_logprobs
from specserve.entrypoints.openai.protocol import ChatCompletionRequest
from specserve.entrypoints.openai.responses import (ChatChoice, ChatCompletionResponse, ChatResponseMessage,
                                                    ResponseFunction, ResponseToolCall)
from specserve.entrypoints.openai.serving import ChunkWriter, OpenAIServing, Outputs, sse, usage
from specserve.entrypoints.openai.tool_calling import ToolPlan, plan_tools
from specserve.entrypoints.openai.tool_parsers.stream import ToolCallStream, new_call_id
from specserve.errors import InvalidRequestError


async def create_chat_completion(serving: OpenAIServing, body: ChatCompletionRequest, request: Request):
    serving.check_model(body.model)
    try:
        plan = plan_tools(body, serving.tool_calling)
        params = body.to_sampling_params(plan.forced_calls)
        prompt = await serving.engine.run_tokenizer(chat_prompt, body.messages, plan.tools, serving.chat_template,
                                                    body.add_generation_prompt, body.continue_final_message)
    except InvalidRequestError as e:
        raise to_openai_error(e, body.param_name) from e
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    outputs = await serving.start(request, prompt, params, request_id, body.param_name)
    if body.stream:
        return sse(_chunks(serving, body, plan, request_id, outputs))
    final = await serving.finish(request, outputs)
    choices = []
    for c in final.outputs:
        logprobs = None
        if body.logprobs:
            logprobs = chat_logprobs(serving.tokenizer, c.token_ids, c.logprobs, body.top_logprobs or 0)
        # Each choice is its own reply: its calls are read from its own text.
        message, finish_reason = _reply(plan, c.text, c.finish_reason)
        choices.append(ChatChoice(index=c.index, message=message, logprobs=logprobs, finish_reason=finish_reason))
    return ChatCompletionResponse(id=request_id, model=serving.model_name, choices=choices, usage=usage(final))


def _reply(plan: ToolPlan, text: str, finish_reason: str | None) -> tuple[ChatResponseMessage, str | None]:
    if plan.parser is None:
        return ChatResponseMessage(content=text), finish_reason
    parsed = plan.parser.parse(text, final=True)
    calls = [ResponseToolCall(id=new_call_id(), function=ResponseFunction(name=call.name, arguments=call.arguments))
             for call in parsed.calls[:plan.max_calls]]
    if not calls:
        return ChatResponseMessage(content=parsed.content), finish_reason
    return ChatResponseMessage(content=parsed.content or None, tool_calls=calls), _finish(finish_reason)


def _finish(reason: str | None) -> str | None:
    """A reply that made calls and ended by itself finished to have them run (OpenAI's "tool_calls")."""
    return "tool_calls" if reason == "stop" else reason


async def _chunks(serving: OpenAIServing, body: ChatCompletionRequest, plan: ToolPlan, request_id: str,
                  outputs: Outputs) -> AsyncIterator[bytes]:
    writer = ChunkWriter(request_id, "chat.completion.chunk", serving.model_name)
    num_choices = body.n or 1
    # Per choice: its calls, read from its own text as it streams.
    calls = [None if plan.parser is None else ToolCallStream(plan.parser, plan.max_calls) for _ in range(num_choices)]
    # As OpenAI does, each choice's first chunk carries the role alone.
    for index in range(num_choices):
        yield writer.chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}])
    async for out in outputs:
        # Each sequence that advanced, with its new tokens since the previous output (RequestOutputKind.DELTA).
        for c in out.outputs:
            logprobs = None
            if body.logprobs:
                logprobs = chat_logprobs(serving.tokenizer, c.token_ids, c.logprobs, body.top_logprobs or 0)
            finished = c.finish_reason is not None
            delta, finish_reason = {"content": c.text}, c.finish_reason
            choice_calls = calls[c.index]
            if choice_calls is not None:
                new = choice_calls.feed(c.text, finished)
                delta = {"content": new.content}
                if new.calls:
                    delta["tool_calls"] = [d.wire() for d in new.calls]
                if choice_calls.called:
                    finish_reason = _finish(finish_reason)
            # Steps whose text is held back (a possible stop string, an unfinished character, the start of what
            # may be a call) send nothing.
            if delta["content"] or "tool_calls" in delta or finished or (logprobs and logprobs.content):
                yield writer.chunk([{"index": c.index, "delta": delta,
                                     "logprobs": None if logprobs is None else logprobs.model_dump(),
                                     "finish_reason": finish_reason}])
    if body.include_usage:
        yield writer.chunk([], usage(out))
