"""A static tree of drafts: which of the head's ranked guesses to draft at each depth.

A node is the path of ranks from the root: (0,) is the head's best guess for the
next token, (1,) its second best, (0, 2) the third best guess after the best one.
This is the form of vLLM's `speculative_token_tree`. Nodes are kept in breadth-first
order (by depth, then by path), with index 0 for the root (the last token the
target emitted) and 1..N for the drafts, so that:

- the nodes of depth <= d are the indices 0 .. end(d) - 1, a prefix: a tree cut to
  its first n drafts is still a tree, and a query over the nodes of one depth is
  the last tokens of the keys written so far (the attention kernels' layout);
- a node's ancestors have smaller indices than it, so one bit per index says which
  keys of the tree a node may see (`ancestor_bits`).

For a greedy request verification reads the target's argmax at every node and
walks down from the root while a child carries it, so a tree never changes the
output. A sampling request's node of rank r is instead the head's r-th draw
there, and its tree is verified by recursive rejection sampling
(sampled_tree.py), which keeps each token distributed as the target's.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import cached_property

from specserve.errors import ConfigError

# One bit per tree index, root included, in a 32-bit mask.
MAX_TREE_NODES = 31


def _bad(msg: str) -> ConfigError:
    return ConfigError("speculative_config.speculative_token_tree", msg)


def parse_tree(value) -> list[tuple[int, ...]]:
    """A tree given as a list of rank paths, or as that list's text (vLLM's form: "[(0,), (1,), (0, 0)]")."""
    if isinstance(value, str):
        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError) as e:
            raise _bad(f"is not a list of tuples of ranks ({e}); e.g. \"[(0,), (1,), (0, 0)]\"") from e
    if not isinstance(value, (list, tuple)) or not value:
        raise _bad("must be a non-empty list of paths of ranks, e.g. [(0,), (1,), (0, 0)]")
    paths = []
    for node in value:
        if not isinstance(node, (list, tuple)) or not node or not all(isinstance(r, int) and r >= 0 for r in node):
            raise _bad(f"node {node!r} is not a non-empty tuple of ranks >= 0")
        paths.append(tuple(node))
    return paths


@dataclass(frozen=True)
class DraftTree:
    """The nodes of a tree of drafts in breadth-first order (see the module docstring)."""

    paths: tuple[tuple[int, ...], ...]

    @classmethod
    def build(cls, value) -> DraftTree:
        paths = parse_tree(value)
        known = set(paths)
        if len(known) != len(paths):
            raise _bad("lists a node twice")
        if len(paths) > MAX_TREE_NODES:
            raise _bad(f"has {len(paths)} nodes; at most {MAX_TREE_NODES} fit (one bit per node in the attention "
                       "mask)")
        for p in paths:
            if len(p) > 1 and p[:-1] not in known:
                raise _bad(f"node {p} has no parent {p[:-1]}: list every prefix of a path")
        return cls(tuple(sorted(paths, key=lambda p: (len(p), p))))

    @property
    def num_nodes(self) -> int:
        """Drafts per step (the root not counted)."""
        return len(self.paths)

    @property
    def depth(self) -> int:
        return len(self.paths[-1])

    @cached_property
    def parents(self) -> tuple[int, ...]:
        """Index of each index's parent (root: 0)."""
        index = {p: i + 1 for i, p in enumerate(self.paths)}
        return (0,) + tuple(index.get(p[:-1], 0) for p in self.paths)

    @cached_property
    def depths(self) -> tuple[int, ...]:
        return (0,) + tuple(len(p) for p in self.paths)

    @cached_property
    def ranks(self) -> tuple[int, ...]:
        """The rank each draft takes among its parent's guesses (root: 0)."""
        return (0,) + tuple(p[-1] for p in self.paths)

    @cached_property
    def ancestor_bits(self) -> tuple[int, ...]:
        """Bit j of entry i: index j is index i or one of its ancestors."""
        bits = [1]
        for i in range(1, self.num_nodes + 1):
            bits.append(bits[self.parents[i]] | 1 << i)
        return tuple(bits)

    def level(self, d: int) -> range:
        """The indices of depth d (depth 0: the root, index 0)."""
        return range(self.depths.index(d), len(self.depths) - self.depths[::-1].index(d))

    def top_k(self, d: int) -> int:
        """Guesses the drafter must rank at a parent of depth d - 1 for the nodes of depth d."""
        return 1 + max(self.ranks[i] for i in self.level(d))

    def depth_of_prefix(self, num_drafts: int) -> int:
        """Depth of the tree cut to its first num_drafts drafts."""
        return self.depths[num_drafts]

    def __str__(self) -> str:
        return str(list(self.paths))
