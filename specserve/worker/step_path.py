"""Which path a step takes through the runner, chosen once per step from what the host knows.

A step either replays its whole-step graph (docs/design.md, 'Whole-step graphs') or runs its parts:
the target's forward (eager, PIECEWISE or FULL, as the batch descriptor says), the sampling of the
rows without drafts, the verification of the rows with drafts, and the drafter's proposal of the
next drafts, each part replaying a graph of its own where the batch allows it. choose_step_path is
pure: the runner gathers its inputs (the batch descriptor, the scheduled requests' sampling
parameters, which graphs are recorded), and each part reads its decision from the result.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from specserve.engine.request import Request
from specserve.engine.scheduler import SchedulerOutput
from specserve.sample.sampler import draws_with_temperature_only
from specserve.worker.cudagraph import BatchDescriptor
from specserve.worker.cudagraph_mode import CUDAGraphMode


class WholeStep(Enum):
    NONE = "parts"  # each part runs on its own
    CHAIN = "whole step"  # decode, or verification of a chain of k drafts, then the drafts, in one graph
    TREE = "whole tree step"  # verification of a whole tree of drafts, then the next tree, in one graph
    # TREE for a batch with a request that samples, every request drawing with its temperature alone: the walk
    # by recursive rejection sampling and the children drawn from the head (spec_decode/sampled_tree.py).
    SAMPLED_TREE = "whole sampled tree step"
    # A greedy decode batch of a speculative engine whose policy keeps this step from drafting: decoded as the
    # whole step of an engine without a speculator does, in a graph of its own.
    PLAIN = "whole plain step"


class Sampling(Enum):
    """How the rows that sample without drafts pick their token."""

    NONE = "none"  # no such row
    IN_WHOLE_STEP = "in the whole step"
    # The argmax of a decode batch, in the greedy graph of its descriptor (masked by the step's grammar masks).
    GREEDY_GRAPH = "greedy graph"
    ARGMAX = "argmax"  # the argmax, eagerly
    SAMPLER = "sampler"  # the sampler: temperature, penalties, min_tokens, logprobs, logit_bias


class Verification(Enum):
    """How the rows with drafts verify them."""

    NONE = "none"  # no such row
    IN_WHOLE_STEP = "in the whole step"
    GREEDY_GRAPH = "greedy graph"  # greedy verification of a uniform batch, in the greedy graph of its descriptor
    GREEDY = "greedy"  # greedy verification, eagerly
    REJECTION = "rejection sampling"
    TREE_ARGMAX = "tree on the argmax"  # the walk of trees, on the target's argmax at every node
    TREE_LOGITS = "tree on the logits"  # the walk of trees, on tokens sampled from (or logprobs of) the logits


class Drafting(Enum):
    """Where the next step's drafts come from."""

    NONE = "none"  # no speculator, or no request yields tokens this step
    ON_HOST = "on the host"  # a host speculator, from the tokens resolve() reads
    IN_WHOLE_STEP = "in the whole step"
    GREEDY_LOOP_GRAPH = "greedy loop graph"  # every draft of a greedy batch, in the drafter's loop graph
    STEPS = "steps"  # one decode step per draft, each replaying its own graph where it has one
    TREE_GRAPH = "tree graph"  # a greedy batch's tree passes, in the drafter's tree graph
    # A batch with a request that samples: its children are drawn from the head (spec_decode/sampled_tree.py),
    # in the drafter's sampled tree graph where every request draws with its temperature alone, else eagerly.
    SAMPLED_TREE_GRAPH = "sampled tree graph"
    TREE_PASSES = "tree passes"
    # A step with a grammar request: the drafter's logits are masked by each draft path's grammar state,
    # which the host builds from each depth's drafts, read back as they are picked (structured_output/
    # draft_masks.py): one decode step per draft, or a tree's passes, eagerly. Without mask_drafts a grammar step
    # drafts as a step without a grammar does, in the graphs above.
    MASKED_STEPS = "masked steps"
    MASKED_TREE_PASSES = "masked tree passes"
    # No drafts this step (none yields tokens, or the policy keeps it from drafting), but it ran prompt tokens: the
    # drafter's prefill over them, so that its own cache holds every prompt token when it drafts later.
    PREFILL_ONLY = "prefill only"

    @property
    def masked(self) -> bool:
        return self in (Drafting.MASKED_STEPS, Drafting.MASKED_TREE_PASSES)


class SpeculatorKind(Enum):
    NONE = "none"
    ON_HOST = "on the host"  # drafts from the host's tokens (n-gram)
    ON_DEVICE = "on the device"  # drafts in the step's launch, from device tensors (a model)


