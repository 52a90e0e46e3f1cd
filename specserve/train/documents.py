"""Long-document requests: summaries, questions over retrieved passages, and extraction, with prompts of
up to a few thousand tokens.

Serving meets such prompts (a document to summarise, passages a retriever
found, a page to pull fields from), and a head trained on one-line requests
drafts the answers to them poorly: the answer quotes and condenses a long
context its training never showed. The documents are the plain-text help that
pydoc renders for modules of Python's standard library (their docstrings, PSF
licence): present wherever the trainer runs, and many thousands of tokens of
English prose about code, cut at paragraph ends into sections.

They are kept apart from the acceptance suite (benchmarks/acceptance_suite),
whose documents are the Language Reference (pydoc_data.topics), package READMEs
and the source of SUITE_CODE_MODULES: none of those is a document here
(tests/test_acceptance_suite.py measures the 8-gram overlap).
"""
from __future__ import annotations

import functools
import importlib
import pydoc
import random
import re
from collections.abc import Callable
from dataclasses import dataclass

# Modules whose functions the suite's code category asks to complete: never a training document.
SUITE_CODE_MODULES = ("textwrap", "shlex", "difflib", "statistics", "calendar", "ipaddress", "heapq", "pprint",
                      "configparser")
# Not typing or collections: their help holds the whole of str's (Text, UserString), as the Language
# Reference's string methods do.
DOCUMENT_MODULES = (
    "json", "argparse", "functools", "itertools", "pathlib", "re", "posixpath", "datetime",
    "logging", "subprocess", "threading", "asyncio", "socket", "http.client", "urllib.parse", "email.message",
    "sqlite3", "unittest", "dataclasses", "enum", "random", "decimal", "string", "struct", "zipfile",
    "tarfile", "shutil", "tempfile", "inspect", "ast", "dis", "pickle", "copy", "contextlib", "abc", "queue",
    "sched", "secrets", "hashlib", "uuid", "html.parser", "xml.etree.ElementTree", "gzip", "lzma", "io", "codecs",
    "locale", "gettext", "selectors", "weakref", "traceback", "warnings", "timeit", "pstats", "glob", "fnmatch",
    "filecmp", "fileinput", "platform", "concurrent.futures", "smtplib", "imaplib", "ftplib", "mailbox",
    "mimetypes", "base64", "csv", "plistlib", "wave", "getopt", "optparse", "cmd", "pkgutil", "runpy",
    "sysconfig", "numbers", "zoneinfo", "graphlib", "bisect", "operator", "tokenize", "stat",
)
SECTION_TOKENS = (300, 3800)
# Tokens a chat template adds around a request, at most (as counted beside the request's own).
TEMPLATE_MARGIN = 32
# A passage of a retrieval prompt is at most this long, so several fit.
PASSAGE_TOKENS = 1200
SUMMARY_ASKS = (
    "Give a short summary of the documentation above.", "Summarise this for a colleague in three sentences:",
    "What is this documentation about? Explain its key points in plain words.",
    "Condense the text above into a bulleted list of its most important facts.",
    "Read the following and write an executive summary of it.",
)
QUESTION_ASKS = (
    "What does {name} do, and which arguments does it take?", "When would I use {name}? Show an example call.",
    "Explain {name} to a beginner.", "What does {name} return, and can it raise an error?",
)
EXTRACTION_ASKS = (
    "Make a JSON list of every function and class documented above, with its parameters.",
    "Pull out each name defined in this text and what it is for, as a markdown table.",
    "Which constants, exceptions and default values does the text above mention? List them.",
)
RETRIEVAL_FORMAT = "Here are some search results:\n\n{passages}\n\nUsing the results above, answer: {question}"
_FUNCTION = re.compile(r"^ {4}(?:\| {3})?([a-z_][a-z0-9_]{2,})\(", re.MULTILINE)


@dataclass(frozen=True)
class Section:
    module: str
    text: str
    tokens: int

    def functions(self) -> list[str]:
        return sorted({m for m in _FUNCTION.findall(self.text) if not m.startswith("_")})


