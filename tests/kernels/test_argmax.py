"""The split argmax against torch.argmax: values, dtypes, and ties (the first maximal index wins)."""
import math

import pytest
import torch

pytest.importorskip("triton")

from specserve.kernels.argmax import argmax_rows  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("cols", [1, 1000, 2048, 2049, 70_000])
def test_matches_torch(dtype, cols):
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(cols)).to(DEVICE, dtype)
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))


def test_ties_go_to_the_first_maximum_across_lanes_and_chunks():
    x = torch.zeros(4, 70_000)
    x[0, [5, 1029, 2048, 69_999]] = 3.0  # one lane, two lanes, two chunks
    x[1, [4097, 2050]] = 3.0  # the later chunk's lane comes first in the block
    x[2] = -math.inf  # nothing but -inf: index 0, as torch
    x[3, [69_999, 40_000]] = 7.0
    x = x.to(DEVICE, torch.bfloat16)
    assert argmax_rows(x).tolist() == x.argmax(dim=-1).tolist() == [5, 2050, 0, 40_000]


def test_rows_of_a_strided_view():
    x = torch.randn(5, 9000, generator=torch.Generator().manual_seed(1)).to(DEVICE)[::2]
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_llama3_vocabulary_on_the_gpu_as_greedy_decoding_calls_it():
    from specserve.sample.argmax import greedy_argmax

    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(64, 128_256, device="cuda", generator=gen).to(torch.bfloat16)
    logits[7, [90_000, 3]] = 100.0
    assert torch.equal(greedy_argmax(logits), logits.argmax(dim=-1))
    assert greedy_argmax(logits)[7].item() == 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_smollm2_vocabulary_replayed_from_a_cuda_graph():
    # Recorded into a graph, greedy_argmax splits SmolLM2's 49,152 logits too; the replay reads new logits.
    from specserve.sample.argmax import greedy_argmax

    gen = torch.Generator(device="cuda").manual_seed(1)
    logits = torch.randn(8, 49_152, device="cuda", generator=gen).to(torch.bfloat16)
    greedy_argmax(logits, captured=True)  # compiles outside the recording
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = greedy_argmax(logits, captured=True)
    logits.copy_(torch.randn(8, 49_152, device="cuda", generator=gen))
    logits[3, [30_000, 7]] = 100.0
    graph.replay()
    assert torch.equal(out, logits.argmax(dim=-1))
    assert out[3].item() == 7
