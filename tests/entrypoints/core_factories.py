"""Engine cores with faults or fixed step times, for tests that start a core process: the process
imports this module by name, so these live at a module's top level."""
from __future__ import annotations

import time

from specserve.engine.core import EngineCore


class BrokenCore(EngineCore):
    """Fails its first step, as a bug in the model runner would."""

    def step(self):
        raise RuntimeError("injected step failure")


class FixedTimeCore(EngineCore):
    """Each step takes at least `STEP_S` of wall time, half of it holding the interpreter (as a GPU
    step's host work does) and half waiting (as on the device), so the time a front end costs the
    engine shows against a known step time."""

    STEP_S = 0.005

    def step(self):
        start = time.perf_counter()
        outputs = super().step()
        busy_until = start + self.STEP_S / 2
        while time.perf_counter() < busy_until:
            pass
        time.sleep(max(0.0, start + self.STEP_S - time.perf_counter()))
        return outputs
