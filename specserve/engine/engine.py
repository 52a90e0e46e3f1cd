"""The engine loop: admit requests, schedule, run the model, turn tokens into outputs."""
from __future__ import annotations

import itertools
import json
import logging
import time

from specserve.attention.backend import get_attention_backend
from specserve.config import EngineConfig
from specserve.engine.detokenizer import IncrementalDetokenizer
from specserve.engine.kv_cache_manager import KVCacheManager
from specserve.engine.request import Request, RequestStatus
from specserve.engine.scheduler import Scheduler
from specserve.engine.warmup import warm_up
from specserve.errors import InvalidRequestError
from specserve.models.loader import build_model, load_tokenizer, open_model_source
from specserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from specserve.sampling_params import RequestOutputKind, SamplingParams
from specserve.spec_decode.factory import build_speculator
from specserve.spec_decode.metrics import SpecDecodeStats
from specserve.worker.cudagraph_mode import CUDAGraphMode
from specserve.worker.graph_recorder import CudaGraphRecorder
from specserve.worker.model_runner import ModelRunner
from specserve.worker.step_handle import StepHandle

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        source = open_model_source(config.model)
        self.tokenizer = load_tokenizer(source, config.tokenizer)
        backend = get_attention_backend(config.attention_backend)
        self.model, self.arch = build_model(source, config.torch_dtype, config.device, backend,
                                             load_format=config.load_format, seed=config.seed)
        config.finalize(self.arch.max_context)
        self.eos_token_ids = self._eos_ids(source)
        self.runner = ModelRunner(self.model, self.arch, config)
        spec = config.speculative_config
        if spec is not None:
            self.runner.set_speculator(build_speculator(spec, self.runner, backend), spec.forced_acceptance_prob)
        self.runner.initialize_kv_cache(backend)
        self.attention_backend = backend
        mode = CUDAGraphMode(config.cudagraph_mode)
        if mode is not CUDAGraphMode.NONE:
            self.runner.capture_graphs(mode, CudaGraphRecorder(self.runner.device), backend)
        self.kv = KVCacheManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching,
                                 config.max_model_len)
        self.scheduler = Scheduler(config, self.kv, num_lookahead_tokens=spec.num_draft_tokens if spec else 0,
                                   tree=spec.tree if spec else None)
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._counter = itertools.count()
        # Running totals for metrics: prompt tokens of admitted requests, and tokens generated, those of
        # requests later aborted included (a FINAL_ONLY caller that left never sees them in an output).
        self.num_prompt_tokens = 0
        self.num_generated_tokens = 0
        # Asynchronous scheduling: the step launched but not yet completed, and whether the next call must
        # complete it before scheduling again.
        self._inflight: StepHandle | None = None
        self._drain = False
        if config.warmup:
            warm_up(self)
        logger.info("specserve ready: %s (%s, %s, %d layers), max_model_len=%d%s", source.name, self.arch.architecture,
                    config.torch_dtype, self.arch.num_layers, config.max_model_len,
                    ", asynchronous scheduling" if config.async_scheduling else "")

    def _eos_ids(self, source) -> set[int]:
        ids = set(self.arch.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        gen_cfg = source.path / "generation_config.json" if source.path.is_dir() else None
        if gen_cfg is not None and gen_cfg.is_file():
            eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
            ids.update([eos] if isinstance(eos, int) else (eos or []))
        return ids

    # ---- requests -------------------------------------------------------------------------

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt", "is empty; give at least one character or token id")
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        ids = list(prompt)
        if not ids:
            raise InvalidRequestError("prompt_token_ids", "is empty; give at least one token id")
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.arch.vocab_size]
        if bad:
            raise InvalidRequestError("prompt_token_ids", f"{bad[:3]} are not token ids of this model "
                                      f"(vocabulary size {self.arch.vocab_size})")
        return ids

    def add_request(
        self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        """Validate and queue a request; raises InvalidRequestError and leaves the engine untouched on bad input."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("sampling_params", f"must be a SamplingParams, got {type(params).__name__}")
        request_id = str(next(self._counter)) if request_id is None else request_id
        if request_id in self.scheduler.requests:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use; give each request its own id")
        ids = self.tokenize(prompt)
        limit = self.config.max_model_len
        if len(ids) >= limit:
            raise InvalidRequestError(
                "prompt", f"is {len(ids)} tokens long but the model's context is {limit} tokens (max_model_len), "
                "which must also leave room for at least one generated token; shorten the prompt"
            )
        req = Request(request_id, ids, params, self.eos_token_ids, limit,
                      prompt=prompt if isinstance(prompt, str) else None, device=self.config.device)
        if params.detokenize:
            self._detok[request_id] = IncrementalDetokenizer(self.tokenizer, ids, params)
        self.scheduler.add_request(req)
        self.num_prompt_tokens += len(ids)
        return request_id

    def abort_request(self, request_id: str) -> bool:
        req = self.scheduler.requests.get(request_id)
        if req is None:
            return False
        self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
        self._detok.pop(request_id, None)
        return True

    @property
    def spec_stats(self) -> SpecDecodeStats:
        """Engine-wide acceptance statistics; empty without a speculator."""
        return self.scheduler.spec_stats

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished or self._inflight is not None

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.scheduler.requests)

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule and launch a step, and return the outputs of the step that completes: this one, or
        with asynchronous scheduling the one launched by the previous call, whose results the host reads
        while the device runs this one."""
        if self._inflight is not None and self._drain:
            # The scheduler stopped short of preempting requests the step in flight still uses.
            self._drain = False
            done, self._inflight = self._inflight, None
            return self._complete(done)
        sched = self.scheduler.schedule()
        launched = None if sched.is_empty else self.runner.launch(sched)
        self._drain = sched.stalled
        if self.config.async_scheduling:
            done, self._inflight = self._inflight, launched
        else:
            done = launched
        return [] if done is None else self._complete(done)

    def _complete(self, handle: StepHandle) -> list[RequestOutput]:
        result = self.runner.resolve(handle)
        sched = handle.sched
        before = {s.request.request_id: s.request.num_output_tokens for s in sched.scheduled}
        updated = self.scheduler.update(sched, result)
        outputs = []
        for req in updated:
            n_before = before[req.request_id]
            req.logprobs.extend(result.logprobs.get(req.request_id, [])[: req.num_output_tokens - n_before])
            out = self._output(req, n_before)
            self.num_generated_tokens += req.num_output_tokens - n_before
            if out is not None:
                outputs.append(out)
        return outputs

    def _output(self, req: Request, n_before: int) -> RequestOutput | None:
        """The request's output after a step that gave it tokens past n_before, in its output kind; None for a
        FINAL_ONLY request that goes on."""
        detok = self._detok.get(req.request_id)  # None without detokenization
        # Tokens past an EOS or stop token were already cut by the request itself.
        stop = detok.update(req.output_token_ids[n_before:]) if detok else None
        if stop is not None:
            req.truncate_output(n_before + detok.num_consumed)
            req.stop_reason = stop
            req.status = RequestStatus.FINISHED_STOPPED
        now = time.monotonic()
        if req.first_token_time is None:
            req.first_token_time = now
        finished = req.is_finished
        if finished:
            self.scheduler.finish(req, req.status)
            self._detok.pop(req.request_id, None)
        kind = req.params.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        # Only text and tokens the caller has not had yet: a FINAL_ONLY request's caller has had nothing.
        delta = detok.get_delta(finished) if detok else ""
        new_tokens = req.output_token_ids[0 if kind is RequestOutputKind.FINAL_ONLY else n_before:]
        lp = req.logprobs if req.params.logprobs is not None else None
        if kind is RequestOutputKind.CUMULATIVE:
            req.released_text += delta
            text, token_ids = req.released_text, list(req.output_token_ids)
        elif kind is RequestOutputKind.DELTA:
            text, token_ids, lp = delta, new_tokens, None if lp is None else lp[n_before:]
        else:
            text, token_ids = delta, new_tokens
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=(sum(next(iter(d.values())).logprob for d in req.logprobs)
                                if lp is not None else None),
            logprobs=lp,
            finish_reason=req.status.value if finished else None,
            stop_reason=req.stop_reason,
        )
        metrics = RequestMetrics(
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=req.num_output_tokens,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            num_model_tokens=req.num_model_tokens,
            num_preemptions=req.num_preemptions,
            first_token_time=req.first_token_time,
            finished_time=now if finished else None,
            arrival_time=req.arrival_time,
            spec=req.spec_stats.as_dict() if self.config.speculative_config else {},
        )
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [completion], finished,
                             delta_text=delta, delta_token_ids=new_tokens, metrics=metrics)
