"""SpeculativeConfig: the same JSON shape as vLLM's --speculative-config."""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

from specserve.errors import ConfigError
from specserve.quantization.config import check_quantization
from specserve.spec_decode.tree import MAX_TREE_NODES, DraftTree

METHODS = ("eagle", "eagle3", "ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16
# Draft tokens one step may verify: a chain's k, or a tree's nodes.
MAX_DRAFT_TOKENS = max(MAX_SPECULATIVE_TOKENS, MAX_TREE_NODES)


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
    # EAGLE heads only: draft a static tree of the head's ranked guesses instead of a chain (tree.py), as
    # vLLM's field of this name: "[(0,), (1,), (0, 0)]". num_speculative_tokens is then the tree's depth.
    speculative_token_tree: str | list | None = None
    # Under tensor parallelism, where the drafter runs (docs/design.md, 'Tensor parallelism'): 1, whole on
    # rank 0 (the other ranks hold the target's shards only); the target's tensor_parallel_size, an EAGLE
    # head sharded like the target (chains or trees), every rank running its shard in lockstep with rank 0
    # (EngineConfig checks the value against the target's size). None: 1.
    draft_tensor_parallel_size: int | None = None
    # Dynamic speculation (spec_decode/policy.py): before each step, draft or not from the batch size, the
    # measured acceptance and a table of step times (docs/design.md, 'Dynamic speculation'). Off by default:
    # it is opt-in until the H100 benchmark shows it at >= 1.0x no speculation at every batch size.
    dynamic: bool = False
    # With dynamic: the step times, a JSON file as StepCosts.save writes it; None: measured at start-up.
    cost_table: str | None = None
    # vLLM's field: no drafts in a step of this many requests or more (with or without dynamic).
    disable_by_batch_size: int | None = None
    # The drafter's weights (docs/design.md, 'FP8 weights'): "fp8" quantizes its decoder projections as the
    # target's --quantization fp8 does; None keeps them in the model's dtype (a draft model's FP8 checkpoint
    # loads as FP8 either way). Chosen apart from the target's.
    quantization: str | None = None
    # A device drafter's drafts for requests with a grammar (docs/design.md, 'Structured output'): true, the
    # drafter's logits are masked by each draft path's grammar state, so every draft is one the grammar allows,
    # at the cost of the host building each depth's masks while the drafter waits for them; false, the drafts
    # come unmasked from the drafter's graphs, as for requests without a grammar, and only the verification's
    # masks keep the output the grammar's (fewer drafts accepted, no wait). Either way the output is exactly
    # constrained decoding's. None: as masks_drafts says.
    mask_drafts: bool | None = None

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
        check_quantization(self.quantization, "speculative_config.quantization")
        if self.quantization is not None and self.method == "ngram":
            bad("quantization", "n-gram speculation has no weights to quantize; drop it")
        p = self.forced_acceptance_prob
        if p is not None and not 0.0 <= p <= 1.0:
            bad("forced_acceptance_prob", f"must be in [0, 1], got {p}")
        if self.speculative_token_tree is not None:
            if self.method not in ("eagle", "eagle3"):
                bad("speculative_token_tree", f"trees of drafts need an EAGLE head; method {self.method!r} drafts "
                    "a chain: use method 'eagle' or 'eagle3', or drop the tree")
            if p is not None:
                bad("forced_acceptance_prob", "forces acceptance of a chain of drafts; drop it with a tree")
            depth = self.tree.depth
            if k != depth:
                bad("num_speculative_tokens", f"is {k} but the tree is {depth} deep: with a tree it must be the "
                    f"tree's depth ({depth}), or leave it out")
        if not isinstance(self.dynamic, bool):
            bad("dynamic", f"must be true or false, got {self.dynamic!r}")
        if self.cost_table is not None:
            if not self.dynamic:
                bad("cost_table", 'is read by the dynamic policy only: add "dynamic": true, or drop it')
            if not Path(self.cost_table).expanduser().is_file():
                bad("cost_table", f"{self.cost_table!r} is not a file; give the JSON that StepCosts.save wrote, "
                    "or leave it out to measure the step times at start-up")
        if self.mask_drafts is not None:
            if not isinstance(self.mask_drafts, bool):
                bad("mask_drafts", f"must be true or false, got {self.mask_drafts!r}")
            if self.mask_drafts and self.method == "ngram":
                bad("mask_drafts", "n-gram drafts are copied from the context, never masked; drop it")
            if not self.mask_drafts and p is not None:
                bad("mask_drafts", "false lets drafts the grammar refuses reach the verification, where "
                    "forced_acceptance_prob would accept them; drop one of the two")
        n = self.disable_by_batch_size
        if n is not None and (type(n) is not int or n < 1):
            bad("disable_by_batch_size", f"must be an integer >= 1 (the batch size from which no step drafts), "
                f"got {n!r}")

    @property
    def masks_drafts(self) -> bool:
        """Whether a grammar request's drafts are masked by its grammar: mask_drafts where given. By default not,
        the faster on the default model at batch 1 and 64 (BENCHMARKS.md, 'Structured output'), but under
        forced_acceptance_prob, which accepts drafts whatever the target's masked logits say, so only drafts the
        grammar allows may reach it. N-gram drafts are never masked."""
        if self.method == "ngram":
            return False
        return self.forced_acceptance_prob is not None if self.mask_drafts is None else self.mask_drafts

    @property
    def tree(self) -> DraftTree | None:
        """The tree of drafts, or None for a chain."""
        if self.speculative_token_tree is None:
            return None
        return DraftTree.build(self.speculative_token_tree)

    @property
    def num_draft_tokens(self) -> int:
        """Drafts one step verifies: the tree's nodes, or k."""
        tree = self.tree
        return tree.num_nodes if tree is not None else self.num_speculative_tokens

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
        if value.get("speculative_token_tree") is not None and "num_speculative_tokens" not in value:
            value = {**value, "num_speculative_tokens": DraftTree.build(value["speculative_token_tree"]).depth}
        for required in ("method", "num_speculative_tokens"):
            if required not in value:
                raise ConfigError(f"speculative_config.{required}", "is required")
        return cls(**value)
