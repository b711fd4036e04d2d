"""The grammar's part of a speculative round: shaping the draft, masking the verify, committing.

The engine calls three functions per constrained row and round (speclm.engine):

1. :func:`guided_draft` (drafting). If the grammar forces the next tokens (a JSON key, ``": "``,
   a closing brace), they are the draft, and the drafter is not asked ("jump-forward"). Else the
   drafter's draft is cut at its first token the grammar forbids (the verifier would reject it:
   the target's masked p is 0 there), and a chain is extended by the tokens the grammar forces
   after it. A token tree loses the nodes the grammar forbids, with their descendants; trees are
   not extended.
2. :func:`draft_masks` (verifying): the allowed tokens at every position of the draft, [k + 1, V],
   from a walk of the matcher over the draft and back. The verifier sets the target's logits
   outside the mask to -inf before its warp, and masks and renormalises a sampled draft's q.
3. :func:`commit_round` (committing): the matcher advances over the emitted tokens, and the
   round's grammar figures go into the request's stats.

Why this stays lossless. Forced and pruned drafts are only drafts: the verifier judges them like
any other. Under greedy decoding the output is the argmax of the masked logits at every step,
so it is token-identical to constrained plain decoding. Under sampling, the rule at a position
needs the draft token to be distributed as the q the verifier uses, given everything that
decided which q that is: a drafter's token that survived the cut was drawn from its q given
that it is allowed, which is the masked, renormalised q; a forced token is deterministic (one-hot
q); whether the position holds one or the other depends only on the draft, never on the target's
randomness. So every emitted token is distributed as the masked, warped p: constrained plain
decoding's distribution. Forced tokens are the grammar's canonical tokenization of its forced
bytes; the model may prefer another tokenization of the same bytes, so they are verified, not
assumed (``RequestStats.forced_accepted`` counts how often they pass).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..drafters.base import Draft
from ..stats import RequestStats
from ..tree import TreeMeta
from .matcher import GrammarMatcher, unpack


@dataclass
class GrammarRound:
    """What the grammar did to one round's draft (kept on the matcher until the commit)."""

    forced_start: int = 0  # draft index of the first forced token
    forced: int = 0  # forced tokens drafted from there (a chain)
    rejected: int = 0  # drafter tokens (tree nodes) the grammar cut off


def guided_draft(matcher: GrammarMatcher, propose: Callable[[], tuple[Draft, bool]],
                 limit: int) -> tuple[Draft, bool]:
    """The round's draft under the grammar, and whether the drafter was asked. ``propose`` asks
    the drafter (or not, for a plain step); ``limit``: the most draft tokens the round may hold."""
    forced = matcher.forced(limit)
    if forced:  # jump-forward: no drafter call
        matcher.round = GrammarRound(0, len(forced))
        return Draft(torch.tensor(forced, dtype=torch.long)), False
    draft, asked = propose()
    if draft.num_tokens == 0:
        matcher.round = GrammarRound()
        return draft, asked
    if draft.tree is not None:
        return _prune_tree(matcher, draft), asked
    tokens = draft.tokens.tolist()  # a host copy: the grammar lives on the host
    n = matcher.advance(tokens)  # up to the first token the grammar forbids
    extra = matcher.forced(limit - n)  # what the grammar forces after the kept draft
    matcher.rollback(n)
    matcher.round = GrammarRound(n, len(extra), len(tokens) - n)
    if n == len(tokens) and not extra:
        return draft, asked
    out = torch.tensor(tokens[:n] + extra, dtype=torch.long, device=draft.tokens.device)  # [n + f]
    q = draft.q_draft
    if q is not None:  # a forced token is deterministic: a one-hot row
        q = torch.cat([q[:n], F.one_hot(torch.tensor(extra, dtype=torch.long, device=q.device),
                                         q.shape[-1]).to(q.dtype)])  # [n + f, V]
    return Draft(out, q), asked


def drafter_accepted(matcher: GrammarMatcher | None, num_accepted: int) -> int:
    """How many of the drafter's own tokens the round accepted. Where the grammar cut the
    drafter's chain and extended it by forced tokens, the draft past the cut is not the
    drafter's: a stateful drafter (a draft model's cache) must keep only its tokens before it."""
    r = matcher.round if matcher is not None else None
    if r is None or not r.forced:
        return num_accepted
    return min(num_accepted, r.forced_start)


