"""Code-completion requests for the trainer's templated data (request_templates.py): a function of Python's
standard library shown up to a point (its signature, docstring and the first third of its body) to finish.

Completing code is how editors and coding assistants call a model, and the
target's answer there is code in the style of the code shown, not the prose
and short snippets of "write a function that..." requests. The functions come
from the pure-Python modules among documents.DOCUMENT_MODULES (PSF licence);
the acceptance suite's code category takes the same kind of opening from
documents.SUITE_CODE_MODULES (scripts/build_acceptance_suite.py, through
function_openings), which no training request does.
"""
from __future__ import annotations

import ast
import functools
import importlib
import inspect
import random
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass

from specserve.train.documents import DOCUMENT_MODULES, SUITE_CODE_MODULES

# Functions of this many lines (signature to last line) have an opening worth showing and a rest worth writing.
FUNCTION_LINES = (12, 60)
COMPLETION_ASKS = (
    "Here is the start of a function from Python's {module} module. Continue it to the end:",
    "Continue this code until the function is complete:", "Fill in the remaining lines of this {module} function:",
    "This function is unfinished. Write the missing part ({module} module):",
)


@dataclass(frozen=True)
class FunctionOpening:
    module: str
    name: str
    shown: str  # the signature, the docstring and the first third of the code after it, dedented


def function_openings(module: str) -> list[FunctionOpening]:
    """The openings of `module`'s documented functions of FUNCTION_LINES lines, in source order; none for a
    module whose source Python does not hold (a C extension)."""
    try:
        source = inspect.getsource(importlib.import_module(module))
    except (OSError, TypeError):
        return []
    lines = source.splitlines()
    lo, hi = FUNCTION_LINES
    funcs = [n for n in ast.walk(ast.parse(source)) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
             and ast.get_docstring(n) and lo <= n.end_lineno - n.lineno <= hi]
    out = []
    for f in sorted(funcs, key=lambda f: f.lineno):
        body = lines[f.lineno - 1 - len(f.decorator_list):f.end_lineno]
        doc_end = f.body[0].end_lineno - f.lineno + 1 + len(f.decorator_list)
        shown = textwrap.dedent("\n".join(body[:doc_end + max(2, (len(body) - doc_end) // 3)]))
        out.append(FunctionOpening(module, f.name, shown))
    return out


@functools.cache
def training_openings() -> tuple[FunctionOpening, ...]:
    """Every opening the trainer may show: of DOCUMENT_MODULES, never of the suite's modules."""
    return tuple(o for m in DOCUMENT_MODULES if m not in SUITE_CODE_MODULES for o in function_openings(m))


def completion_request(rng: random.Random, topics: Sequence[str] = ()) -> str:
    opening = rng.choice(training_openings())
    ask = rng.choice(COMPLETION_ASKS).format(module=opening.module)
    return f"{ask}\n\n```python\n{opening.shown}\n```"
