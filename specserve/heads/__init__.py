"""Speculator heads shipped with specserve, by name (e.g. "smollm2-135m-eagle3" in a speculative config).

smollm2_135m_eagle3: an EAGLE-3 head for SmolLM2-135M-Instruct trained with `specserve train-eagle`
on the model's own answers to prompts it wrote itself and to prompts people wrote, over five runs, each
continuing the last with --init-from (config.json records them); the last widened its MLP to 6144.
"""
from __future__ import annotations

from pathlib import Path

BUILTIN_HEADS = {"smollm2-135m-eagle3": Path(__file__).parent / "smollm2_135m_eagle3"}


def resolve_head(name: str) -> str:
    """The directory of a shipped head, or name unchanged if it names none."""
    path = BUILTIN_HEADS.get(name)
    return str(path) if path is not None else name
