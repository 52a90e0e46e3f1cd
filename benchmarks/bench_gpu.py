"""GPU benchmark of the engine (eager, before CUDA graphs): decode tokens/s beside transformers.

Speed does not depend on weight values, so the SmolLM2-135M shape is built
with random bf16 weights. Prints per-token latency at batch 1 and throughput
at larger batches, for specserve with the Triton attention backend and for
transformers' generate, with the weight-bytes / bandwidth floor beside them.

    python benchmarks/bench_gpu.py [--batch-sizes 1,8,32] [--new-tokens 128]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

SMOLLM2 = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=576, intermediate_size=1536,
               num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
               max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
               bos_token_id=1, eos_token_id=2)


def make_model_dir(root: Path, cfg: dict) -> tuple[Path, torch.nn.Module]:
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{k: v for k, v in cfg.items()
                                                                    if k != "architectures"}))
    hf.save_pretrained(str(root), safe_serialization=True)
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>").save_pretrained(str(root))
    return root, hf


def weight_bytes(model: torch.nn.Module) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * 2  # bf16
    return total


def bench_specserve(path: Path, batch: int, prompt_len: int, new_tokens: int) -> float:
    from specserve import LLM, SamplingParams

    llm = LLM(str(path), device="cuda", dtype="bfloat16", max_model_len=2048, max_num_seqs=max(batch, 8))
    prompts = [[(7 * i + j) % 40000 + 3 for j in range(prompt_len)] for i in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    return batch * new_tokens / (time.perf_counter() - start)


def bench_transformers(hf, batch: int, prompt_len: int, new_tokens: int) -> float:
    x = torch.tensor([[(7 * i + j) % 40000 + 3 for j in range(prompt_len)] for i in range(batch)], device="cuda")
    kw = dict(attention_mask=torch.ones_like(x), do_sample=False, eos_token_id=None, pad_token_id=0)
    hf.generation_config.eos_token_id = None
    hf.generate(x, max_new_tokens=4, **kw)
    torch.cuda.synchronize()
    start = time.perf_counter()
    hf.generate(x, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
    torch.cuda.synchronize()
    return batch * new_tokens / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--bandwidth-tbps", type=float, default=3.0, help="measured HBM bandwidth for the floor")
    ap.add_argument("--json", help="also write the rows here")
    a = ap.parse_args()
    root = Path(tempfile.mkdtemp())
    path, hf = make_model_dir(root / "smollm2-shape", SMOLLM2)
    hf = hf.to("cuda", torch.bfloat16).eval()
    floor = a.bandwidth_tbps * 1e12 / weight_bytes(hf)
    rows = []
    for b in [int(x) for x in a.batch_sizes.split(",")]:
        ours = bench_specserve(path, b, a.prompt_len, a.new_tokens)
        ref = bench_transformers(hf, b, a.prompt_len, a.new_tokens)
        rows.append(dict(batch=b, specserve=ours, transformers=ref, ratio=ours / ref))
        print(f"batch {b}: specserve {ours:.0f} tok/s, transformers {ref:.0f} tok/s", file=sys.stderr)
    print(f"\nSmolLM2-135M shape, random bf16 weights, {torch.cuda.get_device_name()}, eager (no CUDA graphs), "
          f"prompt {a.prompt_len}, {a.new_tokens} new tokens; batch-1 floor = weight bytes / {a.bandwidth_tbps} TB/s "
          f"= {floor:.0f} tok/s\n")
    print("| batch | specserve tok/s | transformers tok/s | ratio |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['specserve']:.0f} | {r['transformers']:.0f} | {r['ratio']:.2f}x |")
    if a.json:
        Path(a.json).write_text(json.dumps(rows))


if __name__ == "__main__":
    main()
