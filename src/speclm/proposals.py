"""Step 2 of the engine loop: what each decoding row's drafter proposes this step.

A row alone (a batch of one) drafts the K of its own
:class:`~speclm.draft_length.DraftLengthPolicy` (measured acceptance and the target's cost),
whatever its sampling: a seeded request's tokens do not depend on its drafts (speclm.verifier),
so its K may follow timing like any other row's. With several rows the step's cost is shared,
so the batch policy (speclm.batch.draft_policy) plans the depth every row is asked for from the
rows' acceptance and the measured cost of the step's (rows x tokens) and of drafting at that many
rows (0: a plain step, nobody asked), then may cap deterministic chains further once the drafts
exist. Rows whose drafters share a ``batch_group`` (a draft model's rows: drafters/draft_rows.py)
draft in one call; a row under a grammar gets its forced tokens without asking its drafter
(speclm.structured).

Drafters only propose: what is accepted is the verifier's business (speclm.verifier).
"""

from __future__ import annotations

from dataclasses import dataclass

from .batch.draft_policy import BatchDraftPolicy
from .draft_length import DraftLengthConfig
from .drafters.base import Draft, DraftContext
from .sequence import Sequence
from .structured.drafts import guided_draft


@dataclass
class Proposed:
    """The step's drafts, one per decoding row."""

    drafts: list[Draft]  # after the batch cap
    asked: list[bool]  # whether the row's drafter was asked (it then hears the verdict)
    longest: int  # the deepest draft before the batch cap (0: a plain step)
    skipped: bool  # the batch policy found that no draft could pay: nobody was asked
    catch_up_s: float = 0.0  # of the drafting time, what rows behind by missed rounds spent catching up


