"""Incremental detokenization and stop-string matching for one request's output."""
from __future__ import annotations

from specserve.sampling_params import RequestOutputKind, SamplingParams

# Prompt tokens kept as decoding context for the first generated tokens: decoders that
# depend on neighbouring tokens (sentencepiece's "▁" drops its space at the start of a
# text, byte-fallback pieces merge into one character) then render them as they appear
# in the full text.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a request's generated tokens into text as they arrive and watches for stop strings.

    Re-decoding the whole output after each token costs O(length) per token, and decoding
    tokens one by one breaks on characters split over several tokens and on decoders that
    look at neighbouring tokens. So each step decodes a short window instead: tokens
    [prefix_offset, read_offset) were already turned into text and only give context,
    tokens from read_offset on are new, and the new text is decode(window) with
    decode(context) cut off its front. While the window's text ends in U+FFFD, a multi-byte
    character still misses bytes from tokens not generated yet, so the text is held back; an
    output that finishes there ends in U+FFFD, as the decode of its tokens does.

    Usage per engine step: `update(new_ids)`; if it returns a stop string, keep only the
    first `num_consumed` of new_ids and finish the request; then `get_delta(finished)` gives
    the text to stream.

    A request whose text is read only once it is finished (FINAL_ONLY, as LLM.generate asks) and that
    watches no stop string decodes nothing per step: its tokens are decoded at the end in one window, the
    same algorithm over one window instead of many, which decodes to the same text (the windows exist to
    stream it) at a fraction of the host time.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self.tokenizer = tokenizer
        # The Rust tokenizer behind a fast transformers tokenizer decodes the same text several times
        # faster than the Python wrapper, which matters at two decodes per token per request.
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = params.stop
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self._max_stop_len = max(map(len, self.stop), default=0)
        # Only the prompt's tail is needed, as context; the rest is generated tokens.
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._text = ""
        self._num_sent_chars = 0
        # The stop string that ended the output, once one has been generated.
        self.stop_str: str | None = None
        # How many of the token ids given to the last update() were used (see update()).
        self.num_consumed = 0
        # Decode once at the end (see the class docstring).
        self._at_end = not self.stop and params.output_kind is RequestOutputKind.FINAL_ONLY

    @property
    def output_text(self) -> str:
        """The text generated so far, truncated at a stop string; held-back partial characters excluded (a request
        decoded at the end: empty until get_delta(finished=True))."""
        return self._text

    def update(self, new_token_ids: list[int]) -> str | None:
        """Appends generated tokens one by one; returns the stop string that ends the output, or None.

        Afterwards `num_consumed` is len(new_token_ids), or on a stop the number of them up to
        and including the token that completed the stop string: the ones after it are ignored
        and the caller should drop them. Must not be called again after a stop.
        """
        if self.stop_str is not None:
            raise RuntimeError(f"output already ended at stop string {self.stop_str!r}")
        if self._at_end:
            self._ids.extend(new_token_ids)
            self.num_consumed = len(new_token_ids)
            return None
        self.num_consumed = 0
        for token_id in new_token_ids:
            self.num_consumed += 1
            self._ids.append(token_id)
            old_len = len(self._text)
            self._text += self._decode_new_text()
            if self.stop and len(self._text) > old_len and self._find_stop(old_len):
                return self.stop_str
        return None

    def get_delta(self, finished: bool = False) -> str:
        """Text not returned by earlier calls.

        Until the output is finished (or ended at a stop string), the last
        len(longest stop string) - 1 characters are withheld: the next tokens could complete
        them into a stop string, and text already streamed cannot be taken back.
        """
        if finished and self.stop_str is None:
            self._text += self._decode_new_text(final=True)
        end = len(self._text)
        if not finished and self.stop_str is None:
            end -= max(self._max_stop_len - 1, 0)
        if end <= self._num_sent_chars:
            return ""
        delta = self._text[self._num_sent_chars:end]
        self._num_sent_chars = end
        return delta

    def _decode_new_text(self, final: bool = False) -> str:
        context = self._decode(self._ids[self._prefix_offset:self._read_offset])
        window = self._decode(self._ids[self._prefix_offset:])
        # No longer than the context: the new tokens decode to nothing yet (e.g. skipped
        # special tokens); keep them in the window so they count as context once text follows.
        if len(window) <= len(context) or (window.endswith("\ufffd") and not final):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return window[len(context):]

    def _decode(self, ids: list[int]) -> str:
        # Clean-up of tokenization spaces is off (the Rust decoder never does it): it rewrites a space
        # depending on the characters after it, so applied per window it would disagree with the full text.
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def _find_stop(self, old_len: int) -> bool:
        """Truncates the text at the earliest stop string that ends in text[old_len:]."""
        found: tuple[int, str] | None = None
        for stop in self.stop:
            # Earlier matches were caught by earlier calls, so a new one ends in the new
            # text and starts at most len(stop) - 1 characters before it.
            start = self._text.find(stop, max(0, old_len - len(stop) + 1))
            if start != -1 and (found is None or start < found[0]):
                found = (start, stop)
        if found is None:
            return False
        start, self.stop_str = found
        end = start + len(self.stop_str) if self.include_stop_str_in_output else start
        self._text = self._text[:end]
        return True
