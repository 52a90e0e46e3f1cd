"""benchmarks/host_overhead.py runs against the engine as it is: every part it times exists and takes time, for
each output mode."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_each_part_of_a_step_is_timed():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "host_overhead.py"), "--batch-sizes", "2",
                           "--prompt-len", "8", "--steps", "4"], env=env, capture_output=True, text=True,
                          timeout=300, check=True)
    lines = done.stdout.splitlines()
    header = next(line.split() for line in lines if line.split()[:1] == ["batch"])
    assert header[3:] == ["step", "scheduler.schedule", "scheduler.update", "processor.process", "runner.launch"]
    rows = [line.split() for line in lines if line.split() and line.split()[0].isdigit()]
    assert [(r[1], r[2]) for r in rows] == [("True", "cumulative"), ("True", "delta"), ("True", "final_only"),
                                            ("False", "final_only")], lines
    assert all(float(x) > 0 for r in rows for x in r[3:]), lines
