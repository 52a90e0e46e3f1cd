"""Prompt-lookup (n-gram) speculation: drafts copied from earlier in the context."""
from __future__ import annotations

from specserve.spec_decode.config import SpeculativeConfig
from specserve.spec_decode.ngram import NgramProposer
from specserve.spec_decode.speculator import Speculator


class NgramSpeculator(Speculator):
    on_device = False

    def __init__(self, cfg: SpeculativeConfig):
        self.num_speculative_tokens = cfg.num_speculative_tokens
        self.proposer = NgramProposer(cfg.prompt_lookup_min, cfg.prompt_lookup_max, cfg.num_speculative_tokens)

    def propose_from_contexts(self, contexts: list[list[int]]) -> list[list[int]]:
        return self.proposer.propose(contexts)
