"""The verifier: decides which drafted tokens the target accepts, losslessly.

Names follow the papers and vLLM: ``p_target`` / ``q_draft``; an output is *accepted* draft
tokens, then one *recovered* token (drawn from norm(max(0, p - q)) at the first rejection) or,
when every draft token was accepted, one *bonus* token drawn from p at the position after the
draft. Each round therefore emits ``num_accepted + 1`` tokens.

- Greedy (temperature 0): accept while draft == argmax p; the token at the stop position is
  argmax p. Output is token-identical to plain greedy decoding.
- Seeded sampling: the token the target draws at each output position is a function of its p
  there and Exp(1) draws fixed by the seed and the position (the exponential race argmax p / E:
  speclm.sampling.PositionNoise). The rule is then greedy's with that draw in place of argmax p:
  accept while draft == the target's draw; the token at the stop position is the target's draw.
  Each token is an exact draw from p (its draws are fresh: no earlier position used them), and
  the output is the one plain seeded decoding gives, whatever was drafted: a draft, sampled or
  not, only decides how many positions one forward settles. For a deterministic draft the
  acceptance is p(x), as with the rule below. Sampled drafters draw a seeded request's tokens
  with the same noise (speclm.drafters.draft_model.draw), a Gumbel coupling of q and p: a draft
  is accepted when both races pick it, always when q = p, at most 1 - TV(p, q), the rule below's.
- Unseeded sampling (Leviathan et al. 2023, Chen et al. 2023): accept token x with probability
  min(1, p(x) / q(x)); on rejection draw from the residual. Deterministic drafters (prompt
  lookup) have one-hot q. The output distribution is exactly p.

Token trees (several candidates per position) use the multi-draft form of the same rule. At a
node, its children are tried in order: child c is accepted with probability min(1, p'(c) / q(c)),
where p' starts as the node's p and, after each rejected child, becomes norm(max(0, p' - q)); if
every child is rejected the next token is drawn from the final p'. With i.i.d. sampled children
(q = the parent's draft distribution) this is recursive rejection sampling; with deterministic
children (one-hot q) it reduces to: draw x from p and descend into the child whose token is x,
if there is one. Either way each emitted token is distributed exactly as the target's p.

An empty draft makes this plain decoding: one token sampled from p, which is how the baseline
shares every line of the sampler with speculation.

Structured outputs (speclm.structured) pass ``allowed``, the grammar's mask at every position of
the draft: the target's logits outside it become -inf before the warp (so p is the constrained
distribution, exactly what constrained plain decoding samples from), and a sampled draft's q is
masked the same way and renormalised (the draft tokens that reach the verifier are the allowed
ones, so the masked q is the distribution they were drawn from). The rules above are unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .drafters.base import Draft
from .sampling import SamplingParams, argmax_last, keyed_choice, sample_token, warp_probs
from .tree import TreeMeta


@dataclass
class Verdict:
    num_accepted: torch.Tensor  # [] int64, 0..depth: how many draft tokens were accepted
    tokens: torch.Tensor  # [k + 1] int64; the first num_accepted + 1 are the round's output
    path: torch.Tensor  # [k] int64 node indices; the first num_accepted are the accepted nodes
    #                     in order (a chain's path is 0, 1, 2, ...)


def acceptance_probs(p_at: torch.Tensor, q_at: torch.Tensor) -> torch.Tensor:
    """min(1, p/q) per drafted token ([k] -> [k]); q_at > 0 for any token the draft proposed."""
    return torch.clamp(p_at / q_at, max=1.0)


def residual_probs(p_target: torch.Tensor, q_draft: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) row-wise ([k, V] -> [k, V]).

    A row whose residual is all zero (p == q there, so rejection has probability 0 and only
    rounding can land us here) falls back to p.
    """
    residual = torch.clamp(p_target - q_draft, min=0.0)
    mass = residual.sum(-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_target)


