"""Triton small-M projection (norm / add + norm prologues, SiLU-and-mul epilogue) against float64.

Every operand is a view into a NaN buffer, so a read past its edges shows up
as NaN in the result and a write past them as a changed NaN. K and N are no
multiples of the block sizes.
"""
from dataclasses import replace

import pytest
import torch

from specserve.kernels.fused_linear import fused_linear, fused_linear_argmax, fused_linear_topk
from specserve.kernels.small_m_configs import INTERPRETER
from specserve.kernels.split_parts import MAX_SPLIT_TILES, split_counters

from .util import DEVICE, assert_close, poison_intact, poisoned_view

EPS = 1e-5
K, N = 100, 70
PROLOGUES = ["none", "norm", "add_norm"]


def norm_weight_of(k: int, dtype) -> torch.Tensor:
    return (1 + 0.1 * torch.randn(k, generator=torch.Generator().manual_seed(7))).to(dtype).to(DEVICE)


def reference(x, weight, norm_weight, residual, silu_mul):
    """(out, x + residual) in float64 from the definitions: sum, RMSNorm, matmul, SiLU * up."""
    h = x.double()
    if residual is not None:
        h = h + residual.double()
    total = h
    if norm_weight is not None:
        h = h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * norm_weight.double()
    out = h @ weight.double().T
    if silu_mul:
        gate, up = out.chunk(2, dim=-1)
        out = gate * torch.sigmoid(gate) * up
    return out, total


def check_fused_linear(m, k, n, dtype, prologue, silu_mul, config=None, norm_tolerance=None):
    """norm_tolerance: compare ||out - expected|| / ||expected|| with it instead of elementwise (at model
    sizes the 16-bit rounding of the normed input, which the unfused path rounds too, makes a few of
    hundreds of thousands of outputs exceed an elementwise bound where the dot cancels)."""
    x = poisoned_view(m, k, dtype, seed=0)
    residual = poisoned_view(m, k, dtype, seed=1) if prologue == "add_norm" else None
    # Scaled so outputs are of order one: tolerances are then absolute and relative alike.
    weight = poisoned_view(2 * n if silu_mul else n, k, dtype, seed=2)
    weight.mul_(k**-0.5)
    norm_weight = norm_weight_of(k, dtype) if prologue != "none" else None
    x_before = x.clone()
    residual_before = residual.clone() if residual is not None else None

    out, total = fused_linear(x, weight, norm_weight=norm_weight, eps=EPS, residual=residual, silu_mul=silu_mul,
                              config=config)
    expected, expected_total = reference(x, weight, norm_weight, residual, silu_mul)
    assert out.shape == (m, n) and out.dtype == dtype
    if norm_tolerance is None:
        assert_close(out, expected, terms=k)
    else:
        rel = ((out.double() - expected).norm() / expected.norm()).item()
        assert rel < norm_tolerance, f"relative error {rel:.2e}"
    if residual is None:
        assert total is None
    else:
        assert total.shape == (m, k) and total.dtype == dtype
        assert_close(total, expected_total)
        assert torch.equal(residual, residual_before) and poison_intact(residual)
    assert torch.equal(x, x_before), "x is an input only"
    assert poison_intact(x) and poison_intact(weight)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
# 17 and 32: the 32-row tile a tree's verification takes past 16 rows.
@pytest.mark.parametrize("m", [1, 3, 16, 17, 32])
@pytest.mark.parametrize("silu_mul", [False, True], ids=["plain", "silu_mul"])
@pytest.mark.parametrize("prologue", PROLOGUES)
def test_fused_linear(prologue, silu_mul, m, dtype):
    check_fused_linear(m, K, N, dtype, prologue, silu_mul)


