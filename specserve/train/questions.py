"""Prompts the target writes itself, when no prompt file is given.

A head learns to predict what the target says in reply to what users ask, so
the prompts should cover the kinds of requests a chat model meets (the
categories of chat benchmarks: writing, role-play, reasoning, maths, coding,
extraction, science, humanities) over many subjects. Each prompt comes from
asking the target, through its chat template, for a request about a topic,
with its reply already begun by the opening words of a task kind: small
models asked for a request otherwise tend to carry the task out instead of
writing it down. The target writes the rest, sampled warm so that repeated
(topic, kind) pairs still differ, up to the closing quote.

Also the second round of requests (with a prompt file too): follow-ups on
the target's own first answers (follow_up_conversations).
"""
from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

TOPICS = (
    "cooking at home", "personal finance", "climate change", "the solar system", "ancient Rome", "machine learning",
    "gardening", "public transport", "the human heart", "renewable energy", "job interviews", "volcanoes",
    "photography", "chess", "the stock market", "healthy sleep", "the French Revolution", "databases",
    "bird migration", "smartphones", "marathon training", "coffee", "electric cars", "the ocean floor",
    "learning a language", "small business marketing", "the immune system", "bridges", "video games",
    "music theory", "probability", "recycling", "the Internet", "ancient Egypt", "time management",
    "pets", "earthquakes", "poetry", "web development", "vaccines", "mountain hiking", "the Moon landing",
    "baking bread", "cybersecurity", "urban planning", "dinosaurs", "meditation", "photosynthesis",
    "the printing press", "football", "space telescopes", "airplanes", "friendship", "honeybees",
    "weather forecasting", "geometry", "the Renaissance", "rainforests", "remote work", "board games",
    "nutrition", "robots", "the water cycle", "moving to a new city",
)

# Whole words of the target's vocabulary make topics too: a few dozen subjects leave most of what users ask
# about (places, people, things) out of the data, and the head then drafts such words poorly.
MIN_WORD_LETTERS = 5


def vocabulary_words(tokenizer) -> list[str]:
    """The target's tokens that are a space and a word of MIN_WORD_LETTERS letters or more, sorted."""
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    return sorted({t[1:] for t in texts if t.startswith(" ") and t[1:].isalpha() and len(t) > MIN_WORD_LETTERS})


def topic_mix(words: Sequence[str], n: int, word_fraction: float, seed: int) -> list[str]:
    """n topics, each a vocabulary word with probability word_fraction (when there are any), else a curated one."""
    rng = random.Random(f"{seed}:topics")
    return [rng.choice(words) if rng.random() < word_fraction and words else rng.choice(TOPICS) for _ in range(n)]


# The opening words of each task kind; the target continues them into a whole request.
TASK_OPENERS = (
    "Can you explain", "Write a short story", "Write a Python function", "Solve this math problem:",
    "What should I do", "What is the difference between", "How do I", "Give me a list of", "Write an email",
    "Write a poem", "What is the history of", "Summarize", "What are the pros and cons of", "Pretend you are",
    "Here is a puzzle:", "Extract the",
    # Kinds chat benchmarks weigh that the list above misses: role-play, longer writing, code, reckoning.
    "Imagine you are", "Act as", "Compose a blog post", "Draft a", "Write a persuasive essay", "Calculate",
    "Write a SQL query", "Write a JavaScript function", "Describe", "Compare",
)

_INSTRUCTION = "Write a question or request about {topic} that someone could ask. Do not answer it."
_REPLY_START = 'Here is the request:\n\n"{opener}'
# Where the target's request ends: the quote _REPLY_START opened.
STOP = '"'
MIN_WORDS = 4


@dataclass(frozen=True)
class QuestionSeed:
    topic: str
    opener: str

    @property
    def instruction(self) -> str:
        return _INSTRUCTION.format(topic=self.topic)

    @property
    def reply_start(self) -> str:
        return _REPLY_START.format(opener=self.opener)

    def question(self, continuation: str) -> str | None:
        """The request the target wrote; None when too short to use."""
        text = (self.opener + continuation).strip()
        return text if len(text.split()) >= MIN_WORDS else None


def question_seeds(n: int, seed: int, topics: Sequence[str] = TOPICS) -> list[QuestionSeed]:
    """n seeds, cycling through every (topic, task kind) pair in a seeded order."""
    pairs = [QuestionSeed(topic, opener) for topic in dict.fromkeys(topics) for opener in TASK_OPENERS]
    random.Random(seed).shuffle(pairs)
    return (pairs * (n // len(pairs) + 1))[:n]


# Second-round requests built on an answer the target already gave. Chat use keeps returning to earlier
# text (a follow-up on the reply, a passage to summarise or pull facts from), and an answer that copies or
# reworks text in its context is one the head must learn to draft; one-line requests never show it that.
FOLLOW_UPS = (
    "Summarize your answer in three bullet points.", "Rewrite your answer in a more formal tone.",
    "Explain that again as if I were ten years old.", "Give me a concrete example.",
    "Turn the main points of your answer into a JSON object.", "What are the weaknesses of your answer?",
    "Make it shorter.", "Continue.", "Now write it as a short poem.", "Rewrite your answer as a numbered list.",
)
PASSAGE_TASKS = (
    "Summarize the following text in two sentences:\n\n{text}",
    "Extract every name, number and date from the text below and return them as JSON.\n\n{text}",
    "{text}\n\nList the key points of the text above.",
    "Proofread this text and point out any mistakes:\n\n{text}",
    "Write three questions a teacher could ask about this text:\n\n{text}",
    "{text}\n\nRewrite the text above as a short news report.",
)
# A reply caught in a loop makes a poor passage: below this share of distinct word 4-grams it is left out.
MIN_DISTINCT_4GRAMS = 0.6


def is_repetitive(text: str) -> bool:
    words = text.split()
    grams = [tuple(words[i:i + 4]) for i in range(len(words) - 3)]
    return len(grams) >= 16 and len(set(grams)) < MIN_DISTINCT_4GRAMS * len(grams)


def follow_up_conversations(answered: Sequence[tuple[list[dict], str]], fraction: float,
                            seed: int) -> list[list[dict]]:
    """Follow-ups to a seeded share of (conversation, reply) pairs, half as another user turn after the
    reply, half as a new one-turn request with the reply as its passage; empty and looping replies get none."""
    rng = random.Random(f"{seed}:follow-up")
    usable = [(c, r.strip()) for c, r in answered if r.strip() and not is_repetitive(r)]
    out = []
    for conversation, reply in rng.sample(usable, round(fraction * len(usable))):
        if rng.random() < 0.5:
            out.append([*conversation, {"role": "assistant", "content": reply},
                        {"role": "user", "content": rng.choice(FOLLOW_UPS)}])
        else:
            out.append([{"role": "user", "content": rng.choice(PASSAGE_TASKS).format(text=reply)}])
    return out
