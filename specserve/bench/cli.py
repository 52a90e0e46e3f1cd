"""`specserve bench decode`: the arguments, on top of a preset. Heavy imports wait for the command."""
from __future__ import annotations

import argparse
from pathlib import Path


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from e


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def add_decode_parser(bench_sub: argparse._SubParsersAction) -> None:
    p = bench_sub.add_parser(
        "decode", help="decode latency and throughput in every graph mode, with and without EAGLE-3, "
        "beside transformers", description="Decode speed of the engine beside transformers' generate and the "
        "weight-bytes / bandwidth limit. A preset sets everything; the options below replace parts of it. "
        "Tables go to stdout, progress to stderr.")
    p.add_argument("--preset", choices=["full", "tiny"], default="full",
                   help="full: every graph mode, a batch sweep and EAGLE-3 at forced acceptance, for the Llama-3-8B "
                   "shape and SmolLM2 on one GPU, sized for one 10-minute run (it starts nothing new after "
                   "540 s); tiny: a 4-layer model on the CPU in seconds")
    p.add_argument("--models", type=_names, help="comma-separated shape names (llama3-8b, qwen2.5-32b, tiny: random "
                   "weights) or model names / paths (their own weights)")
    p.add_argument("--model", help="the model benchmarked with its own weights, in place of the preset's "
                   "(smollm2-135m): a name, a Hugging Face directory or a .gguf file")
    p.add_argument("--device", help="cuda or cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], help="every engine's KV cache element type "
                   "(fp8: e4m3; transformers' rows are unchanged)")
    p.add_argument("--modes", type=_names, help="graph modes measured without speculation at --mode-batch-sizes")
    p.add_argument("--mode-batch-sizes", type=_ints)
    p.add_argument("--default-mode", help="graph mode of the batch sweep and of the speculative runs")
    p.add_argument("--batch-sizes", type=_ints, help="batch sweep of the default mode without speculation")
    p.add_argument("--spec", type=_names, help='EAGLE-3 settings K:P (drafts : forced acceptance), K:P:dynamic '
                   'for the dynamic speculation policy, e.g. "3:0.6,3:0.8,3:0.8:dynamic"; "" for none')
    p.add_argument("--spec-batch-sizes", type=_ints)
    p.add_argument("--hf-batch-sizes", type=_ints, help='transformers batch sizes; "" for none')
    p.add_argument("--prompt-len", type=int)
    p.add_argument("--new-tokens", type=int, help="new tokens per request for specserve")
    p.add_argument("--hf-new-tokens", type=int, help="new tokens per request for transformers (slower)")
    p.add_argument("--capture-sizes", choices=["auto", "default", "batches"],
                   help="auto (default): the engine's own sizes for each model's first engine, the measured "
                   "batch sizes for the others; default: the engine's own everywhere; batches: measured only")
    p.add_argument("--bandwidth-tbps", type=float, help="memory bandwidth for the limit (default: measured)")
    p.add_argument("--tensor-parallel-size", type=int, help="shard every engine's target over this many GPUs "
                   "(rank r on cuda:r; on the CPU, processes over gloo) and time each step's collectives")
    p.add_argument("--all-reduce", choices=["nccl", "one_shot"], help="how the ranks all-reduce (default: "
                   "EngineConfig's, one_shot where it runs, else nccl)")
    p.add_argument("--quantization", choices=["fp8"], help="FP8 weights for every engine's target (default: the "
                   "dtype's)")
    p.add_argument("--draft-quantization", choices=["fp8"], help="FP8 weights for the EAGLE-3 head (default: the "
                   "dtype's)")
    p.add_argument("--draft-tensor-parallel-size", type=int, help="with --tensor-parallel-size N: 1 (default) runs "
                   "the EAGLE-3 head whole on rank 0, N shards it like the target")
    p.add_argument("--time-budget", type=float, help="seconds after which remaining figures are skipped")
    p.add_argument("--json", type=Path, help="write the results here as JSON (kept current during the run)")
    p.add_argument("--markdown", type=Path, help="write the tables here (kept current during the run)")
    p.set_defaults(func=cmd_bench_decode)


def config_from_args(a: argparse.Namespace):
    from specserve.bench.decode_plan import PRESETS, SpecSetting, preset_config
    from specserve.bench.models import SHAPES

    models = a.models
    if a.model is not None:
        shapes = [m for m in (models or PRESETS[a.preset]["models"]) if m in SHAPES]
        models = shapes + [a.model]
    return preset_config(
        a.preset, models=models, device=a.device, dtype=a.dtype, kv_cache_dtype=a.kv_cache_dtype, modes=a.modes, mode_batch_sizes=a.mode_batch_sizes,
        default_mode=a.default_mode, batch_sizes=a.batch_sizes,
        spec=None if a.spec is None else [SpecSetting.parse(s) for s in a.spec],
        spec_batch_sizes=a.spec_batch_sizes, hf_batch_sizes=a.hf_batch_sizes, prompt_len=a.prompt_len,
        new_tokens=a.new_tokens, hf_new_tokens=a.hf_new_tokens, capture_sizes=a.capture_sizes,
        bandwidth_tbps=a.bandwidth_tbps, time_budget_s=a.time_budget, tensor_parallel_size=a.tensor_parallel_size,
        all_reduce=a.all_reduce, quantization=a.quantization, draft_quantization=a.draft_quantization,
        draft_tensor_parallel_size=a.draft_tensor_parallel_size)


def cmd_bench_decode(a: argparse.Namespace) -> None:
    from specserve.bench.decode import run_decode_bench
    from specserve.bench.report import to_markdown

    print(to_markdown(run_decode_bench(config_from_args(a), a.json, a.markdown)))