def test_float16():
    check_fused_linear(5, K, N, torch.float16, "add_norm", True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("silu_mul", [False, True], ids=["plain", "silu_mul"])
@pytest.mark.parametrize("m", [3, 24])
def test_full_tile_prologue(m, silu_mul, dtype):
    # The interpreter's default config is compact, as the GPU's on small weights; large weights over
    # several tokens (NORM_LARGE) normalise every row of the tile.
    check_fused_linear(m, K, N, dtype, "add_norm", silu_mul, config=replace(INTERPRETER, compact=False))


def split_config(split: int):
    # K = 100 in 32-wide chunks, parts of a whole number of chunks: 64 + 36 (split 2), 64 + 36 + an empty part
    # (3), 32 + 32 + 32 + 4 (4).
    return replace(INTERPRETER, block_k=32, split_k=split)


def counters_are_zero() -> bool:
    return not split_counters(torch.empty(0, device=DEVICE).device, 1).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m", [1, 3, 16, 17, 32])
@pytest.mark.parametrize("split", [2, 3, 4])
def test_split_k(split, m, dtype):
    check_fused_linear(m, K, N, dtype, "none", False, config=split_config(split))
    assert counters_are_zero(), "the last part of each column tile resets its count"


def test_split_k_is_deterministic():
    x = poisoned_view(17, K, torch.bfloat16, seed=0)
    weight = poisoned_view(N, K, torch.bfloat16, seed=2).mul_(K**-0.5)
    first, second = (fused_linear(x, weight, config=split_config(3))[0] for _ in range(2))
    assert torch.equal(first, second)


def test_split_k_is_for_plain_projections_only():
    x, weight, norm_weight = torch.randn(2, 8), torch.randn(4, 8), torch.ones(8)
    with pytest.raises(ValueError, match="split_k=2 applies to plain projections only, got norm_weight"):
        fused_linear(x, weight, norm_weight=norm_weight, config=split_config(2))
    with pytest.raises(ValueError, match="got norm_weight, residual, silu_mul"):
        fused_linear(x, weight, norm_weight=norm_weight, residual=x, silu_mul=True, config=split_config(2))
    with pytest.raises(ValueError, match="got top-k"):
        fused_linear_topk(x, weight, 1, config=split_config(2))
    with pytest.raises(ValueError, match=f"at most {MAX_SPLIT_TILES} output tiles"):
        split_counters(x.device, MAX_SPLIT_TILES + 1)
    assert counters_are_zero()


def test_no_rows():
    x = torch.empty(0, K, device=DEVICE)
    out, total = fused_linear(x, torch.randn(N, K, device=DEVICE), norm_weight=torch.ones(K, device=DEVICE),
                              residual=torch.empty(0, K, device=DEVICE))
    assert out.shape == (0, N) and total.shape == (0, K)


@pytest.mark.parametrize("bad,message", [
    (dict(x=torch.randn(33, 8)), "at most 32 rows"),
    (dict(weight=torch.randn(4, 9)), "K=8 but weight has K=9"),
    (dict(weight=torch.randn(4, 8, dtype=torch.float64)), "dtype"),
    (dict(x=torch.randn(8, 2).T), "unit stride"),
    (dict(residual=torch.randn(2, 8)), "only added in front of an RMSNorm"),
    (dict(norm_weight=torch.ones(7)), "norm_weight"),
    (dict(weight=torch.randn(5, 8), silu_mul=True), "even number of rows"),
])
def test_bad_operands_are_named(bad, message):
    args = dict(x=torch.randn(2, 8), weight=torch.randn(4, 8)) | bad
    with pytest.raises(ValueError, match=message):
        fused_linear(args.pop("x"), args.pop("weight"), **args)


# A gap between the two largest float64 logits beyond which the kernel's rounding cannot swap them.
TOLERANCE_OF = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m", [1, 3, 16, 17, 32])
@pytest.mark.parametrize("prologue", PROLOGUES)
def test_argmax(prologue, m, dtype):
    check_argmax(m, K, N, dtype, prologue)


def check_argmax(m, k, n, dtype, prologue):
    """The argmax epilogue returns the first maximum of the logits fused_linear computes, which is the float64
    argmax wherever that is not within the logits' rounding of a tie; x + residual as fused_linear."""
    x = poisoned_view(m, k, dtype, seed=0)
    residual = poisoned_view(m, k, dtype, seed=1) if prologue == "add_norm" else None
    weight = poisoned_view(n, k, dtype, seed=2).mul_(k**-0.5)
    norm_weight = norm_weight_of(k, dtype) if prologue != "none" else None
    kw = dict(norm_weight=norm_weight, eps=EPS, residual=residual)

    tokens, total = fused_linear_argmax(x, weight, **kw)
    logits, expected_total = fused_linear(x, weight, **kw)
    assert tokens.dtype == torch.int64 and torch.equal(tokens, logits.argmax(dim=-1))
    reference_logits = reference(x, weight, norm_weight, residual, False)[0]
    top2 = reference_logits.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 4 * TOLERANCE_OF[dtype]
    assert clear.any()
    assert torch.equal(tokens[clear], reference_logits.argmax(dim=-1)[clear])
    if residual is None:
        assert total is None
    else:
        assert torch.equal(total, expected_total) and poison_intact(residual)
    assert poison_intact(x) and poison_intact(weight)


def test_argmax_ties_go_to_the_first_column_across_programs_and_map():
    # Columns 3 and 65 (in different programs) hold the same row, the largest logit; the map reverses ids.
    k = 16
    x = torch.ones(2, k, device=DEVICE)
    weight = torch.randn(N, k, generator=torch.Generator().manual_seed(0)).mul_(0.01).to(DEVICE)
    weight[3] = weight[65] = 1.0
    weight[1, :] = -1.0
    tokens, _ = fused_linear_argmax(x, weight)
    assert tokens.tolist() == [3, 3]
    token_map = torch.arange(N - 1, -1, -1, device=DEVICE)
    assert fused_linear_argmax(x, weight, token_map=token_map)[0].tolist() == [N - 1 - 3] * 2
    assert fused_linear_argmax(-x, weight, token_map=token_map)[0].tolist() == [N - 1 - 1] * 2


def test_argmax_of_nan_rows_stays_in_range():
    # A NaN never wins, so even a row of NaN picks a real column (and its mapped id): an id past the map
    # would read out of bounds inside a CUDA graph.
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    x[0] = float("nan")
    weight = torch.randn(N, 16, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    weight[5, 0] = float("nan")  # row 1 and 2's column 5 is NaN
    token_map = torch.arange(N, device=DEVICE) + 1000
    tokens = fused_linear_argmax(x, weight, token_map=token_map)[0].tolist()
    assert tokens[0] == 1000
    logits = x[1:] @ weight.T
    logits[:, 5] = float("-inf")
    assert tokens[1:] == (logits.argmax(dim=-1) + 1000).tolist()


@pytest.mark.parametrize("m", [1, 17])
@pytest.mark.parametrize("k", [1, 3])
def test_topk_returns_the_best_columns_best_first(m, k):
    """A tree's guesses: fused_linear_topk's columns are torch.topk's of fused_linear's logits (continuous
    random logits: no ties), across programs (N = 70 spans several), mapped through the token map."""
    x = poisoned_view(m, K, torch.float32, seed=0)
    weight = poisoned_view(N, K, torch.float32, seed=2).mul_(K**-0.5)
    token_map = torch.randperm(N, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    tokens, total = fused_linear_topk(x, weight, k, token_map=token_map)
    logits = fused_linear(x, weight)[0]
    assert total is None and tokens.shape == (m, k) and tokens.dtype == torch.int64
    assert torch.equal(tokens, token_map[logits.topk(k, dim=-1).indices])
    assert torch.equal(reference(x, weight, None, None, False)[0].topk(k, dim=-1).indices,
                       logits.topk(k, dim=-1).indices)


@pytest.mark.parametrize("requests", [1, 3])
def test_topk_scattered_into_a_tree_level(requests):
    """A tree level's guesses sent by the pick kernel to the drafts they become: 2 parents a request, 3 guesses
    each, 4 of the 6 kept (in another order), into the level's tensor and into 4 columns of a wider drafts
    tensor (a strided view) from column 5; what the kernel scatters is what PickScatter.apply makes of
    fused_linear_topk's own [M, k] picks, and nothing else of drafts is written."""
    from specserve.spec_decode.pick_scatter import PickScatter

    m, k = 2 * requests, 3
    x = poisoned_view(m, K, torch.float32, seed=5)
    weight = poisoned_view(N, K, torch.float32, seed=6).mul_(K**-0.5)
    token_map = torch.randperm(N, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    columns = torch.tensor([4, 0, 1, 3], device=DEVICE)  # node j takes pick column columns[j] of its request
    dest = torch.full((2 * k,), -1, dtype=torch.int64, device=DEVICE)
    dest[columns] = torch.arange(4, device=DEVICE)

    def scatter():
        packed = torch.full((requests, 12), -7, dtype=torch.int64, device=DEVICE)
        return PickScatter(dest, columns, 2, torch.empty(requests, 4, dtype=torch.int64, device=DEVICE),
                           packed[:, 1:11], 5), packed

    got, got_packed = scatter()
    level = fused_linear_topk(x, weight, k, token_map=token_map, scatter=got)[0]
    want, want_packed = scatter()
    want.apply(fused_linear_topk(x, weight, k, token_map=token_map)[0])
    assert level is got.out and torch.equal(level, want.out)
    assert torch.equal(got_packed, want_packed)
    picks = fused_linear_topk(x, weight, k, token_map=token_map)[0].view(requests, 2 * k)
    assert torch.equal(level, picks[:, columns])
    assert (got_packed[:, :6] == -7).all() and (got_packed[:, 10:] == -7).all()


def test_topk_ties_go_to_the_lower_column_and_nan_stays_in_range():
    # Columns 3 and 65 (two programs) tie for the best logit, 10 is third; a NaN row picks distinct columns.
    x = torch.ones(2, 16, device=DEVICE)
    x[1] = float("nan")
    weight = torch.randn(N, 16, generator=torch.Generator().manual_seed(0)).mul_(0.01).to(DEVICE)
    weight[3] = weight[65] = 1.0
    weight[10] = 0.5
    tokens = fused_linear_topk(x, weight, 3)[0]
    assert tokens[0].tolist() == [3, 65, 10]
    assert len(set(tokens[1].tolist())) == 3 and all(0 <= t < N for t in tokens[1].tolist())
    with pytest.raises(ValueError, match="k must be between 1 and"):
        fused_linear_topk(x, weight, 0)


def test_argmax_token_map_is_checked():
    with pytest.raises(ValueError, match="token_map must be int64"):
        fused_linear_argmax(torch.randn(2, 8), torch.randn(4, 8), token_map=torch.arange(4, dtype=torch.int32))
