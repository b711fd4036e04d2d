"""B rows of one target: the interface the engine decodes through, and its two implementations.

The engine (speclm.engine) runs every request as a row of a batch; a single request is a batch
of one. Each step it feeds each row ``[pending, d_1 .. d_k]`` (a chain, or a token tree) at the
row's own cache length, reads logits for every fed position, and then tells each row what to keep
(:meth:`TargetRows.keep`). Rows occupy cache *slots* ``0 .. num_slots - 1``; a forward names a
contiguous range of them.

- :class:`RaggedRows`: one transformers forward over all rows (speclm.batch.model: a ragged
  KV cache, explicit positions and a 4D mask). The batched eager-torch path.
- ``CompiledRows`` (speclm.models.compiled_rows): the compiled path's rows in one compiled
  forward over a batched static cache (reached through ``target.batched_rows``; trees too).
- ``LlamaCppRows`` (speclm.models.llamacpp_rows): llama.cpp's rows in one ``llama_decode``, a
  sequence id per row (chains; reached through ``target.batched_rows``).
- :class:`SlotRows`: one :class:`~speclm.models.base.CausalLM` handle per slot (the target
  itself for slot 0, ``fork()``s for the rest), run one after another. Every backend has this
  (the compiled static cache, llama.cpp), and with one slot it is exactly the single-row
  backend, so a single request pays nothing for the batch interface.

Drafters that run the target's own layers (layerskip, early-exit) get a single-row ``CausalLM``
from :meth:`handle` on one-handle-per-slot rows; on :class:`RaggedRows` they get a
:class:`TargetView` whose ``layer_rows`` is the batched cache itself, and draft every row in one
forward per depth (speclm.drafters.layer_skip).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from ..errors import SpeclmError
from ..tree import TreeMeta
from .base import CausalLM


@dataclass
class RowsOutput:
    """What a batched forward returns; rows are padded to the widest row's ``T``."""

    logits: torch.Tensor | None  # [B, T, V] (None when not asked); row b's first num_fed[b] are real
    hidden_states: tuple[torch.Tensor | None, ...] | None = None  # per layer: [B, T, H] or None


class TargetRows(Protocol):
    """The target model over ``num_slots`` cache slots, each holding one sequence."""

    vocab_size: int
    max_context: int
    device: torch.device
    eos_token_ids: frozenset[int]
    num_slots: int
    backend_name: str  # what runs the target (RequestStats.backend)

    def length(self, slot: int) -> int:
        """Positions slot ``slot`` holds (its committed tokens but the pending one)."""

    def forward(self, rows: range, token_ids: torch.Tensor, num_fed: list[int], *,
                logits: bool = True, trees: Sequence[TreeMeta | None] | None = None,
                return_hidden: bool | Sequence[int] = False) -> RowsOutput:
        """Feed ``token_ids`` [B, T] (right-padded; row b's first ``num_fed[b]`` are real) to
        slots ``rows`` (B of them), each continuing at its own length; a row with a tree feeds
        [pending, node_0 ..] laid out by ``trees[b]`` (speclm.tree). What the forward wrote is
        pending until :meth:`keep` says which of it stays."""

    def computed(self, num_rows: int, width: int) -> int:
        """Tokens a forward of ``num_rows`` rows of ``width`` tokens computes, padding included:
        the size its cost follows (the batch draft policy's measure)."""

    def keep(self, slot: int, start: int, keep: list[int]) -> None:
        """After a forward: keep the slot's first ``start`` entries, then those at
        ``start + keep[i]`` (ascending). A prefill keeps all it fed: ``keep(slot, length, [])``."""

    def move(self, src: int, dst: int) -> None:
        """Move the sequence in slot ``src`` to the free slot ``dst``."""

    def swap(self, a: int, b: int) -> None:
        """Exchange the sequences in slots ``a`` and ``b``."""

    def release(self, slot: int) -> None:
        """Empty a slot (its sequence ended)."""

    def clear(self) -> None:
        """Empty every slot and give memory back (after a failed step, or when idle)."""

    def handle(self, slot: int):
        """What the slot's drafter is built with: a single-row ``CausalLM`` on the slot's cache
        where the backend has one (drafters may run the target's own layers on it), else a
        :class:`TargetView` of the weights."""