def draft_masks(matcher: GrammarMatcher, draft: Draft) -> torch.Tensor:
    """[k + 1, V] bool: row 0 the tokens allowed after the committed output, row i + 1 those
    allowed after draft node i (a chain: after its first i + 1 tokens)."""
    tokens = draft.tokens.tolist()
    if draft.tree is None:
        return matcher.masks_along(tokens)
    _, masks = _walk_tree(matcher, tokens, draft.tree.parents.tolist(), masks=True)
    return masks


def commit_round(matcher: GrammarMatcher, emitted: list[int], accepted: int, drafted: int,
                 stats: RequestStats) -> tuple[list[int], bool]:
    """Advance over the round's emitted tokens and record its figures. Returns the tokens that
    belong to the output (none past the grammar's end) and whether the grammar is finished.
    ``drafted``: the draft's length as verified (a batch cap may have cut forced tokens)."""
    r = matcher.round or GrammarRound()
    matcher.round = None
    forced = max(0, min(r.forced_start + r.forced, drafted) - r.forced_start)
    stats.forced_tokens += forced
    stats.forced_accepted += max(0, min(accepted - r.forced_start, forced))
    stats.grammar_rejected_tokens += r.rejected
    keep = matcher.commit(emitted)
    return emitted[:keep], matcher.stopped


def _prune_tree(matcher: GrammarMatcher, draft: Draft) -> Draft:
    """The draft tree without the nodes the grammar forbids (and their descendants). Lossless for
    sampled trees too: the allowed children of a node, however many, are i.i.d. draws from the
    parent's q restricted to the grammar, which is the q the verifier uses."""
    tokens = draft.tokens.tolist()
    parents = draft.tree.parents.tolist()
    valid, _ = _walk_tree(matcher, tokens, parents, masks=False)
    kept = [i for i, ok in enumerate(valid) if ok]
    matcher.round = GrammarRound(rejected=len(tokens) - len(kept))
    if len(kept) == len(tokens):
        return draft
    if not kept:
        return Draft.empty(draft.tokens.device)
    index = {old: new for new, old in enumerate(kept)}
    new_parents = [index[parents[i]] if parents[i] >= 0 else -1 for i in kept]
    keep = torch.tensor(kept, dtype=torch.long, device=draft.tokens.device)
    q = None if draft.q_draft is None else draft.q_draft.index_select(0, keep.to(draft.q_draft.device))
    return Draft(draft.tokens.index_select(0, keep), q, TreeMeta.from_parents(new_parents))


def _walk_tree(matcher: GrammarMatcher, tokens: list[int], parents: list[int], *,
               masks: bool) -> tuple[list[bool], torch.Tensor | None]:
    """Visit the nodes in order with the matcher at each node's path: which nodes the grammar
    allows (a forbidden node's descendants are forbidden too) and, with ``masks``, [k + 1, V]
    allowed tokens at the root and after each node (rows of forbidden nodes: the root's). The
    matcher moves only between neighbouring paths, O(depth) per node, and ends where it began."""
    valid = [False] * len(tokens)
    path: list[int] = []  # nodes whose tokens the matcher has consumed, root first
    words = matcher.buffer(len(tokens) + 1) if masks else None  # [k + 1, W] bitmasks
    if masks:
        matcher.fill(words, 0)
    for i, parent in enumerate(parents):
        if parent >= 0 and not valid[parent]:
            continue
        line = []  # the node's ancestors, root first
        node = parent
        while node >= 0:
            line.append(node)
            node = parents[node]
        line.reverse()
        common = 0
        while common < min(len(path), len(line)) and path[common] == line[common]:
            common += 1
        matcher.rollback(len(path) - common)
        matcher.advance([tokens[j] for j in line[common:]])  # all allowed: checked on the way
        path = line
        if matcher.advance([tokens[i]]) == 1:
            valid[i] = True
            path = line + [i]
            if masks:
                matcher.fill(words, i + 1)
    matcher.rollback(len(path))
    if not masks:
        return valid, None
    words[1:][~torch.tensor(valid, dtype=torch.bool)] = words[0]  # forbidden nodes: the root's
    return valid, matcher.check(unpack(words, matcher.vocab_size))
