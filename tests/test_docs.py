"""Every "<page>.md, 'Section'" citation (docs/design.md, docs/invariants.md, BENCHMARKS.md) in the code, the
scripts, the docs and the README names a page and a section that exist."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# A citation may wrap over a comment's or docstring's line break: "docs/design.md,\n# 'Graph modes'".
CITATION = re.compile(r"((?:docs/)?[A-Za-z_]+)\.md,\s*(?:#\s*)?'([^']+)'")
LINE_BREAK = re.compile(r"\s*\n\s*#?\s*")
SOURCES = {"specserve": "*.py", "tests": "*.py", "benchmarks": "*.py", "scripts": "*.sh", "docs": "*.md"}


def test_cited_doc_sections_exist():
    cited = [(path.relative_to(ROOT), page, LINE_BREAK.sub(" ", name))
             for folder, pattern in SOURCES.items() for path in (ROOT / folder).rglob(pattern)
             for page, name in CITATION.findall(path.read_text())]
    cited += [(Path(top), page, LINE_BREAK.sub(" ", name))
              for top in ("BENCHMARKS.md", "README.md") for page, name in CITATION.findall((ROOT / top).read_text())]
    assert {page for _, page, _ in cited} == {"docs/design", "docs/invariants", "BENCHMARKS"}
    sections = {page: set(re.findall(r"^#+ (.+)$", (ROOT / f"{page}.md").read_text(), re.M))
                for page in {page for _, page, _ in cited}}
    missing = [c for c in cited if c[2] not in sections[c[1]]]
    assert not missing, missing
