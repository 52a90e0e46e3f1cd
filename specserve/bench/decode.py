"""Decode speed: per-token latency at batch 1 and throughput at larger batches, in every CUDA
graph mode, without speculation and with EAGLE-3 at a forced acceptance rate, beside transformers'
generate and the weight-bytes / bandwidth limit, all in one run on one device.

Each figure is decode tokens/s: the clock starts once every request of the batch has its first token
(prefill done) and stops when the last request has its N new tokens (EOS ignored, greedy). For
transformers, whose generate is timed as a whole, it is B * (N - 1) / (t(N) - t(1)), which removes the
prefill and first token the same way.
"""
from __future__ import annotations

import gc
import logging
import math
import platform
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from specserve.bench.decode_plan import DecodeBenchConfig, EngineJob, HFJob, bench_config_error, plan
from specserve.bench.models import BenchModel, build_hf_model, distinct_params, prepare_model, write_random_eagle3_head
from specserve.bench.results import BenchResults, EngineRecord, ModelInfo, Row
from specserve.bench.timing import make_prompts, measure_bandwidth, time_engine, time_hf
from specserve.distributed.collective_probe import step_collective_seconds
from specserve.spec_decode.config import MAX_SPECULATIVE_TOKENS

logger = logging.getLogger(__name__)

BLOCK_SIZE = 16
RUNS_PER_FIGURE = 3


