"""The one interface every drafter implements.

A drafter only *proposes*: it never decides what is accepted. The engine hands it the committed
tokens and a budget, it returns a :class:`Draft`, the verifier judges the draft against the target,
and the engine reports the verdict back through :meth:`Drafter.on_verified`.

A draft is a chain of tokens. Token trees (later) generalise it with a parent index per token; a
chain is the tree whose parents are ``[-1, 0, 1, ...]``, so the same verifier serves both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from ..sampling import SamplingParams


@dataclass
class DraftContext:
    """What a drafter may look at when proposing."""

    token_ids: torch.Tensor  # [n] committed tokens: prompt + output so far (a read-only view)
    max_tokens: int  # the most tokens this round may propose (K); 0 means "do not draft"
    params: SamplingParams  # the request's sampling params (draft models warp q with them)
    generator: torch.Generator  # the request's generator: all draft randomness comes from here


@dataclass
class Draft:
    """A proposal of k tokens continuing ``DraftContext.token_ids``."""

    tokens: torch.Tensor  # [k] int64 proposed token ids (k may be 0)
    q_draft: torch.Tensor | None = None  # [k, V] the warped distributions the tokens were drawn
    #                                     from; None for deterministic drafters (one-hot q)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    def to(self, device: torch.device) -> Draft:
        q = None if self.q_draft is None else self.q_draft.to(device)
        return Draft(self.tokens.to(device), q)

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
        """Called after each round in which ``propose`` was called: the draft's first ``num_accepted`` tokens were accepted; ``emitted`` are the
        tokens committed this round (accepted ones, then the recovered or bonus token)."""
