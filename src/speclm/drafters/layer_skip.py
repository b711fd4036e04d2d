"""Self-speculative decoding: the target drafts with some of its own layers skipped.

No second model is loaded: the draft is :class:`~speclm.models.layer_subset.LayerSubset`, a view
of the target that skips layers and works directly on the target's KV cache (it appends its draft
positions to the kept layers and crops them off before verification, so it needs no cache or
prefill of its own). Each round it runs the pending token and then each draft token but the last
through the kept layers: k subset forwards for k draft tokens.

Two layer sets:

- **layer skipping** (Draft & Verify, SWIFT): any subset, given by hand or chosen automatically
  for the model at hand by measuring speedup on calibration prompts
  (:mod:`speclm.drafters.layer_search`, cached per model);
- **early exit** (LayerSkip): the first N layers, the final norm and the LM head. Its keys and
  values are exactly the target's, so sharing the cache is exact.

Drafts are greedy (argmax) for greedy requests and sampled from q = warp(draft logits) otherwise,
through the same chain loop as a draft model.

**In a batch** (the eager ragged cache, :class:`~speclm.models.rows.RaggedRows`), one
:class:`LayerSkipRows` group drafts every row with one skipping forward per depth over the rows'
shared cache: the draft positions are written at each row's own length, kept while drafting and
dropped afterwards by lowering the lengths again (the ragged cache's rollback is free), so the
rows' verification finds the cache as the last step left it. :func:`layer_skip_drafter` picks
the single-row drafter or a member of the batch's group from the handle the engine gives.
"""

from __future__ import annotations

from collections.abc import Sequence

import weakref

import torch

from ..errors import CacheContractError, SpeclmError
from ..models.hf import HFCausalLM
from ..models.layer_subset import LayerSubset, check_skip, decoder_layers, skipping
from ..models.rows import RaggedRows
from .base import Draft, DraftContext
from .draft_model import draft_chain, draft_chains


def early_exit_skip(num_layers: int, exit_after: int) -> tuple[int, ...]:
    """The layers early exit after ``exit_after`` layers skips: exit_after .. num_layers - 1."""
    if not 1 <= exit_after < num_layers:
        raise SpeclmError(f"early exit needs 1 <= layers < {num_layers} (the model's layer count), "
                          f"got {exit_after}")
    return tuple(range(exit_after, num_layers))


class LayerSkipDrafter:
    """Draft with ``target`` minus the layers in ``skip``; the target verifies."""

    def __init__(self, target: HFCausalLM, skip: Sequence[int], p_min: float = 0.0,
                 origin: str = "given") -> None:
        if not 0.0 <= p_min < 1.0:
            raise SpeclmError(f"draft p_min must be in [0, 1), got {p_min}")
        self.subset = LayerSubset(target, skip)
        self.target = target
        self.p_min = p_min
        self.origin = origin  # "given", "searched" or "cached": reported with the stats

    @property
    def skip(self) -> tuple[int, ...]:
        return self.subset.skip

    def reset(self, prompt_ids: torch.Tensor) -> None:
        self.subset.discard()  # nothing is held between rounds; this only guards a broken round

    def propose(self, ctx: DraftContext) -> Draft:
        ids = ctx.token_ids  # [n]; the target's cache holds ids[: n - 1]
        n = ids.shape[0]
        # draft positions run up to n + k - 2 in the target's own cache
        max_tokens = min(ctx.max_tokens, self.target.max_context - n + 1)
        if max_tokens <= 0:
            return Draft.empty(ids.device)
        try:
            logits = self.subset.forward(ids[n - 1 :], n - 1)  # the pending token: [1, V]
            draft = draft_chain(logits, max_tokens, ctx,
                                lambda token, i: self.subset.forward(token, n + i), self.p_min)
        finally:
            self.subset.discard()  # the target must find its cache as it left it
        return Draft(draft.tokens.to(ids.device), draft.q_draft)

    def on_verified(self, num_accepted: int, emitted: list[int]) -> None:
        pass  # the draft keeps no state: the target's cache is the only cache

    def report(self) -> dict:
        return _report(self.skip, self.subset.num_layers, self.origin)


def layer_target(handle) -> HFCausalLM:
    """The single-row eager target behind a row handle (layer sets are searched on it)."""
    rows = getattr(handle, "layer_rows", None)
    return handle if rows is None else rows.target


