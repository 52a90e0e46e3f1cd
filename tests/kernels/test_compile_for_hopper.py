"""The step kernels and the small-M projections compile for an H100 (sm_90) on a machine without a GPU.

Triton's interpreter runs a kernel's Python, not its compiler: a kernel can pass every interpreter
test and still fail to compile (a loop variable typed int32 in one branch and int64 in the other did).
Compiling ahead of time for the H100's target catches that in CI, before any device time is spent.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from specserve.attention.metadata import PAD_SLOT_ID  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
# One worker runs them all, so the compile_errors fixture compiles every kernel once.
pytestmark = pytest.mark.xdist_group("compile_for_hopper")
ROOT = Path(__file__).resolve().parents[2]


def kernels():
    """(kernel, {argument: type or constexpr value}): the kernels a step launches outside the models, and the
    model's small-M projections."""
    from specserve.kernels import draft_inputs, greedy_verify, inflight_inputs, staged_inputs

    p64, p32, i32 = "*i64", "*i32", "i32"
    yield draft_inputs._gather_draft_inputs_kernel, dict(
        staged_ptr=p64, accepted_ptr=p64, accepted_stride=i32, tokens_ptr=p64, tokens_stride=i32,
        input_ids_ptr=p64, positions_ptr=p64, block_table_ptr=p32, block_table_stride=i32, pad_to=i32, pad_reqs=i32,
        next_ids_ptr=p64, last_ptr=p64, last_tokens_ptr=p64, base_positions_ptr=p64, draft_table_ptr=p32,
        draft_table_stride=i32, max_blocks=i32, REQUESTS_AT=5, REQUESTS_ROWS=6, NUM_TOKENS_AT=0, TOKENS=128,
        COLUMNS=64)
    for forced in (False, True):
        yield greedy_verify._greedy_verify_kernel, dict(
            target_ptr=p64, input_ids_ptr=p64, index_ptr=p64, num_drafts_ptr=p64, out_rows_ptr=p64,
            uniform_ptr="*fp32", accepted_ptr=p64, accepted_stride=i32, tokens_ptr=p64, tokens_stride=i32,
            forced_accept_prob="fp32", K1=4, FORCED=forced, BLOCK=4)
    # Trees of drafts (the sixteen-node tree of depth 5): the walk, the drafter's inputs, a depth's pass.
    from specserve.kernels import tree_drafting, tree_verify

    yield tree_verify._verify_tree_kernel, dict(
        target_ptr=p64, target_stride=i32, input_ids_ptr=p64, index_ptr=p64, index_stride=i32, num_drafts_ptr=p64,
        children_ptr=p64, slot_mapping_ptr=p64, spare_slot=i32, out_rows_ptr=p64, accepted_out_ptr=p64,
        accepted_out_stride=i32, tokens_out_ptr=p64, tokens_out_stride=i32, accepted_ptr=p64, tokens_ptr=p64,
        path_ptr=p64, source_ptr=p64, dest_ptr=p64, DEPTH=5, CHILDREN=3, BLOCK_C=4)
    yield draft_inputs._follow_tree_paths_kernel, dict(
        path_ptr=p64, accepted_ptr=p64, tokens_ptr=p64, slots_ptr=p64, positions_ptr=p64, next_ids_ptr=p64,
        last_ptr=p64, base_positions_ptr=p64, WIDTH=6, BLOCK=8)
    for padded in (False, True):
        yield tree_drafting._tree_pass_kernel, dict(
            base_positions_ptr=p64, block_table_ptr=p32, block_table_stride=i32, num_reqs_ptr=p64,
            ancestor_bits_ptr=p64, level_parents_ptr=p64, positions_ptr=p64, slots_ptr=p64, seq_lens_ptr=p32,
            query_start_loc_ptr=p32, tree_bits_ptr=p64, parent_rows_ptr=p64, n=i32, block_size=i32,
            max_position=i32, max_slot_position=i32, DEPTH=2, START=4, STOP=7, PARENTS=3, PADDED=padded,
            PAD_SLOT=PAD_SLOT_ID, BLOCK=4)
    for tree in (False, True):
        yield staged_inputs._scatter_staged_inputs_kernel, dict(
            staged_ptr=p64, input_ids_ptr=p64, positions_ptr=p64, slot_mapping_ptr=p64, seq_lens_ptr=p32,
            query_start_loc_ptr=p32, block_table_ptr=p32, block_table_stride=i32, max_tokens=i32, max_reqs=i32,
            max_blocks=i32, tree_bits_ptr=p64, PAD_SLOT=PAD_SLOT_ID, TOKENS=1024, REQS=64, COLUMNS=64, HEADER=8,
            TREE=tree)
    # The small-M projections as SmolLM2 decodes one token (K = 576) and verifies a tree (16 rows): the folded
    # add + norm (its rstd after the weight loop, as bfloat16 runs it), with the compact prologue at one
    # token, and the plain output projection.
    from specserve.kernels import token_bitmask

    for dtype in ("*bf16", "*fp32"):
        for switch in (False, True):
            yield token_bitmask._apply_token_bitmask_kernel, dict(
                logits_ptr=dtype, stride_logits=i32, bitmask_ptr=p32, stride_bitmask=i32, n_cols=i32,
                enabled_ptr=p64 if switch else p32, HAS_SWITCH=switch, BLOCK=token_bitmask._BLOCK)
    from specserve.kernels import fused_linear, qkv_rotary_cache
    from specserve.kernels.small_m_configs import load_configs

    tiles = load_configs()

    bf16, f32 = "*bf16", "*fp32"
    projection = dict(x_ptr=bf16, res_ptr=bf16, res_out_ptr=bf16, norm_w_ptr=bf16, w_ptr=bf16, out_ptr=bf16,
                      idx_ptr=bf16, part_ptr=bf16, counter_ptr=bf16, M=i32, N=i32, K=i32, k_per=i32, stride_xm=i32,
                      stride_rm=i32, stride_rom=i32, stride_wn=i32, stride_om=i32, eps="fp32", DOT_FP32=False,
                      BLOCK_M=16, SPLIT_K=1, w_scale_ptr=f32, x_scale_ptr=f32, amax_ptr=f32, W_SCALED=False,
                      X_SCALED=False, AMAX=False)
    for rows, cfg in ((1, tiles["norm_small_one_token"]), (16, tiles["norm_small"]), (4, tiles["norm_medium"])):
        yield fused_linear._fused_linear_kernel, dict(
            projection, ADD=True, NORM=True, SILU_MUL=True, TOP=0, COMPACT=cfg.compact, ROWS=rows,
            PRE_K=4096 // rows, SLICE_K=16, LATE_RSTD=True, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k)
    yield fused_linear._fused_linear_kernel, dict(
        projection, ADD=False, NORM=False, SILU_MUL=False, TOP=0, COMPACT=False, ROWS=16, PRE_K=256,
        SLICE_K=16, LATE_RSTD=False, BLOCK_N=tiles["small_short_k"].block_n, BLOCK_K=tiles["small_short_k"].block_k)
    # FP8 weights (quantization/fp8_linear.py): weight-only, and with FP8 inputs scaled per row.
    for x_scaled in (False, True):
        yield fused_linear._fused_linear_kernel, dict(
            projection, x_ptr="*fp8e4nv" if x_scaled else bf16, w_ptr="*fp8e4nv", W_SCALED=True,
            X_SCALED=x_scaled, ADD=False, NORM=False, SILU_MUL=False, TOP=0, COMPACT=False, ROWS=16, PRE_K=256,
            SLICE_K=16, LATE_RSTD=False, BLOCK_N=64, BLOCK_K=128)
    # The per-token quantization of an FP8 layer's input (quantization/fp8_linear.py).
    from specserve.kernels import fp8_rows

    for block, one_pass in ((fp8_rows.BLOCK_K, False), (fp8_rows.ONE_PASS_MAX, True)):
        yield fp8_rows._quantize_rows_kernel, dict(
            x_ptr=bf16, q_ptr="*fp8e4nv", scale_ptr=f32, K=i32, stride_xm=i32, stride_qm=i32, fp8_max="fp32",
            min_scale="fp32", BLOCK_K=block, ONE_PASS=one_pass)
    # FP8 by FP8 from 16 rows (kernels/fp8_gemm.py): e4m3 dots on the tensor cores, unsplit and split over K,
    # their sums promoted every MMA and every K chunk.
    from specserve.kernels import fp8_gemm

    # SiLU-and-mul in the gate/up projection's epilogue, with each row's largest products.
    for split_k, even_k, promote_k, silu_mul in ((1, True, 32, False), (2, False, 128, False), (1, True, 128, True)):
        yield fp8_gemm._fp8_dot_kernel, dict(
            x_ptr="*fp8e4nv", w_ptr="*fp8e4nv", out_ptr=bf16, x_scale_ptr=f32, w_scale_ptr=f32, part_ptr=f32,
            counter_ptr=p32, amax_ptr=f32, M=i32, N=i32, K=i32, k_per=i32, stride_xm=i32, stride_wn=i32,
            stride_om=i32, DOT_FP32=False, EVEN_K=even_k, BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, SPLIT_K=split_k,
            PROMOTE_K=promote_k, SILU_MUL=silu_mul)
    # A GGUF's block codes (kernels/block_fp8_gemm.py), with and without block offsets, at one token and 64.
    from specserve.kernels import block_fp8_gemm

    for has_offset, block_m, block_n in ((True, 16, 32), (False, 64, 64)):
        yield block_fp8_gemm._block_fp8_kernel, dict(
            x_ptr=bf16, w_ptr="*fp8e4nv", scale_ptr="*fp16", offset_ptr="*fp16", out_ptr=bf16, M=i32, N=i32, K=i32,
            stride_xm=i32, stride_om=i32, HAS_OFFSET=has_offset, GROUP=32, DOT_FP32=False, BLOCK_M=block_m,
            BLOCK_N=block_n, BLOCK_K=128)
    # The small-M gate/up projection of FP8 rows at one token, SiLU-and-mul and its largest products in the
    # epilogue (an 8B model's tile, half its columns from each half).
    yield fused_linear._fused_linear_kernel, dict(
        projection, x_ptr="*fp8e4nv", w_ptr="*fp8e4nv", W_SCALED=True, X_SCALED=True, AMAX=True, ADD=False,
        NORM=False, SILU_MUL=True, TOP=0, COMPACT=False, ROWS=16, PRE_K=256, SLICE_K=16, LATE_RSTD=False,
        BLOCK_N=64, BLOCK_K=256)
    # The head's down_proj (576 x 6144), K split over 4 programs a column tile (atomics, L2 loads, a barrier).
    yield fused_linear._fused_linear_kernel, dict(
        projection, part_ptr=f32, counter_ptr=p32, ADD=False, NORM=False, SILU_MUL=False, TOP=0, COMPACT=False,
        ROWS=16, PRE_K=256, SLICE_K=16, LATE_RSTD=False, BLOCK_N=16, BLOCK_K=256, SPLIT_K=4)
    # An EAGLE-3 head's draft step: final add + norm, lm_head and the per-program argmax; a tree's depth pass
    # keeps each program's 3 best columns.
    for rows, top in ((1, 1), (4, 3)):
        yield fused_linear._fused_linear_kernel, dict(
            projection, out_ptr=f32, idx_ptr=p32, ADD=True, NORM=True, SILU_MUL=False, TOP=top, COMPACT=False,
            ROWS=rows, PRE_K=4096 // rows, SLICE_K=16, LATE_RSTD=True, BLOCK_N=tiles["norm_medium_one_acc"].block_n,
            BLOCK_K=tiles["norm_medium_one_acc"].block_k)
    qkv = dict(
        x_ptr=bf16, res_ptr=bf16, res_out_ptr=bf16, norm_w_ptr=bf16, w_ptr=bf16, bias_ptr=bf16, q_ptr=bf16,
        k_cache_ptr=bf16, v_cache_ptr=bf16, cos_ptr=f32, sin_ptr=f32, positions_ptr=p64, slot_mapping_ptr=p64,
        M=i32, K=i32, num_slots=i32, stride_xm=i32, stride_rm=i32, stride_rom=i32, stride_wn=i32, stride_qm=i32,
        stride_qh=i32, stride_pos=i32, stride_cb=i32, stride_cs=i32, stride_ch=i32, block_size=i32,
        num_heads=i32, num_kv_heads=i32, half=i32, eps="fp32", ADD=True, NORM=True, BIAS=False, DOT_FP32=False,
        PAD_SLOT=PAD_SLOT_ID, ROWS=1, BLOCK_M=16, k_scale_ptr=f32, v_scale_ptr=f32, FP8=False,
        part_ptr=f32, counter_ptr=p32, N=i32, k_per=i32, SPLIT_K=1)
    for rows, cfg in ((1, tiles["qkv_norm_small_one_token"]), (16, tiles["qkv_norm_small"])):
        yield qkv_rotary_cache._qkv_rotary_cache_kernel, dict(
            qkv, ROWS=rows, COMPACT=cfg.compact, PRE_K=4096 // rows, SLICE_K=64, LATE_RSTD=True, BLOCK_P=cfg.block_n,
            BLOCK_K=cfg.block_k)
    # The head's qkv: its input normed already (K = 1152), no prologue.
    yield qkv_rotary_cache._qkv_rotary_cache_kernel, dict(
        qkv, ADD=False, NORM=False, COMPACT=False, ROWS=16, PRE_K=256, SLICE_K=128, LATE_RSTD=False,
        BLOCK_P=tiles["qkv_small"].block_n, BLOCK_K=tiles["qkv_small"].block_k)
    # Llama-3-8B's one token (K = 4096, 96 programs).
    yield qkv_rotary_cache._qkv_rotary_cache_kernel, dict(
        qkv, COMPACT=False, PRE_K=4096, SLICE_K=64, LATE_RSTD=False, BLOCK_P=tiles["qkv_norm_large_one_token"].block_n,
        BLOCK_K=tiles["qkv_norm_large_one_token"].block_k)
    # A rank's qkv at TP=2 (48 programs), K split over 2 programs each (atomics, L2 loads, a barrier).
    yield qkv_rotary_cache._qkv_rotary_cache_kernel, dict(
        qkv, COMPACT=False, PRE_K=4096, SLICE_K=64, LATE_RSTD=False, BLOCK_P=32, BLOCK_K=256, SPLIT_K=2)
    # Into an FP8 (e4m3) KV cache, quantized with the layer's scales.
    fp8, scale = "*fp8e4nv", dict(k_scale_ptr=f32, v_scale_ptr=f32, FP8=True)
    yield qkv_rotary_cache._qkv_rotary_cache_kernel, dict(
        qkv, **scale, k_cache_ptr=fp8, v_cache_ptr=fp8, COMPACT=False, PRE_K=4096, SLICE_K=64, LATE_RSTD=False,
        BLOCK_P=tiles["qkv_norm_large_one_token"].block_n, BLOCK_K=tiles["qkv_norm_large_one_token"].block_k)
    from specserve.kernels import reshape_and_cache, rotary_cache

    yield reshape_and_cache._reshape_and_cache_kernel, dict(
        k_ptr=bf16, v_ptr=bf16, k_cache_ptr=fp8, v_cache_ptr=fp8, slot_mapping_ptr=p64, **scale, stride_kt=i32,
        stride_kh=i32, stride_vt=i32, stride_vh=i32, stride_cb=i32, stride_cs=i32, stride_ch=i32, block_size=i32,
        num_kv_heads=i32, head_dim=i32, PAD_SLOT=PAD_SLOT_ID, BLOCK_H=8, BLOCK_D=128)
    yield rotary_cache._rotary_cache_kernel, dict(
        q_ptr=bf16, k_ptr=bf16, v_ptr=bf16, cos_ptr=f32, sin_ptr=f32, positions_ptr=p64, slot_mapping_ptr=p64,
        k_cache_ptr=fp8, v_cache_ptr=fp8, **scale, stride_qt=i32, stride_qh=i32, stride_kt=i32, stride_kh=i32,
        stride_vt=i32, stride_vh=i32, stride_pos=i32, stride_cb=i32, stride_cs=i32, stride_ch=i32, num_slots=i32,
        block_size=i32, num_heads=i32, num_kv_heads=i32, half=i32, PAD_SLOT=PAD_SLOT_ID, BLOCK_HQ=32, BLOCK_HK=8,
        BLOCK_HALF=64)
    from specserve.attention import triton_backend
    from specserve.kernels import rmsnorm

    attention = dict(
        q_ptr=bf16, k_cache_ptr=bf16, v_cache_ptr=bf16, out_ptr=bf16, query_start_loc_ptr=p32, seq_lens_ptr=p32,
        block_table_ptr=p32, qk_scale="fp32", stride_qt=i32, stride_qh=i32, stride_ot=i32, stride_oh=i32,
        stride_cb=i32, stride_cs=i32, stride_ch=i32, stride_bt=i32, block_size=i32, num_reqs=i32, num_tokens=i32,
        BLOCK_M=16, DOT_FP32=False, MIN_CHUNK=triton_backend.MIN_CHUNK, part_acc_ptr=f32, part_max_ptr=f32,
        part_sum_ptr=f32, counter_ptr=p32, tree_bits_ptr=p64, tree_offset=i32, TREE=False, k_scale_ptr=f32,
        v_scale_ptr=f32, FP8=False)
    # Llama-3-8B's decode at batch 1, keys split over 16 programs (atomics, L2 loads, a barrier).
    yield triton_backend._paged_attention_kernel, dict(
        attention, GROUP=4, HEAD_DIM=128, BLOCK_Q=4, BLOCK_N=64, NUM_SPLITS=16)
    # SmolLM2's (3 query heads a KV head, head_dim 64: 32 splits, wide key steps).
    yield triton_backend._paged_attention_kernel, dict(
        attention, GROUP=3, HEAD_DIM=64, BLOCK_Q=5, BLOCK_N=triton_backend.NARROW_HEAD_DECODE_BLOCK_N, NUM_SPLITS=32)
    # ... verifying a tree of drafts (16 query tokens, 64 rows).
    yield triton_backend._paged_attention_kernel, dict(
        attention, BLOCK_M=64, GROUP=3, HEAD_DIM=64, BLOCK_Q=21, BLOCK_N=64, NUM_SPLITS=1, TREE=True)
    # ... over an FP8 cache: Llama-3-8B's split decode, SmolLM2's tree.
    yield triton_backend._paged_attention_kernel, dict(
        attention, k_cache_ptr=fp8, v_cache_ptr=fp8, FP8=True, GROUP=4, HEAD_DIM=128, BLOCK_Q=4, BLOCK_N=64,
        NUM_SPLITS=16)
    yield triton_backend._paged_attention_kernel, dict(
        attention, k_cache_ptr=fp8, v_cache_ptr=fp8, FP8=True, BLOCK_M=64, GROUP=3, HEAD_DIM=64, BLOCK_Q=21,
        BLOCK_N=64, NUM_SPLITS=1, TREE=True)
    # The fused residual add + RMSNorm; Llama-3-8B's writing an FP8 projection's input rows.
    norm = dict(x_ptr=bf16, residual_ptr=bf16, weight_ptr=bf16, out_ptr=bf16, scale_ptr=bf16, heads=i32,
                stride_xt=i32, stride_xh=i32, stride_rt=i32, stride_rh=i32, n=i32, eps="fp32", fp8_max="fp32",
                min_scale="fp32", ADD=True, QUANTIZE=False, BLOCK=1024)
    yield rmsnorm._rms_norm_kernel, norm
    yield rmsnorm._rms_norm_kernel, dict(norm, out_ptr="*fp8e4nv", scale_ptr=f32, QUANTIZE=True, BLOCK=4096)
    # SiLU-and-mul, plain and writing down_proj's FP8 input rows (its products and chunks' largest magnitudes, then
    # their quantization).
    from specserve.kernels import activation

    yield activation._silu_and_mul_kernel, dict(gate_up_ptr=bf16, out_ptr=bf16, stride_in=i32, inter=i32,
                                                BLOCK=activation._BLOCK)
    yield activation._silu_and_mul_amax_kernel, dict(gate_up_ptr=bf16, out_ptr=bf16, amax_ptr=f32, stride_in=i32,
                                                     inter=i32, BLOCK=fp8_rows.CHUNK_COLUMNS)
    yield fp8_rows._quantize_chunked_rows_kernel, dict(
        x_ptr=bf16, amax_ptr=f32, q_ptr="*fp8e4nv", scale_ptr=f32, K=i32, num_chunks=i32, fp8_max="fp32",
        min_scale="fp32", BLOCK=fp8_rows.CHUNK_COLUMNS, CHUNKS=16)
    from specserve.kernels import argmax

    yield argmax._chunk_argmax_kernel, dict(x_ptr=bf16, stride_x=i32, n_cols=i32, val_ptr=f32, idx_ptr=p32,
                                            CHUNK=argmax._CHUNK, BLOCK=argmax._BLOCK)
    pick = dict(val_ptr=f32, idx_ptr=p32, map_ptr=p64, out_ptr=p64, num_chunks=i32, dest_ptr=p64, group=i32,
                width=i32, also_ptr=p64, also_stride=i32, also_offset=i32)
    for mapped in (False, True):
        yield argmax._pick_chunk_kernel, dict(pick, MAP=mapped, CHUNKS=256, TOP=1, SCATTER=False)
    # A tree level's guesses (the head's lm_head in 384 programs), scattered to its drafts.
    for scatter in (False, True):
        yield argmax._pick_chunk_kernel, dict(pick, MAP=True, CHUNKS=8192, TOP=3, SCATTER=scatter)
    from specserve.kernels import eagle3_input

    for gather in (False, True):
        yield eagle3_input._eagle3_input_kernel, dict(
            ids_ptr=p64, embed_ptr=bf16, hidden_ptr=bf16, rows_ptr=p64, embed_norm_ptr=bf16, hidden_norm_ptr=bf16,
            out_ptr=bf16, gathered_ptr=bf16, n=i32, stride_e=i32, stride_h=i32, stride_o=i32, eps="fp32",
            GATHER=gather, BLOCK=1024)
    yield inflight_inputs._take_inflight_inputs_kernel, dict(
        staged_ptr=p64, accepted_ptr=p64, accepted_stride=i32, tokens_ptr=p64, tokens_stride=i32, drafts_ptr=p64,
        drafts_stride=i32, input_ids_ptr=p64, positions_ptr=p64, seq_lens_ptr=p32, slot_mapping_ptr=p64,
        block_table_ptr=p32, block_table_stride=i32, block_size=i32, META_AT=3, META_ROWS=4, NUM_DRAFT_COLS=3,
        BLOCK=4)


def compile_for_hopper(index: int) -> None:
    fn, args = list(kernels())[index]
    if "PDL" in fn.arg_names:
        # As a Hopper launches it (kernels/pdl.py): waiting for the kernel ahead, a projection asking for its
        # weight's first lines before.
        from specserve.kernels import pdl

        args = dict(args, PDL=True)
        if "PREFETCH_LINES" in fn.arg_names:
            args["PREFETCH_LINES"] = pdl.PREFETCH_LINES
    signature = {name: ("constexpr" if not isinstance(v, str) else v) for name, v in args.items()}
    constexprs = {name: v for name, v in args.items() if not isinstance(v, str)}
    triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=HOPPER)


@pytest.fixture(scope="module")
def compile_errors() -> dict[str, str | None]:
    """Every kernel compiled in one process of its own, {index: None or the error}: with TRITON_INTERPRET set (as
    tests on the CPU run) triton.jit makes interpreted functions, which do not compile. One process for all of
    them: importing torch and Triton took 3.6 of the 4.2 s a process per kernel took."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("index", range(len(list(kernels()))))
def test_step_kernel_compiles_for_the_h100(index, compile_errors):
    assert compile_errors[str(index)] is None, compile_errors[str(index)]


if __name__ == "__main__":
    # With an index, compile that kernel alone and let its error surface whole; without, report every one.
    if len(sys.argv) > 1:
        compile_for_hopper(int(sys.argv[1]))
    else:
        errors = {}
        for i in range(len(list(kernels()))):
            try:
                compile_for_hopper(i)
                errors[i] = None
            except Exception as e:  # noqa: BLE001 (each kernel's error is reported by its own test)
                errors[i] = f"{type(e).__name__}: {e}"[-3000:]
        print(json.dumps(errors))
