"""The engine core: admit token-id requests, schedule, run the model, report each step's new tokens.

It owns the model runner, the scheduler and the KV cache, and nothing that deals in text: the front
end (LLMEngine in this process, the API server in another) tokenizes, detokenizes, matches stop
strings and aborts a request whose text hit one. The core is not thread-safe; one thread calls it.
"""
from __future__ import annotations

import json
import logging
import time

from specserve.attention.backend import get_attention_backend
from specserve.config import EngineConfig
from specserve.distributed.parallel_state import rank_device, tp_group
from specserve.distributed.workers import TPWorkers
from specserve.engine.kv_cache_manager import KVCacheManager
from specserve.engine.messages import CoreOutput, CoreReady, CoreRequest, EngineStats
from specserve.engine.request import Request, RequestStatus
from specserve.engine.scheduler import Scheduler
from specserve.engine.step_costs_measure import measure_step_costs
from specserve.engine.warmup import warm_up
from specserve.errors import ConfigError, InvalidRequestError
from specserve.models.loader import ModelSource, build_model, load_tokenizer, open_model_source
from specserve.spec_decode.factory import build_speculator
from specserve.spec_decode.metrics import SpecDecodeStats
from specserve.spec_decode.policy import SpeculationPolicy
from specserve.spec_decode.step_costs import StepCosts
from specserve.structured_output.manager import StructuredOutputManager
from specserve.worker.cudagraph_mode import CUDAGraphMode
from specserve.worker.graph_recorder import CudaGraphRecorder
from specserve.worker.model_runner import ModelRunner
from specserve.worker.step_handle import StepHandle

logger = logging.getLogger(__name__)


