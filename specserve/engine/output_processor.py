"""The front end's half of a request: the core's new token ids in, text and RequestOutputs out.

Detokenization and stop strings live here, beside whoever owns the text (the offline LLMEngine, or
the API server's process), so the core never spends its step time on them. A stop string found in
a step's text ends that sequence here; the caller then aborts it in the core, whose tokens past the
stop are dropped.

A request with n > 1 runs as n core requests, one per sequence (parallel_sampling.py); here each
has its own detokenizer and stop strings, and their outputs come back as one RequestOutput with a
CompletionOutput per sequence. The request is finished when every sequence is.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from specserve.engine.detokenizer import IncrementalDetokenizer
from specserve.engine.messages import CoreOutput
from specserve.engine.parallel_sampling import SequenceRequest
from specserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from specserve.sampling_params import RequestOutputKind, SamplingParams
from specserve.spec_decode.metrics import SpecDecodeStats


@dataclass
class SequenceState:
    """One sequence of a request: what the core generated for it, and what went to the caller."""

    core_request_id: str
    index: int
    detokenizer: IncrementalDetokenizer | None
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    # Text already handed to the caller of a cumulative request (stop-string look-ahead holds the rest back).
    released_text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # The core's counts for this sequence, as of its latest output.
    num_cached_tokens: int = 0
    num_model_tokens: int = 0
    num_preemptions: int = 0
    spec: dict | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    sequences: list[SequenceState]
    first_token_time: float | None = None

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.sequences)


@dataclass
class ProcessedOutputs:
    outputs: list[RequestOutput]
    # Core requests that ended here (a stop string) while the core still runs them: abort them there.
    to_abort: list[str]


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        # Core request id -> the request and the sequence it runs, while the sequence goes on.
        self._sequences: dict[str, tuple[RequestState, SequenceState]] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, sequences: list[SequenceRequest],
                    arrival_time: float | None = None) -> None:
        """sequences: the request's core requests (parallel_sampling.sequence_requests)."""
        seqs = [SequenceState(s.core_request_id, s.index,
                              IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params)
                              if params.detokenize else None) for s in sequences]
        state = RequestState(request_id, prompt, prompt_token_ids, params,
                             time.monotonic() if arrival_time is None else arrival_time, seqs)
        self.requests[request_id] = state
        for seq in seqs:
            self._sequences[seq.core_request_id] = (state, seq)

    def request_of(self, core_request_id: str) -> str | None:
        """The id of the request a running core request belongs to."""
        entry = self._sequences.get(core_request_id)
        return None if entry is None else entry[0].request_id

    def abort_request(self, request_id: str) -> list[str]:
        """Forget a request; returns the core requests of its sequences still running, to abort in the core."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return []
        running = [s.core_request_id for s in state.sequences if not s.finished]
        for core_request_id in running:
            self._sequences.pop(core_request_id, None)
        return running

    def process(self, core_outputs: list[CoreOutput]) -> ProcessedOutputs:
        """One RequestOutput per request that advanced, in the order of their first core output."""
        to_abort: list[str] = []
        # Request id -> (its state, each advanced sequence's token count before these outputs).
        advanced: dict[str, tuple[RequestState, dict[int, int]]] = {}
        now = time.monotonic()
        for co in core_outputs:
            entry = self._sequences.get(co.request_id)
            if entry is None:
                continue  # aborted here while the core's step ran
            state, seq = entry
            before = advanced.setdefault(state.request_id, (state, {}))[1]
            before.setdefault(seq.index, len(seq.output_token_ids))
            if self._update(seq, co):
                to_abort.append(co.request_id)
            if state.first_token_time is None and co.new_token_ids:
                state.first_token_time = now
            if seq.finished:
                del self._sequences[co.request_id]
        outputs = []
        for state, before in advanced.values():
            if state.finished:
                del self.requests[state.request_id]
            out = self._output(state, before, now)
            if out is not None:
                outputs.append(out)
        return ProcessedOutputs(outputs, to_abort)

    @staticmethod
    def _update(seq: SequenceState, co: CoreOutput) -> bool:
        """Take a core output into its sequence; True when a stop string ended the sequence here while the
        core goes on with it."""
        n_before = len(seq.output_token_ids)
        seq.output_token_ids.extend(co.new_token_ids)
        if co.new_logprobs is not None:
            seq.logprobs.extend(co.new_logprobs)
        seq.num_cached_tokens, seq.num_model_tokens, seq.num_preemptions = (
            co.num_cached_tokens, co.num_model_tokens, co.num_preemptions)
        seq.spec = co.spec
        seq.finish_reason, seq.stop_reason = co.finish_reason, co.stop_reason
        detok = seq.detokenizer
        # Tokens past an EOS or stop token were already cut by the core.
        stop = detok.update(co.new_token_ids) if detok else None
        if stop is None:
            return False
        del seq.output_token_ids[n_before + detok.num_consumed:]
        del seq.logprobs[n_before + detok.num_consumed:]
        still_running = co.finish_reason is None
        seq.finish_reason, seq.stop_reason = "stop", stop
        return still_running

    @staticmethod
    def _output(state: RequestState, before: dict[int, int], now: float) -> RequestOutput | None:
        """The request's output in its output kind; None for a FINAL_ONLY request that goes on. before: the
        token count of each sequence that advanced, as of the request's previous output."""
        finished = state.finished
        kind = state.params.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        # A delta output holds the sequences that advanced; the others, every sequence.
        seqs = ([state.sequences[i] for i in sorted(before)] if kind is RequestOutputKind.DELTA
                else state.sequences)
        completions = [_completion(seq, kind, before.get(seq.index, len(seq.output_token_ids)),
                                   state.params.logprobs is not None) for seq in seqs]
        everyone = state.sequences
        spec = None
        if any(s.spec for s in everyone):
            total = SpecDecodeStats()
            for s in everyone:
                if s.spec:
                    total.add(SpecDecodeStats.from_dict(s.spec))
            spec = total.as_dict()
        metrics = RequestMetrics(
            num_prompt_tokens=len(state.prompt_token_ids),
            num_output_tokens=sum(len(s.output_token_ids) for s in everyone),
            # The prompt is counted once, as the first sequence ran it; later ones find it in the cache.
            num_cached_tokens=everyone[0].num_cached_tokens,
            num_model_tokens=sum(s.num_model_tokens for s in everyone),
            num_preemptions=sum(s.num_preemptions for s in everyone),
            first_token_time=state.first_token_time,
            finished_time=now if finished else None,
            arrival_time=state.arrival_time,
            spec=spec or {},
        )
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, completions, finished,
                             metrics=metrics)


def _completion(seq: SequenceState, kind: RequestOutputKind, n_before: int, with_logprobs: bool) -> CompletionOutput:
    """A sequence's CompletionOutput in the request's output kind. A delta holds only the text and tokens new
    since the request's previous output; a FINAL_ONLY request's caller has had nothing before."""
    detok = seq.detokenizer
    delta = detok.get_delta(seq.finished) if detok else ""
    new_tokens = seq.output_token_ids[0 if kind is RequestOutputKind.FINAL_ONLY else n_before:]
    lp = seq.logprobs if with_logprobs else None
    if kind is RequestOutputKind.CUMULATIVE:
        seq.released_text += delta
        text, token_ids = seq.released_text, list(seq.output_token_ids)
    elif kind is RequestOutputKind.DELTA:
        text, token_ids, lp = delta, new_tokens, None if lp is None else lp[n_before:]
    else:
        text, token_ids = delta, new_tokens
    return CompletionOutput(
        index=seq.index,
        text=text,
        token_ids=token_ids,
        cumulative_logprob=(sum(next(iter(d.values())).logprob for d in seq.logprobs) if with_logprobs else None),
        logprobs=lp,
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
    )
