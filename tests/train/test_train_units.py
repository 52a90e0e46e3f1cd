"""Small pieces of the trainer: learning-rate schedule, self-written prompt instructions, batching."""
from __future__ import annotations

import importlib
import inspect
import math
import random

import pytest

from specserve.errors import ConfigError

from specserve.train.batches import collate, epoch_batches, split
from specserve.train.code_requests import completion_request, training_openings
from specserve.train.config import TrainConfig
from specserve.train.data import Sequence, data_engine_options
from specserve.train.documents import SUITE_CODE_MODULES
from specserve.train.questions import (FOLLOW_UPS, PASSAGE_TASKS, TASK_OPENERS, TOPICS, QuestionSeed,
                                       follow_up_conversations, is_repetitive, question_seeds, topic_mix,
                                       vocabulary_words)
from specserve.train.request_templates import CATEGORIES, templated_requests
from specserve.train.schedule import FLOOR, WarmupCosine
from specserve.train.translation_requests import FOREIGN_SENTENCES, LANGUAGES, translation_request


def test_schedule_warms_up_linearly_then_decays_by_cosine_to_the_floor():
    s = WarmupCosine(peak=1.0, warmup_steps=4, total_steps=14)
    assert [s.lr(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert s.lr(4) == 1.0
    assert s.lr(9) == pytest.approx(FLOOR + (1 - FLOOR) * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert s.lr(14) == pytest.approx(FLOOR) and s.lr(100) == pytest.approx(FLOOR)
    decay = [s.lr(i) for i in range(4, 15)]
    assert decay == sorted(decay, reverse=True)


def test_seeds_cover_every_topic_and_kind_before_repeating():
    pairs = len(TASK_OPENERS) * len(TOPICS)
    first = question_seeds(pairs, seed=1)
    assert len(set(first)) == pairs
    assert question_seeds(pairs + 3, seed=1)[pairs:] == first[:3]
    assert question_seeds(5, seed=1) == first[:5] != question_seeds(5, seed=2)
    assert first[0].topic in first[0].instruction and first[0].reply_start.endswith('"' + first[0].opener)


def test_a_question_is_the_opener_and_what_the_target_wrote():
    seed = QuestionSeed("chess", "How do I")
    assert seed.question(" get better at endgames?  ") == "How do I get better at endgames?"
    assert QuestionSeed("poetry", "Summarize").question(" it.") is None  # too short to be a request


def test_templated_requests_are_distinct_seeded_and_take_turns_by_category():
    requests = templated_requests(400, seed=1)
    assert len(requests) == len(set(requests)) == 400
    assert templated_requests(400, seed=1) == requests != templated_requests(400, seed=2)
    assert all(len(r.split()) >= 6 for r in requests)
    # The first of each round comes from the categories in order: writing first, extraction's passages sixth.
    assert requests[0].startswith("Write a ") and "\n\n" in requests[5]
    assert len(CATEGORIES) == 10
    about = templated_requests(40, seed=1, topics=["zeppelins"])
    assert sum("zeppelins" in r for r in about) >= 10


def test_templated_requests_take_turns_over_the_chosen_categories_only():
    chosen = templated_requests(60, seed=3, categories=("translation", "code_completion"))
    assert len(set(chosen)) == 60
    code = [r for r in chosen if "```python\n" in r]
    # Turns alternate, so half are code and none comes from another category (every other category's requests
    # hold no code block, and no translation request does).
    assert len(code) == 30 and chosen[1::2] == code
    everything = templated_requests(60, seed=3)
    assert sum("```python\n" in r for r in everything) == 6


def test_config_refuses_an_unknown_template_category():
    with pytest.raises(ConfigError, match="poetry"):
        TrainConfig(target="t", out="o", template_categories=("translation", "poetry"), device="cpu")
    with pytest.raises(ConfigError, match="templated-fraction"):
        TrainConfig(target="t", out="o", template_categories=("math",), templated_fraction=0.0, device="cpu")
    cfg = TrainConfig(target="t", out="o", template_categories=["math"], device="cpu")
    assert cfg.template_categories == ("math",)


def test_translation_requests_go_both_ways_with_every_slot_filled():
    rng = random.Random(0)
    requests = [translation_request(rng) for _ in range(400)]
    assert not any("{" in r or "}" in r for r in requests)
    # Only requests into English name English (no English sentence does).
    from_ = [r for r in requests if "English" in r]
    into = [r for r in requests if "English" not in r]
    assert 0.2 < len(from_) / len(requests) < 0.4
    # Every language is asked for both ways, and most other-language sentence templates are shown.
    assert all(any(lang in r for r in into) for lang in LANGUAGES)
    assert all(any(lang in r for r in from_) for lang in FOREIGN_SENTENCES)
    shown = [t.split("{")[0][:12] for sentences in FOREIGN_SENTENCES.values() for t in sentences]
    assert sum(any(start in r for r in from_) for start in shown) >= 0.8 * len(shown)


def test_code_completion_shows_the_opening_of_a_function_outside_the_suites_modules():
    openings = training_openings()
    assert len(openings) > 300
    assert not {o.module for o in openings} & set(SUITE_CODE_MODULES)
    for o in openings[::20]:
        shown = [line.strip() for line in o.shown.splitlines()]
        assert shown[0].startswith(("def ", "async def ", "@")) and f"{o.name}(" in o.shown
        # The lines shown are the function's first ones in its module, and the function goes on after them.
        source = [line.strip() for line in inspect.getsource(importlib.import_module(o.module)).splitlines()]
        starts = [i for i in range(len(source)) if source[i:i + len(shown)] == shown]
        assert starts, o.name
        after = source[starts[0] + len(shown):]
        assert any(after[:3]) and not after[0].startswith(("def ", "class ")), o.name
    request = completion_request(random.Random(0))
    assert request.count("```") == 2 and any(o.shown in request for o in openings)


class WordTokenizer:
    tokens = [" the", " Francisco", " Hawaii", "ing", " 2024", " a-b", " Oahu", " quantum"]

    def __len__(self):
        return len(self.tokens)

    def batch_decode(self, ids):
        return [self.tokens[i[0]] for i in ids]


def test_vocabulary_words_are_whole_words_and_mix_with_the_curated_topics():
    words = vocabulary_words(WordTokenizer())
    assert words == ["Francisco", "Hawaii", "quantum"]  # a space and five letters or more
    mix = topic_mix(words, 2000, 0.6, seed=0)
    assert abs(sum(t in words for t in mix) / 2000 - 0.6) < 0.05
    assert set(mix) - set(words) <= set(TOPICS)
    assert topic_mix([], 5, 0.6, seed=0) == topic_mix(words, 5, 0.0, seed=0)


PROSE = ("Volcanoes form where magma rises through the crust. Pressure builds in a chamber below the surface "
         "until gas and molten rock force their way out, and each eruption leaves layers of ash and lava that "
         "slowly build the mountain higher over thousands of years.")


def test_a_reply_caught_in_a_loop_is_repetitive_and_prose_is_not():
    loop = "Question: What is the answer to the question: " * 8
    assert is_repetitive(loop)
    assert not is_repetitive(PROSE)
    assert not is_repetitive("yes yes yes yes yes yes")  # too short to judge


def test_follow_ups_build_on_a_seeded_share_of_the_usable_replies():
    answered = [([{"role": "user", "content": f"Question {i}?"}], f"{PROSE} ({i})") for i in range(40)]
    answered += [([{"role": "user", "content": "Loop?"}], "a b c d " * 20), ([{"role": "user", "content": "x"}], " ")]
    out = follow_up_conversations(answered, 0.5, seed=3)
    assert out == follow_up_conversations(answered, 0.5, seed=3) != follow_up_conversations(answered, 0.5, seed=4)
    assert len(out) == 20 and len(follow_up_conversations(answered, 1.0, seed=3)) == 40
    turns = [c for c in out if len(c) == 3]
    passages = [c for c in out if len(c) == 1]
    assert turns and passages and len(turns) + len(passages) == len(out)
    for c in turns:  # the earlier exchange, the reply as the assistant's turn, then one of the follow-ups
        assert c[0]["content"].startswith("Question ") and c[1]["role"] == "assistant"
        assert c[1]["content"].startswith(PROSE) and c[2]["role"] == "user" and c[2]["content"] in FOLLOW_UPS
    replies = [r for _, r in answered[:40]]
    for (m,) in passages:  # one request that quotes a reply whole
        assert m["role"] == "user" and any(m["content"] == t.format(text=r) for t in PASSAGE_TASKS for r in replies)
    assert all("a b c d" not in str(c) and c[0]["content"] != "x" for c in out)
    assert follow_up_conversations(answered, 0.0, seed=3) == []


def seqs(lengths):
    return [Sequence(list(range(2)), list(range(n - 2)), 0.0) for n in lengths]


def test_batches_cover_every_sequence_once_per_epoch_reproducibly():
    data = seqs([5 + (i * 7) % 40 for i in range(70)])
    for epoch in range(3):
        batches = epoch_batches(data, 8, seed=0, epoch=epoch)
        assert sorted(i for b in batches for i in b) == list(range(70))
        assert batches == epoch_batches(data, 8, seed=0, epoch=epoch)
    assert epoch_batches(data, 8, 0, 0) != epoch_batches(data, 8, 0, 1)


def test_collate_pads_right_and_keeps_lengths():
    batch = collate([Sequence([1, 2], [3], 0.0), Sequence([4], [5, 6, 7], 0.7)])
    assert batch.ids.tolist() == [[1, 2, 3, 0], [4, 5, 6, 7]]
    assert batch.lengths.tolist() == [3, 4] and batch.prompt_lengths.tolist() == [2, 1]


def test_counted_rows_are_each_drafters_flat_positions():
    data = [Sequence([1, 2, 3], [4, 5, 6, 7], 0.0), Sequence([], [8, 9, 10], 0.0), Sequence([1], [2], 0.0)]
    batch = collate(data, length_multiple=8)
    steps, width = 3, batch.ids.shape[1]
    # Row i of a sequence of n tokens, P of them prompt, drafts step j where i >= P - 1 and i + j + 2 < n.
    want = [[b * width + i for b, s in enumerate(data) for i in range(width)
             if i >= len(s.prompt_ids) - 1 and i + j + 2 < len(s.ids)] for j in range(steps)]
    assert [r.tolist() for r in batch.counted_rows(steps)] == want
    assert want[0] == [2, 3, 4, 8]


def test_split_holds_out_a_seeded_share():
    data = seqs(range(10, 30))
    train, val = split(data, 0.25, seed=3)
    assert len(val) == 5 and len(train) == 15
    assert sorted(map(id, train + val)) == sorted(map(id, data))
    assert split(data, 0.25, seed=3) == (train, val)
    assert split(data, 0.0, seed=3) == (data, [])


def test_the_data_engine_covers_large_batches_with_graphs_on_cuda():
    cfg = TrainConfig(target="smollm2-135m", out="/tmp/head", max_num_seqs=512, kv_cache_memory=16 << 30)
    assert data_engine_options(cfg) == {"kv_cache_memory_bytes": 16 << 30}  # on the CPU: no graphs, default budget
    cfg.device = "cuda"  # as the config would read on a GPU machine
    options = data_engine_options(cfg)
    assert options["max_num_batched_tokens"] == 1024
    sizes = options["cudagraph_capture_sizes"]
    assert sizes[-1] == 1024 and 512 in sizes and sizes == sorted(sizes)
