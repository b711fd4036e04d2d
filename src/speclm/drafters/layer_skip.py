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
shared cache (drafters/shared_cache.py, the loop it shares with the quantized self-draft).
:func:`layer_skip_drafter` picks the single-row drafter or a member of the batch's group from
the handle the engine gives.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import SpeclmError
from ..models.hf import HFCausalLM
from ..models.layer_subset import LayerSubset, check_skip, decoder_layers, skipping
from ..models.rows import RaggedRows, RowsOutput
from .base import Draft, DraftContext
from .draft_model import draft_chain
from .shared_cache import SharedCacheRows


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


class LayerSkipRows(SharedCacheRows):
    """Layer skipping for every row of a batch on the target's ragged cache: per depth, one
    forward of the target minus ``skip`` over the rows asked (one group per cache and layer set;
    see :meth:`of`)."""

    def __init__(self, rows: RaggedRows, skip: Sequence[int], p_min: float = 0.0, origin: str = "given") -> None:
        super().__init__(rows, p_min)
        self.model = rows.target.model
        self.num_layers = len(decoder_layers(self.model))
        self.skip = check_skip(skip, self.num_layers)
        self.origin = origin

    @classmethod
    def of(cls, rows: RaggedRows, skip: Sequence[int], p_min: float = 0.0, origin: str = "given") -> LayerSkipRows:
        """The group of ``rows`` for this layer set, made on first use."""
        return cls.group(rows, (tuple(sorted(set(skip))), p_min, origin), lambda: cls(rows, skip, p_min, origin))

    def run_variant(self, rows: RaggedRows, span: range, tokens: torch.Tensor) -> RowsOutput:
        with skipping(self.model, self.skip):
            return rows.forward(span, tokens, [1] * len(span))

    def report(self) -> dict:
        return _report(self.skip, self.num_layers, self.origin)


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
