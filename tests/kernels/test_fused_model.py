"""The fused-kernel path of the models against their plain torch path, on the same device.

On CPU the fused path is forced on and its kernels run in Triton's interpreter.
Two steps run through both paths: a prefill of two requests, then a decode of
one beside a draft verification of the other, with padded tokens and a
padded request row as a full CUDA graph leaves them. Hidden states,
auxiliary hidden states and KV caches must agree, and no input of the caller
may be written. Both steps are small enough for the small-M kernels; tests
that lower the threshold also run the cuBLAS + separate kernels path, alone
or mixed with the small-M one (the 9-token prefill above the threshold, the
6-token step below it, through one cache).
"""
import copy
import math
import sys
from dataclasses import dataclass

import pytest
import torch

from specserve.attention.backend import get_attention_backend
from specserve.attention.metadata import PAD_SLOT_ID, AttentionMetadata
from specserve.models.arch_config import ArchConfig
from specserve.models.eagle import EagleHead
from specserve.models.eagle3 import Eagle3Head
from specserve.models import layers
from specserve.models.layers import FusableModule, RotaryEmbedding, set_fused_kernels
from specserve.models.llama import DecoderLayer, LlamaForCausalLM

from .util import DEVICE

BLOCK_SIZE = 4
VOCAB = 96
# Relative error (by norm) allowed between the paths; bf16 is rounded differently by the
# interpreter (truncation) than by torch.
REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def tiny_arch(**overrides) -> ArchConfig:
    kw = dict(architecture="LlamaForCausalLM", vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_layers=3,
              num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
              max_position_embeddings=256, tie_word_embeddings=False)
    return ArchConfig(**(kw | overrides))


def randomize(module: torch.nn.Module, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if "norm" in name else 0.08 * noise if p.dim() == 2 else 0.02 * noise)


