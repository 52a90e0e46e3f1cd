"""Where data-parallel replicas run: replica i of M takes GPUs [i*g, (i+1)*g) of those this process sees,
g being the GPUs one replica runs on (EngineConfig.gpus_per_replica), and sees only those."""
from __future__ import annotations

import contextlib
import os

import torch

_VISIBLE = "CUDA_VISIBLE_DEVICES"


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them (indices or UUIDs)."""
    count = torch.cuda.device_count()
    listed = os.environ.get(_VISIBLE)
    if listed is None:
        return [str(i) for i in range(count)]
    # CUDA stops at the first entry it cannot use, and torch counts what it kept.
    return [name.strip() for name in listed.split(",")][:count]


def replica_gpus(replica: int, gpus_per_replica: int) -> list[str]:
    return visible_gpus()[replica * gpus_per_replica:(replica + 1) * gpus_per_replica]


@contextlib.contextmanager
def visible_to_child(gpus: list[str] | None):
    """CUDA_VISIBLE_DEVICES set to `gpus` (None: left as it is) while a child process starts: a spawned process
    takes this process's environment, and CUDA reads the variable once, when the child first uses a GPU."""
    if gpus is None:
        yield
        return
    before = os.environ.get(_VISIBLE)
    os.environ[_VISIBLE] = ",".join(gpus)
    try:
        yield
    finally:
        if before is None:
            del os.environ[_VISIBLE]
        else:
            os.environ[_VISIBLE] = before
