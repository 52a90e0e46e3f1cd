"""benchmarks/step_masks_host.py runs: its per-step times and its thread sweep, on SmolLM2's vocabulary (without
--write, so the host's table stays as committed)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str) -> list[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "step_masks_host.py"), *args], env=env,
                          capture_output=True, text=True, timeout=300, check=True)
    return done.stdout.splitlines()


def test_step_times_for_each_row_count():
    lines = run("--rows", "1,4", "--drafts", "2", "--repeats", "3")
    rows = [line.split() for line in lines if line.split() and line.split()[0].isdigit()]
    assert [r[0] for r in rows] == ["1", "4"]
    assert all(len(r) == 8 and all(float(x) > 0 for x in r[2:]) for r in rows), lines


def test_the_sweep_chooses_a_thread_count_for_each_row_count():
    lines = run("--sweep", "--rows", "4,1", "--threads", "2", "--repeats", "3")
    rows = [line.split() for line in lines if line.split() and line.split()[0].isdigit()]
    assert [r[0] for r in rows] == ["1", "4"]
    assert all(int(r[-1]) in (1, 2) for r in rows)
    assert lines[-1].startswith("choices: ") and "up to 4 rows" in lines[-1]