class Proposals:
    """Builds each step's drafts for the engine (one per engine; it holds no per-row state)."""

    def __init__(self, draft_length: DraftLengthConfig, batch_policy: BatchDraftPolicy | None) -> None:
        self.draft_length = draft_length
        self.batch_policy = batch_policy
        self._plan: int | None = None  # this step's planned depth (None: rows decide)

    def __call__(self, batch: list[Sequence]) -> Proposed:
        self._plan = self._planned(batch)
        if self._plan != 0:
            proposals, catch_up_s = self._proposals(batch)
        else:  # no draft could pay this step: plain, without asking the drafters
            proposals, catch_up_s = [(Draft.empty(), False)] * len(batch), 0.0
        drafts = [d for d, _ in proposals]
        longest = max(d.depth for d in drafts)
        if len(batch) > 1 and self.batch_policy is not None and longest:
            drafts = self._cap(batch, drafts)
        return Proposed(drafts, [a for _, a in proposals], longest, self._plan == 0, catch_up_s=catch_up_s)

    def _propose(self, seq: Sequence) -> tuple[Draft, bool]:
        """The row's draft for this step, and whether its drafter was asked. Under a grammar,
        forced tokens are drafted up to K without asking the drafter (speclm.structured)."""
        if seq.grammar is not None and seq.policy is not None:
            limit = min(self.draft_length.draft_max, seq.budget - 1)
            return guided_draft(seq.grammar, lambda: self._drafter_draft(seq), limit)
        return self._drafter_draft(seq)

    def _drafter_draft(self, seq: Sequence) -> tuple[Draft, bool]:
        ctx = self._ask(seq)
        if ctx is None:
            return Draft.empty(), False
        return self._checked(seq, seq.drafter.propose(ctx), ctx.max_tokens), True

    def _proposals(self, batch: list[Sequence]) -> tuple[list[tuple[Draft, bool]], float]:
        """Each row's draft, and whether its drafter was asked; and the seconds the batched
        groups spent catching rows up. Rows whose drafters share a ``batch_group`` (a draft
        model's rows: drafters/draft_rows.py) draft in one call."""
        shared: dict[int, list[int]] = {}
        asks: dict[int, DraftContext | None] = {}
        for b, seq in enumerate(batch):
            group = getattr(seq.drafter, "batch_group", None)
            if group is not None and seq.grammar is None:
                asks[b] = ctx = self._ask(seq)
                if ctx is not None:
                    shared.setdefault(id(group), []).append(b)
        found: dict[int, tuple[Draft, bool]] = {b: (Draft.empty(), False) for b, ctx in asks.items() if ctx is None}
        catch_up_s = 0.0
        for rows in shared.values():
            group = batch[rows[0]].drafter.batch_group
            drafts = group.propose_rows([batch[b].drafter for b in rows], [asks[b] for b in rows])
            catch_up_s += getattr(group, "catch_up_s", 0.0)
            for b, draft in zip(rows, drafts):
                found[b] = self._checked(batch[b], draft, asks[b].max_tokens), True
        return [found[b] if b in found else self._propose(seq) for b, seq in enumerate(batch)], catch_up_s

    def _ask(self, seq: Sequence) -> DraftContext | None:
        """What the row's drafter is asked to draft this step (None: a plain step). Under a
        batch plan, the plan's depth (an ``auto`` drafter measuring its candidates keeps its own
        say below it); alone, the row's own policy, and a row's first round drafts only what
        keeps its first token from waiting long for the draft (``DraftLengthPolicy.first_round``)."""
        if seq.policy is None:
            return None
        probing = getattr(seq.drafter, "probing", False)
        if self._plan is None:
            k_max = min(seq.policy.next_k(probing), seq.budget - 1)
            if seq.generated == 0:
                k_max = seq.policy.first_round(k_max)
        else:  # the batch's plan: the step's drafting is shared, so the row's own timing is moot
            # (at least draft_min: a shorter draft would be dropped unverified)
            planned = max(self._plan, self.draft_length.draft_min)
            k_max = min(planned, seq.policy.next_k(True) if probing else planned, seq.budget - 1)
        if k_max <= 0:
            return None
        timed = self.draft_length.adaptive and seq.policy.knows_cost
        return DraftContext(seq.committed, k_max, seq.params, seq.generator, seq.slot,
                            seq.policy.verify_s if timed else None,
                            seq.noise_at if seq.noise is not None else None)

    def _checked(self, seq: Sequence, draft: Draft, k_max: int) -> Draft:
        if draft.depth > k_max:
            raise RuntimeError(f"{type(seq.drafter).__name__} proposed a draft of depth "
                               f"{draft.depth}, more than the {k_max} it was asked for")
        # Dropping a short draft is only lossless when the draft is a function of the context
        # (greedy or prompt lookup). A sampled draft's length depends on its own draws, so
        # dropping it would skew the accepted tokens: verify it anyway.
        if draft.depth < self.draft_length.draft_min and draft.q_draft is None:
            return Draft.empty()
        return draft

    def _planned(self, batch: list[Sequence]) -> int | None:
        """The depth every row is asked for this step, from the batch policy's plan
        (speclm.batch.draft_policy; 0: nobody is asked), or None: each row's own policy decides
        (a row alone, no batch policy, or rows under a grammar, whose forced tokens cost no
        drafting and are always asked for)."""
        if len(batch) < 2 or self.batch_policy is None or all(s.policy is None for s in batch):
            return None  # (no drafters: nothing to skip)
        if any(s.grammar is not None for s in batch):
            return None
        draft_max = self.draft_length.draft_max
        caps = [0 if s.policy is None else max(0, min(draft_max, s.budget - 1)) for s in batch]
        return self.batch_policy.plan(len(batch), row_alphas(batch), draft_max, caps)

    def _cap(self, batch: list[Sequence], drafts: list[Draft]) -> list[Draft]:
        """With several rows, cap deterministic chains by the batch's measured step cost.
        Cutting a deterministic chain is lossless; sampled drafts and trees keep theirs whole
        (an unseeded row's random draws follow its draft's shape)."""
        fixed = [d.q_draft is not None or d.tree is not None for d in drafts]
        cap = self.batch_policy.choose([d.depth for d in drafts], row_alphas(batch), fixed)
        return [d if f or d.num_tokens <= cap else Draft(d.tokens[:cap]) for d, f in zip(drafts, fixed)]


def row_alphas(batch: list[Sequence]) -> list[float]:
    """Each row's measured acceptance, as the batch policy reads it."""
    return [s.policy.alpha if s.policy is not None else s.alpha for s in batch]
