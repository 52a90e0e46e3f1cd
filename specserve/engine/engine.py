"""The offline engine: the engine core and its front end (tokenizer, output processing) in one process."""
from __future__ import annotations

import itertools

from specserve.config import EngineConfig
from specserve.engine.core import EngineCore
from specserve.engine.messages import CoreRequest
from specserve.engine.output_processor import OutputProcessor
from specserve.engine.parallel_sampling import sequence_requests
from specserve.errors import InvalidRequestError
from specserve.models.loader import load_tokenizer, open_model_source
from specserve.outputs import RequestOutput
from specserve.sampling_params import SamplingParams
from specserve.spec_decode.metrics import SpecDecodeStats


class LLMEngine:
    def __init__(self, config: EngineConfig, core_factory=EngineCore):
        """`core_factory(config, tokenizer, source)` builds the core; tests pass a subclass of EngineCore."""
        self.config = config
        source = open_model_source(config.model, config.revision)
        self.tokenizer = load_tokenizer(source, config.tokenizer)
        self.core = core_factory(config, self.tokenizer, source)
        self.processor = OutputProcessor(self.tokenizer)
        self._counter = itertools.count()

    # The core's parts, for callers that inspect or instrument them (benchmarks, tests).
    @property
    def runner(self):
        return self.core.runner

    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def kv(self):
        return self.core.kv

    @property
    def attention_backend(self):
        return self.core.attention_backend

    @property
    def spec_stats(self) -> SpecDecodeStats:
        return self.core.spec_stats

    @property
    def num_unfinished_requests(self) -> int:
        return self.core.num_unfinished_requests

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    # ---- requests -------------------------------------------------------------------------

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt", "is empty; give at least one character or token id")
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        return list(prompt)

    def add_request(
        self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        """Validate and queue a request; raises InvalidRequestError and leaves the engine untouched on bad input."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("sampling_params", f"must be a SamplingParams, got {type(params).__name__}")
        request_id = str(next(self._counter)) if request_id is None else request_id
        if request_id in self.processor.requests:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use; give each request its own id")
        ids = self.tokenize(prompt)
        sequences = sequence_requests(request_id, params)
        added = []
        try:
            for seq in sequences:
                self.core.add_request(CoreRequest(seq.core_request_id, ids, seq.params))
                added.append(seq.core_request_id)
        except Exception:
            for core_request_id in added:
                self.core.abort_request(core_request_id)
            raise
        self.processor.add_request(request_id, prompt if isinstance(prompt, str) else None, ids, params, sequences)
        return request_id

    def abort_request(self, request_id: str) -> bool:
        """Abort a request, every one of its sequences; False if it was not running."""
        aborted = [self.core.abort_request(r) for r in self.processor.abort_request(request_id) or [request_id]]
        return any(aborted)

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One engine-core step; the outputs of the requests it advanced (see EngineCore.step)."""
        processed = self.processor.process(self.core.step())
        for request_id in processed.to_abort:
            self.core.abort_request(request_id)
        return processed.outputs