def layer_skip_drafter(handle, skip: Sequence[int], p_min: float = 0.0, origin: str = "given"):
    """A drafter skipping ``skip`` for the row ``handle`` belongs to: a
    :class:`LayerSkipDrafter` on a single-row target, or a member of the :class:`LayerSkipRows`
    group of the batched cache a :class:`~speclm.models.rows.TargetView` names."""
    rows = getattr(handle, "layer_rows", None)
    if rows is None:
        return LayerSkipDrafter(handle, skip, p_min, origin)
    return LayerSkipRows.of(rows, skip, p_min, origin).member()


def early_exit_drafter(handle, layers: int, p_min: float = 0.0):
    """Early exit after ``layers`` layers for the row ``handle`` belongs to."""
    num_layers = len(decoder_layers(handle.model))
    return layer_skip_drafter(handle, early_exit_skip(num_layers, layers), p_min, origin=f"early exit {layers}")


class LayerSkipRows:
    """Layer skipping for every row of a batch on the target's ragged cache: per depth, one
    forward of the target minus ``skip`` over the rows asked (one group per cache and layer set;
    see :meth:`of`)."""

    # rows -> {(skip, p_min, origin): group}; a group holds its rows weakly, so that an entry
    # goes away with the rows it serves
    _groups: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __init__(self, rows: RaggedRows, skip: Sequence[int], p_min: float = 0.0, origin: str = "given") -> None:
        if not 0.0 <= p_min < 1.0:
            raise SpeclmError(f"draft p_min must be in [0, 1), got {p_min}")
        self._rows = weakref.ref(rows)
        self.model = rows.target.model
        self.num_layers = len(decoder_layers(self.model))
        self.skip = check_skip(skip, self.num_layers)
        self.p_min = p_min
        self.origin = origin

    @classmethod
    def of(cls, rows: RaggedRows, skip: Sequence[int], p_min: float = 0.0, origin: str = "given") -> LayerSkipRows:
        """The group of ``rows`` for this layer set, made on first use: the engine drafts the
        rows whose drafters share a group in one call."""
        groups = cls._groups.setdefault(rows, {})
        key = (tuple(sorted(set(skip))), p_min, origin)
        if key not in groups:
            groups[key] = cls(rows, skip, p_min, origin)
        return groups[key]

    @property
    def rows(self) -> RaggedRows:
        rows = self._rows()
        if rows is None:
            raise SpeclmError("layer skipping outlived the batched rows it drafted on")
        return rows

    def member(self) -> LayerSkipMember:
        return LayerSkipMember(self)

    @torch.inference_mode()
    def propose_rows(self, members: list[LayerSkipMember], ctxs: list[DraftContext]) -> list[Draft]:
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
            with skipping(self.model, self.skip):
                out = rows.forward(span, tokens, [1] * width)
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


class LayerSkipMember:
    """One request's layer-skip drafter in a :class:`LayerSkipRows` group (no state of its own:
    the target's cache is the only cache)."""

    def __init__(self, group: LayerSkipRows) -> None:
        self.group = group

    @property
    def batch_group(self) -> LayerSkipRows:
        return self.group

    @property
    def skip(self) -> tuple[int, ...]:
        return self.group.skip

    def reset(self, prompt_ids: torch.Tensor) -> None:
        pass

    def propose(self, ctx: DraftContext) -> Draft:
        return self.group.propose_rows([self], [ctx])[0]

    def on_verified(self, num_accepted: int, emitted: list[int]) -> None:
        pass

    def report(self) -> dict:
        return _report(self.group.skip, self.group.num_layers, self.group.origin)


def _report(skip: tuple[int, ...], num_layers: int, origin: str) -> dict:
    kept = num_layers - len(skip)
    return {"summary": f"{kept} of {num_layers} layers ({origin}); skipped {_ranges(skip)}",
            "skip": list(skip), "kept_layers": kept}


def _ranges(indices: Sequence[int]) -> str:
    """(1, 2, 3, 7) -> "1-3,7": how a layer set is written on the command line."""
    out, start = [], None
    for i, value in enumerate(indices):
        if start is None:
            start = value
        if i + 1 == len(indices) or indices[i + 1] != value + 1:
            out.append(str(start) if start == value else f"{start}-{value}")
            start = None
    return ",".join(out)