# The least room for a prompt that document_requests can fill: its shortest section and the margin beside it.
MIN_PROMPT_TOKENS = SECTION_TOKENS[0] + 64
# pydoc's last part names the file the module was read from: a path of the machine, not documentation.
_FILE_PART = re.compile(r"\nFILE\n.*\Z", re.DOTALL)
# What a class inherits from a built-in type (str's methods under StrEnum ...) is the built-in's own
# documentation, repeated in every module with such a class, and the Language Reference's (the suite's) too.
_INHERITED_FROM_BUILTINS = re.compile(r"^ *\| +[\w ]+ inherited from builtins\.\w+:$")
_CLASS_PART_RULE = re.compile(r"^ *\| +-{10,}$")


@functools.cache
def module_help(name: str) -> str:
    """The module's pydoc help as plain text, without what it inherits from built-ins or its file's path.
    Rendered once per process (seconds for every document module): an imported module's help does not change."""
    text = _FILE_PART.sub("", pydoc.render_doc(importlib.import_module(name), renderer=pydoc.plaintext))
    kept, skipping = [], False
    for line in text.splitlines():
        if _INHERITED_FROM_BUILTINS.match(line):
            skipping = True
        elif skipping and (_CLASS_PART_RULE.match(line) or not line.lstrip().startswith("|")):
            skipping = False
        if not skipping:
            kept.append(line)
    return "\n".join(kept)


# Counts the tokens of each of a list of texts (one call for many: a tokenizer encodes a batch fastest).
TokenCounter = Callable[[list[str]], list[int]]


def sections(count_tokens: TokenCounter, max_tokens: int) -> list[Section]:
    """Every module's help cut at paragraph ends into sections of SECTION_TOKENS[0]..max_tokens tokens."""
    out = []
    for module in DOCUMENT_MODULES:
        current, count = [], 0
        paragraphs = re.split(r"\n\s*\n", module_help(module))
        for paragraph, n in zip(paragraphs, count_tokens(paragraphs)):
            n += 1
            if current and count + n > max_tokens:
                if count >= SECTION_TOKENS[0]:
                    out.append(Section(module, "\n\n".join(current), count))
                current, count = [], 0
            if n <= max_tokens:
                current.append(paragraph)
                count += n
        if count >= SECTION_TOKENS[0]:
            out.append(Section(module, "\n\n".join(current), count))
    return out


def document_requests(n: int, seed: int, count_tokens: TokenCounter, max_prompt_tokens: int) -> list[str]:
    """n requests (fewer only if the documents run out of distinct ones), the kinds taking turns: a section
    to summarise, two to five sections of different modules and a question about a function one of them
    documents, a section to extract from. Prompts stay within max_prompt_tokens of the target's tokenizer."""
    rng = random.Random(f"{seed}:documents")
    # Room for the ask, the results' headers and the chat template's own tokens.
    budget = min(SECTION_TOKENS[1], max_prompt_tokens - 64)
    pool = sections(count_tokens, budget)
    passages = [s for s in pool if s.tokens <= PASSAGE_TOKENS]
    answerable = [s for s in passages if s.functions()]
    out: dict[str, None] = {}
    tries = 0
    while len(out) < n and tries < 20 * n and pool:
        kind = tries % 3
        tries += 1
        request = None
        if kind == 0:
            s = rng.choice(pool)
            ask = rng.choice(SUMMARY_ASKS)
            request = f"{s.text}\n\n{ask}" if rng.random() < 0.5 else f"{ask}\n\n{s.text}"
        elif kind == 1 and answerable:
            answer = rng.choice(answerable)
            chosen, total = [answer], answer.tokens
            for other in rng.sample(passages, min(len(passages), 8)):
                if len(chosen) == 5 or other.module in {c.module for c in chosen}:
                    continue
                if total + other.tokens <= budget - 64:
                    chosen.append(other)
                    total += other.tokens
            rng.shuffle(chosen)
            question = rng.choice(QUESTION_ASKS).format(name=rng.choice(answer.functions()))
            text = "\n\n".join(f"Result {i + 1} ({c.module}):\n{c.text}" for i, c in enumerate(chosen))
            request = RETRIEVAL_FORMAT.format(passages=text, question=question)
        elif kind == 2:
            s = rng.choice(pool)
            request = f"{s.text}\n\n{rng.choice(EXTRACTION_ASKS)}"
        # Sections are counted paragraph by paragraph; the whole is counted once more, as it will be encoded.
        if request is not None and count_tokens([request])[0] <= max_prompt_tokens - TEMPLATE_MARGIN:
            out[request] = None
    return list(out)
