"""A draft model drafting for every row of a batch: one batched draft forward per depth.

Serving B requests with a draft model one row at a time costs B draft forwards per depth, each
of one token: on a CPU that is B small matrix products where one of B rows costs little more
than one. :class:`DraftRows` holds the draft model's rows in the batched form a target of its
backend would decode through (models/rows.py ``make_rows``: eager torch's ragged cache, or the
compiled path's batched static cache, whose one-token graphs for every rows bucket it compiles
when built) and drafts the rows the engine asks for together: a catch-up forward for rows that
have unseen committed tokens beyond the pending one (rounds that were not drafted), one forward
of every row's pending token, then one forward per depth of every row's newest draft token.

Each request gets a :class:`DraftRowsMember`, an ordinary drafter (reset / propose /
on_verified / finish) that owns a slot of the group while its request runs. Its prompt enters
the draft's cache chunk by chunk as the target's prefill feeds it (``on_prefill``), so chunked
prefill bounds the draft's share of a step as it bounds the target's. The engine finds
the group through ``batch_group`` and calls :meth:`DraftRows.propose_rows` once per step for
all of its members; a member's own ``propose`` is the same call for a batch of one.

Each row drafts exactly what :class:`~.draft_model.DraftModelDrafter` would: the token choice
is the same function (argmax, or a draw from q with the row's own sampling params and
generator, ``p_min``), rows stop at their own K, and each row's cache keeps what its verdict
accepted. Token trees and asynchronous drafting stay with ``DraftModelDrafter``.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from ..errors import SpeclmError
from ..models.base import device_clock
from ..models.rows import SlotRows, make_rows, padded_groups
from .base import Draft, DraftContext
from .draft_model import draft_chains, fit_vocab


class DraftRows:
    """A draft model's cache rows for up to ``num_slots`` concurrent requests."""

    def __init__(self, draft, target_vocab_size: int, num_slots: int, p_min: float = 0.0) -> None:
        if not 0.0 <= p_min < 1.0:
            raise SpeclmError(f"draft p_min must be in [0, 1), got {p_min}")
        self.rows = make_rows(draft, num_slots)
        if isinstance(self.rows, SlotRows):  # one handle per row: a draft model per row does that
            raise SpeclmError("this draft model has no batched rows (eager torch's ragged cache or "
                              "the compiled path's batched static cache)")
        warm = getattr(self.rows, "warmup", None)
        if callable(warm):  # the compiled path: a graph per rows bucket for one-token feeds
            warm(0)  # (the depth steps); catch-ups and prompt chunks run eagerly
        self.target_vocab_size = target_vocab_size
        self.p_min = p_min
        self.max_context = draft.max_context
        self._owners: list[weakref.ref | None] = [None] * num_slots  # slot -> member
        # the last propose_rows' catch-up on rows that missed rounds or their prompt: its
        # seconds and the tokens fed (0, 0: none). The engine's cost policy keeps this one-time
        # cost apart from what drafting costs per token once the rows are in step.
        self.catch_up_s, self.caught_up = 0.0, 0

    def member(self) -> DraftRowsMember:
        """A drafter for one request (it takes a slot when its request starts)."""
        return DraftRowsMember(self)

    # -- slots -----------------------------------------------------------------------------
    def _owner(self, slot: int) -> DraftRowsMember | None:
        ref = self._owners[slot]
        return None if ref is None else ref()

    def _take(self, member: DraftRowsMember) -> int:
        for slot in range(len(self._owners)):
            if self._owner(slot) is None:
                self._owners[slot] = weakref.ref(member)
                return slot
        raise SpeclmError(f"all {len(self._owners)} draft rows are in use")

    def _free(self, member: DraftRowsMember) -> None:
        if member.slot is not None:
            self.rows.release(member.slot)
            self._owners[member.slot] = None
            member.slot = None
        if all(self._owner(slot) is None for slot in range(len(self._owners))):
            self.rows.clear()  # no request left: give the cache's memory back, as the target does

    def _place(self, members: list[DraftRowsMember]) -> None:
        """Put ``members[i]`` in slot i (a forward runs a contiguous range of slots)."""
        for want, member in enumerate(members):
            if member.slot == want:
                continue
            other = self._owner(want)
            self.rows.swap(member.slot, want)
            self._owners[member.slot] = None if other is None else weakref.ref(other)
            if other is not None:
                other.slot = member.slot
            self._owners[want], member.slot = weakref.ref(member), want

    def _forward(self, count: int, fed: torch.Tensor, logits: bool) -> torch.Tensor | None:
        """Feed ``fed`` [B, T] to slots 0 .. count - 1; [B, T, V_target] logits when asked."""
        out = self.rows.forward(range(count), fed, [fed.shape[1]] * count, logits=logits)
        return None if out.logits is None else fit_vocab(out.logits, self.target_vocab_size)

    def _grow(self, member: DraftRowsMember, by: int) -> None:
        """Keep ``by`` more of what the last forward wrote in the member's slot."""
        member.synced += by
        self.rows.keep(member.slot, member.synced, [])

    # -- drafting --------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, member: DraftRowsMember, held: torch.Tensor) -> None:
        """Catch the member's row up with ``held`` ([n]: the prompt tokens the target's cache
        now holds), as far as the draft's context allows (counted as prefill)."""
        usable = min(held.shape[0], self.max_context - 1) - member.synced
        if usable > 0:
            slot = member.slot
            fed = held[None, member.synced : member.synced + usable]  # [1, usable]
            self.rows.forward(range(slot, slot + 1), fed, [usable], logits=False)
            self._grow(member, usable)

    @torch.inference_mode()
    def propose_rows(self, members: list[DraftRowsMember], ctxs: list[DraftContext]) -> list[Draft]:
        """Draft for every member at once: one forward per depth for all of them."""
        if len({id(m) for m in members}) != len(members) or any(
                m.group is not self or m.slot is None for m in members):
            raise SpeclmError("propose_rows takes distinct members of this group that have been reset")
        limits = [max(0, min(ctx.max_tokens, self.max_context - int(ctx.token_ids.shape[0]) + 1)) for ctx in ctxs]
        live = [b for b, limit in enumerate(limits) if limit > 0]  # the rest: past the draft's context
        drafts = [Draft.empty(ctx.token_ids.device) for ctx in ctxs]
        self.catch_up_s, self.caught_up = 0.0, 0
        for m in members:
            m.fed_drafts, m.round_start = 0, m.synced  # nothing fed: on_verified keeps the cache
        if live:
            found = self._draft([members[b] for b in live], [ctxs[b] for b in live], [limits[b] for b in live])
            for b, draft in zip(live, found):
                drafts[b] = draft
        return drafts

    def _draft(self, members: list[DraftRowsMember], ctxs: list[DraftContext], limits: list[int]) -> list[Draft]:
        n = len(members)
        self._place(members)
        for m, ctx in zip(members, ctxs):
            m.round_start = int(ctx.token_ids.shape[0])
        unseen = [ctx.token_ids[m.synced :] for m, ctx in zip(members, ctxs)]  # >= 1 each
        # rounds that were not drafted (or a prompt the engine did not prefill): catch up on
        # all but the pending token, rows behind by similar counts in one padded forward
        missed = {id(m): u[:-1] for m, u in zip(members, unseen) if len(u) > 1}
        # a row in step has missed at most its last accepted draft token; more is a catch-up
        lagging = sum(len(t) for t in missed.values() if len(t) > 1)
        start = device_clock(self.rows.device) if lagging else 0.0
        for group in padded_groups([(m, len(missed[id(m)])) for m in members if id(m) in missed]):
            width = max(b for _, b in group)
            fed = torch.stack([F.pad(missed[id(m)], (0, width - b)) for m, b in group])  # [G, width]
            first = group[0][0].slot
            self.rows.forward(range(first, first + len(group)), fed, [b for _, b in group], logits=False)
            for m, b in group:
                self._grow(m, b)
        if lagging:
            self.catch_up_s, self.caught_up = device_clock(self.rows.device) - start, lagging
        logits = self._forward(n, torch.stack([u[-1:] for u in unseen]), logits=True)[:, 0]  # [B, V]
        for m in members:
            self._grow(m, 1)

        def step(fed: torch.Tensor, active: list[bool]) -> torch.Tensor:
            logits = self._forward(n, fed, logits=True)[:, 0]  # [B, V]
            for m, on in zip(members, active):
                if on:
                    self._grow(m, 1)
                    m.fed_drafts += 1
            return logits

        drafts = draft_chains(logits, ctxs, limits, step, self.p_min)
        return [Draft(d.tokens.to(ctx.token_ids.device), d.q_draft) for d, ctx in zip(drafts, ctxs)]


