"""Token trees: the shape of a draft that proposes several continuations at once.

A tree of k draft tokens is given by ``parents`` ([k] int64, on the host): node i continues node
``parents[i]``, or the pending token (the last committed one) when ``parents[i] == -1``. Nodes are
in topological order (``parents[i] < i``), so a parent always comes before its children. A chain
is the tree whose parents are ``[-1, 0, 1, ..., k-2]``; everything here treats it as one.

The target runs ``[pending, node_0 .. node_{k-1}]`` in one forward. Row 0 of its output is the
pending token's, row ``i + 1`` is node i's; node i sits at position ``pending + depth[i]`` and
attends to the committed context, the pending token and its own ancestors (the tree mask).
In a cache the tree is laid out the same way: the pending token's slot, then node i at the slot
after it plus i. A drafter that grows a tree level by level feeds only the newest nodes: the
last T rows of that layout, whose earlier rows are already cached.

Example: parents [-1, -1, 0, 0, 1] is the tree

    pending ─┬─ n0 ─┬─ n2
             │      └─ n3
             └─ n1 ─── n4

with depth [1, 1, 2, 2, 2].
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class TreeMeta:
    """Host-side metadata of a draft tree, computed once per round."""

    parents: torch.Tensor  # [k] int64, -1 = the pending token; parents[i] < i
    depth: torch.Tensor  # [k] int64, >= 1: tokens between the pending token and the node, inclusive
    ancestors: torch.Tensor  # [k, k] bool: ancestors[i, j] = node j is node i or an ancestor of it
    children: torch.Tensor  # [k + 1, B] int64: row 0 the pending token's children, row i + 1
    #                         node i's, in node order, padded with -1 (B = most children of a row)
    max_depth: int  # the longest root-to-leaf chain (0 for an empty tree)

    @property
    def num_nodes(self) -> int:
        return int(self.parents.shape[0])

    @property
    def num_children(self) -> torch.Tensor:
        """[k + 1] int64: how many children the pending token and each node have."""
        return (self.children >= 0).sum(1)

    @property
    def is_chain(self) -> bool:
        return bool(torch.equal(self.parents, torch.arange(-1, self.num_nodes - 1)))

    @staticmethod
    def from_parents(parents: torch.Tensor | list[int]) -> TreeMeta:
        # Host metadata of a few dozen nodes, built with numpy: a tree drafter builds one per
        # level it grows, and in torch the same two dozen small ops cost ~0.3 ms a tree
        p = np.asarray(torch.as_tensor(parents, dtype=torch.long, device="cpu"), dtype=np.int64).reshape(-1)  # [k]
        k = p.shape[0]
        index = np.arange(k)
        if k and not ((p >= -1) & (p < index)).all():
            raise ValueError(f"tree parents must satisfy -1 <= parents[i] < i, got {p.tolist()}")
        # ancestors by repeated squaring of the parent relation: log2(k) boolean matrix products
        ancestors = np.eye(k, dtype=bool)  # [k, k]
        has_parent = p >= 0
        ancestors[index[has_parent], p[has_parent]] = True
        for _ in range(max(1, k).bit_length()):
            as_float = ancestors.astype(np.float32)
            ancestors = np.dot(as_float, as_float) > 0
        depth = ancestors.sum(1, dtype=np.int64)  # ancestors-or-self = tokens from the pending one, exclusive
        # each node's slot among its siblings: how many earlier nodes share its parent
        order = np.argsort(p, kind="stable")  # [k] grouped by parent, node order within a group
        rank = np.empty(k, dtype=np.int64)  # [k]
        rank[order] = index - np.searchsorted(p[order], p[order])  # minus the group's first position
        width = int(rank.max()) + 1 if k else 0
        children = np.full((k + 1, width), -1, dtype=np.int64)
        children[p + 1, rank] = index
        return TreeMeta(torch.from_numpy(p), torch.from_numpy(depth), torch.from_numpy(ancestors),
                        torch.from_numpy(children), int(depth.max()) if k else 0)

    @staticmethod
    def chain(k: int) -> TreeMeta:
        """The one-branch tree of k nodes, built directly: catching up on a long prompt asks for
        chains of thousands of nodes, where ``from_parents``' matrix squaring would cost O(k^3 log k)."""
        index = torch.arange(k)
        # the pending token's child is node 0, node i's is node i + 1, the last has none
        children = torch.cat([index, torch.tensor([-1])]).view(k + 1, 1) if k else \
            torch.full((1, 0), -1, dtype=torch.long)
        return TreeMeta(index - 1, index + 1, torch.ones(k, k, dtype=torch.bool).tril(), children, k)

    def deepest_match(self, matches: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The deepest node whose path from the pending token matches everywhere, given which
        nodes match (``matches`` [k] bool, on any device; no host sync): ``(depth, node)``, 0-d
        int64 tensors, depth 0 (node 0) where no first-level node matches. With distinct tokens
        among each node's children at most one node per depth is on the matching path."""
        ancestors = self.ancestors.to(matches.device)
        on_path = ~(ancestors & ~matches).any(1)  # [k]: every ancestor-or-self matches
        return torch.where(on_path, self.depth.to(matches.device), 0).max(0)

    def positions(self, start: int, rows: int | None = None) -> torch.Tensor:
        """[T] positions of the last T = ``rows`` (default k + 1) entries of [pending, nodes...]
        when the pending token sits at position ``start``."""
        full = start + torch.cat([torch.zeros(1, dtype=torch.long), self.depth])  # [k + 1]
        return full[-(rows or full.shape[0]):]

    def attention_bias(self, past: int, dtype: torch.dtype, device: torch.device,
                       rows: int | None = None) -> torch.Tensor:
        """[1, 1, T, past + k + 1] additive mask for a forward of the last T = ``rows`` (default
        k + 1) entries of [pending, nodes...]: 0 where a query may attend, the dtype's minimum
        elsewhere. ``past`` is the number of committed slots before the pending token's; every
        row sees them and the pending token; a node also sees its ancestors and itself."""
        k = self.num_nodes
        rows = rows or k + 1
        allowed = np.ones((k + 1, past + k + 1), dtype=bool)
        allowed[0, past + 1 :] = False  # the pending token sees only the past and itself
        allowed[1:, past + 1 :] = self.ancestors.numpy()
        # built on the host in numpy (float64 for a float64 mask, else float32, which holds the
        # 16-bit types' minimum exactly), then cast
        wide = np.float64 if dtype == torch.float64 else np.float32
        bias = np.where(allowed[-rows:], wide(0), wide(torch.finfo(dtype).min))  # [T, past + k + 1]
        return torch.from_numpy(bias).to(device=device, dtype=dtype).view(1, 1, rows, past + k + 1)


def tree_from_paths(paths: list[list[int]]) -> tuple[list[int], list[tuple[int, ...]]]:
    """A static tree (Medusa-style) from a list of paths of choice indices.

    Each path names, per depth, which candidate (0 = best) to take; e.g. ``[[0], [1], [0, 0]]``
    is the top-2 first tokens and the best continuation of the first. Returns the parents list
    (paths sorted by depth, then lexicographically) and each node's path, so a drafter can look
    up which candidate each node takes. Missing prefixes are added.
    """
    nodes = {tuple(p[:d]) for p in paths for d in range(1, len(p) + 1)}
    ordered = sorted(nodes, key=lambda p: (len(p), p))
    index = {p: i for i, p in enumerate(ordered)}
    parents = [index[p[:-1]] if len(p) > 1 else -1 for p in ordered]
    return parents, ordered
