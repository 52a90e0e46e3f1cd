"""Prompt files in every supported shape, and a clear error for each kind of bad line."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from specserve.errors import PromptFileError
from specserve.prompt_files import Dialogue, load_dialogues, load_prompt_file

MT_BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "mt_bench.jsonl"


def write(tmp_path, *rows) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_every_shape_becomes_the_conversation_up_to_its_first_user_turn(tmp_path):
    path = write(
        tmp_path,
        {"prompt": "Explain rainbows."},
        {"question_id": 81, "category": "writing", "turns": ["Write a haiku.", "Now another."]},
        {"id": "x", "conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi?"},
                                      {"from": "gpt", "value": "Hello."}, {"from": "human", "value": "More"}]},
        {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]},
        "",
    )
    assert load_prompt_file(path) == [
        [{"role": "user", "content": "Explain rainbows."}],
        [{"role": "user", "content": "Write a haiku."}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}],
        [{"role": "user", "content": "2+2?"}],
    ]
    assert len(load_prompt_file(path, limit=2)) == 2


def test_dialogues_keep_the_users_later_turns_and_drop_the_files_answers(tmp_path):
    path = write(
        tmp_path,
        {"prompt": "Explain rainbows."},
        {"turns": ["Write a haiku.", "Now another.", "Rhyme it."]},
        {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi?"},
                           {"from": "gpt", "value": "Hello."}, {"from": "human", "value": "More"}]},
        {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]},
    )
    assert load_dialogues(path) == [
        Dialogue([{"role": "user", "content": "Explain rainbows."}]),
        Dialogue([{"role": "user", "content": "Write a haiku."}], ("Now another.", "Rhyme it.")),
        Dialogue([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}], ("More",)),
        Dialogue([{"role": "user", "content": "2+2?"}]),
    ]


@pytest.mark.skipif(not MT_BENCH.is_file(), reason="shared/data/mt_bench.jsonl is not beside the repo")
def test_mt_bench_first_turns():
    conversations = load_prompt_file(MT_BENCH)
    rows = [json.loads(line) for line in MT_BENCH.read_text().splitlines() if line.strip()]
    assert conversations == [[{"role": "user", "content": r["turns"][0]}] for r in rows]


@pytest.mark.parametrize("row,message", [
    ('{"prompt": "a"', r"prompts.jsonl:2: not valid JSON"),
    ('["a list"]', r":2: expected a JSON object, got list"),
    ({"promt": "typo"}, r":2: has fields \['promt'\]; give exactly one prompt field of: 'prompt'"),
    ({"prompt": "a", "turns": ["b"]}, r":2: has both 'prompt' and 'turns'"),
    ({"prompt": "  "}, r":2: 'prompt' must be a non-empty string"),
    ({"prompt": 3}, r":2: 'prompt' must be a non-empty string"),
    ({"turns": []}, r":2: 'turns' must be a non-empty list"),
    ({"turns": ["a", ""]}, r":2: 'turns\[1\]' must be a non-empty string"),
    ({"conversations": [{"from": "robot", "value": "x"}]}, r":2: conversations\[0\] has unknown from 'robot'"),
    ({"conversations": [{"from": "gpt", "value": "only an answer"}]}, r":2: 'conversations' has no user turn"),
    ({"messages": [{"role": "user"}]}, r":2: messages\[0\] must be an object with 'role' and 'content'"),
])
def test_bad_lines_name_file_line_and_fix(tmp_path, row, message):
    path = write(tmp_path, {"prompt": "fine"}, row)
    with pytest.raises(PromptFileError, match=message):
        load_prompt_file(path)


def test_missing_empty_and_directory(tmp_path):
    with pytest.raises(PromptFileError, match="nope.jsonl: no such file; give a JSONL file"):
        load_prompt_file(tmp_path / "nope.jsonl")
    with pytest.raises(PromptFileError, match="a directory"):
        load_prompt_file(tmp_path)
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(PromptFileError, match="holds no prompts"):
        load_prompt_file(tmp_path / "empty.jsonl")
