"""What `specserve bench decode` measures: its settings (DecodeBenchConfig, the presets, the EAGLE-3 settings) and
the plan of engine and transformers jobs they make, most wanted first (bench/decode.py runs it)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specserve.errors import ConfigError
from specserve.quantization.config import check_quantization
from specserve.spec_decode.config import MAX_SPECULATIVE_TOKENS
from specserve.worker.cudagraph_mode import CUDAGraphMode

GRAPH_MODES = [m.name for m in CUDAGraphMode]
CAPTURE_POLICIES = ("auto", "default", "batches")


def bench_config_error(field_name: str, message: str) -> ConfigError:
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
            raise bench_config_error("spec", f"k must be in [1, {MAX_SPECULATIVE_TOKENS}], got {self.k}")
        if not 0.0 <= self.p <= 1.0:
            raise bench_config_error("spec", f"the forced acceptance p must be in [0, 1], got {self.p}")

    @property
    def label(self) -> str:
        return f"eagle3 k={self.k} p={self.p:g}" + (" dynamic" if self.dynamic else "")

    def speculative_config(self, head, quantization: str | None = None, draft_tensor_parallel_size: int = 1) -> dict:
        """The engine's speculative config: EAGLE-3 with this head (a directory or shipped name) at this setting,
        its weights quantized as `quantization` says (None: the model's dtype), placed as
        draft_tensor_parallel_size says (1: whole on rank 0; the target's size: sharded like it)."""
        return {"method": "eagle3", "model": str(head), "num_speculative_tokens": self.k,
                "forced_acceptance_prob": self.p, "dynamic": self.dynamic, "quantization": quantization,
                "draft_tensor_parallel_size": draft_tensor_parallel_size}

    @classmethod
    def parse(cls, text: str) -> SpecSetting:
        """'K:P', e.g. '3:0.8', or 'K:P:dynamic'."""
        k, _, rest = text.partition(":")
        p, _, policy = rest.partition(":")
        if policy not in ("", "dynamic"):
            raise bench_config_error("spec", f"{text!r}: after K:P only ':dynamic' may follow, got {policy!r}")
        try:
            k_value, p_value = int(k), float(p)
        except ValueError as e:
            raise bench_config_error("spec", f"{text!r} is not K:P or K:P:dynamic (e.g. 3:0.8)") from e
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
    # How the ranks all-reduce (EngineConfig.all_reduce): "nccl", "one_shot", or None for the engine's choice.
    all_reduce: str | None = None
    # Weight quantization of every engine's target and of its EAGLE-3 head, each chosen apart (EngineConfig's
    # and SpeculativeConfig's `quantization`): None keeps the model's dtype.
    quantization: str | None = None
    draft_quantization: str | None = None
    # Where every EAGLE-3 head runs under tensor parallelism (SpeculativeConfig's field): 1, whole on rank 0;
    # tensor_parallel_size, sharded like the target. Run the benchmark once with each to compare them.
    draft_tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        check_quantization(self.quantization)
        check_quantization(self.draft_quantization, "draft_quantization")
        if not self.models:
            raise bench_config_error("models", "name at least one model or shape")
        if self.device.split(":")[0] not in ("cpu", "cuda"):
            raise bench_config_error("device", f"must be 'cpu' or 'cuda', got {self.device!r}")
        on_cuda = self.device.startswith("cuda")
        if self.dtype is None:
            self.dtype = "bfloat16" if on_cuda else "float32"
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise bench_config_error("dtype", f"must be float32, bfloat16 or float16, got {self.dtype!r}")
        from specserve.attention.kv_quant import KV_CACHE_DTYPES

        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise bench_config_error("kv_cache_dtype", f"must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        self.modes, self.default_mode = [m.upper() for m in self.modes], self.default_mode.upper()
        for mode in [*self.modes, self.default_mode]:
            if mode not in GRAPH_MODES:
                raise bench_config_error("modes", f"unknown graph mode {mode!r}; choose from {', '.join(GRAPH_MODES)}")
            if mode != "NONE" and not on_cuda:
                raise bench_config_error("modes", f"{mode} needs CUDA graphs; on {self.device} use NONE only")
        for name in ("batch_sizes", "mode_batch_sizes", "spec_batch_sizes", "hf_batch_sizes"):
            sizes = getattr(self, name)
            if any(not isinstance(b, int) or b < 1 for b in sizes):
                raise bench_config_error(name, f"must be positive integers, got {sizes}")
        if not self.batch_sizes:
            raise bench_config_error("batch_sizes", "name at least one batch size for the default mode")
        if self.modes and not self.mode_batch_sizes:
            raise bench_config_error("mode_batch_sizes", "graph modes are measured at these; name at least one")
        if self.spec and not self.spec_batch_sizes:
            raise bench_config_error("spec_batch_sizes", "speculation is measured at these; name at least one")
        if self.prompt_len < 1:
            raise bench_config_error("prompt_len", f"must be >= 1, got {self.prompt_len}")
        if self.new_tokens < 2 or self.hf_new_tokens < 2:
            raise bench_config_error("new_tokens", "decode speed needs at least 2 new tokens per request (the first comes "
                       f"with the prefill); got {self.new_tokens} and {self.hf_new_tokens} for transformers")
        if self.capture_sizes not in CAPTURE_POLICIES:
            raise bench_config_error("capture_sizes", f"must be one of {', '.join(CAPTURE_POLICIES)}, got {self.capture_sizes!r}")
        if self.bandwidth_tbps is not None and self.bandwidth_tbps <= 0:
            raise bench_config_error("bandwidth_tbps", f"must be > 0, got {self.bandwidth_tbps}")
        if type(self.tensor_parallel_size) is not int or self.tensor_parallel_size < 1:
            raise bench_config_error("tensor_parallel_size", f"must be an integer >= 1, got {self.tensor_parallel_size!r}")
        from specserve.config import ALL_REDUCES

        if self.all_reduce is not None and self.all_reduce not in ALL_REDUCES:
            raise bench_config_error("all_reduce", f"must be one of {', '.join(ALL_REDUCES)}, got {self.all_reduce!r}")
        draft_tp = self.draft_tensor_parallel_size
        if draft_tp not in (1, self.tensor_parallel_size):
            raise bench_config_error("draft_tensor_parallel_size", f"must be 1 (the EAGLE-3 head whole on rank 0) or "
                                     f"tensor_parallel_size ({self.tensor_parallel_size}, sharded like the target), "
                                     f"got {draft_tp!r}")
        if self.time_budget_s is not None and self.time_budget_s <= 0:
            raise bench_config_error("time_budget_s", f"must be > 0, got {self.time_budget_s}")

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
        raise bench_config_error("preset", f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
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