def constrain(target_logits: torch.Tensor, draft: Draft, allowed: torch.Tensor | None) -> tuple[torch.Tensor, Draft]:
    """Apply a grammar's mask (``allowed`` [k + 1, V] bool, row i + 1 = after draft node i) to
    the target's logits (-inf outside it) and to a sampled draft's q (masked by the row of the
    node's parent, renormalised). Without a mask, both come back unchanged."""
    if allowed is None:
        return target_logits, draft
    target_logits = target_logits.masked_fill(~allowed, float("-inf"))  # [k + 1, V]
    if draft.q_draft is None:
        return target_logits, draft
    if draft.tree is not None:  # [k]: the row whose distribution node i was drawn from
        parent_rows = (draft.tree.parents + 1).to(allowed.device)
    else:
        parent_rows = torch.arange(draft.num_tokens, device=allowed.device)
    q = draft.q_draft * allowed[parent_rows, : draft.q_draft.shape[-1]]  # [k, V]
    q = q / q.sum(-1, keepdim=True).clamp_min(1e-30)
    return target_logits, Draft(draft.tokens, q, draft.tree)


def target_choice(target_logits: torch.Tensor, params: SamplingParams,
                  noise: torch.Tensor | None) -> torch.Tensor:
    """The target's own token per row ([N, V] -> [N]): argmax p (greedy), or a seeded request's
    keyed draw with ``noise`` [N, V] (the draws of the output position each row predicts)."""
    if params.greedy:
        return argmax_last(target_logits)
    return keyed_choice(warp_probs(target_logits, params), noise)


def verify(
    target_logits: torch.Tensor, draft: Draft, params: SamplingParams, generator: torch.Generator,
    allowed: torch.Tensor | None = None, noise: torch.Tensor | None = None,
) -> Verdict:
    """Judge ``draft`` against the target.

    target_logits: [k + 1, V] where row i is the target's prediction for the position of draft
    token i (row k predicts the position after the draft, used for the bonus token).
    allowed: [k + 1, V] bool or None: a grammar's mask per row (structured outputs).
    noise: [depth + 1, V] or None: a seeded sampling request's draws for the round's output
    positions (speclm.sampling.PositionNoise, from the first position this round commits); the
    round is then judged by the target's keyed draws (module docstring).
    """
    target_logits, draft = constrain(target_logits, draft, allowed)
    keyed = params.greedy or noise is not None  # judged by the target's own choice per row
    if draft.tree is not None:
        return _verify_tree(target_logits, draft, params, generator, noise, keyed)
    draft_tokens = draft.tokens  # [k]
    k = draft_tokens.shape[0]
    chain_path = torch.arange(k, device=draft_tokens.device)
    if keyed:
        row_noise = None if noise is None else noise[: k + 1]  # [k + 1, V]
        choice = target_choice(target_logits, params, row_noise)  # [k + 1]
        matches = draft_tokens == choice[:k]
        num_accepted = matches.to(torch.long).cumprod(0).sum()
        # accepted tokens equal the target's choice, and so does the recovered/bonus token
        return Verdict(num_accepted, choice, chain_path)

    p_target = warp_probs(target_logits, params)  # [k + 1, V]
    if draft.q_draft is None:  # deterministic draft: one-hot q
        q_draft = torch.nn.functional.one_hot(draft_tokens, p_target.shape[-1]).to(p_target.dtype)
    else:
        q_draft = draft.q_draft.to(p_target.dtype)  # [k, V]
    index = draft_tokens.unsqueeze(1)  # [k, 1]
    p_at = p_target[:k].gather(1, index).squeeze(1)  # [k]
    q_at = q_draft.gather(1, index).squeeze(1)  # [k]
    u = torch.rand(k, generator=generator, dtype=p_target.dtype, device=p_target.device)
    accepted = u < acceptance_probs(p_at, q_at)  # [k]
    num_accepted = accepted.to(torch.long).cumprod(0).sum()

    # row i < k: where to draw the recovered token if i is the first rejection; row k: bonus.
    final_dist = torch.cat([residual_probs(p_target[:k], q_draft), p_target[k:]])  # [k + 1, V]
    chosen = final_dist.index_select(0, num_accepted.view(1))  # [1, V]
    final_token = sample_token(chosen, generator)  # [1]
    tokens = torch.cat([draft_tokens, draft_tokens.new_zeros(1)])  # [k + 1]
    tokens = tokens.scatter(0, num_accepted.view(1), final_token)
    return Verdict(num_accepted, tokens, chain_path)


