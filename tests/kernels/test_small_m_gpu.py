"""The small-M kernels compiled for a real GPU, at SmolLM2-135M and Llama-3-8B layer shapes.

Each projection kernel against float64, and a whole decoder layer (the small-M
path: five kernels) against the plain torch path on the same device, over a
decode batch padded as a full CUDA graph pads it. Run with `pytest -m gpu`;
it skips only where there is no CUDA device.
"""
import copy

import pytest
import torch

from specserve.attention.backend import get_attention_backend
from specserve.attention.metadata import PAD_SLOT_ID, AttentionMetadata
from specserve.kernels.fused_linear import fused_linear
from specserve.kernels.split_parts import split_counters
from specserve.kernels.small_m_configs import CANDIDATES
from specserve.models.arch_config import ArchConfig
from specserve.models.layers import RotaryEmbedding, set_fused_kernels
from specserve.models.llama import DecoderLayer

from .test_eagle3_input import check_eagle3_input
from .test_fused_linear import check_argmax, check_fused_linear
from .test_fused_model import assert_near, randomize
from .test_qkv_rotary_cache import check_qkv

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("cuda_float32")]

# name: (hidden, intermediate, num_heads, num_kv_heads, head_dim)
SHAPES = {"smollm2-135m": (576, 1536, 9, 3, 64), "llama3-8b": (4096, 14336, 32, 8, 128)}
HEAD_MLP = 6144  # the shipped SmolLM2 EAGLE-3 head's intermediate size
SPLIT_CANDIDATES = [c for c in CANDIDATES if c.split_k > 1]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
BLOCK_SIZE, CONTEXT = 16, 100


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 4, 16, 17, 32])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_projections_at_model_shapes(shape, m, dtype):
    hidden, inter, num_heads, num_kv_heads, head_dim = SHAPES[shape]
    check_qkv(m, num_heads, num_kv_heads, head_dim, dtype, "add_norm", k=hidden)
    # Relative to float64, as accurate as the inputs' dtype allows (a few of its units in the last place).
    tol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    check_fused_linear(m, num_heads * head_dim, hidden, dtype, "none", False, norm_tolerance=tol)  # o_proj
    check_fused_linear(m, hidden, inter, dtype, "add_norm", True, norm_tolerance=tol)  # gate_up + SiLU
    check_fused_linear(m, inter, hidden, dtype, "none", False, norm_tolerance=tol)  # down_proj


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 5, 16, 17, 32])
def test_eagle3_draft_step_kernels_at_the_shipped_head_shape(m, dtype):
    """The shipped SmolLM2 head's draft step: attention input, qkv over 2H without a norm, the final add + norm
    with the lm_head over its 12,288 draft tokens and the argmax."""
    hidden, _, num_heads, num_kv_heads, head_dim = SHAPES["smollm2-135m"]
    check_eagle3_input(m, 49152, hidden, dtype)
    check_qkv(m, num_heads, num_kv_heads, head_dim, dtype, "none", k=2 * hidden)
    check_argmax(m, hidden, 12288, dtype, "add_norm")
    check_argmax(m, hidden, 12288, dtype, "none")
    # Its MLP, 6144 wide: gate_up in the wide tiles of a weight past MEDIUM_WEIGHT_BYTES, down_proj's long K.
    tol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    check_fused_linear(m, hidden, HEAD_MLP, dtype, "add_norm", True, norm_tolerance=tol)
    check_fused_linear(m, HEAD_MLP, hidden, dtype, "none", False, norm_tolerance=tol)


