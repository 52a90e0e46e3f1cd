"""The time of one decode step's all-reduces at tensor parallelism N: NCCL's beside torch's one-shot all-reduce
over symmetric memory, eager and inside a CUDA graph.

A step of the target runs 2 * layers + 1 all-reduces of tokens x hidden (distributed/collective_probe.py); at
batch 1 each is a few KiB, so its latency, not the link's bandwidth, is what it costs. This replays a step's
all-reduces on N processes (NCCL on GPUs, gloo on the CPU) and prints, per message size, the microseconds
of one all-reduce: issued eagerly one by one (what the benchmark's 'collectives ms/step' times), and
replayed from a CUDA graph that holds all of them (what an engine's graphed step pays). On GPUs it times
beside them torch's one-shot all-reduce (torch.distributed._symmetric_memory: every rank's buffer mapped
into every other rank, one kernel that copies the input in, meets the others at a barrier and sums the
buffers over NVLink; no multicast needed), and specserve's own one-shot all-reduce, the same algorithm in one
Triton kernel (distributed/one_shot.py, `all_reduce="one_shot"`). NCCL's variables (NCCL_PROTO, NCCL_ALGO, ...)
reach every rank:

    python benchmarks/allreduce_latency.py --ranks 2 --hidden 4096 --layers 32 --tokens 1 4 16 64 256 1024
    NCCL_PROTO=LL python benchmarks/allreduce_latency.py --ranks 2 --tokens 1
"""
from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from specserve.distributed import one_shot as own_one_shot
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


@dataclass
class SizeResult:
    tokens: int
    nbytes: int
    nccl_eager_us: float
    nccl_graphed_us: float | None  # None: not on GPUs
    one_shot_eager_us: float | None = None  # None: not on GPUs, or symmetric memory unavailable
    one_shot_graphed_us: float | None = None
    own_eager_us: float | None = None  # specserve's one-shot; None: not on GPUs, or the message past its buffer
    own_graphed_us: float | None = None


def _time(reduce, x: torch.Tensor, device: torch.device, calls: int, repeats: int) -> tuple[float, float | None]:
    """Microseconds of one of `calls` back-to-back reduce(x), eagerly and replayed from a graph (GPU only)."""

    def step() -> None:
        for _ in range(calls):
            reduce(x)

    eager = _per_call_us(step, device, calls, repeats)
    if device.type != "cuda":
        return eager, None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graphed = _per_call_us(graph.replay, device, calls, repeats)
    del graph  # a graph holding the group's collectives must go before the group
    return eager, graphed


def _one_shot_all_reduce(device: torch.device, max_bytes: int):
    """torch's one-shot all-reduce on a symmetric buffer of max_bytes joined by every rank (a collective)."""
    from torch.distributed import _symmetric_memory as symm_mem

    group_name = dist.group.WORLD.group_name
    buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
    symm_mem.rendezvous(buffer, group_name)

    def reduce(x: torch.Tensor) -> torch.Tensor:
        staging = buffer[: x.numel() * x.element_size()].view(x.dtype).view(x.shape)
        return torch.ops.symm_mem.one_shot_all_reduce_copy(staging, x, "sum", group_name)

    return reduce


def _rank(rank: int, args: argparse.Namespace, init_method: str, results) -> None:
    on_gpu = args.device == "cuda"
    if on_gpu:
        torch.cuda.set_device(rank)
    device = torch.device(f"cuda:{rank}" if on_gpu else "cpu")
    dist.init_process_group("nccl" if on_gpu else "gloo", init_method=init_method, rank=rank,
                            world_size=args.ranks, device_id=device if on_gpu else None)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    calls = 2 * args.layers + 1
    one_shot = own = None
    try:
        if on_gpu:
            largest = max(args.tokens) * args.hidden * dtype.itemsize
            one_shot = _one_shot_all_reduce(device, largest)
            own_one_shot.join(rank, args.ranks, device)
            own = own_one_shot.current()
        for tokens in args.tokens:
            x = torch.zeros(tokens, args.hidden, dtype=dtype, device=device)
            r = SizeResult(tokens, x.numel() * x.element_size(), *_time(dist.all_reduce, x, device, calls,
                                                                         args.repeats))
            if one_shot is not None:
                r.one_shot_eager_us, r.one_shot_graphed_us = _time(one_shot, x, device, calls, args.repeats)
            if own is not None and own.fits(x):
                r.own_eager_us, r.own_graphed_us = _time(own, x, device, calls, args.repeats)
            if rank == 0:
                results.append(r)
    finally:
        one_shot = own = None
        own_one_shot.leave()
        leave_process_group()


def _us(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


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
        shared = manager.list()
        mp.spawn(_rank, args=(args, Rendezvous.resolve(args.ranks).init_method, shared), nprocs=args.ranks)
        results = list(shared)
    calls = 2 * args.layers + 1
    print("| tokens | bytes | NCCL eager us | NCCL graphed us | torch one-shot eager us | torch one-shot graphed us | "
          "specserve one-shot eager us | specserve one-shot graphed us | graphed ms/step NCCL / torch / specserve |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        per_step = " / ".join("-" if us is None else f"{us * calls / 1e3:.2f}"
                              for us in (r.nccl_graphed_us, r.one_shot_graphed_us, r.own_graphed_us))
        print(f"| {r.tokens} | {r.nbytes:,} | {_us(r.nccl_eager_us)} | {_us(r.nccl_graphed_us)} | "
              f"{_us(r.one_shot_eager_us)} | {_us(r.one_shot_graphed_us)} | {_us(r.own_eager_us)} | "
              f"{_us(r.own_graphed_us)} | {per_step} |")


if __name__ == "__main__":
    main()
