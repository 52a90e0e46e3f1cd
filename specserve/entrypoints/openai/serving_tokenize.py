"""POST /tokenize and /detokenize (vLLM's): the token ids the generation endpoints would run for a prompt or a
chat, so that a client can count and budget them, and the text of token ids."""
from __future__ import annotations

from specserve.engine.async_llm import encode_prompt
from specserve.entrypoints.openai.chat_prompt import chat_prompt
from specserve.entrypoints.openai.errors import to_openai_error
from specserve.entrypoints.openai.serving import OpenAIServing
from specserve.entrypoints.openai.tokenize_fields import (DetokenizeRequest, DetokenizeResponse, TokenizeRequest,
                                                          TokenizeResponse)
from specserve.errors import InvalidRequestError


async def tokenize(serving: OpenAIServing, body: TokenizeRequest) -> TokenizeResponse:
    if body.model is not None:
        serving.check_model(body.model)
    engine = serving.engine
    try:
        if body.prompt is not None:
            ids = await engine.run_tokenizer(encode_prompt, body.prompt)
        else:
            ids = await engine.run_tokenizer(chat_prompt, body.messages, None, serving.chat_template,
                                             body.add_generation_prompt, body.continue_final_message)
    except InvalidRequestError as e:
        raise to_openai_error(e) from e
    strs = serving.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len, tokens=ids, token_strs=strs)


async def detokenize(serving: OpenAIServing, body: DetokenizeRequest) -> DetokenizeResponse:
    if body.model is not None:
        serving.check_model(body.model)
    size = len(serving.tokenizer)
    outside = next((i for i, t in enumerate(body.tokens) if t >= size), None)
    if outside is not None:
        raise to_openai_error(InvalidRequestError(
            f"tokens[{outside}]", f"{body.tokens[outside]} is not a token id of this model's tokenizer "
            f"({size} tokens)"))
    return DetokenizeResponse(prompt=serving.tokenizer.decode(body.tokens))
