"""A prompt-lookup branch beside a tree drafter's own tree (``eagle:lookup=N`` and the like).

A learned head (or a draft model) predicts open-ended text well and text that repeats the
request poorly: on long documents (RAG, summarization, translation) a head trained on the
target's chat answers agrees least often, while prompt lookup (:mod:`.ngram`) agrees most often
there. Each round this wrapper asks both and merges their drafts into one token tree, a trie:
where the lookup's chain agrees with a path of the drafter's tree it shares those nodes, and its
remaining tokens hang below the deepest node they share. The target verifies the merged tree in
its one forward and the round keeps the longest accepted path, whichever drafter proposed it.

Losslessness: both drafts are deterministic (one-hot q: argmax or top-k children, a lookup), and
the merged tree has distinct tokens among each node's children, the case the verifier's rule for
deterministic siblings covers. A drafter that *samples* its draft (q given) is not merged: its
siblings must be independent draws from q, so the round verifies its draft alone.

Cost: a lookup costs microseconds, the extra nodes cost verify time. The wrapped drafter sizes
its own tree (:mod:`.tree_search`) for the verify cost *after* the lookup's nodes, so it keeps
only the nodes that still pay beside them.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..tree import TreeMeta
from .base import Draft, DraftContext, Drafter


def _tree(draft: Draft) -> TreeMeta:
    return draft.tree if draft.tree is not None else TreeMeta.chain(draft.num_tokens)


def shared_path(draft: Draft, chain: torch.Tensor) -> tuple[int, int]:
    """How far ``chain`` ([m] token ids from the pending token on) follows a path of ``draft``:
    ``(depth, node)``, the deepest node of the draft whose path from the root spells
    ``chain[:depth]`` (node -1 and depth 0 where even the first token differs)."""
    m = chain.shape[0]
    if not m or not draft.num_tokens:
        return 0, -1
    tree = _tree(draft)
    at_depth = chain.cpu()[(tree.depth - 1).clamp(max=m - 1)]  # [k] the chain's token at each node's depth
    depth, node = tree.deepest_match((tree.depth <= m) & (draft.tokens.cpu() == at_depth))
    return (int(depth), int(node)) if int(depth) else (0, -1)


def merge_chain(draft: Draft, chain: torch.Tensor) -> Draft:
    """``draft`` plus the deterministic ``chain`` [m] continuing the same pending token, as one
    tree whose first nodes are the draft's own, in order (node i of the draft keeps index i)."""
    matched, node = shared_path(draft, chain)
    if matched == chain.shape[0]:
        return draft  # the draft already holds the whole chain
    k, rest = draft.num_tokens, chain.shape[0] - matched
    # the chain's new tokens: the first hangs below the shared node, each next below the one before
    new = torch.cat([torch.tensor([node]), torch.arange(k, k + rest - 1)])  # [rest]
    tokens = torch.cat([draft.tokens, chain[matched:].to(draft.tokens.device)])  # [k + rest]
    return Draft(tokens, None, TreeMeta.from_parents(torch.cat([_tree(draft).parents, new])))


class LookupBranch:
    """``drafter``'s tree with ``lookup``'s chain of up to ``max_tokens`` merged in, every round.

    The wrapped drafter's optional members (features, prefill, report, finish, ...) are its own:
    attribute look-ups the wrapper does not answer go to it."""

    def __init__(self, drafter: Drafter, lookup: Drafter, max_tokens: int) -> None:
        self.drafter = drafter
        self.lookup = lookup
        self.max_tokens = max_tokens
        self._round: tuple[Draft, Draft] | None = None  # this round's (drafter's, lookup's) drafts
        self.branch_accepted = 0  # tokens accepted beyond the drafter's own, this request

    def __getattr__(self, name: str):
        if name in ("drafter", "lookup"):  # not set yet: no recursion
            raise AttributeError(name)
        return getattr(self.drafter, name)

    @property
    def max_draft_tokens(self) -> int:
        """The drafter's own node budget plus the branch's tokens: see speclm.drafters.base."""
        return int(getattr(self.drafter, "max_draft_tokens", 0) or 0) + self.max_tokens

    def reset(self, prompt_ids: torch.Tensor) -> None:
        self.drafter.reset(prompt_ids)
        self.lookup.reset(prompt_ids)
        self._round, self.branch_accepted = None, 0

    def propose(self, ctx: DraftContext) -> Draft:
        branch = self.lookup.propose(replace(ctx, max_tokens=min(ctx.max_tokens, self.max_tokens)))
        m = branch.num_tokens
        if m and ctx.verify_s is not None:  # the drafter prices its nodes after the branch's
            own_cost = ctx.verify_s
            ctx = replace(ctx, verify_s=lambda n: own_cost(n + m))
        draft = self.drafter.propose(ctx)
        if draft.q_draft is not None:  # sampled siblings must stay independent draws: alone
            branch = Draft.empty(draft.tokens.device)
        self._round = (draft, branch)
        return merge_chain(draft, branch.tokens) if branch.num_tokens else draft

    def on_verified(self, num_accepted: int, emitted: list[int]) -> None:
        if self._round is None:
            return
        draft, branch = self._round
        self._round = None
        path = torch.tensor(emitted[:num_accepted], dtype=torch.long)  # the accepted tokens
        own = shared_path(draft, path)[0]  # the drafter's tokens among them
        self.branch_accepted += num_accepted - own
        self.drafter.on_verified(own, emitted)
        self.lookup.on_verified(shared_path(branch, path)[0], emitted)

    def report(self) -> dict:
        inner = getattr(self.drafter, "report", None)
        own = inner() if callable(inner) else {}
        note = f"{self.branch_accepted} accepted tokens beyond the drafter's own, from the prompt-lookup branch"
        return {**own, "lookup_branch_accepted": self.branch_accepted,
                "summary": "; ".join(filter(None, [own.get("summary"), note]))}
