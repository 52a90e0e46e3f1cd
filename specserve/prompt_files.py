"""Prompt files: JSONL with one prompt per line, in any of the common shapes.

    {"prompt": "..."}                                         plain prompts
    {"question_id": 81, "category": "...", "turns": [...]}    MT-bench (first turn)
    {"conversations": [{"from": "human", "value": "..."}]}    ShareGPT (first human turn)
    {"messages": [{"role": "user", "content": "..."}]}        OpenAI chat (first user turn)

Each line becomes a conversation ending at its first user turn (a system
message before it is kept): acceptance and training data are about how the
model answers a fresh request, and later turns would need the model's own
earlier answers, which a file written by another model does not hold.
load_dialogues also keeps the user's later turns (MT-bench's second turn, a
chat's later user messages; the file's own assistant turns are dropped), for
a caller that plays them after the model's own answers.
Other fields (ids, categories) are ignored.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from specserve.errors import PromptFileError

PROMPT_FIELDS = {
    "prompt": "a string",
    "turns": "a list of strings (MT-bench)",
    "conversations": 'a list of {"from", "value"} turns (ShareGPT)',
    "messages": 'a list of {"role", "content"} messages (OpenAI chat)',
}
_SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                   "chatgpt": "assistant", "bard": "assistant", "bing": "assistant"}


@dataclass(frozen=True)
class Dialogue:
    """One line of a prompt file: the conversation up to its first user turn, and the user's later turns."""

    opening: list[dict]
    later_turns: tuple[str, ...] = ()


def load_prompt_file(path: str | Path, limit: int | None = None) -> list[list[dict]]:
    """The conversations of a JSONL prompt file, at most `limit` of them, in file order."""
    return [d.opening for d in load_dialogues(path, limit)]


def load_dialogues(path: str | Path, limit: int | None = None) -> list[Dialogue]:
    """The dialogues of a JSONL prompt file, at most `limit` of them, in file order."""
    path = Path(path).expanduser()
    if not path.is_file():
        what = "a directory" if path.is_dir() else "no such file"
        raise PromptFileError(f"{path}: {what}; give a JSONL file with one prompt per line, e.g. "
                              '{"prompt": "Explain rainbows."}')
    conversations = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if limit is not None and len(conversations) >= limit:
                break
            if line.strip():
                conversations.append(_parse_line(line, f"{path}:{number}"))
    if not conversations:
        raise PromptFileError(f"{path}: holds no prompts; give one JSON object per line")
    return conversations


def _parse_line(line: str, where: str) -> Dialogue:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise PromptFileError(f"{where}: not valid JSON ({e.msg} at column {e.colno}); "
                              "each line must be one complete JSON object") from e
    if not isinstance(row, dict):
        raise PromptFileError(f"{where}: expected a JSON object, got {type(row).__name__}")
    present = [k for k in PROMPT_FIELDS if k in row]
    if len(present) != 1:
        expected = "; ".join(f"{k!r}: {v}" for k, v in PROMPT_FIELDS.items())
        found = f"both {present[0]!r} and {present[1]!r}" if present else f"fields {sorted(row)}"
        raise PromptFileError(f"{where}: has {found}; give exactly one prompt field of: {expected}")
    key = present[0]
    value = row[key]
    if key == "prompt":
        return Dialogue([{"role": "user", "content": _text(value, where, "prompt")}])
    if key == "turns":
        if not isinstance(value, list) or not value:
            raise PromptFileError(f"{where}: 'turns' must be a non-empty list of strings")
        texts = [_text(t, where, f"turns[{i}]") for i, t in enumerate(value)]
        return Dialogue([{"role": "user", "content": texts[0]}], tuple(texts[1:]))
    if key == "conversations":
        return _dialogue(value, where, key, "from", "value", _SHAREGPT_ROLES)
    return _dialogue(value, where, key, "role", "content", {r: r for r in ("system", "user", "assistant")})


def _text(value, where: str, field: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise PromptFileError(f"{where}: {field!r} must be a non-empty string, got {value!r:.60}")
    return value


def _dialogue(turns, where: str, key: str, role_key: str, text_key: str, roles: dict) -> Dialogue:
    if not isinstance(turns, list):
        raise PromptFileError(f"{where}: {key!r} must be a list of turns")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or role_key not in turn or text_key not in turn:
            raise PromptFileError(f"{where}: {key}[{i}] must be an object with {role_key!r} and {text_key!r}")
        role = roles.get(turn[role_key])
        if role is None:
            raise PromptFileError(f"{where}: {key}[{i}] has unknown {role_key} {turn[role_key]!r}; "
                                  f"known: {', '.join(sorted(roles))}")
        messages.append({"role": role, "content": _text(turn[text_key], where, f"{key}[{i}].{text_key}")})
    first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
    if first_user is None:
        raise PromptFileError(f"{where}: {key!r} has no user turn to answer")
    later = tuple(m["content"] for m in messages[first_user + 1:] if m["role"] == "user")
    return Dialogue(messages[:first_user + 1], later)


def prompt_token_ids(llm, messages: list[dict]) -> list[int]:
    """The prompt a conversation makes: through the chat template for chat models, the plain text otherwise."""
    if getattr(llm.tokenizer, "chat_template", None):
        return llm.apply_chat_template(messages)
    return llm.engine.tokenize("\n\n".join(m["content"] for m in messages))
