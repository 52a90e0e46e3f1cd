"""The `specserve` command line: generate, chat, export, serve, bench, train-eagle, eval-acceptance."""
from __future__ import annotations

import argparse
import logging
import sys
import time
import warnings

from specserve.errors import SpecserveError


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default="smollm2-135m",
                   help="built-in name, Hugging Face directory, .gguf file or Hugging Face id (org/name)")
    g.add_argument("--revision", help="branch, tag or commit of a Hugging Face id (default: main)")
    g.add_argument("--tokenizer", help="the tokenizer, given as --model is (default: the model's)")
    g.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: float32 on CPU, bfloat16 on CUDA")
    g.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    g.add_argument("--max-model-len", type=int)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int)
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of the GPU's memory the engine may use (weights, activations, CUDA graphs, KV cache)")
    g.add_argument("--kv-cache-memory", type=memory_size, metavar="SIZE",
                   help="KV cache size, e.g. 4GiB, 512MiB or bytes, in place of sizing it by --gpu-memory-utilization")
    g.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                   help="the KV cache's element type: auto (the model's dtype) or fp8 (e4m3 with per-layer scales, "
                   "twice the tokens of bfloat16 in the same memory; compute capability 8.9+ on CUDA)")
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--no-chunked-prefill", action="store_true")
    g.add_argument("--seed", type=int, default=0, help="engine seed for unseeded sampling")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="ranks (processes; GPUs on CUDA) the model is sharded over")
    g.add_argument("--all-reduce", choices=["nccl", "one_shot"],
                   help="how the ranks all-reduce: nccl, or one_shot (one kernel over buffers every GPU of the node "
                   "maps, for messages up to 4 MiB; NCCL past it). Default: one_shot where it runs (2, 4 or 8 GPUs "
                   "of one node with peer access), else nccl")
    g.add_argument("--nnodes", type=int, default=1, help="nodes sharing the --tensor-parallel-size ranks equally "
                   "(README, 'Several nodes'); run the same command on each, with its --node-rank")
    g.add_argument("--node-rank", type=int, default=0, help="this node's index: 0 runs the engine (and the server), "
                   "1..nnodes-1 only their ranks")
    g.add_argument("--master-addr", help="node 0's address, where the ranks meet (default: MASTER_ADDR, else "
                   "127.0.0.1 on one node)")
    g.add_argument("--master-port", type=int, help="a free port of node 0 (and the one after it) where the ranks "
                   "meet (default: MASTER_PORT, else a free port on one node)")
    g.add_argument("--data-parallel-size", type=int, default=1, metavar="M",
                   help="engine replicas behind one server (serve only), each on GPUs of its own; new requests go to "
                        "the least loaded")
    g.add_argument("--quantization", choices=["fp8"], help="fp8: FP8 weights (per-channel scales) and per-token "
                   "FP8 activations, quantized as the model loads (default: the checkpoint's own; an FP8 checkpoint "
                   "loads as FP8)")
    g.add_argument("--speculative-config", help='JSON as in vLLM, e.g. \'{"method": "eagle3", "model": PATH, '
                   '"num_speculative_tokens": 4}\'; methods: eagle, eagle3, ngram, draft_model')


def add_sampling_args(p: argparse.ArgumentParser, several_sequences: bool = False) -> None:
    """several_sequences: offer --n (a chat keeps one conversation, so one reply a turn)."""
    g = p.add_argument_group("sampling")
    if several_sequences:
        g.add_argument("--n", type=int, default=1, help="sequences sampled per prompt, sharing its KV blocks; "
                       "with --request-seed S, sequence i is seeded S + i")
    else:
        p.set_defaults(n=1)
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--request-seed", type=int, help="per-request sampling seed")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")


def engine_kwargs(a: argparse.Namespace) -> dict:
    return dict(
        revision=a.revision, tokenizer=a.tokenizer, dtype=a.dtype, device=a.device, max_model_len=a.max_model_len,
        max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
        enable_prefix_caching=not a.no_prefix_caching, enable_chunked_prefill=not a.no_chunked_prefill, seed=a.seed,
        speculative_config=a.speculative_config, gpu_memory_utilization=a.gpu_memory_utilization,
        kv_cache_memory_bytes=a.kv_cache_memory, kv_cache_dtype=a.kv_cache_dtype, tensor_parallel_size=a.tensor_parallel_size,
        all_reduce=a.all_reduce, nnodes=a.nnodes,
        master_addr=a.master_addr, master_port=a.master_port, data_parallel_size=a.data_parallel_size,
        quantization=a.quantization,
    )


def run_worker_node(a: argparse.Namespace) -> int:
    """A node of rank 1.. runs its tensor-parallel ranks only, until node 0's engine stops; its exit status
    counts the ranks that failed."""
    from specserve.distributed.rendezvous import Rendezvous
    from specserve.distributed.worker_node import run_worker_node as run_node

    rendezvous = Rendezvous.resolve(a.tensor_parallel_size, a.nnodes, a.master_addr, a.master_port)
    return min(run_node(a.tensor_parallel_size, rendezvous, a.node_rank), 1)