def both_paths(module: torch.nn.Module, dtype) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(plain, fused) copies of module on DEVICE in dtype."""
    plain = copy.deepcopy(module).to(device=DEVICE, dtype=dtype)
    set_fused_kernels(plain, False)
    fused = copy.deepcopy(plain)
    set_fused_kernels(fused, True)
    return plain, fused


@dataclass
class Step:
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    num_real_tokens: int


# Request i owns the shuffled blocks BLOCK_TABLE[i] in every step of a run; the last row is for a padded request.
MAX_REQS, BLOCKS_PER_REQ = 3, 16
NUM_BLOCKS = MAX_REQS * BLOCKS_PER_REQ
BLOCK_TABLE = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(0)).view(MAX_REQS, -1).tolist()


def make_step(q_lens: list[int], seq_lens: list[int], pad_tokens: int = 0, pad_reqs: int = 0, seed: int = 0) -> Step:
    gen = torch.Generator().manual_seed(seed)
    positions, slots = [], []
    for i, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        for pos in range(seq_len - q_len, seq_len):
            positions.append(pos)
            slots.append(BLOCK_TABLE[i][pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
    num_real = len(positions)
    positions += [0] * pad_tokens
    slots += [PAD_SLOT_ID] * pad_tokens
    qsl = torch.tensor([0] + q_lens + [0] * pad_reqs, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    seq = torch.tensor(seq_lens + [0] * pad_reqs, dtype=torch.int32)
    metadata = AttentionMetadata(
        num_reqs=len(q_lens) + pad_reqs, num_tokens=num_real + pad_tokens, max_query_len=max(q_lens),
        max_seq_len=max(seq_lens), query_start_loc=qsl.to(DEVICE), seq_lens=seq.to(DEVICE),
        block_table=torch.tensor(BLOCK_TABLE[: len(q_lens) + pad_reqs], dtype=torch.int32, device=DEVICE),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        query_start_loc_cpu=qsl, seq_lens_cpu=seq)
    input_ids = torch.randint(0, VOCAB, (num_real + pad_tokens,), generator=gen)
    return Step(input_ids.to(DEVICE), torch.tensor(positions, device=DEVICE), metadata, num_real)


# A prefill of two requests, then a decode of the first beside a verification of three tokens of the second.
STEPS = [dict(q_lens=[6, 3], seq_lens=[6, 3]), dict(q_lens=[1, 3], seq_lens=[7, 6], pad_tokens=2, pad_reqs=1)]


def new_caches(arch: ArchConfig, num_layers: int, dtype) -> list[torch.Tensor]:
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, arch.num_kv_heads, arch.head_dim)
    return [torch.full(shape, math.nan, dtype=dtype, device=DEVICE) for _ in range(num_layers)]


def assert_near(actual: torch.Tensor, expected: torch.Tensor) -> None:
    rel = ((actual.double() - expected.double()).norm() / expected.double().norm()).item()
    assert rel < REL_TOL[actual.dtype], f"relative error {rel:.2e}"


def assert_caches_near(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    for a, e in zip(actual, expected):
        assert torch.equal(a.isnan(), e.isnan()), "the paths wrote different cache slots"
        assert_near(a.nan_to_num(), e.nan_to_num())


def run_target(model, arch, dtype) -> tuple[list, list[torch.Tensor]]:
    """[(hidden, aux) of each step], the final caches."""
    caches = new_caches(arch, arch.num_layers, dtype)
    outs = []
    for kw in STEPS:
        step = make_step(**kw)
        with torch.no_grad():
            hidden, aux = model(step.input_ids, step.positions, caches, step.metadata)
        n = step.num_real_tokens
        outs.append((hidden[:n], [a[:n] for a in aux]))
    return outs, caches


def check_target(arch: ArchConfig, dtype, backend: str) -> None:
    model = LlamaForCausalLM(arch, get_attention_backend(backend), aux_hidden_layers=(0, 1, 2))
    randomize(model)
    plain, fused = both_paths(model, dtype)
    expected, expected_caches = run_target(plain, arch, dtype)
    actual, actual_caches = run_target(fused, arch, dtype)
    for (h, aux), (h_ref, aux_ref) in zip(actual, expected):
        assert_near(h, h_ref)
        for a, a_ref in zip(aux, aux_ref):
            assert_near(a, a_ref)
    assert_caches_near(actual_caches, expected_caches)


def check_head(head: torch.nn.Module, hidden_size: int, arch: ArchConfig, dtype) -> None:
    randomize(head, seed=1)
    plain, fused = both_paths(head, dtype)
    results = []
    for model in (plain, fused):
        caches = new_caches(arch, 1, dtype)
        outs = []
        for kw in STEPS:
            step = make_step(**kw)
            hidden = torch.randn(step.input_ids.shape[0], hidden_size, generator=torch.Generator().manual_seed(2))
            hidden = hidden.to(device=DEVICE, dtype=dtype)
            hidden_before = hidden.clone()
            with torch.no_grad():
                outs.append([t[: step.num_real_tokens] for t in model(step.input_ids, step.positions, hidden,
                                                                     caches[0], step.metadata)])
            assert torch.equal(hidden, hidden_before), "the head wrote its input hidden states"
        results.append((outs, caches))
    (expected, expected_caches), (actual, actual_caches) = results
    for step_out, step_ref in zip(actual, expected):
        for a, e in zip(step_out, step_ref):
            assert_near(a, e)
    assert_caches_near(actual_caches, expected_caches)


def count_calls(monkeypatch, functions: dict) -> dict[str, int]:
    """Counts of calls to each {key: (module, function name)}, updated as the wrapped functions run."""
    calls = dict.fromkeys(functions, 0)

    def counted(key, fn):
        def wrapper(*a, **kw):
            calls[key] += 1
            return fn(*a, **kw)
        return wrapper

    for key, (module, name) in functions.items():
        monkeypatch.setattr(module, name, counted(key, getattr(module, name)))
    return calls


def eagle3_head_with_gaps(dtype) -> tuple[Eagle3Head, Eagle3Head]:
    """(plain, fused) EAGLE-3 heads whose 48 draft ids map to ascending target ids with gaps (as train-eagle
    writes d2t): the fused argmax must return target ids, not draft ids."""
    arch = tiny_arch(num_layers=1)
    head = Eagle3Head(arch, get_attention_backend("triton"), draft_vocab_size=48, target_hidden_size=64,
                      aux_hidden_layers=(0, 1, 2))
    randomize(head, seed=1)
    with torch.no_grad():
        head.lm_head.weight.mul_(5)  # logits of a few units, whose top two bfloat16 rounding rarely swaps
    target_ids = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3))[:48].sort().values
    head.d2t.copy_(target_ids - torch.arange(48))
    head.target_ids.copy_(target_ids)
    return both_paths(head, dtype)


def clear_argmax(logits: torch.Tensor, margin: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(argmax, rows whose two largest logits differ by more than margin, where the paths' rounding
    cannot swap them)."""
    top2 = logits.topk(2, dim=-1).values
    return logits.argmax(dim=-1), (top2[:, 0] - top2[:, 1]) > margin


