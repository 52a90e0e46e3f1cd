"""Where the one-shot all-reduce is used: the table benchmarks/allreduce_latency.py writes and the engine reads,
and the size the benchmark records (the largest up to which the one-shot won at every size)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from specserve.distributed.one_shot_all_reduce import load_max_bytes, write_max_bytes

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "allreduce_latency.py"


def _bench():
    spec = importlib.util.spec_from_file_location("allreduce_latency", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_table_keeps_each_device_and_group_size_apart(tmp_path):
    path = tmp_path / "table.json"
    assert load_max_bytes("H100", 2, path) == 0  # no table: NCCL alone
    write_max_bytes("H100", 2, 1 << 20, path)
    write_max_bytes("H100", 4, 1 << 16, path)
    write_max_bytes("A100", 2, 1 << 12, path)
    assert (load_max_bytes("H100", 2, path), load_max_bytes("H100", 4, path)) == (1 << 20, 1 << 16)
    assert load_max_bytes("A100", 2, path) == 1 << 12
    assert load_max_bytes("H100", 8, path) == 0


def test_the_recorded_size_stops_at_the_first_size_nccl_wins():
    bench = _bench()
    r = bench.SizeResult
    results = [r(4, 400, 40, 20.0, 9, 8.0), r(1, 100, 40, 20.0, 9, 7.0), r(16, 1600, 40, 21.0, 30, 25.0),
               r(64, 6400, 40, 22.0, 12, 10.0)]
    # Sorted by size: wins at 100 and 400, loses at 1600; the win at 6400 after a loss is not trusted.
    assert bench.one_shot_max_bytes(results) == 400
    assert bench.one_shot_max_bytes([r(1, 100, 40, 20.0, None, None)]) == 0  # no symmetric memory
