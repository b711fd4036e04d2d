"""The one interface every drafter implements.

A drafter only *proposes*: it never decides what is accepted. The engine hands it the committed
tokens and a budget, it returns a :class:`Draft`, the verifier judges the draft against the target,
and the engine reports the verdict back through :meth:`Drafter.on_verified`.

A draft is a chain of tokens, or a token tree (:class:`~speclm.tree.TreeMeta`: a parent index per
token). A chain is the tree whose parents are ``[-1, 0, 1, ...]``, so one verifier serves both.

Optional members, looked up with ``getattr`` so that a drafter without them costs nothing:

- ``feature_layers: tuple[int, ...]``: indices into the target's hidden states (0 = embeddings,
  -1 = the last layer after the final norm) that the drafter reads. The engine then calls
  ``on_target_features(features)`` with ``[T, len(feature_layers) * H]`` for every position it
  commits, in order: the prompt's positions after prefill (all but the pending token), then, each
  round before ``on_verified``, the pending token's and the accepted tokens' positions.
- ``wants_target_topk: int`` (> 0) asks for the target's own top candidates. After every round
  (drafted or not) the engine calls ``on_target_topk(fed, topk_ids)`` with the tokens the target
  ran (``fed`` [k + 1], on the CPU) and the ids of its ``wants_target_topk`` most likely next
  tokens after each of them (``topk_ids`` [k + 1, t], on the target's device). The top-k is taken
  on the device before the round's one host sync, so asking adds no sync; not asking adds no work.
  Token recycling learns its candidate table from this.
- ``parallel_tokens: int`` (> 0): the drafter proposes up to this many tokens per round in one
  forward of its own (a head trained for parallel drafting), so a round's draft costs about the
  same whatever its length; the adaptive draft length then charges drafting per round, not per
  token, and asks for at most this many.
- ``max_draft_tokens: int``: the most tokens one draft may hold where that exceeds the round's
  K (a token tree's node budget). The compiled path compiles its steps for verifies of up to
  ``1 + max(K, max_draft_tokens)`` tokens before the first request, not inside one.
- ``probing: bool``: True while the drafter measures candidates of its own, plain decoding
  among them (``auto``); the adaptive draft length then leaves K = 0 to it.
- ``on_prefill(held)``: called after each chunk of the prompt the target prefills, with the
  prompt tokens its cache now holds (``[n]``; all but the pending token at the end). A drafter
  with a cache of its own prefills the same chunk here rather than the whole prompt in ``reset``.
  The engine skips it while the batch policy finds that no draft pays at the batch's size (the
  drafters sit out), so such a drafter catches up on whatever it missed when next asked to propose.
- ``finish()``: called when a request ends, however it ends (a drafter with worker threads
  stops them here, so that none outlives the request).
- ``report() -> dict``: a few figures about the request that just ended (which drafter an
  automatic choice used, a layer set, an index size), copied into ``RequestStats.drafter_report``.
- ``observe(token_ids)``: the final tokens (prompt + output) of the request this drafter was last
  reset for, rounds it was not asked to draft included. Wrappers that choose among drafters call
  it so that drafters which learn from the session's text (suffix matching) see every token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from ..sampling import SamplingParams
from ..tree import TreeMeta


@dataclass
class DraftContext:
    """What a drafter may look at when proposing."""

    token_ids: torch.Tensor  # [n] committed tokens: prompt + output so far (a read-only view)
    max_tokens: int  # the longest chain (tree depth) this round may propose (K); 0: do not draft
    params: SamplingParams  # the request's sampling params (draft models warp q with them)
    generator: torch.Generator  # the request's generator: all draft randomness comes from here
    slot: int = 0  # the row's cache slot in the target's rows this step (drafters that run the
    #               target's own layers on its batched cache read it; slots move between steps)
    verify_s: Callable[[int], float] | None = None  # seconds the target's forward is expected to
    #               take verifying n drafted tokens of this row (measured); a tree drafter keeps
    #               the nodes that pay for it. None: keep the configured size (fixed drafts, or
    #               no cost known yet)
    noise: Callable[[int], torch.Tensor] | None = None  # depth -> [V]: a seeded request's draws
    #               for the round's position ``depth`` (speclm.sampling.PositionNoise), made
    #               only when a drafter samples; a chain drawn with them (keyed_choice) agrees
    #               with the target's own draws wherever q is close to p. None: use ``generator``


@dataclass
class Draft:
    """A proposal of k tokens continuing ``DraftContext.token_ids``: a chain, or a tree.

    ``q_draft`` row i is the warped distribution node i was *sampled* from; siblings must be
    independent draws from their parent's distribution (the multi-draft rule assumes it). Drafters
    that pick tokens deterministically (argmax, top-k children, lookups) pass None: one-hot q.
    """

    tokens: torch.Tensor  # [k] int64 proposed token ids (k may be 0)
    q_draft: torch.Tensor | None = None  # [k, V] or None (deterministic: one-hot q)
    tree: TreeMeta | None = None  # None: a chain, token i continues token i - 1

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def depth(self) -> int:
        """The longest chain in the draft: the most draft tokens one round can accept."""
        return self.num_tokens if self.tree is None else self.tree.max_depth

    def to(self, device: torch.device) -> Draft:
        q = None if self.q_draft is None else self.q_draft.to(device)
        return Draft(self.tokens.to(device), q, self.tree)

    @staticmethod
    def empty(device: torch.device | str = "cpu") -> Draft:
        return Draft(torch.empty(0, dtype=torch.long, device=device))


@runtime_checkable
class Drafter(Protocol):
    """propose -> (target verifies) -> on_verified, once per round; reset between requests."""

    def reset(self, prompt_ids: torch.Tensor) -> None:
        """Start a new request whose prompt is ``prompt_ids`` ([n] int64)."""

    def propose(self, ctx: DraftContext) -> Draft:
        """Propose up to ``ctx.max_tokens`` tokens continuing ``ctx.token_ids``."""

    def on_verified(self, num_accepted: int, emitted: list[int]) -> None:
        """Called after each round in which ``propose`` was called: the draft's first
        ``num_accepted`` tokens were accepted; ``emitted`` are the tokens committed this round
        (accepted ones, then the recovered or bonus token). Under a grammar that replaced the
        draft's tail by forced tokens, ``num_accepted`` counts the drafter's own tokens only and
        ``emitted`` may hold more than ``num_accepted + 1`` tokens (the accepted forced ones)."""


def wanted_target_topk(drafter: object | None) -> int:
    """How many target candidates per position ``drafter`` asks for (0: none; see above)."""
    return max(0, int(getattr(drafter, "wants_target_topk", 0) or 0)) if drafter is not None else 0


def parallel_tokens(drafter: object | None) -> int:
    """Tokens ``drafter`` proposes in one forward per round (0: one forward per token; see above)."""
    return max(0, int(getattr(drafter, "parallel_tokens", 0) or 0)) if drafter is not None else 0


def max_draft_tokens(drafter: object | None, draft_max: int) -> int:
    """The most tokens a round of ``drafter`` may ask the target to verify beyond the pending
    one, with a draft cap of ``draft_max``: its tree budget where it has one."""
    own = int(getattr(drafter, "max_draft_tokens", 0) or 0) if drafter is not None else 0
    return max(draft_max, own)


def drafter_report(drafter: object | None) -> dict | None:
    """The drafter's ``report()`` for the request that just ended, if it has one."""
    report = getattr(drafter, "report", None)
    return report() if callable(report) else None
