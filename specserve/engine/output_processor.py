"""The front end's half of a request: the core's new token ids in, text and RequestOutputs out.

Detokenization and stop strings live here, beside whoever owns the text (the offline LLMEngine, or
the API server's process), so the core never spends its step time on them. A stop string found in
a step's text ends the request here; the caller then aborts it in the core, whose tokens past the
stop are dropped.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from specserve.engine.detokenizer import IncrementalDetokenizer
from specserve.engine.messages import CoreOutput
from specserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from specserve.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    arrival_time: float
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    # Text already handed to the caller of a cumulative request (stop-string look-ahead holds the rest back).
    released_text: str = ""
    first_token_time: float | None = None


@dataclass
class ProcessedOutputs:
    outputs: list[RequestOutput]
    # Requests that ended here (a stop string) while the core still runs them: abort them there.
    to_abort: list[str]


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float | None = None) -> None:
        detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params) if params.detokenize else None
        self.requests[request_id] = RequestState(request_id, prompt, prompt_token_ids, params, detok,
                                                 time.monotonic() if arrival_time is None else arrival_time)

    def abort_request(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def process(self, core_outputs: list[CoreOutput]) -> ProcessedOutputs:
        outputs, to_abort = [], []
        now = time.monotonic()
        for co in core_outputs:
            state = self.requests.get(co.request_id)
            if state is None:
                continue  # aborted here while the core's step ran
            finish_reason, stop_reason = co.finish_reason, co.stop_reason
            n_before = len(state.output_token_ids)
            state.output_token_ids.extend(co.new_token_ids)
            if co.new_logprobs is not None:
                state.logprobs.extend(co.new_logprobs)
            detok = state.detokenizer
            # Tokens past an EOS or stop token were already cut by the core.
            stop = detok.update(co.new_token_ids) if detok else None
            if stop is not None:
                del state.output_token_ids[n_before + detok.num_consumed:]
                del state.logprobs[n_before + detok.num_consumed:]
                if finish_reason is None:
                    to_abort.append(co.request_id)
                finish_reason, stop_reason = "stop", stop
            if state.first_token_time is None and co.new_token_ids:
                state.first_token_time = now
            if finish_reason is not None:
                del self.requests[co.request_id]
            out = self._output(state, co, n_before, finish_reason, stop_reason, now)
            if out is not None:
                outputs.append(out)
        return ProcessedOutputs(outputs, to_abort)

    @staticmethod
    def _output(state: RequestState, co: CoreOutput, n_before: int, finish_reason: str | None,
                stop_reason: int | str | None, now: float) -> RequestOutput | None:
        """The request's output in its output kind; None for a FINAL_ONLY request that goes on."""
        finished = finish_reason is not None
        kind = state.params.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        # Only text and tokens the caller has not had yet: a FINAL_ONLY request's caller has had nothing.
        detok = state.detokenizer
        delta = detok.get_delta(finished) if detok else ""
        new_tokens = state.output_token_ids[0 if kind is RequestOutputKind.FINAL_ONLY else n_before:]
        lp = state.logprobs if state.params.logprobs is not None else None
        if kind is RequestOutputKind.CUMULATIVE:
            state.released_text += delta
            text, token_ids = state.released_text, list(state.output_token_ids)
        elif kind is RequestOutputKind.DELTA:
            text, token_ids, lp = delta, new_tokens, None if lp is None else lp[n_before:]
        else:
            text, token_ids = delta, new_tokens
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=(sum(next(iter(d.values())).logprob for d in state.logprobs)
                                if lp is not None else None),
            logprobs=lp,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
        )
        metrics = RequestMetrics(
            num_prompt_tokens=len(state.prompt_token_ids),
            num_output_tokens=len(state.output_token_ids),
            num_cached_tokens=co.num_cached_tokens,
            num_model_tokens=co.num_model_tokens,
            num_preemptions=co.num_preemptions,
            first_token_time=state.first_token_time,
            finished_time=now if finished else None,
            arrival_time=state.arrival_time,
            spec=co.spec or {},
        )
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, [completion], finished,
                             delta_text=delta, delta_token_ids=new_tokens, metrics=metrics)
