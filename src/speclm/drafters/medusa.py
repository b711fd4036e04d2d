"""Medusa drafting: K heads on the target's last hidden state propose a static token tree.

The heads share the target's LM head (Medusa's design), or use a reduced-vocabulary head.

After every round the engine hands over the target's last-layer hidden state at the last
position it ran (the one whose logits gave the new pending token). Head d's top candidates are
guesses for the token d places after the pending one, and a fixed tree (a list of paths of
candidate ranks, chosen from the heads' measured top-k accuracy when the drafter was trained)
says which combinations to verify. Candidates are top-k picks, so the verifier treats them as
deterministic: the output is the target's exactly.
"""

from __future__ import annotations

import heapq

import torch

from ..tree import TreeMeta, tree_from_paths
from .base import Draft, DraftContext


def best_static_tree(accuracy: list[list[float]], budget: int) -> list[list[int]]:
    """The ``budget`` paths with the highest estimated acceptance, where accuracy[d][r] is the
    chance head d's rank-r candidate is the target's token; a path's estimate is the product."""
    heads, ranks = len(accuracy), len(accuracy[0])
    frontier = [(-accuracy[0][r], (r,)) for r in range(ranks)]
    heapq.heapify(frontier)
    chosen: list[list[int]] = []
    while frontier and len(chosen) < budget:
        neg, path = heapq.heappop(frontier)
        chosen.append(list(path))
        if len(path) < heads:
            for r in range(ranks):
                heapq.heappush(frontier, (neg * accuracy[len(path)][r], path + (r,)))
    return chosen


class MedusaDrafter:
    feature_layers = (-1,)  # the last layer, after the final norm

    def __init__(self, heads, paths: list[list[int]]) -> None:
        self.heads = heads.eval()
        parents, nodes = tree_from_paths(paths)
        self.depth_of = torch.tensor([len(p) - 1 for p in nodes])  # [k] which head
        self.rank_of = torch.tensor([p[-1] for p in nodes])  # [k] which candidate of that head
        self.top = int(self.rank_of.max()) + 1
        # nodes are sorted by depth, so the tree cut at depth d is a prefix of them
        self.trees = {d: TreeMeta.from_parents(parents[: int((self.depth_of < d).sum())])
                      for d in range(1, heads.num_heads + 1)}
        self.last_hidden: torch.Tensor | None = None  # [H]

    @property
    def max_draft_tokens(self) -> int:
        """The static tree's nodes: see speclm.drafters.base."""
        return max(t.num_nodes for t in self.trees.values())

    def reset(self, prompt_ids: torch.Tensor) -> None:
        self.last_hidden = None

    def on_target_features(self, features: torch.Tensor) -> None:
        self.last_hidden = features[-1]

    @torch.inference_mode()
    def propose(self, ctx: DraftContext) -> Draft:
        if self.last_hidden is None or ctx.max_tokens <= 0:
            return Draft.empty(ctx.token_ids.device)
        depth = min(ctx.max_tokens, self.heads.num_heads)
        tree = self.trees[depth]
        param = next(self.heads.parameters())
        logits = self.heads(self.last_hidden.to(param.device, param.dtype))  # [K, N]
        candidates = self.heads.draft_to_target[torch.topk(logits, self.top, dim=-1).indices]  # [K, top]
        k = tree.num_nodes
        pick = (self.depth_of[:k].to(candidates.device), self.rank_of[:k].to(candidates.device))
        return Draft(candidates[pick], None, tree)

    def on_verified(self, num_accepted: int, emitted: list[int]) -> None:
        pass
