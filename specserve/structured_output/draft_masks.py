"""Grammar masks for a step's drafts: the drafter's logits of a grammar request at each draft are masked
with the grammar's state along that draft's path, so the drafts it proposes are ones the grammar allows
(docs/design.md, 'Structured output').

The state a draft continues from is only known on the host, after the tokens before it: the step's new
tokens (its accepted drafts and the token after them) and the drafts of the depths before. So a grammar
step drafts depth by depth, reading each depth's drafts back as soon as they are picked: follow() queues
the copy, and masks() waits for it, after the drafter has queued its next forward, so the host builds the
masks while the device runs that forward. Only steps with a grammar request draft this way (worker/
step_path.py, Drafting.masked).

A chain's depth fills one node a request: each request's matcher walks on from the last depth's node by the
tokens between (the step's new tokens at node 0, then one draft a depth) and stays there, so a path is walked
once and not again from its start every depth; one batched xgrammar call fills every open node
(structured_output/fill_threads.py). close() rolls every matcher back to where it was: the caller calls it once
the step's drafting ends, however it ends, and nothing else reads the matchers before. A tree's depth walks
each request's paths and rolls back (RequestGrammar.fill_masks). The rows go straight into the runner's pinned
buffer for the drafter's masks (InputBuffers.draft_bitmask), a block of rows a depth, and to the device in one
copy.

A chain's masks are also the next step's: its verification of these drafts masks position j with the state
after the step's tokens and drafts 0..j-1, which is the drafter's node j. carried() keeps them for that step's
StepMasks.build (CarriedDraftMasks), which then fills only what the drafter did not (the position after the
last draft).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specserve.sample.token_bitmask import apply_token_bitmask
from specserve.structured_output.fill_threads import batch_fill
from specserve.structured_output.request_grammar import RequestGrammar
from specserve.transfer import HostCopy
from specserve.worker.input_buffers import TokenBitmaskBuffer

# What the drafter's -inf logits (tokens outside an EAGLE-3 head's draft vocabulary) are raised to before
# masking: far below any logit, so such a token is drafted only where the grammar allows no token the
# drafter ranks, and then the grammar's tokens are drafted uniformly rather than an illegal one.
UNRANKED_LOGIT = -1e4


@dataclass(frozen=True)
class CarriedDraftMasks:
    """A chain step's drafter masks, for the next step's verification masks (StepMasks.build).

    What must hold: the drafter's rows stay untouched until the next step drafts, which comes after its
    StepMasks.build and, on the device, after the copies it queues; a row is used only for a request whose
    grammar has accepted exactly the tokens the drafter's path started from, and whose verified drafts begin
    with the drafts the row's path took."""

    source: TokenBitmaskBuffer  # the drafter's buffer, depth-major: depth d of request i at row d * n + i
    n: int
    index: dict[str, int]  # request id -> i
    grammars: list[RequestGrammar | None]
    accepted: list[int]  # tokens each grammar had accepted at the end of the drafter's path's step tokens
    drafts: list[list[int]]  # the drafts each request's rows walked (all but its last)

    def rows(self, request_id: str, grammar: RequestGrammar, drafts: Sequence[int]) -> tuple[int, int]:
        """(i, depths): the mask after a verifying request's drafts 0..d-1 is source's row d * n + i for every
        d < depths; depths 0 where the drafter built none of its masks."""
        i = self.index.get(request_id)
        if i is None or self.grammars[i] is not grammar or grammar.accepted != self.accepted[i]:
            return 0, 0
        walked = self.drafts[i]
        same = 0
        while same < min(len(drafts), len(walked)) and drafts[same] == walked[same]:
            same += 1
        return i, same + 1


