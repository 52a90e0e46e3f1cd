"""Which requests the start-up warm-up runs: enough to launch every compiled kernel variant a request can hit.

Triton compiles a kernel at its first launch with each distinct
specialisation: its constexpr values, and each integer argument as 1, a
multiple of 16 or neither (int_class). A step's shapes decide them, for
three families of kernels (step_variants):

- attention, where it runs eagerly (eager and piecewise steps): the request
  count, the token count it runs over (padded under a piecewise graph), and
  its tiles and key splits (the backend's launch_variant, for every
  attention shape of the target and the drafter);
- the kernels over the step's tokens, where the forward runs eagerly: the
  token count, and the tile rows a small-M kernel picks from it (rows_class);
- the kernels over the step's requests (sampling, verification, drafting):
  the request count and its tile rows.

Recorded graphs compiled their kernels at capture. Candidate steps are swept
in order and each one that launches a variant no earlier one did is kept:
one prompt at a time of every length; batches of fresh prompts prefilled in
one step, of every request count, longest query and token count; decode and
verification batches of every request count, greedy and sampled, their last
request arriving after the others' prefill (a prefill beside decodes). The
prompt lengths a cached prefix of two blocks can precede also run as its
tails, and a prompt longer than the step's token budget runs in chunks,
alone and beside a decode. Every request generates past its prefill, so
verification and the drafter's prefill and drafting (chain or tree) run
with every shape too.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from specserve.models.layers import SMALL_M_MAX_TOKENS
from specserve.worker.cudagraph import BatchDescriptor
from specserve.worker.cudagraph_mode import CUDAGraphMode

# Tokens each request generates: the prefill's, then at least one verification or decode step.
MAX_TOKENS = 2
# Batches run a few decode steps beside their late request's prefill.
BATCH_MAX_TOKENS = 4
# The cached prefix that prompt tails follow, in blocks.
PREFIX_BLOCKS = 2


@dataclass(frozen=True)
class WarmupRequest:
    prompt_len: int
    max_tokens: int = MAX_TOKENS
    sampled: bool = False  # sampling with filters and logprobs (some with penalties or a seed), else greedy
    # Leading tokens taken from the warm-up's one shared prefix: a prefix cache hit once an earlier request has
    # computed them.
    cached_prefix: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.cached_prefix < self.prompt_len or self.max_tokens < 1:
            raise ValueError(f"a warm-up request needs a prompt longer than its cached prefix, got {self}")


@dataclass(frozen=True)
class Scenario:
    """Requests added together and run to completion; `later` ones are added after the first step."""

    name: str
    first: tuple[WarmupRequest, ...]
    later: tuple[WarmupRequest, ...] = ()

    @property
    def requests(self) -> tuple[WarmupRequest, ...]:
        return self.first + self.later


@dataclass(frozen=True)
class EngineShapes:
    """What decides the engine's compiled variants: how a step dispatches (ModelRunner.dispatch), the attention
    variant of a batch (num_reqs, max_query_len) for every attention shape (None where nothing compiles), and
    the limits of what the scheduler can produce."""

    dispatch: Callable[[int, list[int]], BatchDescriptor]
    attention: Callable[[int, int], tuple]
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    block_size: int
    num_drafts: int  # tokens a verifying request adds to its query (chain k, or a tree's nodes); 0: none
    chunked_prefill: bool


def int_class(n: int) -> str:
    """How Triton specialises an integer argument."""
    return "1" if n == 1 else "16n" if n % 16 == 0 else "n"


def rows_class(m: int) -> int:
    """The tile rows a small-M kernel picks for m rows (a power of two), one class past the kernels' limit."""
    return 1 << max(m - 1, 0).bit_length() if m <= SMALL_M_MAX_TOKENS else 2 * SMALL_M_MAX_TOKENS


def step_variants(shapes: EngineShapes, query_lens: list[int]) -> frozenset:
    """The kernel variants a step of these query lengths launches eagerly (module docstring)."""
    tokens, reqs = sum(query_lens), len(query_lens)
    desc = shapes.dispatch(tokens, query_lens)
    # What runs eagerly around the forward depends on the graph it replays: a decode's, a verification's, one
    # request's query of another length, or none.
    uniform = desc.query_len if desc.query_len in (None, 1, 1 + shapes.num_drafts) else "one request"
    variants = {("requests", desc.mode, uniform, int_class(reqs), rows_class(reqs))}
    if desc.mode is not CUDAGraphMode.FULL:
        variants.add(("attention", int_class(reqs), int_class(desc.num_tokens),
                      shapes.attention(reqs, max(query_lens))))
    if desc.mode is CUDAGraphMode.NONE:
        variants.add(("tokens", int_class(tokens), rows_class(tokens)))
    return frozenset(variants)


