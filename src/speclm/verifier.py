"""The verifier: decides which drafted tokens the target accepts, losslessly.

Names follow the papers and vLLM: ``p_target`` / ``q_draft``; an output is *accepted* draft
tokens, then one *recovered* token (drawn from norm(max(0, p - q)) at the first rejection) or,
when every draft token was accepted, one *bonus* token drawn from p at the position after the
draft. Each round therefore emits ``num_accepted + 1`` tokens.

- Greedy (temperature 0): accept while draft == argmax p; the token at the stop position is
  argmax p. Output is token-identical to plain greedy decoding.
- Sampling (Leviathan et al. 2023, Chen et al. 2023): accept token x with probability
  min(1, p(x) / q(x)); on rejection draw from the residual. Deterministic drafters (prompt
  lookup) have one-hot q. The output distribution is exactly p.

An empty draft makes this plain decoding: one token sampled from p, which is how the baseline
shares every line of the sampler with speculation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .drafters.base import Draft
from .sampling import SamplingParams, sample_token, warp_probs


@dataclass
class Verdict:
    num_accepted: torch.Tensor  # [] int64, 0..k: how many draft tokens were accepted
    tokens: torch.Tensor  # [k + 1] int64; the first num_accepted + 1 are the round's output


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


def verify(
    target_logits: torch.Tensor, draft: Draft, params: SamplingParams, generator: torch.Generator
) -> Verdict:
    """Judge ``draft`` against the target.

    target_logits: [k + 1, V] where row i is the target's prediction for the position of draft
    token i (row k predicts the position after the draft, used for the bonus token).
    """
    draft_tokens = draft.tokens  # [k]
    k = draft_tokens.shape[0]
    if params.greedy:
        target_argmax = target_logits.argmax(-1)  # [k + 1]
        matches = draft_tokens == target_argmax[:k]
        num_accepted = matches.to(torch.long).cumprod(0).sum()
        # accepted tokens equal the argmax, and so does the recovered/bonus token
        return Verdict(num_accepted, target_argmax)

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
    return Verdict(num_accepted, tokens)
