"""The one-shot all-reduce (distributed/one_shot.py) on two GPUs, against NCCL: the same sums, bit for bit, on
every rank, for every dtype and for sizes from one element to the whole buffer, eagerly, replayed from a CUDA
graph, and over thousands of calls back to back (a barrier that let a rank overwrite a buffer another still
reads would show as a wrong sum there); and an engine at TP=2 with it gives TP=1's tokens."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from specserve import LLM, SamplingParams
from specserve.distributed import one_shot
from specserve.distributed.parallel_state import destroy_tp_group, init_tp_group, join_all_reduce, rank_device
from specserve.distributed.rendezvous import Rendezvous

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]
WORLD = 2
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _inputs(rank: int, numel: int, dtype: torch.dtype, seed: int, device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    return (torch.randn(numel, generator=gen) * 4).to(dtype).to(device)


def _same_on_every_rank(x: torch.Tensor) -> bool:
    parts = [torch.empty_like(x) for _ in range(WORLD)]
    dist.all_gather(parts, x)
    return all(torch.equal(parts[0], p) for p in parts[1:])


def _rank(rank: int, init_method: str) -> None:
    device = torch.device(rank_device("cuda", rank))
    init_tp_group(rank, WORLD, init_method, str(device))
    join_all_reduce("one_shot", str(device))
    try:
        fast = one_shot.current()
        sizes = [1, 7, 2048, 4096, 2048 * 33 + 5, 300_000]
        for dtype in DTYPES:
            sizes_here = sizes + [one_shot.BUFFER_BYTES // dtype.itemsize]
            for seed, numel in enumerate(sizes_here):
                x = _inputs(rank, numel, dtype, seed, device)
                expected = x.clone()
                dist.all_reduce(expected)
                assert fast.fits(x)
                fast(x)
                assert torch.equal(x, expected), (dtype, numel)
                assert _same_on_every_rank(x)
        # Replayed from a graph: each replay reduces what the inputs hold then.
        static = torch.zeros(4096 * 8, dtype=torch.bfloat16, device=device)
        stream = torch.cuda.Stream(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            for i in range(8):
                fast(static[i * 4096:(i + 1) * 4096])
        for replay in range(5):
            inputs = _inputs(rank, static.numel(), torch.bfloat16, 100 + replay, device)
            static.copy_(inputs)
            graph.replay()
            expected = inputs.clone()
            dist.all_reduce(expected)
            assert torch.equal(static, expected), replay
        del graph
        # Thousands of calls back to back, of sizes every rank draws alike, then checked once.
        gen = torch.Generator().manual_seed(7)
        xs, expected = [], []
        for call in range(3000):
            numel = int(torch.randint(1, 70_000, (1,), generator=gen))
            x = _inputs(rank, numel, torch.bfloat16, 1000 + call, device)
            e = x.clone()
            fast(x)
            if call % 100 == 0:
                xs.append(x)
                expected.append(e)
        for x, e in zip(xs, expected):
            dist.all_reduce(e)
            assert torch.equal(x, e)
        torch.cuda.synchronize(device)
    finally:
        destroy_tp_group()


def test_one_shot_equals_nccl_bit_for_bit():
    mp.spawn(_rank, args=(Rendezvous.resolve(WORLD).init_method,), nprocs=WORLD)


@pytest.mark.usefixtures("cuda_float32")
@pytest.mark.parametrize("mode", ["FULL_AND_PIECEWISE", "NONE"])
def test_tp2_with_the_one_shot_all_reduce_gives_tp1_tokens(tiny_llama, mode):
    prompts = [[5, 6, 7, 8], list(range(3, 60)), [9] * 20]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def tokens(**kwargs) -> list[list[int]]:
        llm = LLM(str(tiny_llama[0]), device="cuda", dtype="float32", max_model_len=256, max_num_seqs=4,
                  kv_cache_memory_bytes=256 << 20, cudagraph_mode=mode, **kwargs)
        try:
            return [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        finally:
            llm.engine.core.close()

    assert tokens(tensor_parallel_size=2, all_reduce="one_shot") == tokens()