def _select_layers(return_hidden: bool | Sequence[int], num_layers: int) -> bool | list[int]:
    return return_hidden if isinstance(return_hidden, bool) else sorted(
        {i % (num_layers + 1) for i in return_hidden})


def describe_target(obj, target) -> None:
    """Copy what every view of a target tells the engine and drafters about it onto ``obj``:
    vocabulary, context, device, end tokens, backend name and source GGUF."""
    obj.backend_name = getattr(target, "backend_name", "torch")
    obj.source_gguf = getattr(target, "source_gguf", None)
    obj.vocab_size = target.vocab_size
    obj.max_context = target.max_context
    obj.device = target.device
    obj.eos_token_ids = target.eos_token_ids


class SlotRows:
    """One single-row backend handle per slot, run in turn: every backend, every drafter."""

    def __init__(self, target: CausalLM, num_slots: int) -> None:
        if num_slots < 1:
            raise SpeclmError(f"max batch must be >= 1, got {num_slots}")
        self.target = target
        describe_target(self, target)
        self.num_slots = num_slots
        self._handles: list[CausalLM | None] = [target] + [None] * (num_slots - 1)

    def _handle(self, slot: int) -> CausalLM:
        h = self._handles[slot]
        if h is None:  # forks share the weights; each has its own cache
            h = self._handles[slot] = self.target.fork()
        return h

    handle = _handle

    def length(self, slot: int) -> int:
        h = self._handles[slot]
        return 0 if h is None else h.cache_length

    def computed(self, num_rows: int, width: int) -> int:
        return num_rows * width  # rows run one after another

    def forward(self, rows: range, token_ids: torch.Tensor, num_fed: list[int], *,
                logits: bool = True, trees: Sequence[TreeMeta | None] | None = None,
                return_hidden: bool | Sequence[int] = False) -> RowsOutput:
        outs = []
        for b, slot in enumerate(rows):
            h, n = self._handle(slot), num_fed[b]
            outs.append(h.forward(token_ids[b, :n], h.cache_length, num_logits=n if logits else 1,
                                  return_hidden=return_hidden, tree=trees[b] if trees else None))
        if len(outs) == 1:  # a batch of one: no copies
            out = outs[0]
            hidden = None if out.hidden_states is None else tuple(
                None if h is None else h.unsqueeze(0) for h in out.hidden_states)
            return RowsOutput(out.logits.unsqueeze(0) if logits else None, hidden)
        width = token_ids.shape[1]
        stacked = None
        if logits:  # [B, T, V], padding rows zero
            stacked = outs[0].logits.new_zeros(len(outs), width, outs[0].logits.shape[-1])
            for b, out in enumerate(outs):
                stacked[b, : num_fed[b]] = out.logits
        hidden = None
        if outs[0].hidden_states is not None:
            hidden = tuple(None if layer is None else torch.stack([
                torch.nn.functional.pad(out.hidden_states[i], (0, 0, 0, width - num_fed[b]))
                for b, out in enumerate(outs)]) for i, layer in enumerate(outs[0].hidden_states))
        return RowsOutput(stacked, hidden)

    def keep(self, slot: int, start: int, keep: list[int]) -> None:
        self._handle(slot).compact(start, keep)

    def move(self, src: int, dst: int) -> None:
        self._handles[dst], self._handles[src] = self._handles[src], self._handles[dst]
        if self._handles[src] is not None:
            self._handles[src].reset()

    def swap(self, a: int, b: int) -> None:
        self._handles[a], self._handles[b] = self._handles[b], self._handles[a]

    def release(self, slot: int) -> None:
        if self._handles[slot] is not None:
            self._handles[slot].reset()

    def clear(self) -> None:
        for slot in range(self.num_slots):
            self.release(slot)


