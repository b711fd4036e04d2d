"""One request's state inside the engine: its tokens, generator, drafter, policy and stats."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .draft_length import DraftLengthPolicy
from .drafters.base import Drafter, drafter_report
from .sampling import PositionNoise, SamplingParams
from .stats import RequestStats
from .structured.matcher import GrammarMatcher


@dataclass
class Sequence:
    """A request being decoded.

    Invariant: once prefilled, the request's cache slot holds every committed token but the
    last, the *pending* token, so ``slot length == n - 1`` between steps. While ``prefilled <
    n - 1`` the prompt is still being fed, a chunk per step.
    """

    request_id: str
    params: SamplingParams
    generator: torch.Generator  # the request's only source of randomness
    drafter: Drafter | None  # set when the request gets its slot (None: plain decoding)
    tokens: torch.Tensor  # [limit] int64: prompt, then committed output
    n: int  # committed tokens (prompt included)
    limit: int  # n never exceeds this: min(context, prompt + max_tokens)
    stats: RequestStats
    policy: DraftLengthPolicy | None = None  # this request's own draft length (K) choice
    slot: int = -1
    prefilled: int = 0  # positions in the cache slot (prompt, then committed tokens)
    alpha: float = 0.6  # measured per-token acceptance (EMA), for the batch's draft cap
    generated: int = 0
    finish_reason: str | None = None
    aborted: bool = False
    closed: bool = False
    own_drafter: bool = False  # given with the request (reset here) rather than built for it
    grammar: GrammarMatcher | None = None  # structured outputs: follows the committed output
    arrival: float = field(default_factory=time.perf_counter)
    noise: PositionNoise | None = None  # a seeded request's draws per output position
    #   (speclm.sampling.PositionNoise); None: greedy or unseeded

    @property
    def committed(self) -> torch.Tensor:
        return self.tokens[: self.n]  # [n]

    @property
    def decoding(self) -> bool:
        """Prefill done: the row drafts and verifies."""
        return self.prefilled >= self.n - 1

    def round_noise(self, depth: int) -> torch.Tensor | None:
        """A seeded sampling request's draws for the output positions a round of draft ``depth``
        may commit ([depth + 1, V]), or None (greedy, unseeded)."""
        if self.noise is None:
            return None
        return self.noise.rows(self.generated, depth + 1)

    def noise_at(self, depth: int) -> torch.Tensor:
        """The draws of the output position ``depth`` past the round's first ([V]; seeded only)."""
        return self.noise.row(self.generated + depth)

    @property
    def budget(self) -> int:
        """Tokens this request may still commit."""
        return min(self.params.max_tokens - self.generated, self.limit - self.n)

    def close(self) -> None:
        """The request ended (finished, aborted or failed): stop the drafter's workers, and
        complete the stats."""
        if self.closed:
            return
        self.closed = True
        finish = getattr(self.drafter, "finish", None)
        if callable(finish):  # a drafter's worker threads never outlive the request
            finish()
        self.stats.total_time_s = time.perf_counter() - self.arrival
        self.stats.drafter_report = drafter_report(self.drafter)
