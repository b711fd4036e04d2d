"""Drafting on the target's own batched cache: a variant of the target drafts every row at once.

Two drafters draft with the target itself, changed: layer skipping runs it with some layers
skipped (drafters/layer_skip.py), the quantized self-draft runs a copy of it whose linear layers
hold fewer bits (drafters/quant.py). On eager torch's ragged cache
(:class:`~speclm.models.rows.RaggedRows`) neither needs a cache of its own: the variant attends
to the target's keys and values for every committed position and writes its draft positions at
each row's own length, which are kept while drafting and dropped afterwards by lowering the
lengths again (the ragged cache's rollback is free), so the rows' verification finds the cache as
the last step left it. No draft prefill, no catch-up on rounds a row did not draft: a row that
joins or sits out costs the variant nothing.

:class:`SharedCacheRows` is that loop, one forward per depth over the rows asked; a subclass
says how the variant runs (:meth:`SharedCacheRows.run_variant`). Each request gets a
:class:`SharedCacheMember` (no state of its own: the target's cache is the only cache).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from ..errors import CacheContractError, SpeclmError
from ..models.rows import RaggedRows, RowsOutput
from .base import Draft, DraftContext
from .draft_model import draft_chains


class SharedCacheRows:
    """A variant of the target drafting for the rows of its ragged cache (one group per cache
    and variant: see :meth:`of`)."""

    # rows -> {key: group}; a group holds its rows weakly, so an entry goes away with the rows
    _groups: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __init__(self, rows: RaggedRows, p_min: float = 0.0) -> None:
        if not 0.0 <= p_min < 1.0:
            raise SpeclmError(f"draft p_min must be in [0, 1), got {p_min}")
        self._rows = weakref.ref(rows)
        self.p_min = p_min

    @classmethod
    def group(cls, rows: RaggedRows, key: tuple, make: Callable[[], SharedCacheRows]) -> SharedCacheRows:
        """The group ``key`` names on ``rows``, made on first use: the engine drafts the rows
        whose drafters share a group in one call, and a group's variant is built once."""
        groups = SharedCacheRows._groups.setdefault(rows, {})
        key = (cls, *key)
        if key not in groups:
            groups[key] = make()
        return groups[key]

    @property
    def rows(self) -> RaggedRows:
        rows = self._rows()
        if rows is None:
            raise SpeclmError("a self-draft outlived the batched rows it drafted on")
        return rows

    def member(self) -> SharedCacheMember:
        return SharedCacheMember(self)

    def run_variant(self, rows: RaggedRows, span: range, tokens: torch.Tensor) -> RowsOutput:
        """Feed ``tokens`` [S, 1] to the slots of ``span`` through the variant (logits [S, 1, V])."""
        raise NotImplementedError

    def report(self) -> dict:
        """Figures for a request's stats (``Drafter.report``)."""
        return {}

    @torch.inference_mode()
    def propose_rows(self, members: list[SharedCacheMember], ctxs: list[DraftContext]) -> list[Draft]:
        """Draft for the rows in ``ctxs[b].slot``, each holding ``token_ids[:-1]`` in the cache."""
        rows = self.rows
        slots = [ctx.slot for ctx in ctxs]
        if len(set(slots)) != len(slots):
            raise SpeclmError("propose_rows takes each slot once")
        for slot, ctx in zip(slots, ctxs):
            if rows.length(slot) != ctx.token_ids.shape[0] - 1:
                raise CacheContractError(f"slot {slot} holds {rows.length(slot)} positions, its "
                                         f"request {ctx.token_ids.shape[0] - 1}: the engine moved it")
        # draft positions run up to n + k - 2 <= max_context - 1 in the row's cache
        limits = [max(0, min(ctx.max_tokens, rows.max_context - int(ctx.token_ids.shape[0]) + 1)) for ctx in ctxs]
        span = range(min(slots), max(slots) + 1)  # a forward runs contiguous slots
        offsets = [s - span.start for s in slots]  # where each asked row sits in the span
        at = torch.tensor(offsets)  # [N]
        before = [rows.length(s) for s in span]
        width = len(span)

        def run(fed: torch.Tensor, active: list[bool]) -> torch.Tensor:
            """Feed ``fed`` [N, 1] to the asked rows and keep what active rows fed. The span's
            other rows, and asked rows that stopped, go back to their own length and rewrite a
            pad there, which their verification overwrites (never past the context)."""
            tokens = fed.new_zeros(width, 1)  # [S, 1], on fed's device: no host sync
            tokens[at.to(fed.device)] = fed
            out = self.run_variant(rows, span, tokens)
            for slot, on, b in zip(slots, active, offsets):
                rows.keep(slot, rows.length(slot) + 1 if on else before[b], [])
            return out.logits[at.to(out.logits.device), 0]  # [N, V]

        try:
            pending = torch.stack([ctx.token_ids[-1:] for ctx in ctxs])  # [N, 1]
            logits = run(pending, [limit > 1 for limit in limits])
            drafts = draft_chains(logits, ctxs, limits, run, self.p_min)
        finally:
            for slot, length in zip(span, before):  # the drafts' positions are dropped
                rows.keep(slot, length, [])
        return [Draft(d.tokens.to(ctx.token_ids.device), d.q_draft) for d, ctx in zip(drafts, ctxs)]


class SharedCacheMember:
    """One request's drafter in a :class:`SharedCacheRows` group."""

    def __init__(self, group: SharedCacheRows) -> None:
        self.group = group

    @property
    def batch_group(self) -> SharedCacheRows:
        """What the engine drafts this request's row with, beside the group's other rows."""
        return self.group

    def reset(self, prompt_ids: torch.Tensor) -> None:
        pass  # the target's prefill fills the only cache

    def propose(self, ctx: DraftContext) -> Draft:
        return self.group.propose_rows([self], [ctx])[0]

    def on_verified(self, num_accepted: int, emitted: list[int]) -> None:
        pass

    def report(self) -> dict:
        return self.group.report()