class RaggedRows:
    """All rows in one transformers forward over a ragged batch cache (eager torch)."""

    def __init__(self, target, num_slots: int) -> None:
        from ..batch.model import BatchModel

        self.model = BatchModel(target, num_slots + 1)  # the last slot: scratch for swaps
        self.target = target
        describe_target(self, target)
        self.num_slots = num_slots
        self._num_layers = getattr(target, "num_layers", 0)

    @property
    def cache(self):
        return self.model.cache

    def length(self, slot: int) -> int:
        return int(self.model.cache.lengths[slot])

    def computed(self, num_rows: int, width: int) -> int:
        return num_rows * width

    def forward(self, rows: range, token_ids: torch.Tensor, num_fed: list[int], *,
                logits: bool = True, trees: Sequence[TreeMeta | None] | None = None,
                return_hidden: bool | Sequence[int] = False, model=None) -> RowsOutput:
        """As :meth:`TargetRows.forward`; ``model``: a module of the target's architecture and
        dtype to run on the rows' cache instead of the target (speclm.batch.model)."""
        width = token_ids.shape[1]
        if trees is not None and not any(t is not None for t in trees):
            trees = None
        hidden = _select_layers(return_hidden, self._num_layers) if return_hidden else False
        out = self.model.forward(slice(rows.start, rows.stop), token_ids, num_logits=width if logits else 1,
                                 trees=list(trees) if trees is not None else None, return_hidden=hidden,
                                 model=model)
        return RowsOutput(out.logits if logits else None, out.hidden_states)

    def keep(self, slot: int, start: int, keep: list[int]) -> None:
        cache = self.model.cache
        if keep == list(range(len(keep))):
            cache.lengths[slot] = start + len(keep)
        else:
            cache.compact(slot, start, keep)

    def move(self, src: int, dst: int) -> None:
        self.model.cache.move(src, dst)

    def swap(self, a: int, b: int) -> None:
        scratch = self.num_slots
        self.model.cache.move(a, scratch)
        self.model.cache.move(b, a)
        self.model.cache.move(scratch, b)

    def release(self, slot: int) -> None:
        self.model.cache.release(slot)

    def clear(self) -> None:
        self.model.cache.clear()

    def handle(self, slot: int) -> TargetView:
        return TargetView(self.target, layer_rows=self)


class TargetView:
    """What a drafter may read of a target whose rows share one batched cache: its weights,
    shapes and device, but no single-row cache. ``layer_rows``: the rows themselves where a
    drafter may run the target's own layers on them (the eager ragged cache), else None."""

    returns_hidden = True

    def __init__(self, target, layer_rows: RaggedRows | None = None) -> None:
        describe_target(self, target)
        self.target = target
        self.model = target.model
        self.dtype = target.dtype
        self.num_layers = getattr(target, "num_layers", 0)
        self.layer_rows = layer_rows


def make_rows(target: CausalLM, max_batch: int, *, needs_trees: bool = False) -> TargetRows:
    """The rows a target decodes through: one batched forward where the backend has one for
    more than one row (eager torch on a model the ragged cache supports; the compiled path, and
    llama.cpp for chains, through ``target.batched_rows``), else one handle per slot (a batch
    of one, and every other case). ``needs_trees``: drafters grow token trees."""
    from .hf import HFCausalLM

    if max_batch > 1 and type(target) is HFCausalLM:
        try:
            return RaggedRows(target, max_batch)
        except SpeclmError:  # attention layers the ragged cache does not handle
            pass
    batched = getattr(target, "batched_rows", None)
    takes_trees = getattr(target, "batched_trees", False)  # the compiled path's rows do; llama.cpp's not
    if max_batch > 1 and callable(batched) and (takes_trees or not needs_trees):
        return batched(max_batch)
    return SlotRows(target, max_batch)


class Slotted(Protocol):
    slot: int  # the cache slot the item's row lives in


def padded_groups(todo: list[tuple[Slotted, int]], waste: float = 0.25, slack: int = 64
                  ) -> Iterator[list[tuple[Slotted, int]]]:
    """Split per-row token counts (rows in slot order, e.g. prompt chunks or a draft's
    catch-up) into groups of adjacent slots that share one right-padded forward: a group grows
    while its padding stays under ``waste`` of its tokens (or it is at most ``slack`` tokens
    wide), so short feeds batch together and a long one does not pad the rest."""
    group: list[tuple[Slotted, int]] = []
    for item in todo:
        trial = group + [item]
        real = sum(c for _, c in trial)
        padded = len(trial) * max(c for _, c in trial)
        apart = group and item[0].slot != group[-1][0].slot + 1  # a forward takes adjacent slots
        if apart or (group and padded > slack and padded - real > waste * real):
            yield group
            trial = [item]
        group = trial
    if group:
        yield group
