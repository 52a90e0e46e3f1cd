"""Training checkpoints: the head, optimizer and schedule state, written so a crash never leaves half a file.

A checkpoint also records what it was trained on (a digest of the data and
the settings that shape the run), and resuming refuses a checkpoint that
does not match, instead of silently mixing two runs.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from specserve.errors import ConfigError

CHECKPOINT_NAME = "checkpoint.pt"


def save_checkpoint(path: Path, state: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: Path, identity: dict) -> dict:
    """The checkpoint at path, after checking it was made by a run with this identity."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    theirs = state.get("identity", {})
    for key, ours in identity.items():
        if theirs.get(key) != ours:
            raise ConfigError("resume", f"{path} was made with {key}={theirs.get(key)!r}, this run has {ours!r}; "
                              "resume with the same data and settings, or start afresh without --resume")
    return state
