"""The graph manager's mode rules, dispatch and padding (docs/design.md, 'Graph modes'), without a GPU."""
from __future__ import annotations

import pytest

from specserve.worker.cudagraph import BatchDescriptor, CUDAGraphManager, default_capture_sizes
from specserve.worker.cudagraph_mode import CUDAGraphMode as M
from specserve.worker.graph_recorder import AttentionSplitter, EagerRecorder

SIZES = [1, 2, 4, 8, 16, 32]


class _Backend:
    name = "stub"


def manager(mode: M, sizes=SIZES, max_reqs=16, max_tokens=64, k=3) -> CUDAGraphManager:
    return CUDAGraphManager("t", mode, sizes, max_reqs, max_tokens, (1, 1 + k), EagerRecorder(),
                            splitter=AttentionSplitter(_Backend()))


@pytest.mark.parametrize("mode,uniform_runs,mixed_runs", [
    (M.NONE, M.NONE, M.NONE),
    (M.PIECEWISE, M.PIECEWISE, M.PIECEWISE),
    (M.FULL, M.FULL, M.FULL),
    (M.FULL_DECODE_ONLY, M.FULL, M.NONE),
    (M.FULL_AND_PIECEWISE, M.FULL, M.PIECEWISE),
])
def test_runtime_mode_table(mode, uniform_runs, mixed_runs):
    m = manager(mode)
    assert m.dispatch(3, 3, 1).mode is uniform_runs  # three decodes
    assert m.dispatch(12, 3, 4).mode is uniform_runs  # three verifies of k = 3
    assert m.dispatch(9, 3, None).mode is mixed_runs  # prefill + decodes
    # A uniform query length no graph is recorded for counts as mixed.
    assert m.dispatch(6, 3, 2).mode is mixed_runs


def test_full_pads_requests_and_tokens():
    m = manager(M.FULL_AND_PIECEWISE)
    assert m.dispatch(3, 3, 1) == BatchDescriptor(M.FULL, 4, 4, 1)
    assert m.dispatch(20, 5, 4) == BatchDescriptor(M.FULL, 32, 8, 4)
    # Mixed full graphs (FULL mode) pad tokens and give every token a possible request row.
    assert manager(M.FULL).dispatch(9, 3, None) == BatchDescriptor(M.FULL, 16, 16, None)
    assert manager(M.FULL, max_reqs=4).dispatch(9, 3, None) == BatchDescriptor(M.FULL, 16, 4, None)


def test_piecewise_pads_tokens_only():
    d = manager(M.FULL_AND_PIECEWISE).dispatch(9, 3, None)
    assert d == BatchDescriptor(M.PIECEWISE, 16, 3, None)
    # Piecewise graphs are shared by every num_reqs with the same padded token count.
    assert d.key == manager(M.PIECEWISE).dispatch(11, 7, None).key


def test_too_large_runs_eagerly():
    m = manager(M.FULL_AND_PIECEWISE, max_reqs=16, max_tokens=48)
    assert m.dispatch(17, 17, 1).mode is M.NONE  # more requests than the largest request size
    # Ten verifies of 4 tokens would pad to 16 x 4 = 64 tokens, over the 48-token buffers; 8 fit.
    assert m.dispatch(40, 10, 4).mode is M.NONE
    assert m.dispatch(32, 8, 4) == BatchDescriptor(M.FULL, 32, 8, 4)
    assert m.dispatch(33, 5, None).mode is M.NONE  # 33 tokens > largest size 32


def test_capture_sizes_respect_limits():
    m = manager(M.FULL_AND_PIECEWISE, max_reqs=8, max_tokens=20, k=3)
    assert m.req_sizes == {1: [1, 2, 4, 8], 4: [1, 2, 4]}  # 8 verifies of 4 tokens exceed 20
    assert m.token_sizes == [1, 2, 4, 8, 16]
    descs = m.capture_descriptors()
    assert [d.num_tokens for d in descs] == sorted((d.num_tokens for d in descs), reverse=True)
    assert {d.mode for d in descs} == {M.FULL, M.PIECEWISE}
    assert default_capture_sizes(256)[:5] == [1, 2, 4, 8, 16] and default_capture_sizes(256)[-1] == 256
    assert default_capture_sizes(3) == [1, 2]
    # Past 256 (large batches of a small model, train-eagle's data), every 32 tokens.
    large = default_capture_sizes(1024)
    assert large[:35] == default_capture_sizes(256) and large[35:] == list(range(288, 1025, 32))
    assert default_capture_sizes(300)[-1] == 288


def test_large_batches_of_a_small_model_replay_graphs():
    # train-eagle's data engine at 512 sequences: 1,024 tokens a step, graphs up to that.
    m = manager(M.FULL_AND_PIECEWISE, sizes=default_capture_sizes(1024), max_reqs=512, max_tokens=1024, k=0)
    assert m.dispatch(512, 512, 1) == BatchDescriptor(M.FULL, 512, 512, 1)
    assert m.dispatch(300, 300, 1) == BatchDescriptor(M.FULL, 320, 320, 1)
    assert m.dispatch(700, 480, None) == BatchDescriptor(M.PIECEWISE, 704, 480, None)


@pytest.mark.parametrize("mode", list(M))
def test_draft_decode_is_never_piecewise(mode):
    draft_mode = mode.for_draft_decode()
    assert draft_mode in (M.FULL_DECODE_ONLY, M.NONE)
    assert (draft_mode is M.FULL_DECODE_ONLY) == mode.has_full
    m = CUDAGraphManager("draft decode", draft_mode, SIZES, 16, 16, (1,), EagerRecorder())
    assert all(d.mode is M.FULL for d in m.capture_descriptors())
    for n in range(1, 20):
        assert m.dispatch(n, n, 1).mode in (M.FULL, M.NONE)


def test_piecewise_mode_needs_a_splitter():
    with pytest.raises(ValueError, match="AttentionSplitter"):
        CUDAGraphManager("t", M.PIECEWISE, SIZES, 4, 4, (1,), EagerRecorder())


def test_one_request_with_a_short_query_runs_a_full_graph():
    """A prompt's uncached tail (a prefill of one request, at most a block): one full graph per length, for one
    request; more requests with such queries still run piecewise, and the uniform lengths keep their sizes."""
    m = CUDAGraphManager("t", M.FULL_AND_PIECEWISE, SIZES, 16, 64, (1, 4), EagerRecorder(),
                         splitter=AttentionSplitter(_Backend()), single_request_query_lens=range(2, 9))
    assert m.single_request_query_lens == (2, 3, 5, 6, 7, 8) and m.req_sizes[5] == [1]
    assert m.dispatch(5, 1, 5) == BatchDescriptor(M.FULL, 5, 1, 5)
    assert m.dispatch(10, 2, 5) == BatchDescriptor(M.PIECEWISE, 16, 2)
    assert m.dispatch(9, 1, 9) == BatchDescriptor(M.PIECEWISE, 16, 1)
    assert m.dispatch(12, 3, 4) == BatchDescriptor(M.FULL, 16, 4, 4)
    assert BatchDescriptor(M.FULL, 5, 1, 5) in m.capture_descriptors()
    assert BatchDescriptor(M.FULL, 10, 2, 5) not in m.capture_descriptors()
