"""The fused kernels compiled for a real GPU: SmolLM2 and Llama-3-8B shapes, the
fused model path against Hugging Face and against the unfused path on the
same device, and capture of the fused path in a CUDA graph. Run with
`pytest -m gpu`; it skips only where there is no CUDA device.
"""
import pytest
import torch

from conftest import make_hf_model
from specserve.attention.backend import get_attention_backend
from specserve.kernels.rmsnorm import fused_add_rms_norm
from specserve.models.eagle import EagleHead
from specserve.models.eagle3 import Eagle3Head
from specserve.models.layers import FusableModule, set_fused_kernels
from specserve.models.llama import LlamaForCausalLM
from specserve.models.loader import build_model, open_model_source

from .test_activation import check_silu_and_mul
from .test_fp8_folded import check_norm_fp8_rows, check_silu_and_mul_fp8_rows
from .test_qkv_rotary_cache import check_qkv
from .test_fused_model import (STEPS, assert_near, check_eagle3_greedy_step, check_eagle3_greedy_tokens, check_head,
                               check_target, make_step, new_caches, randomize, tiny_arch)
from .test_rmsnorm import check_fused_add, check_rms_norm
from .test_rotary_cache import check_rotary_and_cache

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("cuda_float32")]

# name: (hidden, intermediate, num_heads, num_kv_heads, head_dim)
SHAPES = {"smollm2-135m": (576, 1536, 9, 3, 64), "llama3-8b": (4096, 14336, 32, 8, 128)}



@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("num_tokens", [1, 64, 512])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_kernels_at_model_shapes(shape, num_tokens, dtype):
    hidden, inter, num_heads, num_kv_heads, head_dim = SHAPES[shape]
    check_rms_norm(num_tokens, hidden, dtype)
    check_fused_add(num_tokens, hidden, dtype)
    check_silu_and_mul(num_tokens, inter, dtype)
    check_rotary_and_cache(num_tokens, num_heads, num_kv_heads, head_dim, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_fp8_rows_kernels_at_model_shapes(shape, dtype):
    """Compiled, the norm and SiLU-and-mul that write FP8 rows are the kernel then quantize_rows, bit for bit
    (float32 norms: within the last bits check_norm_fp8_rows allows)."""
    hidden, inter = SHAPES[shape][:2]
    check_norm_fp8_rows(hidden, dtype, add=False)
    check_norm_fp8_rows(hidden, dtype, add=True)
    check_silu_and_mul_fp8_rows(inter, dtype)


@pytest.mark.parametrize("split_k", [1, 2, 4])
@pytest.mark.parametrize("m", [1, 4])
def test_qkv_split_k_at_a_ranks_shape(m, split_k):
    """Rank 0's qkv of Llama-3-8B at TP=2 (16 q heads, 4 KV heads of 128, K = 4096), compiled, whole and split
    over K (the parts' workspace, counts and the last part's epilogue), against float64."""
    from specserve.kernels.small_m_configs import SmallMConfig

    config = SmallMConfig(32, 256, 4, 4, split_k=split_k)
    for _ in range(2):  # the second launch finds the counts back at zero
        check_qkv(m, 16, 4, 128, torch.bfloat16, "add_norm", k=4096, config=config)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_fused_residual_add_rounds_as_torch(dtype):
    # On the GPU both round to nearest: the residual stream is bit for bit the unfused one.
    x, residual = (torch.randn(64, 4096, device="cuda", dtype=dtype) for _ in range(2))
    expected = residual + x
    fused_add_rms_norm(x, residual, torch.ones(4096, device="cuda", dtype=dtype), 1e-5)
    assert torch.equal(residual, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fused_model_equals_unfused(backend, dtype):
    check_target(tiny_arch(), dtype, backend)
    check_target(tiny_arch(architecture="Qwen3ForCausalLM", qk_norm=True, attention_bias=True), dtype, backend)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_heads_equal_unfused(dtype):
    arch = tiny_arch(num_layers=1)
    backend = get_attention_backend("triton")
    check_head(EagleHead(arch, backend), arch.hidden_size, arch, dtype)
    head = Eagle3Head(arch, backend, draft_vocab_size=48, target_hidden_size=64, aux_hidden_layers=(0, 1, 2))
    check_head(head, arch.hidden_size, arch, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_eagle3_greedy_drafts_equal_unfused(monkeypatch, dtype):
    check_eagle3_greedy_step(monkeypatch, dict(q_lens=[1], seq_lens=[7]), dtype)
    check_eagle3_greedy_step(monkeypatch, STEPS[1], dtype)
    check_eagle3_greedy_tokens(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_logits_match_transformers(tmp_path, tokenizer_dir, dtype):
    hf = make_hf_model(tmp_path, tokenizer_dir, "llama")
    model, arch = build_model(open_model_source(str(tmp_path)), dtype, "cuda", get_attention_backend("triton"))
    assert all(m.fused for m in model.modules() if isinstance(m, FusableModule)), "moving to CUDA turns fusion on"
    step = make_step([40], [40])
    with torch.no_grad():
        hidden, _ = model(step.input_ids, step.positions, new_caches(arch, arch.num_layers, dtype), step.metadata)
        logits = model.compute_logits(hidden)
        expected = hf(step.input_ids.cpu()[None]).logits[0].float()
    rel = ((logits.cpu() - expected).norm() / expected.norm()).item()
    assert rel < {torch.float32: 1e-4, torch.bfloat16: 5e-2}[dtype], f"relative logits error {rel:.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_graph_replay_equals_eager(dtype):
    # A padded decode batch captured once, replayed on another batch of the same shape
    # written into the captured input buffers: it must compute the new batch.
    arch = tiny_arch()
    model = LlamaForCausalLM(arch, get_attention_backend("triton"), aux_hidden_layers=(0, 2))
    randomize(model)
    model = model.to(device="cuda", dtype=dtype)
    captured = make_step([1, 1], [5, 9], pad_tokens=2, pad_reqs=1, seed=0)
    replayed = make_step([1, 1], [11, 3], pad_tokens=2, pad_reqs=1, seed=1)
    gen = torch.Generator(device="cuda").manual_seed(0)
    # Random, not NaN: the decode steps attend over cached positions no step of this test wrote.
    shape = new_caches(arch, 1, dtype)[0].shape
    caches = [torch.randn(shape, generator=gen, device="cuda").to(dtype) for _ in range(arch.num_layers)]
    args = (captured.input_ids, captured.positions, caches, captured.metadata)
    with torch.no_grad():
        model(*args)  # compiles the kernels outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            hidden, aux = model(*args)
        eager_caches = [c.clone() for c in caches]
        for name in ("input_ids", "positions"):
            getattr(captured, name).copy_(getattr(replayed, name))
        for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"):
            getattr(captured.metadata, name).copy_(getattr(replayed.metadata, name))
        graph.replay()
        eager_hidden, eager_aux = model(replayed.input_ids, replayed.positions, eager_caches, replayed.metadata)
    n = replayed.num_real_tokens
    for got, want in zip([hidden, *aux], [eager_hidden, *eager_aux]):
        assert_near(got[:n], want[:n])
    for got, want in zip(caches, eager_caches):
        assert_near(got, want)


def test_unfused_path_can_be_forced_on_cuda():
    model = LlamaForCausalLM(tiny_arch(), get_attention_backend("triton")).cuda()
    set_fused_kernels(model, False)
    assert not any(m.fused for m in model.modules() if isinstance(m, FusableModule))
