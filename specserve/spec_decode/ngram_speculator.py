"""Prompt-lookup (n-gram) speculation: drafts copied from earlier in the context."""
from __future__ import annotations

from specserve.spec_decode.config import SpeculativeConfig
from specserve.spec_decode.ngram import NgramProposer
from specserve.spec_decode.speculator import DraftInput, Speculator


class NgramSpeculator(Speculator):
    def __init__(self, cfg: SpeculativeConfig):
        self.num_speculative_tokens = cfg.num_speculative_tokens
        self.proposer = NgramProposer(cfg.prompt_lookup_min, cfg.prompt_lookup_max, cfg.num_speculative_tokens)

    def propose(self, inp: DraftInput) -> list[list[int]]:
        drafts = self.proposer.propose(inp.contexts)
        return [d[:m] for d, m in zip(drafts, inp.max_drafts)]
