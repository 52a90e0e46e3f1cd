"""The offline API: LLM(model=...).generate(prompts, SamplingParams) and LLM.chat(messages)."""
from __future__ import annotations

from dataclasses import fields, replace

from tqdm import tqdm

from specserve.config import EngineConfig
from specserve.engine.engine import LLMEngine
from specserve.errors import InvalidRequestError
from specserve.outputs import RequestOutput
from specserve.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    """An engine for batch generation in this process.

    Keyword arguments are EngineConfig fields, e.g. LLM("smollm2-135m", max_model_len=2048).
    """

    def __init__(self, model: str = "smollm2-135m", **kwargs):
        known = {f.name for f in fields(EngineConfig)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"LLM() got unknown arguments {unknown}; engine options are {sorted(known)}")
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise InvalidRequestError("sampling_params", f"got {len(params)} for {len(prompts)} prompts; give one, or one per prompt")
        # Only the final outputs are returned, so the engine need not build the ones in between.
        final_only = {id(sp): replace(sp, output_kind=RequestOutputKind.FINAL_ONLY)
                      for sp in params if isinstance(sp, SamplingParams)}
        params = [final_only.get(id(sp), sp) for sp in params]
        # A bad prompt withdraws the ones queued before it, so nothing is left half-run.
        ids = []
        try:
            for p, sp in zip(prompts, params):
                ids.append(self.engine.add_request(p, sp))
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(c) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError("messages", "this model's tokenizer has no chat template; use generate() with plain prompts")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise InvalidRequestError(f"messages[{i}]", "must be a dict with 'role' and 'content'")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Generating", unit="req", disable=not use_tqdm or len(ids) < 2)
        while len(final) < len(ids):
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [final[i] for i in ids]
