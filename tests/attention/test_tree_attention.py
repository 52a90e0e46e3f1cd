"""Attention over trees of drafts: both backends against a float64 dense computation whose mask comes from
the tree's paths (a node sees the context, itself and the nodes whose path is a prefix of its own), not from
the bits the kernels read."""
import math

import pytest
import torch

from specserve.attention.torch_backend import TorchAttentionBackend
from specserve.spec_decode.tree import DraftTree

from test_triton_attention import DEVICE, TOLERANCE, make_batch  # noqa: E402

pytest.importorskip("triton")

from specserve.attention.triton_backend import TritonAttentionBackend  # noqa: E402

TREE = DraftTree.build([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0), (0, 0, 0, 0)])


def sees(tree: DraftTree, query: int, key: int) -> bool:
    """Tree index query may attend to tree index key (0 is the root, an ancestor of all)."""
    paths = ((),) + tree.paths
    return paths[query][:len(paths[key])] == paths[key]


def dense_tree_attention(batch, scale, visible_of) -> torch.Tensor:
    """float64 attention per request; visible_of(request, q_len, seq_len) -> [q_len, seq_len] bool."""
    out = torch.zeros(batch.num_real_tokens, *batch.q.shape[1:], dtype=torch.float64, device=batch.q.device)
    group = batch.q.shape[1] // batch.k.shape[1]
    qsl = batch.metadata.query_start_loc_cpu.tolist()
    for i, (keys, values) in enumerate(batch.history):
        start, end = qsl[i], qsl[i + 1]
        keys = keys.double().repeat_interleave(group, dim=1)
        values = values.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", batch.q[start:end].double(), keys) * scale
        visible = visible_of(i, end - start, keys.shape[0]).to(keys.device)
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, -math.inf).softmax(-1), values)
    return out


def causal(q_len: int, seq_len: int) -> torch.Tensor:
    return torch.arange(seq_len)[None, :] <= torch.arange(seq_len - q_len, seq_len)[:, None]


def check_both_backends(batch, expected, scale):
    for backend in (TorchAttentionBackend(), TritonAttentionBackend()):
        out = backend.forward(batch.q, batch.k, batch.v, batch.kv_cache.clone(), batch.metadata, scale)
        tol = TOLERANCE[batch.q.dtype]
        torch.testing.assert_close(out[:batch.num_real_tokens].double(), expected, **tol, msg=backend.name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_verification_of_trees_beside_other_requests(dtype):
    """A batch with a whole tree, a tree cut to its first 5 drafts, a prefill and a decode: tree tokens see the
    context and their ancestors, everything else attends causally."""
    n = TREE.num_nodes + 1
    q_lens, seq_lens = [n, 13, 6, 1], [n + 20, 13, 6 + 9, 30]
    batch = make_batch(q_lens, seq_lens, 4, 2, 64, dtype)
    bits = []
    for i, q_len in enumerate(q_lens):
        is_tree = i in (0, 2)
        bits += list(TREE.ancestor_bits[:q_len]) if is_tree else [-1] * q_len
    batch.metadata.tree_bits = torch.tensor(bits, dtype=torch.int64, device=DEVICE)

    def visible_of(i, q_len, seq_len):
        mask = causal(q_len, seq_len)
        if i in (0, 2):
            base = seq_len - q_len
            for qi in range(q_len):
                for ki in range(q_len):
                    mask[qi, base + ki] = sees(TREE, qi, ki)
        return mask

    check_both_backends(batch, dense_tree_attention(batch, 0.125, visible_of), 0.125)


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_a_level_of_the_drafters_tree(depth):
    """The drafter's pass over the drafts of one depth: the queries are the last keys written, the tree starts
    tree_offset keys before them (at the first draft; the root is not in the drafter's tree), and a draft sees
    the context, its ancestors and itself."""
    level = TREE.level(depth)
    written = level.stop - 1  # drafts 1 .. level.stop - 1 have keys
    contexts = [17, 40]
    q_lens = [len(level)] * len(contexts)
    seq_lens = [c + written for c in contexts]
    batch = make_batch(q_lens, seq_lens, 4, 2, 64, torch.float32, pad_reqs=1)
    batch.metadata.tree_bits = torch.tensor([TREE.ancestor_bits[i] >> 1 for i in level] * len(contexts),
                                            dtype=torch.int64, device=DEVICE)
    batch.metadata.tree_offset = level.start - 1

    def visible_of(i, q_len, seq_len):
        mask = causal(q_len, seq_len)
        first = seq_len - written  # key of draft 1
        for qi, node in enumerate(level):
            for key in range(1, written + 1):
                mask[qi, first + key - 1] = sees(TREE, node, key)
        return mask

    check_both_backends(batch, dense_tree_attention(batch, 0.125, visible_of), 0.125)


def test_tree_shape():
    assert TREE.num_nodes == 9 and TREE.depth == 4
    assert TREE.parents == (0, 0, 0, 0, 1, 1, 2, 4, 5, 7)
    assert list(TREE.level(2)) == [4, 5, 6] and TREE.top_k(1) == 3 and TREE.top_k(2) == 2
    assert all(bool(TREE.ancestor_bits[q] >> k & 1) == sees(TREE, q, k) for q in range(10) for k in range(10))
    assert TREE.depth_of_prefix(5) == 2


@pytest.mark.gpu
def test_tree_attention_on_the_gpu():
    assert DEVICE == "cuda"
    for dtype in (torch.float32, torch.bfloat16):
        test_verification_of_trees_beside_other_requests(dtype)
    for depth in (1, 2, 3):
        test_a_level_of_the_drafters_tree(depth)
