"""The thread count of a step's batch fills (structured_output/fill_threads.py): a host reads the table measured
with the most CPUs not above its own, the bucket holding the row count, never more threads than its CPUs."""
from __future__ import annotations

import pytest

import specserve.structured_output.fill_threads as ft
from specserve.structured_output.fill_threads import FillThreads, fill_threads, load_table, write_table


@pytest.fixture
def tables(tmp_path, monkeypatch):
    monkeypatch.setattr(ft, "TABLE_DIR", tmp_path)
    load_table.cache_clear()
    yield tmp_path
    load_table.cache_clear()


def test_without_a_table_every_fill_runs_on_one_thread(tables):
    assert [fill_threads(rows, cpus=64) for rows in (1, 64, 1000)] == [1, 1, 1]


def test_the_table_of_the_most_cpus_not_above_the_hosts_and_its_bucket(tables):
    write_table(4, [FillThreads(15, 1), FillThreads(64, 2)])
    write_table(16, [FillThreads(7, 1), FillThreads(31, 4), FillThreads(128, 8)])
    assert [fill_threads(r, cpus=16) for r in (1, 7, 8, 31, 32, 128, 4096)] == [1, 1, 4, 4, 8, 8, 8]
    load_table.cache_clear()
    assert [fill_threads(r, cpus=8) for r in (1, 16, 64, 500)] == [1, 2, 2, 2]
    load_table.cache_clear()
    assert fill_threads(64, cpus=2) == 1  # no table measured with 2 CPUs or fewer
    load_table.cache_clear()
    assert fill_threads(100, cpus=12) == 2


def test_never_more_threads_than_cpus(tables):
    """A table names more threads than its host has CPUs only if edited by hand: the host's CPUs bound it."""
    write_table(3, [FillThreads(64, 16)])
    assert fill_threads(64, cpus=3) == 3


def test_the_shipped_tables_load():
    load_table.cache_clear()
    for path in ft.TABLE_DIR.glob("*cpus.json"):
        cpus = int(path.name.removesuffix("cpus.json"))
        buckets = load_table(cpus)
        assert buckets and all(1 <= b.threads for b in buckets)
        assert [b.max_rows for b in buckets] == sorted({b.max_rows for b in buckets})


def test_a_table_that_does_not_parse_names_its_file_and_the_fix(tables):
    (tables / "8cpus.json").write_text('{"cpus": 8, "buckets": [{"max_rows": 8}]}')
    with pytest.raises(ValueError, match=r"8cpus\.json is not a table.*--sweep --write"):
        fill_threads(8, cpus=8)


def test_a_bucket_needs_rows_and_threads():
    with pytest.raises(ValueError, match="at least 1"):
        FillThreads(0, 1)
    with pytest.raises(ValueError, match="at least 1"):
        FillThreads(8, 0)