def _verify_tree(
    target_logits: torch.Tensor, draft: Draft, params: SamplingParams, generator: torch.Generator,
    noise: torch.Tensor | None, keyed: bool,
) -> Verdict:
    """Multi-draft verification of a token tree; target_logits row 0 is the pending token's,
    row i + 1 node i's. ``keyed``: judged by the target's own choice per row (greedy, or seeded
    with ``noise`` [max depth + 1, V]: row i + 1 predicts the output position at node i's depth).
    No host sync: the loops run over the tree's host-side shape only."""
    tree: TreeMeta = draft.tree
    device = target_logits.device
    tokens = draft.tokens  # [k]
    k = tokens.shape[0]
    parent_row = (tree.parents + 1).to(device)  # [k] the row that judges each node
    depth = tree.depth.to(device)  # [k]
    if keyed:
        rows_depth = torch.cat([depth.new_zeros(1), depth])  # [k + 1]: the depth each row predicts, less 1
        row_noise = None if noise is None else noise[rows_depth]  # [k + 1, V]
        target_argmax = target_choice(target_logits, params, row_noise)  # [k + 1]
        matches = tokens == target_argmax[parent_row]  # [k]
        num_accepted, best = tree.deepest_match(matches)  # the deepest accepted node (one per depth)
        final_token = target_argmax[torch.where(num_accepted > 0, best + 1, 0)]
        in_path = tree.ancestors.to(device)[best] & (num_accepted > 0)  # [k]
        path = torch.argsort(torch.where(in_path, depth, k + 1))  # accepted nodes first, by depth
        out = torch.cat([tokens[path], tokens.new_zeros(1)]).scatter(0, num_accepted.view(1), final_token.view(1))
        return Verdict(num_accepted, out, path)

    p_cur = warp_probs(target_logits, params)  # [k + 1, V], becomes the residual as children fail
    if draft.q_draft is None:
        q_nodes = torch.nn.functional.one_hot(tokens, p_cur.shape[-1]).to(p_cur.dtype)  # [k, V]
    else:
        q_nodes = draft.q_draft.to(p_cur.dtype)
    child = tree.children.to(device)  # [k + 1, B] children per row, in the order they are tried
    slots = child.shape[1]
    u = torch.rand(k + 1, slots, generator=generator, dtype=p_cur.dtype, device=device)
    accepted_child = torch.full((k + 1,), -1, dtype=torch.long, device=device)  # [k + 1]
    for j in range(slots):  # try the j-th child of every row at once
        c = child[:, j]  # [k + 1]
        safe = c.clamp(min=0)
        tok = tokens[safe].unsqueeze(1)  # [k + 1, 1]
        q_rows = q_nodes[safe]  # [k + 1, V]
        ratio = acceptance_probs(p_cur.gather(1, tok).squeeze(1), q_rows.gather(1, tok).squeeze(1))
        trying = (c >= 0) & (accepted_child < 0)
        accepted = trying & (u[:, j] < ratio)
        accepted_child = torch.where(accepted, c, accepted_child)
        rejected = trying & ~accepted
        p_cur = torch.where(rejected.unsqueeze(1), residual_probs(p_cur, q_rows), p_cur)
    final_per_row = sample_token(p_cur, generator)  # [k + 1]: recovered, or bonus at a leaf
    row = torch.zeros((), dtype=torch.long, device=device)
    alive = torch.ones((), dtype=torch.bool, device=device)
    path_nodes = []
    for _ in range(tree.max_depth):  # follow accepted children down from the pending token
        nxt = accepted_child[row]
        alive = alive & (nxt >= 0)
        path_nodes.append(torch.where(alive, nxt, -1))
        row = torch.where(alive, nxt + 1, row)
    path = torch.stack(path_nodes) if path_nodes else torch.empty(0, dtype=torch.long, device=device)
    num_accepted = (path >= 0).sum()
    path = torch.cat([path, path.new_full((k - path.shape[0],), -1)]).clamp(min=0)  # [k]
    out = torch.cat([tokens[path], tokens.new_zeros(1)]).scatter(0, num_accepted.view(1), final_per_row[row].view(1))
    return Verdict(num_accepted, out, path)
