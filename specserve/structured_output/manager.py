"""Compiles structured-output specs against the model's vocabulary and hands each request its matcher.

Compiling a grammar (the token masks of every grammar state) is the costly part and depends only on the
spec, so compiled grammars are cached by spec: a schema that many requests share compiles once. Compiling
runs when the engine core admits a request (EngineCore.add_request), between steps, never inside one.
"""
from __future__ import annotations

from collections import OrderedDict

from specserve.structured_output.request_grammar import RequestGrammar
from specserve.structured_output.spec import StructuredOutput

# Compiled grammars kept; the oldest unused is dropped past this.
CACHE_SIZE = 256


class StructuredOutputManager:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: set[int]):
        """vocab_size: the width of the model's logits (may exceed the tokenizer's: the extra ids are never
        allowed); stop_token_ids: the engine's EOS ids, the only tokens that end a completed grammar."""
        import xgrammar as xgr

        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=sorted(stop_token_ids))
        self.compiler = xgr.GrammarCompiler(info, max_threads=2)
        self._compiled: OrderedDict[tuple[str, str], object] = OrderedDict()

    def compiled(self, spec: StructuredOutput):
        """The spec's compiled grammar, from the cache when an equal spec was compiled before."""
        found = self._compiled.get(spec.key)
        if found is None:
            found = self._compiled[spec.key] = self.compiler.compile_grammar(spec.grammar())
            if len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(spec.key)
        return found

    def grammar_for(self, spec: StructuredOutput) -> RequestGrammar:
        """A fresh grammar state for one request (it can roll back any number of tokens)."""
        matcher = self._xgr.GrammarMatcher(self.compiled(spec))
        return RequestGrammar(matcher)
