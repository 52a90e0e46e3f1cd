"""xgrammar's batch filler (BatchGrammarMatcher), through which every grammar mask is filled (batch_fill) but a
verified tree's (tree_masks.py, one call per tree, spread over as many threads), and how many threads it fills on,
by the number of rows one call fills (docs/design.md, 'Structured output').

The choice is data, measured on the host: `benchmarks/step_masks_host.py --sweep --write` times the batch fill
at each row count on each thread count and writes, for the CPUs the process may run on, `structured_output/
configs/fill_threads/<cpus>cpus.json`: row-count buckets and the fewest threads within SAME_WITHIN of the
fastest in each. A host uses the table measured with the most CPUs not above its own, never more threads than it
has CPUs; without one every call runs on the engine's thread alone (1).
"""
from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

TABLE_DIR = Path(__file__).resolve().parent / "configs" / "fill_threads"
# A thread count this close to the fastest (relative) counts as fast as it: more threads than that buy nothing
# but contention with the engine's own thread and other processes.
SAME_WITHIN = 0.05


@dataclass(frozen=True)
class FillThreads:
    """For a call filling at most max_rows rows (and more than the next smaller bucket's max_rows), threads."""

    max_rows: int
    threads: int

    def __post_init__(self) -> None:
        if self.max_rows < 1 or self.threads < 1:
            raise ValueError(f"max_rows and threads must be at least 1, got {self.max_rows} and {self.threads}")


@lru_cache(maxsize=None)
def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity, which a container or taskset narrows)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def table_path(cpus: int) -> Path:
    return TABLE_DIR / f"{cpus}cpus.json"


def write_table(cpus: int, buckets: list[FillThreads]) -> Path:
    """A host's table, one bucket a line, by ascending max_rows."""
    path = table_path(cpus)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [f"    {json.dumps(asdict(b))}" for b in sorted(buckets, key=lambda b: b.max_rows)]
    path.write_text(f'{{\n  "cpus": {cpus},\n  "buckets": [\n' + ",\n".join(lines) + "\n  ]\n}\n")
    return path


@lru_cache(maxsize=None)
def load_table(cpus: int) -> tuple[FillThreads, ...]:
    """The buckets of the table measured with the most CPUs not above `cpus`, by ascending max_rows; empty
    without one."""
    measured = sorted(int(m.group(1)) for p in TABLE_DIR.glob("*cpus.json")
                      if (m := re.fullmatch(r"(\d+)cpus\.json", p.name)))
    fitting = [c for c in measured if c <= cpus]
    if not fitting:
        return ()
    path = table_path(fitting[-1])
    try:
        buckets = [FillThreads(**row) for row in json.loads(path.read_text())["buckets"]]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is not a table of fill threads ({e}); rewrite it with "
                         f"`python benchmarks/step_masks_host.py --sweep --write` on this host") from e
    return tuple(sorted(buckets, key=lambda b: b.max_rows))


def fill_threads(rows: int, cpus: int | None = None) -> int:
    """The threads for one batch fill of `rows` rows on a host with `cpus` usable CPUs (default: this one's):
    the bucket holding rows (past the last bucket, the last), at most cpus; 1 without a table."""
    cpus = usable_cpus() if cpus is None else cpus
    table = load_table(cpus)
    if not table:
        return 1
    bucket = next((b for b in table if rows <= b.max_rows), table[-1])
    return max(1, min(bucket.threads, cpus))


def batch_fill(matchers: list, host, rows: list[int]) -> None:
    """matchers[r]'s next-token mask into host[rows[r]] (a bitmask tensor), in one call on as many threads as
    the host's table gives that many rows: a call per row from Python costs as much again as xgrammar's fill
    of it."""
    if matchers:
        _filler(fill_threads(len(matchers))).batch_fill_next_token_bitmask(matchers, host, rows)


@functools.cache
def _filler(threads: int):
    import xgrammar as xgr

    return xgr.BatchGrammarMatcher(max_threads=threads)
