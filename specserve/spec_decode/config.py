"""SpeculativeConfig: the same JSON shape as vLLM's --speculative-config."""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

from specserve.errors import ConfigError

METHODS = ("eagle", "eagle3", "ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16


@dataclass
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3
    # Benchmark only: accept each draft with this probability regardless of the models,
    # which makes speed measurable at a fixed acceptance rate. Output is then not the target's.
    forced_acceptance_prob: float | None = None

    def __post_init__(self) -> None:
        def bad(field: str, msg: str) -> None:
            raise ConfigError(f"speculative_config.{field}", msg)

        if self.method not in METHODS:
            bad("method", f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            bad("num_speculative_tokens", f"must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}; "
                "3 to 5 is typical")
        if self.method == "ngram":
            if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
                bad("prompt_lookup_min", f"need 1 <= prompt_lookup_min ({self.prompt_lookup_min}) <= "
                    f"prompt_lookup_max ({self.prompt_lookup_max})")
        else:
            from specserve.heads import BUILTIN_HEADS, resolve_head

            self.model = resolve_head(self.model) if self.model else self.model
            if not self.model:
                bad("model", f"method {self.method!r} needs the path of its {'draft model' if self.method == 'draft_model' else 'head'}")
            if not Path(self.model).expanduser().exists() and self.model != "smollm2-135m":
                bad("model", f"{self.model!r} does not exist; give a Hugging Face directory or a shipped head "
                    f"({', '.join(BUILTIN_HEADS)})")
        p = self.forced_acceptance_prob
        if p is not None and not 0.0 <= p <= 1.0:
            bad("forced_acceptance_prob", f"must be in [0, 1], got {p}")

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict | str | None") -> "SpeculativeConfig | None":
        """Accept a SpeculativeConfig, a dict, or a JSON string as on vLLM's command line."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError("speculative_config", f"is not valid JSON ({e}); e.g. "
                                  '\'{"method": "ngram", "num_speculative_tokens": 3}\'') from e
        if not isinstance(value, dict):
            raise ConfigError("speculative_config", f"must be a JSON object, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"speculative_config.{unknown[0]}", f"unknown field; known fields: {', '.join(sorted(known))}")
        for required in ("method", "num_speculative_tokens"):
            if required not in value:
                raise ConfigError(f"speculative_config.{required}", "is required")
        return cls(**value)
