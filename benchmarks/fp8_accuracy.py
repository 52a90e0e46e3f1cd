"""FP8 weights' accuracy on a real model against the same model unquantized: greedy agreement on chat prompts and
the perplexity of texts (issue 35's accuracy targets: agreement >= 95% over the first 64 tokens, perplexity up
under 2%).

    python benchmarks/fp8_accuracy.py --model smollm2-135m --prompts mt_bench.jsonl [--device cuda] \
        [--max-tokens 64] [--texts tests/data/heldout.txt tests/data/heldout_fp8.txt] [--weight-groups 0 64 32]

With --quantization fp8 a GGUF whose projections are Q4_0, Q4_1 or Q5_0 loads their codes as FP8 with block
scales, exactly (quantization/gguf_blocks.py); any other model is quantized per channel.

Agreement is printed four ways, since greedy outputs part for good at the first near-tie the two models round
differently: teacher-forced (at each position of the unquantized engine's greedy output, the FP8 model's argmax
given the same prefix) in one causal pass with torch attention and no cache (the weights alone), and through the
engine's decode path (the prompt prefilled, then every token a step of its own reading the context from a paged
cache, the FP8 model's of --kv-cache-dtype: weights, cache and kernels); and free-running (the FP8 engine's own
greedy output against the unquantized one's, up to the first difference, and position by position). The
unquantized row's teacher-forced figures are the noise floors: the engine's batched, graph-captured kernels
against the one-pass path and against one request's eager steps. Perplexity: one causal pass over each text (at
most --max-text-tokens), the model's torch attention. --weight-groups adds rows for weights rounded to e4m3 with
a scale per G weights along K of each output channel (0: per channel), activations unquantized: the weights' own
share of the error, and what finer weight scales would buy.
"""
from __future__ import annotations

import argparse
import gc
from pathlib import Path

import torch

from specserve import LLM, SamplingParams
from specserve.bench.fidelity import (decode_path_agreement, perplexity, positionwise_agreement, prefix_agreement,
                                      teacher_forced_agreement)
from specserve.models.loader import build_model, load_tokenizer, open_model_source
from specserve.prompt_files import load_prompt_file, prompt_token_ids
from specserve.train.attention import CausalAttention
from specserve.train.features import attention_in_torch

ROOT = Path(__file__).resolve().parents[1]
TEXTS = [ROOT / "tests" / "data" / "heldout.txt", ROOT / "tests" / "data" / "heldout_fp8.txt"]


def engine_greedy(model: str, conversations, max_tokens: int, device: str, dtype: str, max_model_len: int,
                  kv_cache_dtype: str) -> tuple[list[list[int]], dict[str | None, list[list[int]]]]:
    """(the prompts' token ids, each engine's greedy outputs: unquantized (None) and FP8, whose KV cache is
    kv_cache_dtype)."""
    prompts, outputs = None, {}
    for quantization in (None, "fp8"):
        llm = LLM(model, dtype=dtype, device=device, quantization=quantization, max_model_len=max_model_len,
                  kv_cache_memory_bytes=2 << 30, kv_cache_dtype=kv_cache_dtype if quantization else "auto")
        prompts = prompts or [prompt_token_ids(llm, c) for c in conversations]
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        outputs[quantization] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm
        gc.collect()
    return prompts, outputs


def round_weights_to_e4m3(model, group: int) -> None:
    """Every decoder projection's weight rounded to e4m3 in place, a scale per `group` weights along K in each
    output channel (0: one per channel)."""
    top = torch.finfo(torch.float8_e4m3fn).max
    with torch.no_grad():
        for name, w in model.named_parameters():
            if w.dim() != 2 or ".layers." not in name:
                continue
            rows, k = w.shape
            size = group or k
            if k % size:
                raise SystemExit(f"--weight-groups {group}: {name} has K = {k}, not a multiple of it; pick a divisor")
            x = w.float().view(rows, k // size, size)
            scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / top
            w.copy_(((x / scale).to(torch.float8_e4m3fn).float() * scale).view(rows, k))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", required=True, help="chat prompts, one JSON object a line (MT-bench's layout)")
    ap.add_argument("--num-prompts", type=int, default=0, help="the first N (0: all)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--texts", nargs="*", type=Path, default=TEXTS)
    ap.add_argument("--max-text-tokens", type=int, default=2048)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                    help="the FP8 engine's KV cache (free-running rows; the teacher-forced pass has no cache)")
    ap.add_argument("--weight-groups", nargs="*", type=int, default=[],
                    help="also score e4m3-rounded weights, a scale per G weights along K (0: per channel)")
    a = ap.parse_args()
    conversations = load_prompt_file(a.prompts)
    conversations = conversations[:a.num_prompts] if a.num_prompts else conversations
    source = open_model_source(a.model)
    tokenizer = load_tokenizer(source)
    texts = {p.name: tokenizer(p.read_text())["input_ids"][:a.max_text_tokens] for p in a.texts}
    prompts, greedy = engine_greedy(a.model, conversations, a.max_tokens, a.device, a.dtype, a.max_model_len,
                                    a.kv_cache_dtype)
    rows, ppl = [], {}
    for q in (None, "fp8", *(f"e4m3 weights, scale per {g or 'channel'}" for g in a.weight_groups)):
        model, arch = build_model(source, getattr(torch, a.dtype), a.device, CausalAttention(),
                                  quantization=q if q in (None, "fp8") else None)
        if q not in (None, "fp8"):
            round_weights_to_e4m3(model, a.weight_groups[len(rows) - 2])
        attention_in_torch(model)
        forced = [teacher_forced_agreement(model, arch, prompts, greedy[None], a.device)]
        ppl[q] = {name: perplexity(model, arch, ids, a.device) for name, ids in texts.items()}
        del model
        if q in (None, "fp8"):
            forced.append(decode_path_agreement(source, prompts, greedy[None], getattr(torch, a.dtype), a.device, q,
                                                a.kv_cache_dtype if q else "auto"))
        rows.append((q, forced))
        gc.collect()
    print(f"{a.model}, {len(prompts)} prompts x {a.max_tokens} greedy tokens, {a.dtype} on {a.device}, the FP8 "
          f"engine's KV cache {a.kv_cache_dtype}")
    header = " | ".join(f"perplexity {name} ({len(ids)} tokens)" for name, ids in texts.items())
    print(f"| weights | teacher-forced agreement: one pass / the decode path | free-running: to the first difference "
          f"/ by position | {header} |")
    print("|---|---|---|" + "---|" * len(texts))
    for q, forced in rows:
        ref, out = greedy[None], greedy.get(q)
        free = f"{prefix_agreement(ref, out):.4f} / {positionwise_agreement(ref, out):.4f}" if out else "-"
        cells = " | ".join(f"{ppl[q][name]:.3f} ({ppl[q][name] / ppl[None][name] - 1:+.2%})" for name in texts)
        print(f"| {q or a.dtype} | {' / '.join(f'{f:.4f}' for f in forced)} | {free} | {cells} |")


if __name__ == "__main__":
    main()
