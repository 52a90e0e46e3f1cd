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
"""
from __future__ import annotations

import random
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

# The opening words of each task kind; the target continues them into a whole request.
TASK_OPENERS = (
    "Can you explain", "Write a short story", "Write a Python function", "Solve this math problem:",
    "What should I do", "What is the difference between", "How do I", "Give me a list of", "Write an email",
    "Write a poem", "What is the history of", "Summarize", "What are the pros and cons of", "Pretend you are",
    "Here is a puzzle:", "Extract the",
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


def question_seeds(n: int, seed: int) -> list[QuestionSeed]:
    """n seeds, cycling through every (topic, task kind) pair in a seeded order."""
    pairs = [QuestionSeed(topic, opener) for topic in TOPICS for opener in TASK_OPENERS]
    random.Random(seed).shuffle(pairs)
    return (pairs * (n // len(pairs) + 1))[:n]