@dataclass(frozen=True)
class RowsSampling:
    """The sampling parameters of a group of batch rows, as far as they choose a step's path."""

    all_greedy: bool = True
    logprobs: bool = False  # some request asks for logprobs
    needs_host_tokens: bool = False  # some request's sampling reads the host's tokens (penalties, min_tokens)
    # Some request's logits are masked by its grammar (structured_output/step_masks.py). Every path applies the
    # step's masks (the greedy graphs, the argmax, the samplers) but the whole step: its graph runs the forward
    # and the argmax in one replay, and the masks are built on the host while the forward runs, after it is
    # enqueued.
    grammar: bool = False
    # Some request has a logit_bias (sample/logit_bias.py), which only the logits paths apply.
    logit_bias: bool = False
    # Every request draws with its temperature alone (sample/sampler.draws_with_temperature_only).
    temperature_only: bool = True

    @classmethod
    def of(cls, requests: Sequence[Request]) -> RowsSampling:
        return cls(all(r.params.greedy for r in requests), any(r.params.logprobs is not None for r in requests),
                   any(r.needs_host_tokens for r in requests), any(r.grammar is not None for r in requests),
                   any(r.params.logit_bias is not None for r in requests),
                   all(draws_with_temperature_only(r) for r in requests))

    @property
    def argmax_only(self) -> bool:
        """Every request takes the argmax of its unbiased (maybe masked) logits and asks for no logprobs: the
        tokens alone are needed."""
        return self.all_greedy and not self.logprobs and not self.logit_bias

    @property
    def samples_argmax(self) -> bool:
        """Sampling without drafts is the argmax alone: argmax_only, and no request needs what only the
        sampler applies (penalties, min_tokens)."""
        return self.argmax_only and not self.needs_host_tokens

    def __or__(self, other: RowsSampling) -> RowsSampling:
        """The parameters of both groups of rows together."""
        return RowsSampling(self.all_greedy and other.all_greedy, self.logprobs or other.logprobs,
                            self.needs_host_tokens or other.needs_host_tokens, self.grammar or other.grammar,
                            self.logit_bias or other.logit_bias, self.temperature_only and other.temperature_only)


@dataclass(frozen=True)
class StepRows:
    """What a step's scheduled requests tell about its path."""

    num_scheduled: int
    drafts: tuple[int, ...]  # the drafts each scheduled request verifies
    num_sample: int = 0  # requests that yield tokens without verifying drafts
    num_verify: int = 0  # requests that verify drafts
    sample: RowsSampling = RowsSampling()  # the parameters of the first group
    verify: RowsSampling = RowsSampling()  # of the second
    prompt_tokens: bool = False  # some request runs prompt tokens (ScheduledRequest.decodes false)

    @classmethod
    def of(cls, sched: SchedulerOutput) -> StepRows:
        sample = [s.request for s in sched.scheduled if s.samples and not s.spec_token_ids]
        verify = [s.request for s in sched.scheduled if s.samples and s.spec_token_ids]
        return cls(len(sched.scheduled), tuple(len(s.spec_token_ids) for s in sched.scheduled), len(sample),
                   len(verify), RowsSampling.of(sample), RowsSampling.of(verify),
                   any(not s.decodes for s in sched.scheduled))

    @property
    def num_sampling(self) -> int:
        """Requests that yield tokens this step."""
        return self.num_sample + self.num_verify

    def all_verify(self, query_len: int | None) -> bool:
        """Every scheduled request verifies the query_len - 1 drafts a uniform batch's query holds."""
        return query_len is not None and all(d == query_len - 1 for d in self.drafts)


@dataclass(frozen=True)
class GraphsReady:
    """Which recorded graphs could serve the step; all False where no graphs are recorded."""

    whole_step: bool = False  # a whole-step graph for the descriptor (never under debug_cudagraph)
    greedy: bool = False  # a greedy sampling or verification graph for the descriptor
    drafting: bool = False  # the drafter's loop graph (chains) or tree graph for the requests that draft
    sampled_tree: bool = False  # the drafter's sampled tree graph for them
    whole_sampled_tree: bool = False  # a whole sampled tree step's graph for the descriptor
    plain_step: bool = False  # a whole plain step's graph for the descriptor (a speculative engine's)
    # The engine has a device drafter, whose cache of its own a step that drafts nothing prefills over its prompt
    # tokens (every rank of a sharded one).
    drafter_cache: bool = False


@dataclass(frozen=True)
class StepPath:
    """The path of one step: the target's graph mode (its descriptor's), and how each later part runs."""

    target: CUDAGraphMode  # NONE (eager), PIECEWISE or FULL
    whole: WholeStep
    sampling: Sampling
    verification: Verification
    drafting: Drafting
    # Some sampling row is masked by its grammar: the runner builds the step's masks (StepMasks).
    masked: bool = False

    @property
    def drafts_on_device(self) -> bool:
        return self.drafting not in (Drafting.NONE, Drafting.ON_HOST, Drafting.PREFILL_ONLY)

    @property
    def verifies_trees(self) -> bool:
        """Some rows verify trees of drafts outside the whole step's graph (the runner's _verify_tree)."""
        return self.verification in (Verification.TREE_ARGMAX, Verification.TREE_LOGITS)


