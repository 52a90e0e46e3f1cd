"""Engine configuration: typed dataclasses validated at construction."""
from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass

import torch

from specserve.errors import ConfigError
from specserve.quantization.config import check_quantization

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LOAD_FORMATS = ("auto", "dummy")
ALL_REDUCES = ("nccl", "one_shot")


def _check(cond: bool, field: str, message: str) -> None:
    if not cond:
        raise ConfigError(field, message)


_MEMORY_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
                 "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_memory_size(text: str) -> int:
    """Bytes from a size as written on a command line: "4GiB", "512 MiB", "1.5GB", "4294967296". KiB, MiB, GiB
    and TiB are powers of 1024, KB, MB, GB and TB powers of 1000 (any case). Raises ValueError."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*", text)
    unit = match and _MEMORY_UNITS.get(match.group(2).lower())
    if unit is None:
        raise ValueError(f"{text!r} is not a memory size; write bytes, or a number and a unit, such as 4GiB, "
                         "512MiB or 2GB (KiB, MiB, GiB, TiB: powers of 1024; KB, MB, GB, TB: of 1000)")
    size = int(float(match.group(1)) * unit)
    if size < 1:
        raise ValueError(f"{text!r} is less than a byte; give a positive size")
    return size


@dataclass
class EngineConfig:
    """Everything the engine needs to know before it loads a model.

    None means "choose for me": dtype float32 on CPU and bfloat16 on CUDA;
    max_model_len from the model (capped at 8192); the KV cache's size from
    num_kv_blocks, else kv_cache_memory_bytes, else gpu_memory_utilization
    (worker/kv_sizing.py).
    """

    # A built-in name, a Hugging Face directory, a .gguf file or a Hugging Face id (org/name); tokenizer: any of
    # these too (None: the model's).
    model: str = "smollm2-135m"
    tokenizer: str | None = None
    # The branch, tag or commit of a Hugging Face id to load (None: main).
    revision: str | None = None
    dtype: str | None = None
    device: str | None = None
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    # The share of the GPU's total memory this engine may use in all: weights, activations, CUDA graphs and
    # the KV cache, which gets what the rest leaves (as vLLM's --gpu-memory-utilization). What other processes
    # or engines hold does not count, but the share must be free when the engine starts. Not read on the CPU,
    # nor with an explicit size below.
    gpu_memory_utilization: float = 0.9
    # The KV cache's size in bytes (every model's layers, a drafter's included), in place of sizing it by
    # gpu_memory_utilization.
    kv_cache_memory_bytes: int | None = None
    # The KV cache's element type: "auto" (the model's dtype) or "fp8" (e4m3 with per-layer scales, twice the
    # tokens of bfloat16 in the same memory; docs/design.md, 'FP8 KV cache').
    kv_cache_dtype: str = "auto"
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    # "auto": the weights in the model's files; "dummy": random weights made on the device, so that speed can be
    # measured for a shape whose weights we lack (a config.json and a tokenizer are enough).
    load_format: str = "auto"
    # "torch" (exact reference, any device) or "triton" (paged kernels); None: triton on CUDA, torch on CPU.
    attention_backend: str | None = None
    # A SpeculativeConfig, or its dict / JSON form as on vLLM's command line.
    speculative_config: object = None
    # CUDA graph mode as in vLLM (docs/design.md, 'Graph modes'): NONE, PIECEWISE, FULL, FULL_DECODE_ONLY or
    # FULL_AND_PIECEWISE; None: FULL_AND_PIECEWISE on CUDA with the triton backend, else NONE.
    cudagraph_mode: str | None = None
    # Batch sizes (num_tokens; num_reqs for full decode graphs) to capture; None: 1, 2, 4, 8, then every 8
    # up to 256, capped at the scheduler's limits.
    cudagraph_capture_sizes: list[int] | None = None
    # Re-run every replayed step eagerly and raise on any difference (slow; for debugging). Also set by
    # the environment variable SPECSERVE_DEBUG_CUDAGRAPH=1.
    debug_cudagraph: bool = False
    # Schedule step N+1 while step N runs on the device, so that host work (scheduling, input preparation,
    # detokenization) overlaps the GPU instead of idling it, as vLLM's --async-scheduling. None: on with
    # CUDA and the triton backend, unless the speculator drafts on the host (n-gram).
    async_scheduling: bool | None = None
    # Run every kernel shape a request can hit once at start-up (engine/warmup.py), so that no request waits
    # for a kernel to compile. None: on CUDA, where kernels compile; off on the CPU.
    warmup: bool | None = None
    # Ranks the model is sharded over (docs/design.md, 'Tensor parallelism'), one process each: this one and
    # tensor_parallel_size - 1 it starts. On CUDA rank r runs on cuda:r.
    tensor_parallel_size: int = 1
    # How the ranks all-reduce (distributed/one_shot.py): "nccl", or "one_shot" (one kernel over buffers every
    # rank of one node maps, for messages up to its buffer; NCCL past it). None: "one_shot" where it runs (2, 4
    # or 8 ranks on one node's GPUs that reach each other's memory), which is faster than NCCL at every size it
    # takes (BENCHMARKS.md, 'Tensor parallelism'); else "nccl".
    all_reduce: str | None = None
    # Several nodes (specserve/distributed/rendezvous.py): nodes sharing the ranks, and where they meet (node 0's
    # address and a port; None: MASTER_ADDR / MASTER_PORT, else on one node 127.0.0.1 and a free port).
    nnodes: int = 1
    master_addr: str | None = None
    master_port: int | None = None
    # Engine replicas behind one API server (as vLLM's --data-parallel-size), each an engine core process with
    # GPUs of its own (docs/design.md, 'Data parallelism'). Only the server runs replicas; an engine in one
    # process (LLM, LLMEngine) is one replica.
    data_parallel_size: int = 1
    # Weight quantization (docs/design.md, 'FP8 weights'): "fp8" quantizes an unquantized checkpoint's projections
    # as it loads; None loads the checkpoint as it is (an FP8 checkpoint as FP8), as vLLM's --quantization.
    quantization: str | None = None

    def __post_init__(self) -> None:
        from specserve.spec_decode.config import SpeculativeConfig

        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        _check(isinstance(self.model, str) and bool(self.model), "model",
               "give a model name (e.g. smollm2-135m), a Hugging Face directory, a .gguf file or a Hugging Face id")
        _check(self.revision is None or (isinstance(self.revision, str) and bool(self.revision)), "revision",
               f"must be a branch, tag or commit of the model's Hugging Face repository, got {self.revision!r}")
        check_quantization(self.quantization)
        _check(self.load_format in LOAD_FORMATS, "load_format",
               f"must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}")
        _check(self.dtype is None or self.dtype in DTYPES, "dtype",
               f"must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        _check(self.device.split(":")[0] in ("cpu", "cuda"), "device", f"must be 'cpu' or 'cuda', got {self.device!r}")
        if self.device.startswith("cuda"):
            _check(torch.cuda.is_available(), "device",
                   "CUDA was asked for but torch sees no GPU; use device='cpu' or install a CUDA build of torch")
            # The CUDA path runs Triton kernels (specserve/kernels/); the CPU path runs without them.
            _check(importlib.util.find_spec("triton") is not None, "device",
                   "the CUDA path runs Triton kernels but Triton is not installed; pip install triton, "
                   "or use device='cpu'")
        if self.attention_backend is None:
            self.attention_backend = "triton" if self.device.startswith("cuda") else "torch"
        _check(self.attention_backend in ("torch", "triton"), "attention_backend",
               f"must be 'torch' or 'triton', got {self.attention_backend!r}")
        _check(self.block_size in (8, 16, 32, 64, 128), "block_size", f"must be 8, 16, 32, 64 or 128, got {self.block_size}")
        _check(self.max_num_seqs >= 1, "max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
        _check(self.max_model_len is None or self.max_model_len >= 1, "max_model_len",
               f"must be >= 1, got {self.max_model_len}")
        _check(self.num_kv_blocks is None or self.num_kv_blocks >= 2, "num_kv_blocks",
               f"must be >= 2, got {self.num_kv_blocks}")
        util = self.gpu_memory_utilization
        _check(isinstance(util, (int, float)) and not isinstance(util, bool) and 0 < util <= 1,
               "gpu_memory_utilization", f"must be a fraction in (0, 1], got {util!r}")
        _check(self.kv_cache_memory_bytes is None or (type(self.kv_cache_memory_bytes) is int
                                                     and self.kv_cache_memory_bytes > 0), "kv_cache_memory_bytes",
               f"must be a positive number of bytes, got {self.kv_cache_memory_bytes!r}")
        _check(self.num_kv_blocks is None or self.kv_cache_memory_bytes is None, "kv_cache_memory_bytes",
               "and num_kv_blocks both size the KV cache; give one of them")
        _check(self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1, "max_num_batched_tokens",
               f"must be >= 1, got {self.max_num_batched_tokens}")
        tp = self.tensor_parallel_size
        _check(type(tp) is int and tp >= 1, "tensor_parallel_size", f"must be an integer >= 1, got {tp!r}")
        self.rendezvous()  # raises on nodes that cannot share the ranks, or no address to meet at
        if tp > 1:
            self._check_tensor_parallel()
        self._check_all_reduce()
        self._check_draft_placement()
        self._check_cudagraph_fields()
        self._check_async_scheduling()
        self._check_kv_cache_dtype()
        self._check_data_parallel()
        if self.warmup is None:
            self.warmup = self.device.startswith("cuda")
        _check(isinstance(self.warmup, bool), "warmup", f"must be True, False or None, got {self.warmup!r}")

    def _check_tensor_parallel(self) -> None:
        """What runs sharded so far: the target (in graphs or eagerly), a drafter on rank 0."""
        tp = self.tensor_parallel_size
        _check(not self.debug_cudagraph and os.environ.get("SPECSERVE_DEBUG_CUDAGRAPH", "0") in ("", "0"),
               "debug_cudagraph", f"re-runs replayed steps eagerly on rank 0 alone, which the other ranks' "
               f"collectives cannot follow; turn it off with tensor_parallel_size > 1 (got {tp})")
        if self.device.startswith("cuda"):
            _check(self.device == "cuda", "device", f"with tensor_parallel_size > 1 rank r runs on cuda:r; pass "
                   f"device='cuda', not {self.device!r} (choose the GPUs with CUDA_VISIBLE_DEVICES)")
            per_node = tp // self.nnodes
            _check(torch.cuda.device_count() >= per_node, "tensor_parallel_size",
                   f"{per_node} ranks on this node need {per_node} GPUs, torch sees {torch.cuda.device_count()}; "
                   "lower tensor_parallel_size, make more GPUs visible (CUDA_VISIBLE_DEVICES) or add nodes (nnodes)")

    def _check_all_reduce(self) -> None:
        if self.all_reduce is None:
            self.all_reduce = "one_shot" if self._one_shot_refusal() is None and self._gpus_reach_each_other() \
                else "nccl"
        _check(self.all_reduce in ALL_REDUCES, "all_reduce",
               f"must be one of {', '.join(ALL_REDUCES)}, got {self.all_reduce!r}")
        if self.all_reduce == "one_shot":
            refusal = self._one_shot_refusal()
            _check(refusal is None, "all_reduce", refusal or "")

    def _one_shot_refusal(self) -> str | None:
        """Why the one-shot all-reduce cannot serve this group, naming the fix; None where it can (peer access
        aside: joining checks it, and the default asks _gpus_reach_each_other)."""
        tp, name = self.tensor_parallel_size, "'one_shot'"
        if tp == 1:
            return (f"{name} all-reduces between ranks, and tensor_parallel_size is {tp}; raise it, or leave "
                    "all_reduce at 'nccl'")
        if not self.device.startswith("cuda"):
            return f"{name} runs on NVIDIA GPUs, not on {self.device}; use 'nccl' (gloo on the CPU)"
        if self.nnodes != 1:
            return f"{name} maps every rank's memory, so its ranks share one node; with nnodes={self.nnodes} use 'nccl'"
        if tp & (tp - 1) or tp > 8:
            return f"{name} takes 2, 4 or 8 ranks, got tensor_parallel_size {tp}; use 'nccl'"
        return None

    def _gpus_reach_each_other(self) -> bool:
        """Whether GPUs 0..tp-1 (rank r's, parallel_state.rank_device) each reach the others' memory."""
        tp = self.tensor_parallel_size
        return all(torch.cuda.can_device_access_peer(a, b) for a in range(tp) for b in range(tp) if a != b)

    def _check_draft_placement(self) -> None:
        spec, tp = self.speculative_config, self.tensor_parallel_size
        draft_tp = None if spec is None else spec.draft_tensor_parallel_size
        if draft_tp is None or draft_tp == 1:
            return
        field = "speculative_config.draft_tensor_parallel_size"
        _check(type(draft_tp) is int and draft_tp == tp, field,
               f"must be 1 (the drafter whole on rank 0) or tensor_parallel_size ({tp}), got {draft_tp!r}")
        _check(spec.method in ("eagle", "eagle3"), field,
               f"{draft_tp} shards an EAGLE head like the target; method {spec.method!r} drafts whole on rank 0: "
               "pass 1")

    @property
    def drafter_sharded(self) -> bool:
        """Whether every rank runs its shard of the drafter beside rank 0 (draft_tensor_parallel_size N > 1;
        docs/design.md, 'Tensor parallelism')."""
        spec, tp = self.speculative_config, self.tensor_parallel_size
        return tp > 1 and spec is not None and spec.draft_tensor_parallel_size == tp

    def _check_async_scheduling(self) -> None:
        spec = self.speculative_config
        host_drafts = spec is not None and spec.method == "ngram"
        reads_host_metadata = self.device.startswith("cuda") and self.attention_backend == "torch"
        if self.async_scheduling is None:
            self.async_scheduling = self.device.startswith("cuda") and not host_drafts and not reads_host_metadata
        _check(isinstance(self.async_scheduling, bool), "async_scheduling",
               f"must be True, False or None, got {self.async_scheduling!r}")
        if self.async_scheduling:
            _check(not host_drafts, "async_scheduling",
                   "n-gram speculation drafts from the tokens on the host, which asynchronous scheduling has not "
                   "read yet when it schedules the next step; set async_scheduling=False or use an EAGLE head")
            _check(not reads_host_metadata, "async_scheduling",
                   "the 'torch' reference attention backend reads host copies of the sequence lengths, which "
                   "asynchronous scheduling corrects on the device; use the 'triton' backend or async_scheduling=False")

    def _check_cudagraph_fields(self) -> None:
        from specserve.worker.cudagraph_mode import CUDAGraphMode

        on_cuda = self.device.startswith("cuda")
        if self.cudagraph_mode is None:
            self.cudagraph_mode = "FULL_AND_PIECEWISE" if on_cuda and self.attention_backend == "triton" else "NONE"
        names = [m.name for m in CUDAGraphMode]
        mode = str(self.cudagraph_mode).upper()
        _check(mode in names, "cudagraph_mode", f"must be one of {names}, got {self.cudagraph_mode!r}")
        self.cudagraph_mode = mode
        _check(mode == "NONE" or on_cuda, "cudagraph_mode",
               f"{mode} needs CUDA graphs, which run on a GPU only; use cudagraph_mode='NONE' on {self.device}")
        _check(mode == "NONE" or self.attention_backend == "triton", "cudagraph_mode",
               f"{mode} needs the graph-capturable 'triton' attention backend; the 'torch' reference backend "
               "reads host metadata, so use cudagraph_mode='NONE' with it")
        sizes = self.cudagraph_capture_sizes
        if sizes is not None:
            _check(len(sizes) > 0 and all(isinstance(n, int) and n >= 1 for n in sizes), "cudagraph_capture_sizes",
                   f"must be a non-empty list of positive integers, got {sizes!r}")
            self.cudagraph_capture_sizes = sorted(set(sizes))
        self.debug_cudagraph = self.debug_cudagraph or os.environ.get("SPECSERVE_DEBUG_CUDAGRAPH", "0") not in ("", "0")

    def _check_kv_cache_dtype(self) -> None:
        from specserve.attention.kv_quant import KV_CACHE_DTYPES

        _check(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype",
               f"must be one of {', '.join(KV_CACHE_DTYPES)} (fp8: e4m3 with per-layer scales), "
               f"got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype != "fp8" or not self.device.startswith("cuda"):
            return
        # Triton converts to and from e4m3 on compute capability 8.9 (Ada) and later.
        index = torch.device(self.device).index or 0
        capability = torch.cuda.get_device_capability(index)
        _check(capability >= (8, 9), "kv_cache_dtype",
               f"fp8 needs a GPU of compute capability 8.9 or later (Ada, Hopper); {torch.cuda.get_device_name(index)} "
               f"has {capability[0]}.{capability[1]}; use kv_cache_dtype='auto'")

    @property
    def kv_cache_torch_dtype(self) -> torch.dtype:
        """The KV cache's element type (kv_cache_dtype; "auto" is the model's dtype)."""
        from specserve.attention.kv_quant import kv_cache_torch_dtype

        return kv_cache_torch_dtype(self.kv_cache_dtype, self.torch_dtype)

    def rendezvous(self):
        """Where this engine's ranks meet (distributed/rendezvous.py); a free port each call unless one is set."""
        from specserve.distributed.rendezvous import Rendezvous

        return Rendezvous.resolve(self.tensor_parallel_size, self.nnodes, self.master_addr, self.master_port)

    def _check_data_parallel(self) -> None:
        from specserve.engine.data_parallel import visible_gpus

        dp = self.data_parallel_size
        _check(type(dp) is int and dp >= 1, "data_parallel_size", f"must be an integer >= 1, got {dp!r}")
        # Each replica's ranks meet at a free port of their own.
        _check(dp == 1 or (self.nnodes == 1 and self.master_port is None), "data_parallel_size",
               f"{dp} replicas run on one node, each its ranks meeting at a port of its own; leave nnodes and "
               "master_port out with data_parallel_size > 1")
        if not self.device.startswith("cuda") or dp == 1:
            return
        _check(self.device == "cuda", "device",
               f"is {self.device!r}, but with data_parallel_size={dp} each replica runs on GPUs of its own; give "
               "device='cuda' and choose the GPUs with CUDA_VISIBLE_DEVICES")
        per_replica, have = self.gpus_per_replica, len(visible_gpus())
        _check(dp * per_replica <= have, "data_parallel_size",
               f"{dp} replicas of {per_replica} GPU each need {dp * per_replica} GPUs, but {have} are visible; "
               f"lower --data-parallel-size to {have // per_replica} or make more GPUs visible (CUDA_VISIBLE_DEVICES)")

    @property
    def gpus_per_replica(self) -> int:
        """The GPUs one replica (one engine core) runs on: one per tensor-parallel rank."""
        return self.tensor_parallel_size

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype is None:
            return torch.bfloat16 if self.device.startswith("cuda") else torch.float32
        return DTYPES[self.dtype]

    def finalize(self, model_max_len: int) -> None:
        """Fill the fields that depend on the loaded model and check their fit."""
        if self.max_model_len is None:
            self.max_model_len = min(model_max_len, 8192)
        _check(self.max_model_len <= model_max_len, "max_model_len",
               f"{self.max_model_len} exceeds the model's context length {model_max_len}")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = 2048 if self.enable_chunked_prefill else max(2048, self.max_model_len)
        if not self.enable_chunked_prefill:
            _check(self.max_num_batched_tokens >= self.max_model_len, "max_num_batched_tokens",
                   f"({self.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len}) without chunked "
                   "prefill, or a long prompt could never be scheduled; raise it or enable chunked prefill")
        if self.num_kv_blocks is not None:
            capacity = self.num_kv_blocks * self.block_size
            _check(capacity >= self.max_model_len, "num_kv_blocks",
                   f"{self.num_kv_blocks} blocks of {self.block_size} tokens hold {capacity} tokens, fewer than "
                   f"max_model_len={self.max_model_len}; raise num_kv_blocks or lower max_model_len")
