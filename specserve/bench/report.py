"""The decode benchmark's tables (markdown, one per model) and JSON, with the ratios derived from the rows."""
from __future__ import annotations

import json
from dataclasses import asdict

from specserve.bench.decode_plan import GRAPH_MODES
from specserve.bench.results import BenchResults, Row

COLUMNS = ["system", "graph mode", "speculation", "batch", "tok/s", "ms/token", "x transformers", "x no-spec",
           "tokens/step", "drafting steps", "limit tok/s", "collectives ms/step"]


def derived(results: BenchResults, row: Row) -> dict:
    """A row with its ratios: over transformers at the same batch, over no speculation in the same mode."""
    hf = results.find(row.model, "transformers", row.batch)
    base = results.find(row.model, "specserve", row.batch, row.mode) if row.spec != "none" else None
    ok = row.tok_s is not None
    return {**asdict(row), "ms_per_token": row.ms_per_token,
            "x_transformers": row.tok_s / hf.tok_s if ok and hf and row.system != "transformers" else None,
            "x_no_spec": row.tok_s / base.tok_s if ok and base else None,
            "limit_tok_s": results.limit_tok_s(row)}


def _order(row: Row) -> tuple:
    mode = GRAPH_MODES.index(row.mode) if row.mode in GRAPH_MODES else -1
    return row.model, row.system != "specserve", mode, row.spec != "none", row.spec, row.batch


def to_json(results: BenchResults) -> str:
    return json.dumps({
        "config": results.config, "device": results.device_name, "versions": results.versions,
        "bandwidth_bytes_s": results.bandwidth_bytes_s, "bandwidth_measured": results.bandwidth_measured,
        "models": {k: asdict(v) for k, v in results.models.items()},
        "engines": [asdict(e) for e in results.engines],
        "rows": [derived(results, r) for r in sorted(results.rows, key=_order)],
    }, indent=1)


def _num(value: float | None, digits: int = 0, suffix: str = "") -> str:
    return "-" if value is None else f"{value:,.{digits}f}{suffix}"


def to_markdown(results: BenchResults) -> str:
    cfg = results.config
    bw = results.bandwidth_bytes_s / 1e12
    kv_dtype = cfg.get("kv_cache_dtype", "auto")
    kv = "" if kv_dtype == "auto" else f", KV cache {kv_dtype}"
    for field, what in (("quantization", "weights"), ("draft_quantization", "EAGLE-3 head's weights")):
        if cfg.get(field):
            kv += f", {what} {cfg[field]}"
    if cfg.get("draft_tensor_parallel_size", 1) > 1:
        kv += f", EAGLE-3 head sharded over {cfg['draft_tensor_parallel_size']} GPUs like the target"
    out = [f"Device: {results.device_name}; " + ", ".join(f"{k} {v}" for k, v in results.versions.items())
           + f"; {cfg['dtype']}{kv}; prompt {cfg['prompt_len']} tokens, {cfg['new_tokens']} new tokens per request "
           f"({cfg['hf_new_tokens']} for transformers), greedy, EOS ignored; decode tokens/s after the prefill. "
           f"Bandwidth {bw:.2f} TB/s ({'device-to-device copy, measured' if results.bandwidth_measured else 'given'});"
           " limit tok/s = batch x bandwidth / weight bytes (no speculation; under tensor parallelism the bytes "
           "one GPU reads, its shard). Collectives ms/step: one step's all-reduces and all-gather replayed alone "
           "on every rank. Speculation: a random EAGLE-3 head, "
           "each draft accepted with probability p; 'dynamic': the engine's policy drafts or not per step, "
           "drafting steps the share of steps that drafted.", ""]
    for model in dict.fromkeys(r.model for r in results.rows):
        info = results.models.get(model)
        head = f"### {model}"
        if info is not None:
            kind = "random weights" if info.random_weights else "its own weights"
            tp = info.tensor_parallel_size
            shard = f" per GPU, tensor parallel over {tp} GPUs, {info.all_reduce} all-reduce" if tp > 1 else ""
            head += (f" ({kind}, {info.num_params / 1e6:,.1f} M parameters, {info.weight_bytes / 1e9:.3f} GB{shard}; "
                     f"batch-1 limit {results.bandwidth_bytes_s / info.weight_bytes:,.0f} tok/s)")
        out += [head, "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        errors = []
        for row in sorted((r for r in results.rows if r.model == model), key=_order):
            d = derived(results, row)
            if row.error:
                errors.append(f"- {row.system} {row.mode} {row.spec} batch {row.batch}: {row.error}")
            out.append("| " + " | ".join([
                row.system, row.mode, row.spec, str(row.batch), _num(row.tok_s) if not row.error else "failed",
                _num(d["ms_per_token"], 2), _num(d["x_transformers"], 2, "x"), _num(d["x_no_spec"], 2, "x"),
                _num(row.accept_len, 2), _num(None if row.drafting_share is None else 100 * row.drafting_share, 0, "%"),
                _num(d["limit_tok_s"]), _num(row.collectives_ms, 3)]) + " |")
        engines = [e for e in results.engines if e.model == model]
        if engines:
            out += ["", "| graph mode | speculation | engine build s | graph capture s | graph memory GiB | capture sizes |",
                    "|---|---|---|---|---|---|"]
            for e in engines:
                memory = None if e.graph_memory_bytes is None else e.graph_memory_bytes / 2**30
                sizes = e.capture_sizes if isinstance(e.capture_sizes, str) else ",".join(map(str, e.capture_sizes))
                out.append(f"| {e.mode} | {e.spec} | {_num(e.build_s, 1)} | {_num(e.capture_s, 1)} | "
                           f"{_num(memory, 2)} | {sizes} |")
        if errors:
            out += ["", "Not measured:", *errors]
        out.append("")
    return "\n".join(out)
