"""A chat's prompt token ids: its messages through the model's chat template, the people's text kept text.

A chat template marks turns with special tokens (`<|im_start|>`, `<|im_end|>`) that it writes as text, and
the tokenizer makes every occurrence of such text the special token. A message holding `<|im_end|>` would so
end its own turn, and what it wrote next could pass for another role's turn. Here only the template's
special tokens are special:

- the messages' strings are rendered with each special token's text replaced by a placeholder, a
  private-use character that none of them holds, so that every special token's text in the rendering is
  the template's;
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

import itertools
import re

import jinja2

from specserve.entrypoints.openai.protocol import ChatMessage
from specserve.errors import InvalidRequestError

# Private-use code points (the BMP's area, then plane 15's), from which placeholders are taken.
_PRIVATE_USE = (range(0xE000, 0xF900), range(0xF0000, 0xFFFFE))


def chat_prompt(tokenizer, messages: list[ChatMessage]) -> list[int]:
    """The prompt's token ids; slow for long conversations, so the server runs it in its tokenizer thread."""
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError("messages", "this model's tokenizer has no chat template; use /v1/completions")
    conversation = [m.for_template(i) for i, m in enumerate(messages)]
    specials = {t.content: i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    # Longest first, so that of two special tokens starting at one place the longer is taken, as tokenizers do.
    pattern = re.compile("(" + "|".join(map(re.escape, sorted(specials, key=len, reverse=True))) + ")")
    strings = [v for m in conversation for k, v in m.items() if k != "role"]
    found = sorted({s for text in strings for s in pattern.findall(text)}) if specials else []
    if not found:
        # The template writes the special tokens itself; the tokenizer must not add them again.
        return tokenizer.encode(_render(tokenizer, conversation), add_special_tokens=False)
    used = set().union(*strings)
    placeholders = dict(zip(found, (c for c in map(chr, itertools.chain(*_PRIVATE_USE)) if c not in used)))
    escaped = [{k: v if k == "role" else pattern.sub(lambda m: placeholders[m.group()], v) for k, v in m.items()}
               for m in conversation]
    unescape = str.maketrans({p: s for s, p in placeholders.items()})
    ids = []
    # Split by a pattern with one group: text, a special token, text, ..., text.
    for i, piece in enumerate(pattern.split(_render(tokenizer, escaped))):
        if i % 2:
            ids.append(specials[piece])
        elif piece:
            ids += tokenizer.encode(piece.translate(unescape), add_special_tokens=False, split_special_tokens=True)
    return ids


def _render(tokenizer, conversation: list[dict[str, str]]) -> str:
    try:
        return tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    except jinja2.TemplateError as e:
        raise InvalidRequestError("messages", f"the model's chat template rejected them: {e}") from e
