"""Split-K for the projection kernels: the parts of one output tile summed in part order, in one launch.

A projection with few output tiles over a long K (an EAGLE-3 head's down_proj, a rank's qkv, an 8B model's
o_proj at 64 rows) leaves most SMs idle with one program a tile, so its kernel may split K over SPLIT_K
programs. Each part stores its float32 partial sums to a workspace and counts itself in with an atomic; the
last to finish adds the parts in part order (float atomics would sum in whatever order the parts finished, a
result that varies from run to run) and resets the count: no second kernel. The counters assume one stream
runs these projections.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# Split counts, one per output tile: 4096 tiles cover 65,536 columns in the narrowest (16-wide) tiles, more
# than a split projection has (split-K pays where columns are few).
MAX_SPLIT_TILES = 4096
_split_counters: dict[torch.device, torch.Tensor] = {}


def split_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """The split counts' persistent zeros on device, shared by every split projection there: their launches
    run one after another on one stream. Allocated on first use, which the eager warm-up before any graph
    recording makes."""
    if tiles > MAX_SPLIT_TILES:
        raise ValueError(f"a split-K projection takes at most {MAX_SPLIT_TILES} output tiles, got {tiles}: "
                         "use a wider tile or no split")
    if device not in _split_counters:
        _split_counters[device] = torch.zeros(MAX_SPLIT_TILES, dtype=torch.int32, device=device)
    return _split_counters[device]


@triton.jit
def counts_in_last(counter_ptr, tile, SPLIT_K: tl.constexpr):
    """Called by every part of an output tile once its partial sums are stored: whether this part finished
    last, in which case the tile's count is back at zero for the next launch."""
    # Every thread's stores are done before the count (released at GPU scope) says so.
    tl.debug_barrier()
    last = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel") == SPLIT_K - 1
    if last:
        tl.atomic_xchg(counter_ptr + tile, 0)
    return last


@triton.jit
def sum_parts(parts, mask, part_stride, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The float32 sum of the SPLIT_K parts at parts + s * part_stride, in part order: the same sum every run."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for s in range(0, SPLIT_K):
        # From L2: other SMs wrote these.
        acc += tl.load(parts + s * part_stride, mask=mask, other=0.0, cache_modifier=".cg")
    return acc