ARGMAX_MARGIN = {torch.float32: 1e-4, torch.bfloat16: 0.1}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("step_kw", [dict(q_lens=[1], seq_lens=[7]), STEPS[1]], ids=["one_token", "mixed"])
def test_eagle3_greedy_step(monkeypatch, step_kw, dtype):
    check_eagle3_greedy_step(monkeypatch, step_kw, dtype)


def check_eagle3_greedy_step(monkeypatch, step_kw, dtype):
    """A draft decode step on the fused path (attention input and lm_head + argmax kernels) drafts what the
    plain path's forward and compute_logits' argmax draft, and feeds back the same hidden state."""
    import specserve.kernels.eagle3_input as input_module
    import specserve.kernels.fused_linear as fused_linear_module

    calls = count_calls(monkeypatch, {"input": (input_module, "eagle3_layer_input"),
                                      "argmax": (fused_linear_module, "fused_linear_argmax")})
    plain, fused = eagle3_head_with_gaps(dtype)
    arch = plain.cfg
    results = []
    for model in (plain, fused):
        caches = new_caches(arch, 1, dtype)
        gen = torch.Generator().manual_seed(2)
        for i, kw in enumerate((STEPS[0], step_kw)):
            step = make_step(**kw)
            hidden = torch.randn(step.input_ids.shape[0], arch.hidden_size, generator=gen).to(DEVICE, dtype)
            with torch.no_grad():
                if i == 0:
                    model(step.input_ids, step.positions, hidden, caches[0], step.metadata)
                elif model is plain:
                    h, normed = model(step.input_ids, step.positions, hidden, caches[0], step.metadata)
                    results.append((h, plain.compute_logits(normed)))
                else:
                    results.append(model.greedy_step(step.input_ids, step.positions, hidden, caches[0],
                                                     step.metadata))
    assert calls == {"input": 2, "argmax": 1}
    n = step.num_real_tokens
    (h_ref, logits), (h, tokens) = results
    expected, clear = clear_argmax(logits[:n], ARGMAX_MARGIN[dtype])
    assert clear.sum() >= n // 2
    assert torch.equal(tokens[:n][clear], expected[clear])
    assert_near(h[:n], h_ref[:n])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_eagle3_tree_step(monkeypatch, dtype):
    """A pass over a tree level's drafts on the fused path (each draft's parent state gathered in the attention
    input kernel, the final norm in the lm_head + top-k kernel, the guesses scattered by the pick): the
    plain path's forward over the gathered states, and the top 2 of its compute_logits, feed back and
    draft the same. Four drafts (and two padded rows) read the states of two parents out of three rows."""
    import specserve.kernels.eagle3_input as input_module
    import specserve.kernels.fused_linear as fused_linear_module
    from specserve.spec_decode.pick_scatter import PickScatter

    calls = count_calls(monkeypatch, {"input": (input_module, "eagle3_layer_input"),
                                      "topk": (fused_linear_module, "fused_linear_topk")})
    plain, fused = eagle3_head_with_gaps(dtype)
    arch, k = plain.cfg, 2
    step = make_step(**STEPS[1])
    m = step.input_ids.shape[0]
    rows = torch.tensor([2, 0, 0, 2, 0, 0], device=DEVICE)
    # Every row's guesses kept, in order, as one group: out [1, m * k].
    everything = torch.arange(m * k, device=DEVICE)
    results = []
    for model in (plain, fused):
        caches = new_caches(arch, 1, dtype)
        gen = torch.Generator().manual_seed(2)
        prefill = make_step(**STEPS[0])
        hidden = torch.randn(prefill.input_ids.shape[0], arch.hidden_size, generator=gen).to(DEVICE, dtype)
        parents = torch.randn(3, arch.hidden_size, generator=gen).to(DEVICE, dtype)
        with torch.no_grad():
            model(prefill.input_ids, prefill.positions, hidden, caches[0], prefill.metadata)
            if model is plain:
                h, normed = model(step.input_ids, step.positions, parents[rows], caches[0], step.metadata)
                results.append((h, plain.compute_logits(normed)))
            else:
                out = torch.empty(1, m * k, dtype=torch.int64, device=DEVICE)
                scatter = PickScatter(everything, everything, m, out, out, 0)
                h, tokens = model.tree_step(step.input_ids, step.positions, parents, rows, caches[0],
                                            step.metadata, k, scatter)
                assert tokens is out
                results.append((h, tokens.view(m, k)))
    assert calls == {"input": 2, "topk": 1}
    n = step.num_real_tokens
    (h_ref, logits), (h, tokens) = results
    top3 = logits[:n].topk(3, dim=-1).values
    clear = ((top3[:, :-1] - top3[:, 1:]) > ARGMAX_MARGIN[dtype]).all(dim=1)
    assert clear.sum() >= n // 2
    assert torch.equal(tokens[:n][clear], logits[:n].topk(k, dim=-1).indices[clear])
    assert_near(h[:n], h_ref[:n])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_eagle3_greedy_tokens(dtype):
    check_eagle3_greedy_tokens(dtype)