class DecodeBench:
    """Runs a plan, keeping the results (and the files named) current after every figure, so a run
    stopped by a time limit still leaves what it measured."""

    def __init__(self, cfg: DecodeBenchConfig, json_path: Path | None = None, markdown_path: Path | None = None):
        if cfg.device.startswith("cuda") and not torch.cuda.is_available():
            raise bench_config_error("device", "CUDA was asked for but torch sees no GPU; use --preset tiny --device cpu")
        self.cfg = cfg
        self.json_path, self.markdown_path = json_path, markdown_path
        self.jobs = plan(cfg)
        self._start = time.perf_counter()
        self._models: dict[str, BenchModel] = {}
        self._heads: dict[str, Path] = {}
        self._tmp = tempfile.TemporaryDirectory(prefix="specserve-bench-")
        measured = cfg.bandwidth_tbps is None
        bandwidth = measure_bandwidth(cfg.device) if measured else cfg.bandwidth_tbps * 1e12
        self.results = BenchResults(asdict(cfg), _device_name(cfg.device), _versions(), bandwidth, measured)

    def run(self) -> BenchResults:
        engines = sum(isinstance(j, EngineJob) for j in self.jobs)
        figures = sum(len(j.batch_sizes) for j in self.jobs)
        self._log(f"plan: {engines} engines, {len(self.jobs) - engines} transformers models, {figures} figures; "
                  f"bandwidth {self.results.bandwidth_bytes_s / 1e12:.2f} TB/s "
                  f"({'measured' if self.results.bandwidth_measured else 'given'})")
        try:
            for i, job in enumerate(self.jobs, 1):
                what = (f"{job.model} {job.mode} {job.spec_label}" if isinstance(job, EngineJob)
                        else f"{job.model} transformers")
                if self._out_of_time():
                    self._fail(job, job.batch_sizes, "skipped: time budget spent")
                    continue
                self._log(f"[{i}/{len(self.jobs)}] {what}")
                rows_before = len(self.results.rows)
                try:
                    self._run_engine(job) if isinstance(job, EngineJob) else self._run_hf(job)
                except Exception as e:  # one failed combination must not cost the rest of the run
                    logger.exception("%s failed", what)
                    done = {r.batch for r in self.results.rows[rows_before:]}
                    self._fail(job, [b for b in job.batch_sizes if b not in done], f"{type(e).__name__}: {e}")
                # Outside the except block, so the traceback no longer holds the failed engine.
                gc.collect()
                if self.cfg.device.startswith("cuda"):
                    torch.cuda.empty_cache()
        finally:
            self._tmp.cleanup()
        self._log("done")
        return self.results

    # ---- jobs -------------------------------------------------------------------------------------

    def _run_engine(self, job: EngineJob) -> None:
        from specserve.config import EngineConfig
        from specserve.engine.engine import LLMEngine

        model = self._model(job.model)
        cfg = self.cfg
        spec = None
        if job.spec is not None:
            spec = job.spec.speculative_config(self._head(model), cfg.draft_quantization,
                                               cfg.draft_tensor_parallel_size)
        max_batch = max(job.batch_sizes)
        max_model_len = cfg.prompt_len + cfg.new_tokens + 16
        # Room for every request's context and draft lookahead at once: nothing is ever preempted.
        blocks_per_req = math.ceil((max_model_len + MAX_SPECULATIVE_TOKENS) / BLOCK_SIZE) + 1
        sizes = None if job.capture_sizes is None else list(job.capture_sizes)
        config = EngineConfig(
            model=model.path, load_format=model.load_format, device=cfg.device, dtype=cfg.dtype, seed=cfg.seed,
            kv_cache_dtype=cfg.kv_cache_dtype, max_model_len=max_model_len, block_size=BLOCK_SIZE, num_kv_blocks=max_batch * blocks_per_req + 1,
            max_num_seqs=max_batch,
            # The whole batch's prompts in one step: every request then decodes in lockstep.
            max_num_batched_tokens=max(2048, max_batch * cfg.prompt_len),
            enable_prefix_caching=False, speculative_config=spec, cudagraph_mode=job.mode,
            tensor_parallel_size=cfg.tensor_parallel_size, all_reduce=cfg.all_reduce, quantization=cfg.quantization,
            cudagraph_capture_sizes=sizes,
            # Each batch size runs once untimed before its timed runs, which is all the warm-up it needs; the
            # engine's start-up warm-up of every shape would only lengthen the build.
            warmup=False)
        record = EngineRecord(job.model, job.mode, job.spec_label,
                              capture_sizes=sizes or ("none" if job.mode == "NONE" else "default"))
        self.results.engines.append(record)
        start = time.perf_counter()
        engine = LLMEngine(config)
        try:
            self._measure_engine(job, engine, record, start)
        finally:
            engine.core.close()  # stops the other tensor-parallel ranks before the next engine starts them

    def _measure_engine(self, job: EngineJob, engine, record: EngineRecord, start: float) -> None:
        cfg = self.cfg
        record.build_s = time.perf_counter() - start
        record.capture_s = getattr(engine.runner, "capture_seconds", None)
        record.graph_memory_bytes = getattr(engine.runner, "graph_memory_bytes", None)
        self._log(f"  engine built in {record.build_s:.1f} s"
                  + (f" (graph capture {record.capture_s:.1f} s)" if record.capture_s is not None else ""))
        if job.model not in self.results.models:
            self.results.models[job.model] = ModelInfo(job.model, self._model(job.model).random_weights,
                                                       *distinct_params(engine.core.model), cfg.tensor_parallel_size,
                                                       engine.core.config.all_reduce if cfg.tensor_parallel_size > 1
                                                       else None)
        self._save()
        vocab = engine.core.arch.vocab_size
        for b in job.batch_sizes:
            if self._out_of_time():
                self._fail(job, [b], "skipped: time budget spent")
                continue
            time_engine(engine, make_prompts(b, cfg.prompt_len, vocab, cfg.seed + 1), min(cfg.new_tokens, 16))
            # The median of three runs: a batch-1 run of a small model lasts a tenth of a second, so one host
            # hiccup moves it visibly.
            runs = [time_engine(engine, make_prompts(b, cfg.prompt_len, vocab, cfg.seed + r), cfg.new_tokens)
                    for r in range(RUNS_PER_FIGURE)]
            t = sorted(runs, key=lambda run: run.tok_s)[RUNS_PER_FIGURE // 2]
            collectives = None
            if cfg.tensor_parallel_size > 1:
                # A decode step's tokens and logits rows: each request's token, and its drafts when verifying.
                rows = b * (1 + (job.spec.k if job.spec else 0))
                collectives = 1e3 * step_collective_seconds(engine.core, rows, rows)
            self._add(Row(job.model, "specserve", job.mode, job.spec_label, b, t.tok_s, t.accept_len, t.drafting_share,
                          collectives))

    def _run_hf(self, job: HFJob) -> None:
        model = self._model(job.model)
        start = time.perf_counter()
        hf = build_hf_model(model, self.cfg.torch_dtype, self.cfg.device)
        self._log(f"  transformers model built in {time.perf_counter() - start:.1f} s")
        vocab = model.hf_config["vocab_size"]
        for b in job.batch_sizes:
            if self._out_of_time():
                self._fail(job, [b], "skipped: time budget spent")
                continue
            time_hf(hf, make_prompts(b, self.cfg.prompt_len, vocab, self.cfg.seed + 1), 4, self.cfg.device)
            t = time_hf(hf, make_prompts(b, self.cfg.prompt_len, vocab, self.cfg.seed), self.cfg.hf_new_tokens,
                        self.cfg.device)
            self._add(Row(job.model, "transformers", "eager", "none", b, t.tok_s))

    def _model(self, name: str) -> BenchModel:
        if name not in self._models:
            self._models[name] = prepare_model(name, Path(self._tmp.name) / "models", self.cfg.torch_dtype)
        return self._models[name]

    def _head(self, model: BenchModel) -> Path:
        """One random EAGLE-3 head per model, shared by every speculative engine of that model."""
        if model.name not in self._heads:
            start = time.perf_counter()
            path = Path(self._tmp.name) / "heads" / model.name.replace("/", "_")
            self._heads[model.name] = write_random_eagle3_head(path, model.hf_config, self.cfg.torch_dtype,
                                                               self.cfg.device, self.cfg.seed)
            self._log(f"  random EAGLE-3 head written in {time.perf_counter() - start:.1f} s")
        return self._heads[model.name]

    # ---- bookkeeping ------------------------------------------------------------------------------

    def _out_of_time(self) -> bool:
        budget = self.cfg.time_budget_s
        return budget is not None and time.perf_counter() - self._start > budget

    def _add(self, row: Row) -> None:
        self.results.rows.append(row)
        extra = f", {row.accept_len:.2f} tokens/step" if row.accept_len else ""
        self._log(f"  {row.system} batch {row.batch}: {row.tok_s:.1f} tok/s, {row.ms_per_token:.2f} ms/token{extra}")
        self._save()

    def _fail(self, job: EngineJob | HFJob, batches, error: str) -> None:
        for b in batches:
            if isinstance(job, EngineJob):
                self.results.rows.append(Row(job.model, "specserve", job.mode, job.spec_label, b, error=error))
            else:
                self.results.rows.append(Row(job.model, "transformers", "eager", "none", b, error=error))
        self._save()

    def _save(self) -> None:
        from specserve.bench.report import to_json, to_markdown

        if self.json_path is not None:
            self.json_path.write_text(to_json(self.results))
        if self.markdown_path is not None:
            self.markdown_path.write_text(to_markdown(self.results))

    def _log(self, message: str) -> None:
        logger.info("[bench %5.0fs] %s", time.perf_counter() - self._start, message)


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def _versions() -> dict:
    import transformers

    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    try:
        import triton

        versions["triton"] = triton.__version__
    except ImportError:
        pass
    return versions


def run_decode_bench(cfg: DecodeBenchConfig, json_path: Path | None = None,
                     markdown_path: Path | None = None) -> BenchResults:
    return DecodeBench(cfg, json_path, markdown_path).run()
