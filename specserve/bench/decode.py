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
import random
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from specserve.bench.models import BenchModel, build_hf_model, distinct_params, prepare_model, write_random_eagle3_head
from specserve.distributed.collective_probe import step_collective_seconds
from specserve.errors import ConfigError
from specserve.quantization.config import check_quantization
from specserve.spec_decode.config import MAX_SPECULATIVE_TOKENS
from specserve.worker.cudagraph_mode import CUDAGraphMode

logger = logging.getLogger(__name__)

GRAPH_MODES = [m.name for m in CUDAGraphMode]
CAPTURE_POLICIES = ("auto", "default", "batches")
BLOCK_SIZE = 16
RUNS_PER_FIGURE = 3


def _bad(field_name: str, message: str) -> ConfigError:
    return ConfigError(f"bench.{field_name}", message)


@dataclass(frozen=True)
class SpecSetting:
    """EAGLE-3 with k drafts per step, each accepted with probability p whatever the models say; dynamic: the
    engine's policy decides per step whether to draft (docs/design.md, 'Dynamic speculation')."""

    k: int
    p: float
    dynamic: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.k <= MAX_SPECULATIVE_TOKENS:
            raise _bad("spec", f"k must be in [1, {MAX_SPECULATIVE_TOKENS}], got {self.k}")
        if not 0.0 <= self.p <= 1.0:
            raise _bad("spec", f"the forced acceptance p must be in [0, 1], got {self.p}")

    @property
    def label(self) -> str:
        return f"eagle3 k={self.k} p={self.p:g}" + (" dynamic" if self.dynamic else "")

    def speculative_config(self, head, quantization: str | None = None) -> dict:
        """The engine's speculative config: EAGLE-3 with this head (a directory or shipped name) at this setting,
        its weights quantized as `quantization` says (None: the model's dtype)."""
        return {"method": "eagle3", "model": str(head), "num_speculative_tokens": self.k,
                "forced_acceptance_prob": self.p, "dynamic": self.dynamic, "quantization": quantization}

    @classmethod
    def parse(cls, text: str) -> SpecSetting:
        """'K:P', e.g. '3:0.8', or 'K:P:dynamic'."""
        k, _, rest = text.partition(":")
        p, _, policy = rest.partition(":")
        if policy not in ("", "dynamic"):
            raise _bad("spec", f"{text!r}: after K:P only ':dynamic' may follow, got {policy!r}")
        try:
            k_value, p_value = int(k), float(p)
        except ValueError as e:
            raise _bad("spec", f"{text!r} is not K:P or K:P:dynamic (e.g. 3:0.8)") from e
        return cls(k_value, p_value, policy == "dynamic")