def choose_step_path(desc: BatchDescriptor, rows: StepRows, graphs: GraphsReady, speculator: SpeculatorKind,
                     trees: bool, mask_drafts: bool) -> StepPath:
    """The path the step takes. desc: its target's batch descriptor; trees: the speculator drafts trees;
    mask_drafts: a device drafter's drafts for grammar requests are masked by their grammars (SpeculativeConfig.
    mask_drafts), else they are drafted as without a grammar.

    A step runs whole when it has a whole-step graph, every request yields tokens, greedily, without
    logprobs or a grammar, and a verifying batch verifies exactly the drafts its graph verifies: the conditions
    under which each part would replay its own graph. A batch of trees with a request that samples runs the
    whole sampled tree step on the same conditions, but that its requests draw with their temperatures alone; a
    greedy decode batch that drafts nothing this step (the policy's decision) the whole plain step. A step with a
    grammar request replays the target's graph and then the greedy graph, which applies the masks built in
    between."""
    everyone = rows.num_sampling == rows.num_scheduled
    both = rows.sample | rows.verify
    if graphs.whole_step and everyone and not both.grammar:
        greedy = both.samples_argmax if desc.query_len == 1 else both.argmax_only and rows.all_verify(desc.query_len)
        if greedy:
            return StepPath(desc.mode, WholeStep.TREE if trees else WholeStep.CHAIN,
                            Sampling.IN_WHOLE_STEP if rows.num_sample else Sampling.NONE,
                            Verification.IN_WHOLE_STEP if rows.num_verify else Verification.NONE,
                            _drafting(rows, graphs, speculator, trees, mask_drafts, in_whole_step=True))
    if (graphs.plain_step and speculator is SpeculatorKind.NONE and everyone and desc.query_len == 1
            and both.samples_argmax and not both.grammar):
        return StepPath(desc.mode, WholeStep.PLAIN, Sampling.IN_WHOLE_STEP, Verification.NONE, Drafting.NONE)
    if (trees and graphs.whole_sampled_tree and everyone and rows.all_verify(desc.query_len)
            and _draws_in_graph(both)):
        return StepPath(desc.mode, WholeStep.SAMPLED_TREE, Sampling.NONE, Verification.IN_WHOLE_STEP,
                        _drafting(rows, graphs, speculator, trees, mask_drafts, in_whole_step=True))
    return StepPath(desc.mode, WholeStep.NONE, _sampling(desc, rows, graphs), _verification(desc, rows, graphs, trees),
                    _drafting(rows, graphs, speculator, trees, mask_drafts, in_whole_step=False),
                    masked=both.grammar)


def _draws_in_graph(rows: RowsSampling) -> bool:
    """Every request's tokens are drawn with its temperature alone from its unmasked, unbiased logits, and none
    asks for logprobs or for what the sampler alone applies: a graph can record its draws."""
    return (rows.temperature_only and not rows.all_greedy and not rows.logprobs and not rows.logit_bias
            and not rows.needs_host_tokens and not rows.grammar)


def _sampling(desc: BatchDescriptor, rows: StepRows, graphs: GraphsReady) -> Sampling:
    if not rows.num_sample:
        return Sampling.NONE
    if not rows.sample.samples_argmax:
        return Sampling.SAMPLER
    # A uniform batch of 1 + k query tokens here is a prefill with nothing to verify: no greedy graph.
    if desc.query_len == 1 and graphs.greedy and rows.num_sample == rows.num_scheduled:
        return Sampling.GREEDY_GRAPH
    return Sampling.ARGMAX


def _verification(desc: BatchDescriptor, rows: StepRows, graphs: GraphsReady, trees: bool) -> Verification:
    if not rows.num_verify:
        return Verification.NONE
    if trees:
        return Verification.TREE_ARGMAX if rows.verify.argmax_only else Verification.TREE_LOGITS
    if not rows.verify.argmax_only:
        return Verification.REJECTION
    if graphs.greedy and rows.num_verify == rows.num_scheduled and rows.all_verify(desc.query_len):
        return Verification.GREEDY_GRAPH
    return Verification.GREEDY


def _drafting(rows: StepRows, graphs: GraphsReady, speculator: SpeculatorKind, trees: bool, mask_drafts: bool,
              in_whole_step: bool) -> Drafting:
    if not rows.num_sampling or speculator is SpeculatorKind.NONE:
        return Drafting.PREFILL_ONLY if graphs.drafter_cache and rows.prompt_tokens else Drafting.NONE
    if speculator is SpeculatorKind.ON_HOST:
        return Drafting.ON_HOST
    if in_whole_step:
        return Drafting.IN_WHOLE_STEP
    both = rows.sample | rows.verify
    if both.grammar and mask_drafts:
        return Drafting.MASKED_TREE_PASSES if trees else Drafting.MASKED_STEPS
    greedy = both.all_greedy
    if trees:
        if greedy and graphs.drafting:
            return Drafting.TREE_GRAPH
        return (Drafting.SAMPLED_TREE_GRAPH if not greedy and both.temperature_only and graphs.sampled_tree
                else Drafting.TREE_PASSES)
    return Drafting.GREEDY_LOOP_GRAPH if greedy and graphs.drafting else Drafting.STEPS