def eos_token_ids(source: ModelSource, arch, tokenizer) -> set[int]:
    """Every token id that ends a generation: the model config's, the tokenizer's and generation_config's."""
    ids = set(arch.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    gen_cfg = source.path / "generation_config.json" if source.path.is_dir() else None
    if gen_cfg is not None and gen_cfg.is_file():
        eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    return ids


class EngineCore:
    def __init__(self, config: EngineConfig, tokenizer=None, source: ModelSource | None = None):
        """`tokenizer` and `source` are the front end's when it shares this process (the core reads only the
        tokenizer's EOS id), so the model's files are opened once."""
        if config.data_parallel_size != 1:
            n = config.data_parallel_size
            raise ConfigError("data_parallel_size",
                              f"is {n}, but an engine in one process is one replica: replicas run behind the API "
                              f"server (specserve serve --data-parallel-size {n}); offline, run one LLM per GPU, "
                              "each in a process of its own with its CUDA_VISIBLE_DEVICES")
        self.config = config
        source = source if source is not None else open_model_source(config.model, config.revision)
        tokenizer = tokenizer if tokenizer is not None else load_tokenizer(source, config.tokenizer)
        backend = get_attention_backend(config.attention_backend)
        # Tensor parallel: this process is rank 0, the scheduler's; the others follow its steps.
        self.tp_workers = None
        if config.tensor_parallel_size > 1:
            config.device = rank_device(config.device, 0)
            self.tp_workers = TPWorkers(config, source)
        try:
            self._build(config, tokenizer, source, backend)
        except BaseException:
            # The workers wait in a collective or for a message that will not come: stop them and leave the
            # group now, not when the failed core is collected, so that the next engine of this process starts.
            if self.tp_workers is not None:
                self.tp_workers.abort()
            raise

    def _build(self, config: EngineConfig, tokenizer, source: ModelSource, backend) -> None:
        """Everything after the other ranks started: the model, the runner, the KV cache, graphs, scheduler."""
        self.model, self.arch = build_model(source, config.torch_dtype, config.device, backend,
                                             load_format=config.load_format, seed=config.seed, tp=tp_group(),
                                             quantization=config.quantization, kv_cache_dtype=config.kv_cache_dtype)
        config.finalize(self.arch.max_context)
        self.eos_token_ids = eos_token_ids(source, self.arch, tokenizer)
        self.tokenizer = tokenizer
        # Built with the first request that has a structured_output (reading the vocabulary takes a while).
        self._structured: StructuredOutputManager | None = None
        # model.cfg: the rank's shard of the architecture, which sizes its KV cache.
        self.runner = ModelRunner(self.model, self.model.cfg, config, self.tp_workers)
        spec = config.speculative_config
        if spec is not None:
            self.runner.set_speculator(build_speculator(spec, self.runner, backend), spec.forced_acceptance_prob)
        if self.tp_workers is not None:
            self.tp_workers.wait_until_loaded()
        self.runner.initialize_kv_cache(backend)
        if self.tp_workers is not None:
            self.tp_workers.wait_until_ready()
        self.attention_backend = backend
        mode = CUDAGraphMode(config.cudagraph_mode)
        if mode is not CUDAGraphMode.NONE:
            self.runner.capture_graphs(mode, CudaGraphRecorder(self.runner.device), backend)
        self.kv = KVCacheManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching,
                                 config.max_model_len)
        policy = (SpeculationPolicy(spec.num_speculative_tokens, spec.dynamic, spec.disable_by_batch_size)
                  if spec else None)
        self.scheduler = Scheduler(config, self.kv, num_lookahead_tokens=spec.num_draft_tokens if spec else 0,
                                   tree=spec.tree if spec else None, policy=policy)
        # Running totals for metrics, as vLLM counts them. Prompt tokens processed: a core request's prompt once
        # its prefill produced its first token (each sequence of an n > 1 request is a core request, so its
        # prompt counts n times), and of those, the ones its first scheduling found in the prefix cache. Tokens
        # generated, those of requests later aborted included.
        self.num_prompt_tokens = 0
        self.num_cached_prompt_tokens = 0
        self.num_generated_tokens = 0
        # Asynchronous scheduling: the step launched but not yet completed, and whether the next call must
        # complete it before scheduling again.
        self._inflight: StepHandle | None = None
        self._drain = False
        if config.warmup:
            warm_up(self)
        if spec is not None and spec.dynamic:
            # After the warm-up: its compilations would count as step time.
            policy.set_costs(StepCosts.load(spec.cost_table) if spec.cost_table else measure_step_costs(self))
        logger.info("specserve ready: %s (%s, %s, %d layers), max_model_len=%d%s", source.name, self.arch.architecture,
                    config.torch_dtype, self.arch.num_layers, config.max_model_len,
                    ", asynchronous scheduling" if config.async_scheduling else "")

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (also done when the core is collected); nothing to do at 1."""
        if self.tp_workers is not None:
            self.runner.release_graphs()  # they hold the group's collectives, which must go before the group
            self.tp_workers.close()

    def ready_message(self) -> CoreReady:
        return CoreReady(self.config.max_model_len, self.kv.num_blocks, self.config.block_size)

    # ---- requests -------------------------------------------------------------------------

    def add_request(self, request: CoreRequest) -> None:
        """Validate and queue a request; raises InvalidRequestError and leaves the core untouched on bad input."""
        ids, params = request.prompt_token_ids, request.params
        if request.request_id in self.scheduler.requests:
            raise InvalidRequestError("request_id", f"{request.request_id!r} is already in use; "
                                      "give each request its own id")
        if not ids:
            raise InvalidRequestError("prompt_token_ids", "is empty; give at least one token id")
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.arch.vocab_size]
        if bad:
            raise InvalidRequestError("prompt_token_ids", f"{bad[:3]} are not token ids of this model "
                                      f"(vocabulary size {self.arch.vocab_size})")
        outside = [t for t in params.logit_bias or () if t >= self.arch.vocab_size]
        if outside:
            raise InvalidRequestError("logit_bias", f"key {outside[0]} is not a token id of this model "
                                      f"(vocabulary size {self.arch.vocab_size})")
        limit = self.config.max_model_len
        if len(ids) >= limit:
            raise InvalidRequestError(
                "prompt", f"is {len(ids)} tokens long but the model's context is {limit} tokens (max_model_len), "
                "which must also leave room for at least one generated token; shorten the prompt"
            )
        self.scheduler.add_request(Request(request.request_id, ids, params, self.eos_token_ids, limit,
                                           device=self.config.device, grammar=self._grammar(params)))

    def _grammar(self, params):
        """The grammar state of a request with a structured_output, None for one without."""
        spec = params.structured_output
        if spec is None:
            return None
        if self._structured is None:
            self._structured = StructuredOutputManager(self.tokenizer, self.arch.vocab_size, self.eos_token_ids)
        return self._structured.grammar_for(spec)

    def abort_request(self, request_id: str) -> bool:
        req = self.scheduler.requests.get(request_id)
        if req is None:
            return False
        self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
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

    def stats(self) -> EngineStats:
        spec, pool, policy = self.spec_stats, self.kv.pool, self.scheduler.policy
        return EngineStats(len(self.scheduler.running), len(self.scheduler.waiting),
                           self.kv.num_blocks - pool.num_free, self.kv.num_blocks, pool.queries, pool.hits,
                           spec.num_drafted, spec.num_accepted, tuple(spec.drafted_per_position),
                           tuple(spec.accepted_per_position), self.num_prompt_tokens, self.num_cached_prompt_tokens,
                           self.num_generated_tokens,
                           policy.steps_drafting if policy else 0, policy.steps_without_drafts if policy else 0)

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[CoreOutput]:
        """Schedule and launch a step, and return the new tokens of the step that completes: this one, or
        with asynchronous scheduling the one launched by the previous call, whose results the host reads
        while the device runs this one."""
        if self._inflight is not None and self._drain:
            # The scheduler stopped short of preempting requests the step in flight still uses.
            self._drain = False
            done, self._inflight = self._inflight, None
            return self._complete(done)
        started = time.perf_counter()
        if self._inflight is not None:
            # Under asynchronous scheduling a step's time is the engine's whole loop from its launch to the next:
            # its caller's work on the outputs (per token, so more after a step that accepted drafts) included.
            self._inflight.sched.seconds = started - self._inflight.sched.started
        sched = self.scheduler.schedule()
        sched.started = started
        self._drain = sched.stalled
        if not self.config.async_scheduling:
            return [] if sched.is_empty else self._complete(self.runner.launch(sched))
        # The step in flight completes while this one runs: right after this one is launched, or, for a step
        # with grammar masks, once its forward is enqueued, since its masks start from the tokens of the step
        # in flight (ModelRunner.launch; docs/design.md, 'Structured output').
        done, self._inflight = self._inflight, None
        outputs: list[CoreOutput] = []

        def complete_previous() -> None:
            nonlocal done
            if done is not None:
                outputs.extend(self._complete(done))
                done = None

        self._inflight = None if sched.is_empty else self.runner.launch(sched, complete_previous)
        complete_previous()
        return outputs

    def _complete(self, handle: StepHandle) -> list[CoreOutput]:
        result = self.runner.resolve(handle)
        sched = handle.sched
        if sched.seconds is None and sched.started:  # synchronous scheduling: launch to results
            sched.seconds = time.perf_counter() - sched.started
        before = {s.request.request_id: s.request.num_output_tokens for s in sched.scheduled}
        outputs = []
        with_spec = self.config.speculative_config is not None
        for req in self.scheduler.update(sched, result):
            rid = req.request_id
            new = req.output_token_ids[before[rid]:]
            if before[rid] == 0 and new:  # its prefill is done (a preempted request keeps its output tokens)
                self.num_prompt_tokens += req.num_prompt_tokens
                self.num_cached_prompt_tokens += max(req.num_cached_tokens, 0)
            self.num_generated_tokens += len(new)
            logprobs = result.logprobs.get(rid, [])[:len(new)] if req.params.logprobs is not None else None
            finished = req.is_finished
            if finished:
                self.scheduler.finish(req, req.status)
            outputs.append(CoreOutput(
                rid, new, req.status.value if finished else None, req.stop_reason, logprobs,
                max(req.num_cached_tokens, 0), req.num_model_tokens, req.num_preemptions,
                req.spec_stats.as_dict() if finished and with_spec else None))
        return outputs
