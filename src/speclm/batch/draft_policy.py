"""How many tokens the batch drafts per step, chosen from measured step cost.

A batched step feeds ``B`` rows of ``T = 1 + K`` tokens to the target, so its cost grows with
the batch: on a GPU a decode step is memory-bound and extra tokens are nearly free until the
batch is large; on a CPU the cost grows with ``B * T`` almost at once. The policy therefore picks
the cap ``K`` (0 = a plain step) that maximises expected committed tokens per second:

    tokens(K) = sum over rows b of  sum_{i=0}^{min(d_b, K)} alpha_b^i
    rate(K)   = tokens(K) / cost(B * (1 + min(K, max_b d_b)))

where ``d_b`` is row b's actual draft length (prompt lookup drafts are known before the forward
and are a function of the context, so choosing K after seeing them is lossless) and ``alpha_b``
the row's measured per-token acceptance (an exponential moving average). ``cost(M)`` is learned
online by :class:`StepCostModel` from the steps the server actually runs: seconds per forward
as a function of the tokens it computes, padding included (``computed``: the compiled path runs
graphs at padded row and token counts, so 3 rows of 2 tokens cost what 4 rows of 4 cost, and
K = 1 costs what K = 3 costs there), interpolated between measured sizes. Unmeasured larger sizes
are extrapolated along the slope over the whole measured range (optimistically flat before
there are two points), so the policy explores upward once and then settles. When plain steps
win, a short draft (K = 2) is still tried after ``probe_every`` plain steps, then after twice
as many, and so on (up to 16x), so that a change in acceptance is noticed without paying for
wide steps often; and never
before the plain steps since the last probe have run long enough that the probe's extra cost
(its measured step cost minus a plain step's) is at most ``probe_share`` of their time. A probe
over 16 rows on a CPU costs several plain steps (16 rows x 4 tokens through every weight), so a
busy server probes rarely, where a single row's probe costs little and comes often.

Before the rows draft, :meth:`BatchDraftPolicy.plan` picks the cap the drafters are asked for,
counting what drafting costs too: seconds per drafted depth as a function of the rows asked
(:meth:`~BatchDraftPolicy.update_drafting`, learned like the step cost), times the depth. A draft
model drafts every row with one batched forward per depth (drafters/draft_rows.py,
drafters/shared_cache.py), so 16 rows cost a small multiple of one row's depth, not 16 times it:
priced per drafted token, the few-row steps of a server's ramp made a 16-row draft look several
times dearer than it is, and a busy server's rows never drafted. Prompt lookup's drafts cost
microseconds and change nothing. Asking for the planned depth, not ``draft_max``, spares the
depths the verify would cut; once the drafts exist their cost is spent, so
:meth:`~BatchDraftPolicy.choose` caps them by the verify's cost alone. A probe's price counts the
drafting too: a draft model's rows that sat out plain steps first catch up on every token they
missed (a prompt's worth each), which on 16 rows made a probe cost seconds. That catch-up is
measured apart (batched draft rows report it) and prices probes only.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..draft_length import expected_tokens
from ..errors import SpeclmError

if TYPE_CHECKING:
    from ..cost_model import CostModel


@dataclass
class BatchDraftConfig:
    draft_max: int = 10  # K cap: most tokens drafted per row per step
    adaptive: bool = True  # choose K per step by measured cost (False: always draft_max)
    probe_every: int = 16  # with K = 0 winning, try a short draft this often (doubling while plain wins)
    probe_share: float = 0.02  # ... but a probe's extra cost is at most this share of the plain steps' time

    def __post_init__(self) -> None:
        if self.draft_max < 1:
            raise SpeclmError(f"draft max must be >= 1, got {self.draft_max}")
        if self.probe_every < 1:
            raise SpeclmError(f"probe_every must be >= 1, got {self.probe_every}")
        if not 0 < self.probe_share <= 1:
            raise SpeclmError(f"probe_share must be in (0, 1], got {self.probe_share}")


class StepCostModel:
    """Seconds per target forward as a function of the tokens it was fed (``B * T``)."""

    _EMA = 0.2

    def __init__(self) -> None:
        self._sizes: list[int] = []  # sorted measured sizes
        self._seconds: dict[int, float] = {}
        self._prior: set[int] = set()  # sizes known only from a prior (one row's forwards)

    def observe(self, tokens: int, seconds: float, prior: bool = False) -> None:
        """Record a step of ``tokens`` that took ``seconds``; ``prior``: a figure from elsewhere
        (the target's single-row cost model), which bounds no other size until a real step of
        its size replaces it (a row-by-row backend's 8 rows cost 8 forwards, not one of 8)."""
        old = self._seconds.get(tokens)
        if old is None or tokens in self._prior:
            if old is None:
                bisect.insort(self._sizes, tokens)
            self._seconds[tokens] = seconds
            if prior:
                self._prior.add(tokens)
            else:
                self._prior.discard(tokens)
        elif not prior:
            self._seconds[tokens] = (1 - self._EMA) * old + self._EMA * seconds

    def measured(self, tokens: int) -> bool:
        return tokens in self._seconds

    def estimate(self, tokens: int) -> float | None:
        """Measured, interpolated or extrapolated seconds; None before any measurement. Never
        more than a larger measured size costs: a forward over more tokens (or rows) does not
        cost less, so a size whose only measurements came from a cold or contended moment (a
        server's first steps, a size visited once) is priced by the larger sizes measured since."""
        sizes, secs = self._sizes, self._seconds
        if not sizes:
            return None
        i = bisect.bisect_left(sizes, tokens)
        if i == len(sizes):
            return self._extrapolate(tokens)
        # the cheapest size at least this large that real steps measured
        cap = min((secs[s] for s in sizes[i:] if s not in self._prior), default=float("inf"))
        if i == 0 or sizes[i] == tokens:
            return min(secs[sizes[i]], cap)
        lo, hi = sizes[i - 1], sizes[i]  # between two measured sizes
        return min(secs[lo] + (secs[hi] - secs[lo]) * (tokens - lo) / (hi - lo), cap)

    def _extrapolate(self, tokens: int) -> float:
        """Past the largest measured size."""
        sizes, secs = self._sizes, self._seconds
        if len(sizes) == 1:
            return secs[sizes[0]]  # optimistic: explore upward once
        # the slope over the whole measured range: two neighbouring sizes a few tokens apart
        # (the prior's 6 tokens, a first 8-token step of 4 rows) turn one slow step into a
        # slope that prices every wider step out, and a size never tried is never measured
        lo, hi = sizes[0], sizes[-1]
        slope = max(0.0, (secs[hi] - secs[lo]) / (hi - lo))
        return secs[hi] + slope * (tokens - hi)


_PROBE_K = 2  # draft cap of a probe step
_MAX_PROBE_FACTOR = 16  # probes at least every probe_every * this steps


class BatchDraftPolicy:
    """Chooses the batch's draft cap each step and learns from what each step cost.

    ``prior``: the target's measured cost model (speclm.cost_model), whose single-row forwards
    of T tokens seed the step cost of T tokens fed, so the first steps already know what a wide
    step costs; the steps the server runs refine it. ``computed(rows, width)``: the tokens such
    a forward computes, padding included (the rows' :meth:`~speclm.models.rows.TargetRows.computed`;
    default ``rows * width``)."""

    def __init__(self, config: BatchDraftConfig, prior: CostModel | None = None,
                 computed: Callable[[int, int], int] | None = None) -> None:
        self.config = config
        self.cost = StepCostModel()
        self._computed = computed or (lambda rows, width: rows * width)
        for tokens, seconds in zip(prior.widths, prior.seconds) if prior is not None else ():
            self.cost.observe(self._computed(1, tokens), seconds, prior=True)
        self._plain_streak = 0
        self._probe_interval = config.probe_every
        self.drafting = StepCostModel()  # seconds per drafted depth, by the rows of the step
        self._catch_up_s = 0.0  # seconds a step spent catching rows up on missed rounds (recent average)

    def draft_s(self, batch: int, depth: int) -> float:
        """Expected seconds of drafting ``depth`` tokens for each of ``batch`` rows (0 before
        any drafting was measured: the first drafts are how it is learned)."""
        per_depth = self.drafting.estimate(batch)
        return 0.0 if per_depth is None or depth <= 0 else per_depth * depth

    def update_drafting(self, seconds: float, batch: int, depth: int, catch_up_s: float = 0.0) -> None:
        """Record one step's drafting: ``seconds`` spent asking ``batch`` rows for up to
        ``depth`` tokens each; apart from it, ``catch_up_s`` that rows which sat out rounds spent
        feeding the tokens they missed (their prompts too). That is paid once when drafting
        resumes, so it prices a probe, not a drafted depth: averaged in, one probe's catch-up
        made drafting look several times dearer than it is, and the rows then sat out for good."""
        if depth > 0:
            self.drafting.observe(batch, max(0.0, seconds) / depth)
        if catch_up_s > 0:
            e = StepCostModel._EMA
            old = self._catch_up_s
            self._catch_up_s = catch_up_s if old == 0.0 else (1 - e) * old + e * catch_up_s

    def plan(self, batch: int, alphas: list[float], draft_max: int, caps: list[int] | None = None) -> int:
        """Before any row drafts: the depth to ask each row for (0: a plain step, the drafters
        not asked). The K with the best expected rate if every row drafted it, drafting
        included; a probe's short depth when one is due. The drafts the rows return can only
        earn less at the same cost, so :meth:`choose` may cut them further, never widen them.
        A plain answer counts as a plain step. ``caps``: the most each row can draft (its
        remaining budget; 0 without a drafter), ``draft_max`` each if not given."""
        if not self.config.adaptive or draft_max < 1:
            return draft_max
        lengths = [min(c, draft_max) for c in caps] if caps is not None else [draft_max] * batch
        best = self._best(lengths, alphas, [False] * batch, drafting=True)
        if best > 0:
            return best
        if self._probe_due(batch, self._plain_streak + 1):
            return min(draft_max, _PROBE_K)  # choose() runs the probe on the real drafts
        self._plain_streak += 1
        return 0

    def drafting_pays(self, batch: int, alphas: list[float], draft_max: int) -> bool:
        """Whether a step of ``batch`` rows is expected to draft at all (what
        :meth:`plan` finds, without counting a plain step or a probe). False while the
        plain step of this size is unmeasured: the first such step runs plain. The engine skips
        a joining row's draft prefill when False: the drafters sit out under this load."""
        if not self.config.adaptive or draft_max < 1:
            return True
        return self._best([draft_max] * batch, alphas, [False] * batch, drafting=True) > 0

    def choose(self, draft_lengths: list[int], alphas: list[float],
               fixed: list[bool] | None = None) -> int:
        """The cap K for a step whose rows drafted ``draft_lengths`` (proposed with the full
        ``draft_max``) and have measured acceptance ``alphas``. Rows marked ``fixed`` keep their
        whole draft whatever the cap (sampled drafts and trees: speclm.proposals), so the step is at least
        as wide as their longest draft."""
        fixed = fixed or [False] * len(draft_lengths)
        longest = max(draft_lengths, default=0)
        if longest == 0 or not self.config.adaptive:
            return longest
        best_k = self._best(draft_lengths, alphas, fixed)
        if best_k > 0:
            self._plain_streak, self._probe_interval = 0, self.config.probe_every
            return best_k
        self._plain_streak += 1
        if not self._probe_due(len(draft_lengths), self._plain_streak):
            return 0
        # probe: a short draft refreshes the rows' acceptance and the cost of a wider step at
        # a fraction of a full draft's price; while plain keeps winning, probe less often
        self._plain_streak = 0
        self._probe_interval = min(2 * self._probe_interval, _MAX_PROBE_FACTOR * self.config.probe_every)
        return min(longest, _PROBE_K)

    def _probe_due(self, batch: int, streak: int) -> bool:
        """Whether a probe runs after ``streak`` plain steps of ``batch`` rows: the interval has
        passed, and the probe's extra cost is at most ``probe_share`` of those steps' time."""
        if streak < self._probe_interval:
            return False
        plain = self.cost.estimate(self._computed(batch, 1))
        probe = self.cost.estimate(self._computed(batch, 1 + _PROBE_K))
        if plain is None or probe is None:
            return True
        # a draft model's probe also drafts, and first catches its rows up on what they missed
        drafting = self.draft_s(batch, _PROBE_K) + self._catch_up_s
        return probe - plain + drafting <= self.config.probe_share * streak * plain

    def _best(self, draft_lengths: list[int], alphas: list[float], fixed: list[bool],
              drafting: bool = False) -> int:
        """The K with the highest expected tokens per second (0 while the plain step of this
        batch size is unmeasured: it is what drafts must beat); ``drafting``: the drafts are not
        made yet, so their measured cost counts too."""
        batch = len(draft_lengths)
        floor = max((d for d, f in zip(draft_lengths, fixed) if f), default=0)
        best_k, best_rate = 0, 0.0
        for k in range(max(draft_lengths, default=0) + 1):
            size = self._computed(batch, 1 + max(k, floor))
            if not self.cost.measured(size) and k == 0:
                return 0
            tokens = sum(expected_tokens(d if f else min(d, k), a)
                         for d, a, f in zip(draft_lengths, alphas, fixed))
            seconds = self.cost.estimate(size)
            if drafting:  # one forward per depth drafts every row (or each row in turn)
                seconds += self.draft_s(batch, max(k, floor))
            rate = tokens / seconds
            if k == 0 or rate > best_rate:
                best_k, best_rate = k, rate
        return best_k

    def update(self, batch: int, fed_per_row: int, seconds: float) -> None:
        """Record one target forward of ``batch`` rows of ``fed_per_row`` tokens."""
        self.cost.observe(self._computed(batch, fed_per_row), seconds)

