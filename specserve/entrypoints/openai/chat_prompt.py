"""A chat's prompt token ids: its messages through the model's chat template, the people's text kept text.

A chat template marks turns with special tokens (`<|im_start|>`, `<|im_end|>`) that it writes as text, and
the tokenizer makes every occurrence of such text the special token. A message holding `<|im_end|>` would so
end its own turn, and what it wrote next could pass for another role's turn. Here only the template's
special tokens are special:

- the messages' strings (their calls' names and arguments too) and the tools' are rendered with each special
  token's text replaced by a placeholder, a private-use character that none of them holds, so that every
  special token's text in the rendering is the template's;
- the rendering is split at those, each becoming its token's id, and each stretch between them, its
  placeholders turned back into the text they stand for, is tokenized with `split_special_tokens=True`:
  the text `<|im_end|>` there becomes the ordinary tokens of that text.

A tokenizer also splits its input at special tokens and tokenizes the stretches between them apart, so the
template's tokens and the text between them come out as the tokenizer makes them; two things differ only in
the stretches, and only for tokenizers that chat models do not use: a pre-tokenizer that marks the start of
the whole input alone (Metaspace with prepend_scheme "first") sees each stretch as a start, and special
tokens with lstrip, rstrip or normalized set are matched here as written. Conversations whose strings hold no
special token's text (nearly all) skip all this and are tokenized as the tokenizer does.

/v1/completions takes its prompt as raw text, special tokens included, as vLLM and OpenAI's legacy
completions do: it is how a client that applies a template itself writes the template's tokens.
"""
from __future__ import annotations

import functools
import itertools
import re
from collections.abc import Callable
from dataclasses import dataclass

import jinja2

from specserve.entrypoints.openai.protocol import ChatMessage
from specserve.errors import InvalidRequestError

# Private-use code points (the BMP's area, then plane 15's), from which placeholders are taken.
_PRIVATE_USE = (range(0xE000, 0xF900), range(0xF0000, 0xFFFFE))


def chat_prompt(tokenizer, messages: list[ChatMessage], tools: list[dict] | None = None,
                template: str | None = None, add_generation_prompt: bool = True,
                continue_final_message: bool = False) -> list[int]:
    """The prompt's token ids; slow for long conversations, so the server runs it in its tokenizer thread.
    tools: as chat templates take them (OpenAI's function tools); template: the server's --chat-template, in
    place of the tokenizer's; add_generation_prompt: open the assistant's turn after the messages;
    continue_final_message: end the prompt inside the final message instead, for the model to continue it
    (transformers' apply_chat_template, as vLLM takes them)."""
    template = template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise InvalidRequestError("messages", "this model's tokenizer has no chat template; use /v1/completions, "
                                  "or start the server with --chat-template")
    if continue_final_message and add_generation_prompt:
        raise InvalidRequestError("continue_final_message", "leaves the final message open, and "
                                  "add_generation_prompt would open a new assistant turn after it; set "
                                  "add_generation_prompt to false")
    conversation = [m.for_template(i) for i, m in enumerate(messages)]
    _check_template_shows_tools(tokenizer, template, conversation, tools)
    render = functools.partial(_render, tokenizer, template=template, add_generation_prompt=add_generation_prompt,
                               continue_final_message=continue_final_message)
    specials = {t.content: i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    # Longest first, so that of two special tokens starting at one place the longer is taken, as tokenizers do.
    pattern = re.compile("(" + "|".join(map(re.escape, sorted(specials, key=len, reverse=True))) + ")")
    # Every string, dict keys included (a schema's property names, an argument's name); roles and the other
    # fixed keys hold no special token's text, so they pass unchanged.
    strings = list(_strings([conversation, tools]))
    found = sorted({s for text in strings for s in pattern.findall(text)}) if specials else []
    if not found:
        # The template writes the special tokens itself; the tokenizer must not add them again.
        return tokenizer.encode(render(conversation, tools), add_special_tokens=False)
    used = set().union(*strings)
    placeholders = dict(zip(found, (c for c in map(chr, itertools.chain(*_PRIVATE_USE)) if c not in used)))

    def escape(text: str) -> str:
        return pattern.sub(lambda m: placeholders[m.group()], text)

    unescape = str.maketrans({p: s for s, p in placeholders.items()})
    ids = []
    # Split by a pattern with one group: text, a special token, text, ..., text.
    for i, piece in enumerate(pattern.split(render(_map_strings(conversation, escape), _map_strings(tools, escape)))):
        if i % 2:
            ids.append(specials[piece])
        elif piece:
            ids += tokenizer.encode(piece.translate(unescape), add_special_tokens=False, split_special_tokens=True)
    return ids


def _render(tokenizer, conversation: list[dict], tools: list[dict] | None, template: str,
            add_generation_prompt: bool = True, continue_final_message: bool = False) -> str:
    try:
        return tokenizer.apply_chat_template(conversation, tools=tools, chat_template=template,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message, tokenize=False)
    except jinja2.TemplateError as e:
        raise InvalidRequestError("messages", f"the model's chat template rejected them: {e}") from e
    except ValueError as e:  # transformers: the final message cannot be left open (its text is not rendered)
        if not continue_final_message:
            raise
        raise InvalidRequestError("continue_final_message", f"cannot continue the final message: {e}") from e


def _strings(value):
    """Every string in a JSON-like value, dict keys included."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def _map_strings(value, fn: Callable[[str], str]):
    """value with fn applied to every string in it, dict keys included."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, dict):
        return {fn(k): _map_strings(v, fn) for k, v in value.items()}
    if isinstance(value, list):
        return [_map_strings(v, fn) for v in value]
    return value


@dataclass(frozen=True)
class _ToolSupport:
    """What a chat template shows the model of tool calling; a template that drops it (SmolLM2's, say) would
    have the model answer without seeing the tools or its own earlier calls."""

    tools: bool  # the `tools` it is given
    calls: bool  # an assistant message's tool_calls


# A probe conversation: names that no template writes by itself show whether it renders each part.
_PROBE_TOOLS = [{"type": "function", "function": {"name": "specserve_probe_tool", "description": "A probe.",
                                                  "parameters": {"type": "object", "properties": {}}}}]
_PROBE = [{"role": "user", "content": "Call the probe."},
          {"role": "assistant", "content": "", "tool_calls": [
              {"id": "call_probe", "type": "function", "function": {"name": "specserve_probe_call", "arguments": {}}}]},
          {"role": "tool", "tool_call_id": "call_probe", "content": "done"}]


@functools.lru_cache(maxsize=4)
def _tool_support(tokenizer, template: str) -> _ToolSupport:
    try:
        shown = _render(tokenizer, _PROBE, _PROBE_TOOLS, template)
    except InvalidRequestError:  # a template that cannot render a call and its result
        return _ToolSupport(False, False)
    return _ToolSupport("specserve_probe_tool" in shown, "specserve_probe_call" in shown)


def _check_template_shows_tools(tokenizer, template: str, conversation: list[dict], tools: list[dict] | None) -> None:
    calls = next((i for i, m in enumerate(conversation) if "tool_calls" in m), None)
    if tools is None and calls is None:
        return
    support = _tool_support(tokenizer, template)
    fix = ("start the server with --chat-template FILE, a template that renders tools and tool calls "
           "(the model's own tool-calling template)")
    if tools is not None and not support.tools:
        raise InvalidRequestError("tools", f"the chat template does not show tools to the model; {fix}")
    if calls is not None and not support.calls:
        raise InvalidRequestError(f"messages[{calls}].tool_calls", "the chat template does not show an assistant's "
                                  f"tool calls to the model; {fix}")
