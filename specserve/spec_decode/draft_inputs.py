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
    last[i] = last_tokens[i] = 0                    R <= i < pad_reqs: a padded graph's rows

Each scheduled request is one program, which owns its tokens, so the overrides
need no ordering between programs. The host stages one row per scheduled
request as extra "draft_requests", which the kernel finds through the staged
array's header (staged_inputs.py), with T: (first token, token count, drafting
index i or -1, drafts verified, the prompt's next token for a chunk that does
not sample); base[i] is first + count - 1 - drafts verified. So the launch is
the same every step, and a graph can hold it.
"""
from __future__ import annotations

import torch

from specserve.worker.staged_inputs import HEADER_EXTRAS, NUM_TOKENS, header_extra

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is optional on CPU installs; the torch path serves there.
    triton = None

REQUEST_COLUMNS = 5
_TOKENS_PER_LOOP = 128
_TABLE_COLUMNS = 64


def gather_draft_inputs_torch(staged: torch.Tensor, accepted: torch.Tensor, tokens: torch.Tensor,
                              input_ids: torch.Tensor, positions: torch.Tensor, block_table: torch.Tensor,
                              pad_to: int, pad_reqs: int, next_ids: torch.Tensor, last: torch.Tensor,
                              last_tokens: torch.Tensor, base_positions: torch.Tensor,
                              draft_block_table: torch.Tensor) -> None:
    """The gather in torch ops (the CPU path and the kernel's reference)."""
    requests = header_extra(staged, "draft_requests", REQUEST_COLUMNS)
    num_tokens = int(staged[NUM_TOKENS])
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
    last[requests.shape[0]:pad_reqs] = 0
    last_tokens[requests.shape[0]:pad_reqs] = 0


if triton is not None:

    # pad_to and pad_reqs are a graph's sizes, one per recorded batch size: not specializing on them keeps
    # one compiled kernel for all.
    @triton.jit(do_not_specialize=["pad_to", "pad_reqs"])
    def _gather_draft_inputs_kernel(
        staged_ptr, accepted_ptr, accepted_stride, tokens_ptr, tokens_stride, input_ids_ptr, positions_ptr,
        block_table_ptr, block_table_stride, pad_to, pad_reqs,
        next_ids_ptr, last_ptr, last_tokens_ptr, base_positions_ptr, draft_table_ptr, draft_table_stride,
        max_blocks, REQUESTS_AT: tl.constexpr, REQUESTS_ROWS: tl.constexpr, NUM_TOKENS_AT: tl.constexpr,
        TOKENS: tl.constexpr, COLUMNS: tl.constexpr,
    ):
        r = tl.program_id(0)
        # The grid is a bound: the header says how many requests there are and where their rows are.
        num_scheduled = tl.load(staged_ptr + REQUESTS_ROWS)
        num_tokens = tl.load(staged_ptr + NUM_TOKENS_AT)
        requests_ptr = staged_ptr + tl.load(staged_ptr + REQUESTS_AT)
        if r > num_scheduled:
            return
        if r == num_scheduled:
            # The extra program: zeros over the drafter graph's padded tokens and rows.
            for p0 in range(num_tokens, pad_to, TOKENS):
                p = p0 + tl.arange(0, TOKENS)
                tl.store(next_ids_ptr + p, tl.zeros([TOKENS], dtype=tl.int64), mask=p < pad_to)
            for i0 in range(num_scheduled, pad_reqs, TOKENS):
                i = i0 + tl.arange(0, TOKENS)
                tl.store(last_ptr + i, tl.zeros([TOKENS], dtype=tl.int64), mask=i < pad_reqs)
                tl.store(last_tokens_ptr + i, tl.zeros([TOKENS], dtype=tl.int64), mask=i < pad_reqs)
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


def gather_draft_inputs(staged: torch.Tensor, accepted: torch.Tensor, tokens: torch.Tensor,
                        input_ids: torch.Tensor, positions: torch.Tensor, block_table: torch.Tensor,
                        pad_to: int, pad_reqs: int, next_ids: torch.Tensor, last: torch.Tensor,
                        last_tokens: torch.Tensor, base_positions: torch.Tensor, draft_block_table: torch.Tensor,
                        max_rows: int, *, use_triton: bool | None = None) -> None:
    """Fill the drafter's inputs (see the module docstring). staged: the step's staged array (int64), whose
    header locates the R request rows and holds T; max_rows >= R bounds the grid (a graph records it once);
    accepted [>= R], tokens [>= R, k + 1]: the step's outputs by batch row; input_ids, positions, block_table:
    the step's persistent inputs; the rest are outputs (next_ids over [0, pad_to), the others at each drafting
    request's index, and last, last_tokens zero over [R, pad_reqs)). One Triton launch on CUDA, torch ops
    elsewhere (use_triton forces either; tests run the kernel under TRITON_INTERPRET=1)."""
    if use_triton is None:
        use_triton = triton is not None and input_ids.is_cuda
    if not use_triton:
        gather_draft_inputs_torch(staged, accepted, tokens, input_ids, positions, block_table, pad_to, pad_reqs,
                                  next_ids, last, last_tokens, base_positions, draft_block_table)
        return
    assert staged.is_contiguous() and staged.dtype == torch.int64 and block_table.stride(1) == 1
    assert draft_block_table.stride(1) == 1 and tokens.stride(1) == 1
    at_slot, rows_slot = HEADER_EXTRAS["draft_requests"]
    _gather_draft_inputs_kernel[(max_rows + 1,)](
        staged, accepted, accepted.stride(0), tokens, tokens.stride(0), input_ids, positions,
        block_table, block_table.stride(0), pad_to, pad_reqs,
        next_ids, last, last_tokens, base_positions, draft_block_table, draft_block_table.stride(0),
        block_table.shape[1], REQUESTS_AT=at_slot, REQUESTS_ROWS=rows_slot, NUM_TOKENS_AT=NUM_TOKENS,
        TOKENS=_TOKENS_PER_LOOP, COLUMNS=_TABLE_COLUMNS,
    )


def follow_tree_paths_torch(path_tokens: torch.Tensor, accepted: torch.Tensor, tokens: torch.Tensor,
                            slots: torch.Tensor, positions: torch.Tensor, next_ids: torch.Tensor, last: torch.Tensor,
                            base_positions: torch.Tensor) -> None:
    """follow_tree_paths in torch ops (the CPU path and the kernel's reference)."""
    depth = torch.arange(path_tokens.shape[1], device=path_tokens.device)
    on_path = depth[None, :] <= accepted[:, None]
    end = accepted[:, None]
    last_index = path_tokens.gather(1, end)
    # Past the path, the last node's entry again: the same index written with the same value.
    next_ids[torch.where(on_path, path_tokens, last_index).flatten()] = torch.where(
        on_path, tokens, tokens.gather(1, end)).flatten()
    last[slots] = last_index.squeeze(1)
    base_positions[slots] = positions[last_index.squeeze(1)]


if triton is not None:

    @triton.jit
    def _follow_tree_paths_kernel(path_ptr, accepted_ptr, tokens_ptr, slots_ptr, positions_ptr, next_ids_ptr,
                                  last_ptr, base_positions_ptr, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, BLOCK)
        acc = tl.load(accepted_ptr + i)
        on_path = d <= acc
        path = tl.load(path_ptr + i * WIDTH + d, mask=on_path, other=0)
        tl.store(next_ids_ptr + path, tl.load(tokens_ptr + i * WIDTH + d, mask=on_path, other=0), mask=on_path)
        last_index = tl.load(path_ptr + i * WIDTH + acc)
        slot = tl.load(slots_ptr + i)
        tl.store(last_ptr + slot, last_index)
        tl.store(base_positions_ptr + slot, tl.load(positions_ptr + last_index))


def follow_tree_paths(path_tokens: torch.Tensor, accepted: torch.Tensor, tokens: torch.Tensor, slots: torch.Tensor,
                      positions: torch.Tensor, next_ids: torch.Tensor, last: torch.Tensor,
                      base_positions: torch.Tensor, *, use_triton: bool | None = None) -> None:
    """After gather_draft_inputs, the drafter's inputs of requests that verified trees of drafts: their
    accepted tokens are not consecutive in the step, but at the token indices path_tokens [n, D + 1] (root,
    then each accepted draft). The token after path node d is emitted token d (tokens [n, D + 1]: the
    accepted drafts, then the bonus token), and the last accepted token is path node accepted. slots [n]:
    each request's drafting index. One Triton launch on CUDA, torch ops elsewhere (use_triton forces
    either; tests run the kernel under TRITON_INTERPRET=1)."""
    if use_triton is None:
        use_triton = triton is not None and path_tokens.is_cuda
    if not use_triton:
        follow_tree_paths_torch(path_tokens, accepted, tokens, slots, positions, next_ids, last, base_positions)
        return
    n, width = path_tokens.shape
    assert path_tokens.is_contiguous() and tokens.is_contiguous() and tokens.shape[1] == width
    if n:
        _follow_tree_paths_kernel[(n,)](path_tokens, accepted, tokens, slots, positions, next_ids, last,
                                        base_positions, WIDTH=width, BLOCK=triton.next_power_of_2(width))