def memory_size(text: str) -> int:
    """argparse's type for a memory size (config.parse_memory_size), its message shown on a bad value."""
    from specserve.config import parse_memory_size

    try:
        return parse_memory_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def sampling_params(a: argparse.Namespace, output_kind: str = "cumulative"):
    from specserve.sampling_params import SamplingParams

    return SamplingParams(n=a.n, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, min_p=a.min_p,
                          max_tokens=a.max_tokens, seed=a.request_seed, stop=a.stop, output_kind=output_kind)


def cmd_generate(a: argparse.Namespace) -> None:
    from specserve.llm import LLM

    params = sampling_params(a)
    llm = LLM(a.model, **engine_kwargs(a))
    prompts = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in a.prompts] if a.chat else a.prompts
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    for prompt, out in zip(a.prompts, outs):
        print(f"=== {prompt!r}")
        for c in out.outputs:
            if params.n > 1:
                print(f"--- sequence {c.index}")
            print(f"{c.text}\n--- {len(c.token_ids)} tokens, finished: {c.finish_reason}")
        if a.stats and out.metrics.spec:
            print(f"--- speculation: {format_spec_stats(out.metrics.spec)}")
    if a.stats:
        total = sum(o.metrics.num_output_tokens for o in outs)
        print(f"=== {total} tokens in {elapsed:.2f} s ({total / elapsed:.1f} tokens/s)")
        if llm.engine.config.speculative_config:
            print(f"=== speculation, all requests: {format_spec_stats(llm.engine.spec_stats.as_dict())}")


def format_spec_stats(s: dict) -> str:
    per_pos = ", ".join(f"{p:.2f}" for p in s["acceptance_per_position"])
    return (f"drafted {s['num_drafted']}, accepted {s['num_accepted']} ({s['acceptance_rate']:.1%}), "
            f"mean acceptance length {s['mean_acceptance_length']:.2f}, per position [{per_pos}]")


def cmd_chat(a: argparse.Namespace) -> None:
    from specserve.llm import LLM

    params = sampling_params(a, output_kind="delta")
    llm = LLM(a.model, **engine_kwargs(a))
    engine = llm.engine
    history = [{"role": "system", "content": a.system}] if a.system else []
    print("Chat with the model; an empty line or Ctrl-D quits, /reset clears the history.", file=sys.stderr)
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            break
        if not line:
            break
        if line == "/reset":
            history = history[:1] if a.system else []
            continue
        history.append({"role": "user", "content": line})
        rid = engine.add_request(llm.apply_chat_template(history), params)
        reply = ""
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == rid:
                    # A delta output: the reply's one sequence, with its text new since the previous output.
                    for c in out.outputs:
                        print(c.text, end="", flush=True)
                        reply += c.text
        print()
        history.append({"role": "assistant", "content": reply})


def cmd_export(a: argparse.Namespace) -> None:
    from specserve.models.export import ExportConfig, export

    out = export(ExportConfig(a.model, a.out_dir, a.dtype, a.revision))
    print(f"wrote {a.model} as a Hugging Face directory: {out}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description="LLM inference with speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate completions for prompts")
    gen.add_argument("prompts", nargs="+", help="one or more prompts")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    gen.add_argument("--stats", action="store_true", help="print throughput and speculative-decoding acceptance")
    add_engine_args(gen)
    add_sampling_args(gen, several_sequences=True)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat, streaming tokens as they come")
    chat.add_argument("--system", help="system prompt")
    add_engine_args(chat)
    add_sampling_args(chat)
    chat.set_defaults(func=cmd_chat)

    export = sub.add_parser("export", help="write a model (a GGUF too) as a complete Hugging Face directory")
    export.add_argument("model", help="built-in name, Hugging Face directory, .gguf file or Hugging Face id")
    export.add_argument("out_dir", help="the directory to write")
    export.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                        help="of the weights written (default: the model's; float32 for a GGUF, dequantized)")
    export.add_argument("--revision", help="branch, tag or commit of a Hugging Face id (default: main)")
    export.set_defaults(func=cmd_export)

    # Imported here because cli_args builds on this module's add_engine_args.
    from specserve.entrypoints.openai.cli_args import add_bench_parser, add_serve_parser

    add_serve_parser(sub)
    add_bench_parser(sub)

    from specserve.entrypoints.eval_acceptance import add_eval_parser
    from specserve.train.cli import add_train_parser

    add_train_parser(sub)
    add_eval_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    for noisy in ("transformers", "gguf", "httpx"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="transformers")
    try:
        if getattr(args, "node_rank", 0):
            return run_worker_node(args)
        args.func(args)
    except SpecserveError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
