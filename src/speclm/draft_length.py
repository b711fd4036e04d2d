"""How many tokens to draft each round (K).

Adaptive mode (the default of the CLI, the API, the benchmark and the server) picks the K that
maximises expected tokens per second from measured quantities:

    E[tokens | K] = (1 - alpha^(K+1)) / (1 - alpha)       (Leviathan et al., i.i.d. acceptance)
    cost(K)       = verify(1 + K) + K * t_draft           (verify(1): a plain step; K = 0: no draft)

alpha is an exponential moving average of the per-token acceptance rate, started as a running
mean (a row's first rounds weigh 1/2, 1/3, ... against the prior, which counts as one round,
until the EMA's weight takes over: a blind prior of 0.6 would otherwise take a dozen rounds to
reach a drafter's 0.95, and a server's rows, drafting only in occasional probes while they do
not pay, would never get there), and t_draft the measured drafting time per token. A drafter
that proposes its whole draft in one forward (``parallel_tokens`` = N > 0,
speclm.drafters.base) costs about the same per round whatever K is, so for it the draft term is t_round (measured per round, not per token) and K <= N;
charging it per token would make a short round look dear per token and push K lower still.
``verify(T)`` comes from the target's measured cost model (speclm.cost_model: seconds per
forward of T tokens, timed once per model and backend and cached) scaled by a moving average of
measured / predicted step times, so the policy knows from the first round whether a wide verify is nearly free (a GPU) or costs ~0.3 plain steps per token
(llama.cpp on a CPU). Without a cost model it is learned from the rounds themselves as
``t_plain + K * t_token``. K == 0 (a plain step) wins when drafting cannot pay; a draft is then
still tried every ``probe_every`` rounds so the acceptance estimate can recover. That probe is
short: the K the cost model favours at an optimistic acceptance (``PROBE_ALPHA``), so on a
backend where each drafted token costs ~0.6 plain steps (llama.cpp on a CPU) a probe that
misses costs about one step, not a K = 10 verify; where a verify is nearly free it is long. The
same K serves ``exploring`` rounds (``auto`` measuring a candidate). Fixed mode
(``adaptive=False``, ``--no-adaptive``) drafts ``draft_max`` every round.

Every request is sized this way, seeded sampling ones included: a seeded request's tokens are
the target's keyed draws at their positions whatever K was (speclm.verifier), so its draft
length may follow timing too.

``draft_min`` follows llama.cpp: a draft shorter than it is not worth a verify and is dropped,
but only when the draft is a function of the context (greedy drafting, prompt lookup). A sampled
draft's length depends on its own random draws (through ``p_min``), and dropping short ones
would bias which tokens reach the verifier, so those are always verified.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import SpeclmError

if TYPE_CHECKING:
    from .cost_model import CostModel


@dataclass
class DraftLengthConfig:
    draft_max: int = 5  # K: most tokens proposed per round
    draft_min: int = 0  # drafts shorter than this are discarded
    adaptive: bool = False
    probe_every: int = 8

    def __post_init__(self) -> None:
        if self.draft_max < 1:
            raise SpeclmError(f"draft max (num_speculative_tokens) must be >= 1, got {self.draft_max}")
        if not 0 <= self.draft_min <= self.draft_max:
            raise SpeclmError(
                f"draft min must be in [0, draft max={self.draft_max}], got {self.draft_min}"
            )


PROBE_ALPHA = 0.8  # the acceptance a probe's K is sized for: a draft worth trying, not a sure one
# A row's first token waits for its first round: drafting may delay it by at most this share of a
# plain step (a draft model's K forwards doubled a server's time to first token).
FIRST_ROUND_DELAY = 0.5


class DraftLengthPolicy:
    """Chooses K per round; fed back with what each round drafted, accepted and cost.

    ``prior``: the target's measured cost model (speclm.cost_model.CostModel); None learns
    the verify cost from the rounds alone. ``parallel``: the drafter's ``parallel_tokens`` (0: it
    pays one forward per drafted token)."""

    _EMA = 0.2  # weight of the newest observation

    def __init__(self, config: DraftLengthConfig, prior: CostModel | None = None, parallel: int = 0) -> None:
        self.config = config
        self.prior = prior
        self.parallel = parallel
        self.scale = 1.0  # measured / the prior's predicted step time (moving average)
        self.alpha = 0.6  # prior per-token acceptance
        self._alpha_rounds = 0  # rounds averaged into alpha (the prior counts as one more)
        self.t_plain: float | None = None
        self.t_verify: float | None = None  # seen at all: K may be chosen
        self.t_token: float = 0.0  # a verify's time over a plain step, per drafted token
        self.t_draft: float | None = None  # per drafted token, per round if parallel (None: not yet)
        self._plain_streak = 0
        self._verified_k = 0  # K of the latest verify

    def start_from(self, alpha: float, t_draft: float | None = None) -> None:
        """Start from what the same drafter measured on the engine's other rows: its acceptance
        (instead of the blind prior; it weighs as much as the moving average's memory) and its
        drafting time (per token, or per round for a parallel drafter)."""
        self.alpha = alpha
        self._alpha_rounds = round(1 / self._EMA)
        if t_draft is not None:
            self.t_draft = t_draft

    def first_round(self, k: int) -> int:
        """K for a row's first round, whose drafting delays the row's first token: at most what
        drafts in ``FIRST_ROUND_DELAY`` of a plain step, where the drafting time is known (from
        the engine's earlier rows). Prompt lookup's or token recycling's drafting costs nearly
        nothing, so their first round keeps its K; a draft model's K forwards may not."""
        if not self.config.adaptive or not self.t_draft or not self.knows_cost:
            return k
        budget = FIRST_ROUND_DELAY * self.verify_s(0)
        if self.parallel:
            return k if self.t_draft <= budget else 0
        return min(k, int(budget / self.t_draft))

    @property
    def knows_cost(self) -> bool:
        """Whether :meth:`verify_s` can answer yet (a cost model, or a plain step timed)."""
        return self.prior is not None or self.t_plain is not None

    def verify_s(self, k: int) -> float:
        """Expected seconds of a target forward that verifies ``k`` drafted tokens."""
        if self.prior is not None:
            return self.scale * self.prior.verify_s(1 + k)
        return self.t_plain + k * self.t_token

    def next_k(self, exploring: bool = False) -> int:
        """K for the next round. ``exploring``: the drafter is measuring its candidates (``auto``,
        plain decoding among them), so a plain step is its decision to make, not this one's."""
        cfg = self.config
        if not cfg.adaptive:
            return cfg.draft_max
        if self.prior is None and self.t_verify is None:
            return self._top
        if self.prior is None and self.t_plain is None:
            return 0  # measure one plain step: the cost every draft must beat
        best_k = self._best_k(self.alpha)
        if best_k == 0:
            self._plain_streak += 1
            if self._plain_streak >= cfg.probe_every or exploring:
                self._plain_streak = 0
                return max(cfg.draft_min, 1, self._best_k(max(self.alpha, PROBE_ALPHA)))
        return best_k

    @property
    def _top(self) -> int:
        """The longest draft worth asking for: a parallel drafter proposes at most its width."""
        return min(self.config.draft_max, self.parallel) if self.parallel else self.config.draft_max

    def _best_k(self, alpha: float) -> int:
        """The K in {0, draft_min..draft_max} with the most expected tokens per second."""
        cfg = self.config
        best_k, best_rate = 0, 1.0 / self.verify_s(0)
        for k in range(max(cfg.draft_min, 1), self._top + 1):
            rate = expected_tokens(k, alpha) / (self.verify_s(k) + self.draft_s(k))
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k

    def draft_s(self, k: int) -> float:
        """Expected seconds of drafting ``k`` tokens (0 before anything was drafted)."""
        return (self.t_draft or 0.0) * (1 if self.parallel else k)

    def update(self, drafted: int, accepted: int, draft_time: float, target_time: float) -> None:
        w = self._EMA
        if self.prior is not None:
            predicted = self.prior.verify_s(1 + drafted)
            if predicted > 0:
                self.scale = (1 - w) * self.scale + w * target_time / predicted
        if drafted == 0:
            if self.t_plain is None and self.t_verify is not None:  # the verifies so far, per token
                self.t_token = max(0.0, self.t_verify - target_time) / max(1, self._verified_k)
            self.t_plain = target_time if self.t_plain is None else (1 - w) * self.t_plain + w * target_time
            return
        self._verified_k = drafted
        self._plain_streak = 0
        self.t_verify = target_time if self.t_verify is None else (1 - w) * self.t_verify + w * target_time
        if self.t_plain is not None:
            self.t_token = (1 - w) * self.t_token + w * max(0.0, target_time - self.t_plain) / drafted
        unit = draft_time if self.parallel else draft_time / drafted  # the first draft sets it
        self.t_draft = unit if self.t_draft is None else (1 - w) * self.t_draft + w * unit
        self.observe_acceptance(drafted, accepted)

    def observe_acceptance(self, drafted: int, accepted: int) -> None:
        """Fold one round's acceptance in, not its timing: a round verified in a batch with
        other rows, whose time was the batch's (its depth was the batch policy's choice)."""
        if drafted == 0:
            return
        self.alpha = update_acceptance(self.alpha, drafted, accepted, max(self._EMA, 1 / (self._alpha_rounds + 2)))
        self._alpha_rounds += 1


def expected_tokens(drafted: int, alpha: float) -> float:
    """E[tokens committed by a round] with ``drafted`` draft tokens and i.i.d. per-token
    acceptance ``alpha``: (1 - alpha^(K+1)) / (1 - alpha)."""
    a = min(max(alpha, 0.0), 0.999)
    return (1 - a ** (drafted + 1)) / (1 - a)


def update_acceptance(alpha: float, drafted: int, accepted: int, weight: float) -> float:
    """Move a per-token acceptance estimate towards one round's observation: accepted successes
    over trials (the first rejection is a trial). A round that drafted nothing changes nothing."""
    if drafted == 0:
        return alpha
    trials = accepted + (1 if accepted < drafted else 0)
    return (1 - weight) * alpha + weight * accepted / trials