@pytest.mark.parametrize("config", SPLIT_CANDIDATES, ids=str)
@pytest.mark.parametrize("m", [1, 16])
def test_split_k_parts_race_to_one_deterministic_sum(m, config):
    """Split-K at the head's down_proj shape, where 36 column tiles' parts run at once on different SMs: the
    last part of each tile sums them all, in order, whichever part finished last."""
    hidden = SHAPES["smollm2-135m"][0]
    check_fused_linear(m, HEAD_MLP, hidden, torch.bfloat16, "none", False, config=config, norm_tolerance=3e-2)
    x = torch.randn(m, HEAD_MLP, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(hidden, HEAD_MLP, device="cuda", dtype=torch.bfloat16) * HEAD_MLP**-0.5
    runs = [fused_linear(x, weight, config=config)[0] for _ in range(20)]
    assert all(torch.equal(runs[0], run) for run in runs[1:])
    assert not split_counters(x.device, 1).any(), "every column tile's count is back at zero"


def arch_of(shape: str) -> ArchConfig:
    hidden, inter, heads, kv_heads, head_dim = SHAPES[shape]
    return ArchConfig(architecture="LlamaForCausalLM", vocab_size=256, hidden_size=hidden, intermediate_size=inter,
                      num_layers=1, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-5,
                      rope_theta=500000.0, max_position_embeddings=4096, tie_word_embeddings=False)


def padded_decode(num_reqs: int, pad_tokens: int = 2, pad_reqs: int = 1) -> tuple[torch.Tensor, AttentionMetadata]:
    """(positions, metadata) of num_reqs decode requests of CONTEXT tokens, padded as a full graph pads them."""
    blocks = -(-CONTEXT // BLOCK_SIZE)
    table = torch.arange((num_reqs + pad_reqs) * blocks, dtype=torch.int32).view(-1, blocks)
    last = CONTEXT - 1
    slots = (table[:num_reqs, last // BLOCK_SIZE].long() * BLOCK_SIZE + last % BLOCK_SIZE).tolist()
    qsl = torch.tensor([0] + [1] * num_reqs + [0] * pad_reqs, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    seq_lens = torch.tensor([CONTEXT] * num_reqs + [0] * pad_reqs, dtype=torch.int32)
    metadata = AttentionMetadata(
        num_reqs=num_reqs + pad_reqs, num_tokens=num_reqs + pad_tokens, max_query_len=1, max_seq_len=CONTEXT,
        query_start_loc=qsl.cuda(), seq_lens=seq_lens.cuda(), block_table=table.cuda(),
        slot_mapping=torch.tensor(slots + [PAD_SLOT_ID] * pad_tokens, device="cuda"),
        query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens)
    positions = torch.tensor([last] * num_reqs + [0] * pad_tokens, device="cuda")
    return positions, metadata


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_reqs", [1, 4, 14, 30])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_decoder_layer_small_m_equals_torch(shape, num_reqs, dtype):
    """float32: the paths agree to float32 rounding. 16-bit: against the float32 torch path on the same
    (rounded) weights and inputs, the small-M path is about as accurate as the torch path."""
    # 14 (30) requests and 2 padding tokens: the 16-token (32-token) graph of a batch of 14 (30).
    arch = arch_of(shape)
    layer = DecoderLayer(arch, get_attention_backend("triton"))
    randomize(layer)
    layer = layer.to(device="cuda", dtype=dtype)
    rotary = RotaryEmbedding(arch.head_dim, arch.max_position_embeddings, arch.rope_theta, {}).cuda()
    positions, metadata = padded_decode(num_reqs)
    gen = torch.Generator(device="cuda").manual_seed(0)
    x, residual = (torch.randn(metadata.num_tokens, arch.hidden_size, generator=gen, device="cuda").to(dtype)
                   for _ in range(2))
    blocks = metadata.block_table.numel()
    cache = torch.randn(2, blocks, BLOCK_SIZE, arch.num_kv_heads, arch.head_dim, generator=gen, device="cuda")
    cache = cache.to(dtype)

    def run(fused: bool, run_dtype: torch.dtype):
        model = copy.deepcopy(layer).to(run_dtype)
        set_fused_kernels(model, fused)
        layer_cache = cache.to(run_dtype, copy=True)
        with torch.no_grad():
            out, res = model(x.to(run_dtype, copy=True), positions, rotary, layer_cache, metadata,
                             residual.to(run_dtype, copy=True))
        return out[:num_reqs], res[:num_reqs], layer_cache

    plain, fused = run(False, dtype), run(True, dtype)
    if dtype == torch.float32:
        for got, want in zip(fused, plain):
            assert_near(got, want)
        return
    reference = run(False, torch.float32)
    for name, got, want, ref in zip(["output", "residual", "cache"], fused, plain, reference):
        err, err_plain = relative_error(got, ref), relative_error(want, ref)
        assert err <= 2 * err_plain + 1e-3, f"{name}: small-M error {err:.2e}, torch path {err_plain:.2e}"