@dataclass
class DecodeBenchConfig:
    # Shape names (SHAPES in bench/models.py: random weights) or model names / paths (their own weights).
    models: list[str]
    device: str = "cuda"
    dtype: str | None = None
    # Every engine's KV cache element type (EngineConfig.kv_cache_dtype): "auto" or "fp8".
    kv_cache_dtype: str = "auto"
    # Graph modes measured without speculation at mode_batch_sizes.
    modes: list[str] = field(default_factory=lambda: list(GRAPH_MODES))
    mode_batch_sizes: list[int] = field(default_factory=lambda: [1, 64])
    # The mode of the batch sweep and of every speculative run.
    default_mode: str = "FULL_AND_PIECEWISE"
    batch_sizes: list[int] = field(default_factory=lambda: [1, 8, 32, 64, 128, 256])
    spec: list[SpecSetting] = field(default_factory=list)
    spec_batch_sizes: list[int] = field(default_factory=lambda: [1, 8, 64])
    hf_batch_sizes: list[int] = field(default_factory=lambda: [1, 64])
    prompt_len: int = 64
    new_tokens: int = 128
    hf_new_tokens: int = 32
    # auto: the engine's own capture sizes for the first engine of each model (its capture time is the
    # one to report) and only the measured sizes for the others, which saves minutes of capture;
    # default: the engine's own everywhere; batches: the measured sizes everywhere.
    capture_sizes: str = "auto"
    # None: measured by a device-to-device copy at the start.
    bandwidth_tbps: float | None = None
    # Jobs and batches not started after this many seconds are recorded as skipped.
    time_budget_s: float | None = None
    seed: int = 0
    # Ranks each engine shards its target over (one GPU each); > 1 also measures each step's collectives.
    tensor_parallel_size: int = 1
    # Weight quantization of every engine's target and of its EAGLE-3 head, each chosen apart (EngineConfig's
    # and SpeculativeConfig's `quantization`): None keeps the model's dtype.
    quantization: str | None = None
    draft_quantization: str | None = None

    def __post_init__(self) -> None:
        check_quantization(self.quantization)
        check_quantization(self.draft_quantization, "draft_quantization")
        if not self.models:
            raise _bad("models", "name at least one model or shape")
        if self.device.split(":")[0] not in ("cpu", "cuda"):
            raise _bad("device", f"must be 'cpu' or 'cuda', got {self.device!r}")
        on_cuda = self.device.startswith("cuda")
        if self.dtype is None:
            self.dtype = "bfloat16" if on_cuda else "float32"
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise _bad("dtype", f"must be float32, bfloat16 or float16, got {self.dtype!r}")
        from specserve.attention.kv_quant import KV_CACHE_DTYPES

        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise _bad("kv_cache_dtype", f"must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        self.modes, self.default_mode = [m.upper() for m in self.modes], self.default_mode.upper()
        for mode in [*self.modes, self.default_mode]:
            if mode not in GRAPH_MODES:
                raise _bad("modes", f"unknown graph mode {mode!r}; choose from {', '.join(GRAPH_MODES)}")
            if mode != "NONE" and not on_cuda:
                raise _bad("modes", f"{mode} needs CUDA graphs; on {self.device} use NONE only")
        for name in ("batch_sizes", "mode_batch_sizes", "spec_batch_sizes", "hf_batch_sizes"):
            sizes = getattr(self, name)
            if any(not isinstance(b, int) or b < 1 for b in sizes):
                raise _bad(name, f"must be positive integers, got {sizes}")
        if not self.batch_sizes:
            raise _bad("batch_sizes", "name at least one batch size for the default mode")
        if self.modes and not self.mode_batch_sizes:
            raise _bad("mode_batch_sizes", "graph modes are measured at these; name at least one")
        if self.spec and not self.spec_batch_sizes:
            raise _bad("spec_batch_sizes", "speculation is measured at these; name at least one")
        if self.prompt_len < 1:
            raise _bad("prompt_len", f"must be >= 1, got {self.prompt_len}")
        if self.new_tokens < 2 or self.hf_new_tokens < 2:
            raise _bad("new_tokens", "decode speed needs at least 2 new tokens per request (the first comes "
                       f"with the prefill); got {self.new_tokens} and {self.hf_new_tokens} for transformers")
        if self.capture_sizes not in CAPTURE_POLICIES:
            raise _bad("capture_sizes", f"must be one of {', '.join(CAPTURE_POLICIES)}, got {self.capture_sizes!r}")
        if self.bandwidth_tbps is not None and self.bandwidth_tbps <= 0:
            raise _bad("bandwidth_tbps", f"must be > 0, got {self.bandwidth_tbps}")
        if type(self.tensor_parallel_size) is not int or self.tensor_parallel_size < 1:
            raise _bad("tensor_parallel_size", f"must be an integer >= 1, got {self.tensor_parallel_size!r}")
        if self.time_budget_s is not None and self.time_budget_s <= 0:
            raise _bad("time_budget_s", f"must be > 0, got {self.time_budget_s}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


PRESETS: dict[str, dict] = {
    # The tables of BENCHMARKS.md, 'Decode speed', on one GPU, sized for one 10-minute run.
    "full": dict(models=["llama3-8b", "smollm2-135m"], device="cuda",
                 spec=[SpecSetting(3, 0.6), SpecSetting(3, 0.8), SpecSetting(5, 0.6), SpecSetting(5, 0.8)],
                 time_budget_s=540.0),
    # Seconds on a CPU: the same code paths on a 4-layer random model.
    "tiny": dict(models=["tiny"], device="cpu", modes=["NONE"], mode_batch_sizes=[1], default_mode="NONE",
                 batch_sizes=[1, 4], spec=[SpecSetting(2, 0.8)], spec_batch_sizes=[1, 4], hf_batch_sizes=[1, 4],
                 prompt_len=16, new_tokens=12, hf_new_tokens=32),
}


def preset_config(name: str, **overrides) -> DecodeBenchConfig:
    """A preset with the fields given (not None) replaced."""
    if name not in PRESETS:
        raise _bad("preset", f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    return DecodeBenchConfig(**{**PRESETS[name], **{k: v for k, v in overrides.items() if v is not None}})


# ---- the plan -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineJob:
    """One engine (built once, graphs captured once) measured at several batch sizes."""

    model: str
    mode: str
    spec: SpecSetting | None
    batch_sizes: tuple[int, ...]
    capture_sizes: tuple[int, ...] | None

    @property
    def spec_label(self) -> str:
        return self.spec.label if self.spec else "none"


@dataclass(frozen=True)
class HFJob:
    model: str
    batch_sizes: tuple[int, ...]


def _capture_sizes(cfg: DecodeBenchConfig, mode: str, spec: SpecSetting | None, batches: list[int],
                   first: bool) -> tuple[int, ...] | None:
    if mode == "NONE" or cfg.capture_sizes == "default" or (cfg.capture_sizes == "auto" and first):
        return None
    # A verify step carries 1 + k tokens per request; piecewise graphs are keyed by tokens.
    per_req = 1 + (spec.k if spec else 0)
    return tuple(sorted(set(batches) | {b * per_req for b in batches}))


def plan(cfg: DecodeBenchConfig) -> list[EngineJob | HFJob]:
    """Jobs, most wanted first, so a run cut short keeps the figures that matter: per model the
    default mode without speculation (it also gives every speculative row its baseline) and
    transformers; then speculation; then the other graph modes."""
    jobs: list[EngineJob | HFJob] = []
    mode = cfg.default_mode
    for m in cfg.models:
        sizes = set(cfg.batch_sizes) | (set(cfg.spec_batch_sizes) if cfg.spec else set())
        if mode in cfg.modes:
            sizes |= set(cfg.mode_batch_sizes)
        batches = sorted(sizes)
        jobs.append(EngineJob(m, mode, None, tuple(batches), _capture_sizes(cfg, mode, None, batches, True)))
        if cfg.hf_batch_sizes:
            jobs.append(HFJob(m, tuple(sorted(set(cfg.hf_batch_sizes)))))
    for m in cfg.models:
        for s in cfg.spec:
            batches = sorted(set(cfg.spec_batch_sizes))
            jobs.append(EngineJob(m, mode, s, tuple(batches), _capture_sizes(cfg, mode, s, batches, False)))
    for m in cfg.models:
        for other in cfg.modes:
            if other != mode:
                batches = sorted(set(cfg.mode_batch_sizes))
                jobs.append(EngineJob(m, other, None, tuple(batches), _capture_sizes(cfg, other, None, batches, False)))
    return jobs


# ---- results --------------------------------------------------------------------------------------


@dataclass
class Row:
    model: str
    system: str  # "specserve" or "transformers"
    mode: str  # graph mode; "eager" for transformers
    spec: str  # "none" or SpecSetting.label
    batch: int
    tok_s: float | None = None
    # Tokens emitted per verification step (accepted drafts + 1), measured.
    accept_len: float | None = None
    # The share of the timed steps whose requests drafted (the dynamic policy's decisions).
    drafting_share: float | None = None
    # Under tensor parallelism: the time of one step's collectives alone (distributed/collective_probe.py).
    collectives_ms: float | None = None
    error: str | None = None

    @property
    def ms_per_token(self) -> float | None:
        """Time between two tokens of one request."""
        return None if not self.tok_s else 1000.0 * self.batch / self.tok_s


@dataclass
class EngineRecord:
    model: str
    mode: str
    spec: str
    # Engine construction, graph capture included.
    build_s: float | None = None
    # From the runner where it has them (ModelRunner.capture_seconds, .graph_memory_bytes).
    capture_s: float | None = None
    graph_memory_bytes: int | None = None
    capture_sizes: list[int] | str = "default"


@dataclass
class ModelInfo:
    name: str
    random_weights: bool
    num_params: int
    weight_bytes: int  # read by one GPU each step: under tensor parallelism, rank 0's shard
    tensor_parallel_size: int = 1


@dataclass
class BenchResults:
    config: dict
    device_name: str
    versions: dict
    bandwidth_bytes_s: float
    bandwidth_measured: bool
    models: dict[str, ModelInfo] = field(default_factory=dict)
    engines: list[EngineRecord] = field(default_factory=list)
    rows: list[Row] = field(default_factory=list)

    def limit_tok_s(self, row: Row) -> float | None:
        """Weight-read limit without speculation: every step reads all weights once for `batch` tokens (under
        tensor parallelism each GPU its shard, all at once: the GPUs' bandwidths add up)."""
        info = self.models.get(row.model)
        if info is None or row.spec != "none":
            return None
        return row.batch * self.bandwidth_bytes_s / info.weight_bytes

    def find(self, model: str, system: str, batch: int, mode: str | None = None, spec: str = "none") -> Row | None:
        for r in self.rows:
            if (r.model, r.system, r.batch, r.spec) == (model, system, batch, spec) and r.tok_s \
                    and (mode is None or r.mode == mode):
                return r
        return None


# ---- measuring ------------------------------------------------------------------------------------


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure_bandwidth(device: str) -> float:
    """Bytes/s of a large device-to-device copy, which reads and writes every byte once."""
    n = 1 << 30 if device.startswith("cuda") else 1 << 26
    src = torch.ones(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    reps = 10
    start = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    _sync(device)
    return 2 * n * reps / (time.perf_counter() - start)


def make_prompts(batch: int, prompt_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Distinct random prompts of one length (ids from 3: past the pad, BOS and EOS ids of the shapes)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(prompt_len)] for _ in range(batch)]


@dataclass
class DecodeTiming:
    tokens: int
    seconds: float
    accept_len: float | None = None
    drafting_share: float | None = None

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


def time_engine(engine, prompts: list[list[int]], new_tokens: int) -> DecodeTiming:
    """Decode tokens/s of one batch: from the step that gives the last request its first token to the end."""
    from specserve.sampling_params import RequestOutputKind, SamplingParams

    # Delta outputs: cumulative ones would time the copy of every request's tokens at every step.
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    stats, policy = engine.spec_stats, engine.scheduler.policy
    steps0, emitted0 = stats.num_steps, stats.num_emitted

    def decisions() -> tuple[int, int]:
        return (policy.steps_drafting, policy.steps_without_drafts) if policy is not None else (0, 0)

    ids = [engine.add_request(p, params) for p in prompts]
    counts: dict[str, int] = {}
    start, before = None, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            counts[out.request_id] = out.metrics.num_output_tokens
        if start is None and len(counts) == len(ids):
            start, before, decided = time.perf_counter(), sum(counts.values()), decisions()
    seconds = time.perf_counter() - start
    total = sum(counts.values())
    if total != len(ids) * new_tokens:
        raise RuntimeError(f"expected {len(ids)} x {new_tokens} tokens, got {total}; was a request cut short?")
    steps = stats.num_steps - steps0
    accept = (stats.num_emitted - emitted0) / steps if steps else None
    drafting, without = (now - then for now, then in zip(decisions(), decided))
    share = drafting / (drafting + without) if policy is not None and drafting + without else None
    return DecodeTiming(total - before, seconds, accept, share)


def time_hf(hf, prompts: list[list[int]], new_tokens: int, device: str) -> DecodeTiming:
    x = torch.tensor(prompts, device=device)

    def generate(n: int) -> float:
        _sync(device)
        start = time.perf_counter()
        with torch.inference_mode():
            hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                        eos_token_id=None, pad_token_id=0)
        _sync(device)
        return time.perf_counter() - start

    # The fastest of a few runs each: one run's noise can exceed a short decode on a small model.
    decode = min(generate(new_tokens) for _ in range(3)) - min(generate(1) for _ in range(3))
    if decode <= 0:
        raise RuntimeError("transformers' decode time came out non-positive; use more --hf-new-tokens")
    return DecodeTiming(len(prompts) * (new_tokens - 1), decode)


# ---- running --------------------------------------------------------------------------------------


class DecodeBench:
    """Runs a plan, keeping the results (and the files named) current after every figure, so a run
    stopped by a time limit still leaves what it measured."""

    def __init__(self, cfg: DecodeBenchConfig, json_path: Path | None = None, markdown_path: Path | None = None):
        if cfg.device.startswith("cuda") and not torch.cuda.is_available():
            raise _bad("device", "CUDA was asked for but torch sees no GPU; use --preset tiny --device cpu")
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
            spec = job.spec.speculative_config(self._head(model), cfg.draft_quantization)
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
            tensor_parallel_size=cfg.tensor_parallel_size, quantization=cfg.quantization,
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
                                                       *distinct_params(engine.core.model), cfg.tensor_parallel_size)
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