def check_eagle3_greedy_tokens(dtype):
    """greedy_tokens of normed hidden states (draft 1, from the prefill) on the fused path: target ids of the
    full logits' argmax."""
    plain, fused = eagle3_head_with_gaps(dtype)
    normed = torch.randn(5, plain.cfg.hidden_size, generator=torch.Generator().manual_seed(4)).to(DEVICE, dtype)
    with torch.no_grad():
        expected, clear = clear_argmax(plain.compute_logits(normed), ARGMAX_MARGIN[dtype])
        tokens = fused.greedy_tokens(normed)
    assert clear.sum() >= 3 and torch.equal(tokens[clear], expected[clear])


# Small-M kernel thresholds that send the test steps elsewhere than the default does.
OTHER_PATHS = pytest.mark.parametrize("small_m_max_tokens", [0, 8], ids=["cublas_path", "mixed_paths"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_llama(backend, dtype):
    check_target(tiny_arch(), dtype, backend)


@OTHER_PATHS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_llama_other_paths(monkeypatch, small_m_max_tokens, dtype):
    monkeypatch.setattr(layers, "SMALL_M_MAX_TOKENS", small_m_max_tokens)
    check_target(tiny_arch(), dtype, "triton")


def test_qk_norm_and_qkv_bias():
    # Qwen3's attention keeps the unfused-projection path (no per-head norm in the small-M qkv kernel).
    check_target(tiny_arch(architecture="Qwen3ForCausalLM", qk_norm=True, attention_bias=True), torch.float32,
                 "torch")


def test_qkv_bias():
    # Qwen2: the small-M qkv kernel adds the bias before rotary.
    check_target(tiny_arch(architecture="Qwen2ForCausalLM", attention_bias=True), torch.float32, "triton")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_eagle_head(dtype):
    arch = tiny_arch(num_layers=1)
    check_head(EagleHead(arch, get_attention_backend("torch")), arch.hidden_size, arch, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_eagle3_head(dtype):
    arch = tiny_arch(num_layers=1)
    head = Eagle3Head(arch, get_attention_backend("torch"), draft_vocab_size=48, target_hidden_size=64,
                      aux_hidden_layers=(0, 1, 2))
    # Hidden states of the head's own size: a draft decode step's fed-back state.
    check_head(head, arch.hidden_size, arch, dtype)


@OTHER_PATHS
def test_heads_other_paths(monkeypatch, small_m_max_tokens):
    monkeypatch.setattr(layers, "SMALL_M_MAX_TOKENS", small_m_max_tokens)
    arch = tiny_arch(num_layers=1)
    backend = get_attention_backend("triton")
    check_head(EagleHead(arch, backend), arch.hidden_size, arch, torch.float32)
    head = Eagle3Head(arch, backend, draft_vocab_size=48, target_hidden_size=64, aux_hidden_layers=(0, 1, 2))
    check_head(head, arch.hidden_size, arch, torch.float32)


ONE_TOKEN_STEP = dict(q_lens=[1], seq_lens=[4])


@pytest.mark.parametrize("small_m_max_tokens,fold_bytes,step,linear_calls,qkv_calls", [
    (16, layers.FOLD_NORM_MAX_WEIGHT_BYTES, STEPS[1], 3, 1),  # folded: qkv+rotary+cache, o_proj, gate_up+SiLU, down_proj
    (16, 0, STEPS[1], 2, 0),  # weights above the folding limit (Llama-3-8B): o_proj and down_proj only
    (16, 0, ONE_TOKEN_STEP, 3, 1),  # ... except at one token, where every weight folds
    (0, layers.FOLD_NORM_MAX_WEIGHT_BYTES, STEPS[1], 0, 0),
], ids=["folded", "large_weights", "large_weights_one_token", "cublas_path"])
def test_small_batches_run_small_m_kernels(monkeypatch, small_m_max_tokens, fold_bytes, step, linear_calls, qkv_calls):
    import specserve.kernels.fused_linear as fused_linear_module
    import specserve.kernels.qkv_rotary_cache as qkv_module

    monkeypatch.setattr(layers, "SMALL_M_MAX_TOKENS", small_m_max_tokens)
    monkeypatch.setattr(layers, "FOLD_NORM_MAX_WEIGHT_BYTES", fold_bytes)
    calls = count_calls(monkeypatch, {"linear": (fused_linear_module, "fused_linear"),
                                      "qkv": (qkv_module, "qkv_rotary_cache")})
    model = LlamaForCausalLM(tiny_arch(num_layers=1), get_attention_backend("triton"))
    randomize(model)
    _, fused = both_paths(model, torch.float32)
    step = make_step(**step)
    with torch.no_grad():
        fused(step.input_ids, step.positions, new_caches(tiny_arch(), 1, torch.float32), step.metadata)
    assert calls == {"linear": linear_calls, "qkv": qkv_calls}


# Steps of 1, 16, 17 and 33 tokens (17: the 32-row tile; 33: above SMALL_M_MAX_TOKENS, back to cuBLAS and the
# separate kernels).
FOLD_STEPS = {
    1: [dict(q_lens=[5], seq_lens=[5]), dict(q_lens=[1], seq_lens=[6])],
    16: [dict(q_lens=[9, 7], seq_lens=[9, 7]), dict(q_lens=[6, 8], seq_lens=[15, 15], pad_tokens=2, pad_reqs=1)],
    17: [dict(q_lens=[10, 7], seq_lens=[10, 7]), dict(q_lens=[9, 8], seq_lens=[19, 15])],
    33: [dict(q_lens=[20, 13], seq_lens=[20, 13]), dict(q_lens=[17, 16], seq_lens=[27, 20])],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tokens", list(FOLD_STEPS))
def test_folded_norms(monkeypatch, tokens, dtype):
    """Norms folded into qkv and gate/up (first layer without residual, aux hidden states of every layer,
    qkv bias) against the plain path and against the fused path without folding."""
    monkeypatch.setattr(sys.modules[__name__], "STEPS", FOLD_STEPS[tokens])
    # Two layers: the first without a residual coming in, the second with one.
    arch = tiny_arch(architecture="Qwen2ForCausalLM", attention_bias=True, num_layers=2)
    model = LlamaForCausalLM(arch, get_attention_backend("triton"), aux_hidden_layers=(0, 1))
    randomize(model)
    plain, fused = both_paths(model, dtype)
    expected, expected_caches = run_target(plain, arch, dtype)
    actual, actual_caches = run_target(fused, arch, dtype)
    monkeypatch.setattr(layers, "FOLD_NORM_MAX_WEIGHT_BYTES", 0)
    monkeypatch.setattr(layers, "FOLD_NORM_ANY_WEIGHT_MAX_TOKENS", 0)
    unfolded, unfolded_caches = run_target(fused, arch, dtype)
    for (h, aux), (h_ref, aux_ref), (h_unf, aux_unf) in zip(actual, expected, unfolded):
        assert_near(h, h_ref)
        assert_near(h, h_unf)
        # Layer 0's input is the embedding, whatever the path.
        assert torch.equal(aux[0], aux_ref[0])
        for a, a_ref, a_unf in zip(aux, aux_ref, aux_unf):
            assert_near(a, a_ref)
            assert_near(a, a_unf)
    assert_caches_near(actual_caches, expected_caches)
    assert_caches_near(actual_caches, unfolded_caches)
    if tokens > layers.SMALL_M_MAX_TOKENS:
        # Nothing folds above the threshold: the paths are the same kernels.
        for (h, aux), (h_unf, aux_unf) in zip(actual, unfolded):
            assert torch.equal(h, h_unf) and all(torch.equal(a, b) for a, b in zip(aux, aux_unf))


@pytest.mark.parametrize("first_layer", [True, False], ids=["first_layer", "later_layer"])
def test_folded_layer_residual_stream(monkeypatch, first_layer):
    """A folded decoder layer hands on the residual stream the unfolded one does, with or without a residual
    coming in, and never writes its inputs (an aux hidden state may alias them)."""
    arch = tiny_arch(num_layers=1)
    layer = DecoderLayer(arch, get_attention_backend("triton"))
    randomize(layer)
    layer = layer.to(device=DEVICE)
    set_fused_kernels(layer, True)
    # A prefill (every key it attends to is its own), padded as a CUDA graph pads it.
    step = make_step(q_lens=[6, 3], seq_lens=[6, 3], pad_tokens=2, pad_reqs=1)
    n = step.input_ids.shape[0]
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(n, arch.hidden_size, generator=gen).to(DEVICE)
    residual = None if first_layer else torch.randn(n, arch.hidden_size, generator=gen).to(DEVICE)
    rotary = RotaryEmbedding(arch.head_dim, arch.max_position_embeddings, arch.rope_theta, {}).to(DEVICE)
    outs = []
    for fold_bytes in (layers.FOLD_NORM_MAX_WEIGHT_BYTES, 0):
        monkeypatch.setattr(layers, "FOLD_NORM_MAX_WEIGHT_BYTES", fold_bytes)
        x_in = x.clone()
        res_in = residual.clone() if residual is not None else None
        with torch.no_grad():
            out, res_out = layer(x_in, step.positions, rotary, new_caches(arch, 1, torch.float32)[0], step.metadata,
                                 res_in)
        if fold_bytes:
            assert torch.equal(x_in, x) and (residual is None or torch.equal(res_in, residual))
        outs.append((out[: step.num_real_tokens], res_out))
    (out, res_out), (out_ref, res_ref) = outs
    assert_near(out, out_ref)
    assert_near(res_out[: step.num_real_tokens], res_ref[: step.num_real_tokens])


def test_fused_path_follows_the_device():
    model = LlamaForCausalLM(tiny_arch(), get_attention_backend("torch"))
    fusable = [m for m in model.modules() if isinstance(m, FusableModule)]
    assert {type(m).__name__ for m in fusable} == {"RMSNorm", "Attention", "GatedMLP"}
    assert not any(m.fused for m in fusable)
    model.to(DEVICE)
    assert all(m.fused == (DEVICE == "cuda") for m in fusable)