class DraftRowsMember:
    """One request's drafter in a :class:`DraftRows` group."""

    def __init__(self, group: DraftRows) -> None:
        self.group = group
        self.slot: int | None = None
        self.synced = 0  # committed tokens held in the slot
        self.round_start = 0  # committed length when the last draft was made
        self.fed_drafts = 0  # draft tokens of the last round that went through the draft model

    @property
    def batch_group(self) -> DraftRows:
        """What the engine drafts this request's row with, beside the group's other rows."""
        return self.group

    def reset(self, prompt_ids: torch.Tensor) -> None:
        if self.slot is None:
            self.slot = self.group._take(self)
        self.group.rows.release(self.slot)
        self.synced = self.round_start = self.fed_drafts = 0  # the prompt comes by on_prefill

    def on_prefill(self, held: torch.Tensor) -> None:
        """The target's chunk of the prompt is in: the draft prefills the same tokens, so a
        long prompt joins the draft in chunks too (a row never prefilled this way, e.g. under
        ``auto``, catches up when first asked to draft)."""
        self.group.prefill(self, held)

    def propose(self, ctx: DraftContext) -> Draft:
        return self.group.propose_rows([self], [ctx])[0]

    def on_verified(self, num_accepted: int, emitted: list[int]) -> None:
        """Keep the committed prefix and the accepted draft tokens the draft model has seen."""
        self.synced = self.round_start + min(num_accepted, self.fed_drafts)
        self.group.rows.keep(self.slot, self.synced, [])

    def finish(self) -> None:
        """The request ended: give the slot back."""
        self.group._free(self)
