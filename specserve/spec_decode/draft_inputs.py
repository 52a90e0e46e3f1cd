"""What a device drafter needs from the target step just run, gathered in one kernel.

After verification the accepted counts exist only on the device. From them and
the step's inputs the drafter needs, per drafting request i (batch row b):

    last[i]          = base[i] + accepted[b]        index of its last accepted token
    last_tokens[i]   = tokens[b, accepted[b]]       the token the step emitted last
    base_positions[i] = positions[last[i]]
    block_table[i]   = the step's block-table row b

and per token t of the step the token after it, for the draft prefill:

    next_ids[t] = input_ids[t + 1]                  (input_ids[0] for the last token)
    next_ids[last[i]] = last_tokens[i]              a drafting request's newest token
    next_ids[end - 1] = the prompt's next token     a prompt chunk that does not sample
    next_ids[T:pad_to] = 0                          padding of the drafter's graph

Each scheduled request is one program, which owns its tokens, so the overrides
need no ordering between programs. The host gives one row per scheduled
request: (first token, token count, drafting index i or -1, drafts verified,
the prompt's next token for a chunk that does not sample); base[i] is
first + count - 1 - drafts verified.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is optional on CPU installs; the torch path serves there.
    triton = None

REQUEST_COLUMNS = 5
_TOKENS_PER_LOOP = 128
_TABLE_COLUMNS = 64


def gather_draft_inputs_torch(requests: torch.Tensor, accepted: torch.Tensor, tokens: torch.Tensor,
                              input_ids: torch.Tensor, positions: torch.Tensor, block_table: torch.Tensor,
                              num_tokens: int, pad_to: int, next_ids: torch.Tensor, last: torch.Tensor,
                              last_tokens: torch.Tensor, base_positions: torch.Tensor,
                              draft_block_table: torch.Tensor) -> None:
    """The gather in torch ops (the CPU path and the kernel's reference)."""
    first, count, slot, drafts, next_prompt = requests.unbind(1)
    batch_rows = torch.arange(requests.shape[0], device=requests.device)
    drafting = slot >= 0
    b, i = batch_rows[drafting], slot[drafting]
    acc = accepted[b]
    last_idx = first[drafting] + count[drafting] - 1 - drafts[drafting] + acc
    emitted = tokens[b, acc]
    next_ids[:num_tokens] = torch.roll(input_ids[:num_tokens], -1)
    chunk = ~drafting
    next_ids[(first + count - 1)[chunk]] = next_prompt[chunk]
    next_ids[last_idx] = emitted
    next_ids[num_tokens:pad_to] = 0
    last[i] = last_idx
    last_tokens[i] = emitted
    base_positions[i] = positions[last_idx]
    draft_block_table[i] = block_table[b]


if triton is not None:

    # Sizes change from step to step: specializing on them would compile new variants mid-run.
    @triton.jit(do_not_specialize=["num_tokens", "pad_to", "num_scheduled"])
    def _gather_draft_inputs_kernel(
        requests_ptr, accepted_ptr, accepted_stride, tokens_ptr, tokens_stride, input_ids_ptr, positions_ptr,
        block_table_ptr, block_table_stride, num_tokens, pad_to, num_scheduled,
        next_ids_ptr, last_ptr, last_tokens_ptr, base_positions_ptr, draft_table_ptr, draft_table_stride,
        max_blocks, TOKENS: tl.constexpr, COLUMNS: tl.constexpr,
    ):
        r = tl.program_id(0)
        if r == num_scheduled:
            # The extra program: zeros over the drafter graph's padded tokens.
            for p0 in range(num_tokens, pad_to, TOKENS):
                p = p0 + tl.arange(0, TOKENS)
                tl.store(next_ids_ptr + p, tl.zeros([TOKENS], dtype=tl.int64), mask=p < pad_to)
        else:
            first = tl.load(requests_ptr + r * 5)
            end = first + tl.load(requests_ptr + r * 5 + 1)
            slot = tl.load(requests_ptr + r * 5 + 2)
            override_at = end - 1
            value = tl.load(requests_ptr + r * 5 + 4)
            if slot >= 0:
                acc = tl.load(accepted_ptr + r * accepted_stride)
                override_at = end - 1 - tl.load(requests_ptr + r * 5 + 3) + acc
                value = tl.load(tokens_ptr + r * tokens_stride + acc)
                tl.store(last_ptr + slot, override_at)
                tl.store(last_tokens_ptr + slot, value)
                tl.store(base_positions_ptr + slot, tl.load(positions_ptr + override_at))
                for c0 in range(0, max_blocks, COLUMNS):
                    c = c0 + tl.arange(0, COLUMNS)
                    block = tl.load(block_table_ptr + r * block_table_stride + c, mask=c < max_blocks, other=0)
                    tl.store(draft_table_ptr + slot * draft_table_stride + c, block, mask=c < max_blocks)
            for t0 in range(first, end, TOKENS):
                t = t0 + tl.arange(0, TOKENS)
                live = t < end
                following = tl.where(t + 1 < num_tokens, t + 1, 0)
                nxt = tl.load(input_ids_ptr + following, mask=live, other=0)
                tl.store(next_ids_ptr + t, tl.where(t == override_at, value, nxt), mask=live)


def gather_draft_inputs(requests: torch.Tensor, accepted: torch.Tensor, tokens: torch.Tensor,
                        input_ids: torch.Tensor, positions: torch.Tensor, block_table: torch.Tensor,
                        num_tokens: int, pad_to: int, next_ids: torch.Tensor, last: torch.Tensor,
                        last_tokens: torch.Tensor, base_positions: torch.Tensor, draft_block_table: torch.Tensor,
                        *, use_triton: bool | None = None) -> None:
    """Fill the drafter's inputs (see the module docstring). requests [R, 5] int64, one row per scheduled
    request in batch order; accepted [>= R], tokens [>= R, k + 1]: the step's outputs by batch row;
    input_ids, positions, block_table: the step's persistent inputs; the rest are outputs (next_ids over
    [0, pad_to), the others at each drafting request's index). One Triton launch on CUDA, torch ops elsewhere
    (use_triton forces either; tests run the kernel under TRITON_INTERPRET=1)."""
    assert requests.dim() == 2 and requests.shape[1] == REQUEST_COLUMNS, \
        f"requests must be [R, {REQUEST_COLUMNS}], got {tuple(requests.shape)}"
    if use_triton is None:
        use_triton = triton is not None and input_ids.is_cuda
    if not use_triton:
        gather_draft_inputs_torch(requests, accepted, tokens, input_ids, positions, block_table, num_tokens, pad_to,
                                  next_ids, last, last_tokens, base_positions, draft_block_table)
        return
    assert requests.is_contiguous() and requests.dtype == torch.int64 and block_table.stride(1) == 1
    assert draft_block_table.stride(1) == 1 and tokens.stride(1) == 1
    num_scheduled = requests.shape[0]
    _gather_draft_inputs_kernel[(num_scheduled + 1,)](
        requests, accepted, accepted.stride(0), tokens, tokens.stride(0), input_ids, positions,
        block_table, block_table.stride(0), num_tokens, pad_to, num_scheduled,
        next_ids, last, last_tokens, base_positions, draft_block_table, draft_block_table.stride(0),
        block_table.shape[1], TOKENS=_TOKENS_PER_LOOP, COLUMNS=_TABLE_COLUMNS,
    )
