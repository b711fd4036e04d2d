"""One request's state inside the batched engine."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..drafters.base import Drafter
from ..sampling import SamplingParams
from ..stats import RequestStats


@dataclass
class Sequence:
    """A request being decoded: its tokens, its own generator and drafter, and its stats.

    Invariant (as in the solo engine): the batch cache row holds every committed token but the
    last, the *pending* token, so ``cache length == n - 1`` between steps.
    """

    request_id: str
    params: SamplingParams
    generator: torch.Generator  # the request's only source of randomness
    drafter: Drafter | None
    tokens: torch.Tensor  # [limit] int64: prompt, then committed output
    n: int  # committed tokens (prompt included)
    prompt_len: int
    limit: int  # n never exceeds this: min(context, prompt + max_tokens)
    stats: RequestStats
    alpha: float = 0.6  # measured per-token acceptance (EMA), for the draft-length policy
    generated: int = 0
    finish_reason: str | None = None
    aborted: bool = False
    arrival: float = field(default_factory=time.perf_counter)

    @property
    def committed(self) -> torch.Tensor:
        return self.tokens[: self.n]  # [n]

    @property
    def fixed_draft(self) -> bool:
        """Seeded sampling: the draft must not depend on the batch (see BatchEngine)."""
        return not self.params.greedy and self.params.seed is not None

    @property
    def budget(self) -> int:
        """Tokens this request may still commit."""
        return min(self.params.max_tokens - self.generated, self.limit - self.n)