class VariantCover:
    """The variants launched so far: a candidate is kept when it launches one more."""

    def __init__(self, shapes: EngineShapes):
        self.shapes = shapes
        self.seen: set = set()

    def keep(self, steps: Iterable[list[int]]) -> bool:
        new = set().union(*(step_variants(self.shapes, lens) for lens in steps)) - self.seen
        self.seen |= new
        return bool(new)


def prefill_lengths(shapes: EngineShapes, cover: VariantCover | None = None) -> list[int]:
    """Prompt lengths, each alone in its step, that launch new variants, up to the longest prompt one step holds."""
    cover = cover or VariantCover(shapes)
    longest = min(shapes.max_num_batched_tokens, shapes.max_model_len - 1)
    return [q for q in range(1, longest + 1) if cover.keep([[q]])]


def batch_prefills(shapes: EngineShapes, cover: VariantCover) -> list[list[int]]:
    """Query lengths of steps prefilling r fresh prompts (r from 2 to max_num_seqs) that launch new variants. For
    each r and each attention variant the longest query q gives (from its first to its last q), the step's
    tokens run from the least to the most r such queries can have: the first 17 and the last 16 of them (every
    integer class, and a multiple of 16 among the graph sizes past the least)."""
    budget, chosen = shapes.max_num_batched_tokens, []
    longest = min(budget, shapes.max_model_len - 1)
    for r in range(2, min(shapes.max_num_seqs, budget) + 1):
        bounds: dict[tuple, list[int]] = {}
        for q in range(1, min(longest, budget - r + 1) + 1):
            bounds.setdefault(shapes.attention(r, q), [q, q])[1] = q
        for first, last in bounds.values():
            least, most = first + r - 1, min(budget, r * last)
            for tokens in sorted({*range(least, min(most, least + 16) + 1), *range(max(least, most - 15), most + 1)}):
                # The shortest longest query that holds the tokens, the rest spread evenly (at most q, at least 1).
                q = max(first, -(-tokens // r))
                rest, extra = divmod(tokens - q, r - 1)
                lens = [q] + [rest + (i < extra) for i in range(r - 1)]
                if cover.keep([lens]):
                    chosen.append(lens)
    return chosen


def batch_sizes(shapes: EngineShapes, cover: VariantCover | None = None) -> list[int]:
    """Request counts from 2 to max_num_seqs whose decode or verification steps launch new variants."""
    cover = cover or VariantCover(shapes)
    query_lens = (1, 1 + shapes.num_drafts) if shapes.num_drafts else (1,)
    most = min(shapes.max_num_seqs, shapes.max_num_batched_tokens // query_lens[-1])
    return [r for r in range(2, most + 1) if cover.keep([[q] * r for q in query_lens])]


def plan(shapes: EngineShapes) -> list[Scenario]:
    """Every scenario of the warm-up, in order (module docstring)."""
    cover = VariantCover(shapes)
    lengths = prefill_lengths(shapes, cover)
    scenarios = [Scenario(f"prefill {q}", (WarmupRequest(q),)) for q in lengths]
    prefix = PREFIX_BLOCKS * shapes.block_size
    tails = [q for q in lengths if prefix + q < shapes.max_model_len and q <= prefix]
    if tails:
        scenarios.append(Scenario("prefix", (WarmupRequest(prefix + 1, cached_prefix=prefix),)))
        scenarios += [Scenario(f"cached prefix + {q}", (WarmupRequest(prefix + q, cached_prefix=prefix),))
                      for q in tails]
    scenarios += [Scenario(f"prefill {'+'.join(map(str, lens))}", tuple(WarmupRequest(q) for q in lens))
                  for lens in batch_prefills(shapes, cover)]
    # Decode batches of each request count's variants, whichever the prefills above launched already: greedy and
    # sampled steps run different code around the same kernels. Their first requests take prompts of a block at
    # most, the late one the prefill lengths in turn; the sampled ones from one request up.
    short = [1 + i % shapes.block_size for i in range(shapes.max_num_seqs)]
    sizes = batch_sizes(shapes)
    for sampled in (False, True):
        for i, r in enumerate(([1] if sampled else []) + sizes):
            first = tuple(WarmupRequest(short[j], BATCH_MAX_TOKENS, sampled and j % 2 == 0) for j in range(r - 1))
            late = (WarmupRequest(lengths[i % len(lengths)], BATCH_MAX_TOKENS, sampled),)
            name = f"{'sampled' if sampled else 'greedy'} {r}"
            scenarios.append(Scenario(name, first, late) if first else Scenario(name, late))
    longest = min(shapes.max_num_batched_tokens + shapes.block_size + 1, shapes.max_model_len - 1)
    if shapes.chunked_prefill and longest > shapes.max_num_batched_tokens:
        scenarios.append(Scenario("chunked", (WarmupRequest(longest),)))
        scenarios.append(Scenario("chunked beside a decode", (WarmupRequest(1, BATCH_MAX_TOKENS),),
                                  (WarmupRequest(longest),)))
    return scenarios
