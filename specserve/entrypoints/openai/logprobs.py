"""Engine logprobs (per token: {token id: Logprob}, the sampled token first, then the top-N by
rank) in OpenAI's two formats: the legacy completions one and the chat one."""
from __future__ import annotations

from specserve.entrypoints.openai.responses import ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob
from specserve.outputs import Logprob


def completion_logprobs(tokenizer, token_ids: list[int], entries: list[dict[int, Logprob]],
                        text_offset: int) -> tuple[CompletionLogprobs, int]:
    """Logprobs of these tokens, whose text starts at text_offset; returns them and the offset after."""
    out = CompletionLogprobs()
    for token_id, entry in zip(token_ids, entries):
        token = tokenizer.decode([token_id])
        out.tokens.append(token)
        out.token_logprobs.append(entry[token_id].logprob)
        # As in OpenAI's API, the sampled token is listed even when it is not in the top N.
        out.top_logprobs.append({tokenizer.decode([t]): lp.logprob for t, lp in entry.items()})
        out.text_offset.append(text_offset)
        text_offset += len(token)
    return out, text_offset


def chat_logprobs(tokenizer, token_ids: list[int], entries: list[dict[int, Logprob]], top_n: int) -> ChatLogprobs:
    def top(token_id: int, lp: Logprob) -> TopLogprob:
        token = tokenizer.decode([token_id])
        return TopLogprob(token=token, logprob=lp.logprob, bytes=list(token.encode()))

    content = []
    for token_id, entry in zip(token_ids, entries):
        ranked = sorted((lp.rank, t) for t, lp in entry.items() if lp.rank <= top_n)
        sampled = top(token_id, entry[token_id])
        content.append(TokenLogprob(**sampled.model_dump(), top_logprobs=[top(t, entry[t]) for _, t in ranked]))
    return ChatLogprobs(content=content)
