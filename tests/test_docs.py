"""Every "docs/<page>.md, 'Section'" citation in the code names a page and a section that exist."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# A citation may wrap over a comment's or docstring's line break: "docs/design.md,\n# 'Graph modes'".
CITATION = re.compile(r"docs/(\w+)\.md,\s*(?:#\s*)?'([^']+)'")
LINE_BREAK = re.compile(r"\s*\n\s*#?\s*")


def test_cited_doc_sections_exist():
    sections = {path.stem: set(re.findall(r"^## (.+)$", path.read_text(), re.M)) for path in (ROOT / "docs").glob("*.md")}
    cited = []
    for folder in ("specserve", "tests", "benchmarks", "docs"):
        for path in (ROOT / folder).rglob("*.py" if folder != "docs" else "*.md"):
            cited += [(path.relative_to(ROOT), page, LINE_BREAK.sub(" ", name))
                      for page, name in CITATION.findall(path.read_text())]
    assert cited
    missing = [c for c in cited if c[2] not in sections.get(c[1], ())]
    assert not missing, missing