class DraftMasks:
    """The masks of one step's drafts, for its n drafting requests (rows in the drafter's order)."""

    def __init__(self, grammars: Sequence[RequestGrammar | None], step_tokens: torch.Tensor,
                 tree_parents: tuple[int, ...] | None, buffer: TokenBitmaskBuffer):
        """step_tokens [n, 2 + a + ...]: each drafting request's row of the step outputs (accepted count, then
        the tokens emitted), on the device, copied back now; tree_parents: DraftTree.parents for trees,
        None for chains; buffer: where the masks are built, n rows a draft for a chain (every depth's kept),
        n a node of the widest depth for a tree."""
        self.grammars = list(grammars)
        self.tree_parents = tree_parents
        self.buffer = buffer
        self._step_tokens: HostCopy | None = HostCopy(step_tokens)
        self._pending: list[HostCopy] = []
        # Each request's tokens before its drafts this step, and its drafts so far in tree order.
        self._prefix: list[list[int]] = []
        self._drafts: list[list[int]] = [[] for _ in self.grammars]
        # What each grammar will have accepted once the step's tokens are appended; the depths masked so far.
        self._accepted: list[int] = []
        self._depths = 0
        # A chain's walk: the tokens each matcher took this step (close() rolls them back), and whether its path
        # is still open (the grammar took every token of it and has not ended).
        self._walked = [0] * len(self.grammars)
        self._open = [g is not None for g in self.grammars]

    def follow(self, drafts: torch.Tensor) -> None:
        """The next drafts were picked, [n, m] on the device (a chain's next draft, or a tree's next depth in
        tree order): start reading them back."""
        self._pending.append(HostCopy(drafts))

    def masks(self, nodes: range) -> torch.Tensor:
        """[n * len(nodes), words] on the device: row i * len(nodes) + r allows the tokens after node nodes[r]
        of request i (node 0: its last token this step; node j: its draft j, as RequestGrammar.fill_masks
        numbers them); every token in rows of requests without a grammar and where the path is refused. Each
        call's nodes follow the last's (a chain: one node a call)."""
        self._read_back()
        return self._build(nodes)

    def _build(self, nodes: range) -> torch.Tensor:
        """masks() once the drafts are back: the host's part."""
        n, width = len(self.grammars), len(nodes)
        # A chain keeps every depth's rows (for carried()), a tree one depth's at a time.
        first = n * nodes[0] if self.tree_parents is None else 0
        rows = n * width
        if first + rows > self.buffer.host.shape[0]:
            raise RuntimeError(f"a draft depth masks rows {first}..{first + rows} but the drafter's bitmask buffer "
                               f"holds {self.buffer.host.shape[0]}")
        host = self.buffer.fillable()
        self.buffer.allow_all(first, first + rows)
        if self.tree_parents is None:
            self._fill_chain_node(host[first:first + rows], nodes[0])
        else:
            for i, grammar in enumerate(self.grammars):
                if grammar is not None:
                    grammar.fill_masks(host, i * width, self._drafts[i], self.tree_parents, nodes, self._prefix[i])
        self._depths = nodes[-1] + 1
        return self.buffer.copy(rows, first)

    def carried(self, request_ids: Sequence[str]) -> CarriedDraftMasks | None:
        """A chain's masks for the next step's verification (request_ids: the drafting requests, in order);
        None for trees. Reads back nothing more: the last draft's row is the next step's own to fill."""
        if self.tree_parents is not None or not self._prefix:
            return None
        return CarriedDraftMasks(self.buffer, len(self.grammars), {r: i for i, r in enumerate(request_ids)},
                                 self.grammars, self._accepted, [d[:self._depths - 1] for d in self._drafts])

    def close(self) -> None:
        """Roll every matcher back by what the chain's walk took: each is where it was before the step drafted."""
        for grammar, taken in zip(self.grammars, self._walked):
            if taken:
                grammar.matcher.rollback(taken)
        self._walked = [0] * len(self.grammars)
        self._open = [False] * len(self.grammars)

    def _fill_chain_node(self, host: torch.Tensor, node: int) -> None:
        """Row i: the tokens request i's grammar allows after its step's tokens and its drafts before `node`,
        as RequestGrammar.fill_masks walks a chain: a path the grammar refuses, or ends (a stop token), keeps
        its row allowing every token. Each matcher walks on from node - 1, where the last call left it."""
        if node != self._depths:
            raise RuntimeError(f"a chain's masks are built node after node: node {self._depths} is next, not {node}")
        matchers, rows = [], []
        for i, grammar in enumerate(self.grammars):
            if not self._open[i]:
                continue
            tokens = self._prefix[i] if node == 0 else self._drafts[i][node - 1:node]
            taken = grammar.walk(tokens)
            self._walked[i] += taken
            if node > len(self._drafts[i]) or taken < len(tokens) or grammar.matcher.is_terminated():
                self._open[i] = False
                continue
            matchers.append(grammar.matcher)
            rows.append(i)
        batch_fill(matchers, host, rows)

    def _read_back(self) -> None:
        if self._step_tokens is not None:
            rows = self._step_tokens.wait().tolist()
            self._prefix = [row[1:row[0] + 2] for row in rows]
            self._accepted = [0 if g is None else g.accepted + len(p) for g, p in zip(self.grammars, self._prefix)]
            self._step_tokens = None
        for copy in self._pending:
            for drafts, new in zip(self._drafts, copy.wait().tolist()):
                drafts.extend(new)
        self._pending = []


def mask_draft_logits(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """The drafter's logits [rows, V] with the tokens each bitmask row refuses at -inf, in a new tensor (the
    input may be a graph's output); tokens the drafter cannot propose rank below every other (UNRANKED_LOGIT)
    but stay above the refused ones."""
    masked = logits.clamp(min=UNRANKED_LOGIT)
    apply_token_bitmask(masked, bitmask)
    return masked
