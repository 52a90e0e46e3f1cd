"""The time of one decode step's collectives at tensor parallelism N, eager and inside a CUDA graph.

A step of the target runs 2 * layers + 1 all-reduces of tokens x hidden (distributed/collective_probe.py); at
batch 1 each is a few KiB, so its latency, not the link's bandwidth, is what it costs. This replays a step's
all-reduces over torch.distributed on N processes (NCCL on GPUs, gloo on the CPU) and prints, per message
size, the microseconds of one all-reduce: issued eagerly one by one (what the benchmark's 'collectives
ms/step' times), and replayed from a CUDA graph that holds all of them (what an engine's graphed step pays).
NCCL's variables (NCCL_PROTO, NCCL_ALGO, NCCL_MAX_NCHANNELS, NCCL_GRAPH_MIXING_SUPPORT, ...) reach every rank:

    python benchmarks/allreduce_latency.py --ranks 2 --hidden 4096 --layers 32 --tokens 1 4 64
    NCCL_PROTO=LL python benchmarks/allreduce_latency.py --ranks 2 --tokens 1
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from specserve.distributed.parallel_state import leave_process_group
from specserve.distributed.rendezvous import Rendezvous


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _per_call_us(fn, device: torch.device, calls: int, repeats: int) -> float:
    fn()
    _sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    _sync(device)
    return 1e6 * (time.perf_counter() - start) / (repeats * calls)


def _rank(rank: int, args: argparse.Namespace, init_method: str, results) -> None:
    on_gpu = args.device == "cuda"
    if on_gpu:
        torch.cuda.set_device(rank)
    device = torch.device(f"cuda:{rank}" if on_gpu else "cpu")
    dist.init_process_group("nccl" if on_gpu else "gloo", init_method=init_method, rank=rank,
                            world_size=args.ranks, device_id=device if on_gpu else None)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    calls = 2 * args.layers + 1
    try:
        for tokens in args.tokens:
            x = torch.zeros(tokens, args.hidden, dtype=dtype, device=device)

            def step() -> None:
                for _ in range(calls):
                    dist.all_reduce(x)

            eager = _per_call_us(step, device, calls, args.repeats)
            graphed = None
            if on_gpu:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    step()
                graphed = _per_call_us(graph.replay, device, calls, args.repeats)
                del graph  # a graph holding the group's collectives must go before the group
            if rank == 0:
                results.append((tokens, tokens * args.hidden * x.element_size(), eager, graphed))
    finally:
        leave_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--hidden", type=int, default=4096, help="the model's hidden size (llama3-8b: 4096)")
    p.add_argument("--layers", type=int, default=32, help="decoder layers: 2 all-reduces each, and the embedding's")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64], help="tokens per step (batch x (1 + k))")
    p.add_argument("--repeats", type=int, default=50, help="timed steps per size, after one untimed")
    args = p.parse_args()
    if args.device == "cuda" and torch.cuda.device_count() < args.ranks:
        p.error(f"{args.ranks} ranks need {args.ranks} GPUs, torch sees {torch.cuda.device_count()}")
    nccl = {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}
    print(f"{args.ranks} ranks on {args.device}, hidden {args.hidden}, {2 * args.layers + 1} all-reduces a step; "
          f"NCCL variables: {nccl or 'none'}")
    with mp.Manager() as manager:
        results = manager.list()
        mp.spawn(_rank, args=(args, Rendezvous.resolve(args.ranks).init_method, results), nprocs=args.ranks)
        print("| tokens | bytes | eager us/all-reduce | graphed us/all-reduce | graphed ms/step |")
        print("| ---: | ---: | ---: | ---: | ---: |")
        for tokens, nbytes, eager, graphed in results:
            g = "-" if graphed is None else f"{graphed:.1f}"
            step = "-" if graphed is None else f"{graphed * (2 * args.layers + 1) / 1e3:.2f}"
            print(f"| {tokens} | {nbytes:,} | {eager:.1f} | {g} | {step} |")


if __name__ == "__main__":
    main()
