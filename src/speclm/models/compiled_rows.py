"""The compiled path's rows: B sequences in one compiled forward over a batched static cache.

:class:`CompiledRows` is the :class:`~speclm.models.rows.TargetRows` of a
:class:`~speclm.models.compiled.CompiledCausalLM` serving several requests. Every slot's keys and
values live in one :class:`~speclm.models.static_cache.StaticRowsCache` ([slots + 1, H_kv,
capacity, D] per layer, written by position), so a decode step over B rows reads the weights once
instead of B times (one handle per row, :class:`~speclm.models.rows.SlotRows`, runs B forwards).

A step over rows ``0 .. B-1`` (the engine keeps decoding rows there) feeding T tokens each runs
the model's compiled graph for (rows bucket, token bucket), whatever the cache's capacity (a
dimension the graphs take symbolically, models/static_cache.py): B is padded up to a power of
two (at most the slot count), T up to the target's token buckets. Padded rows write into the
scratch row and their logits are dropped; padded tokens of a row write past its length, where the
mask hides them until they are overwritten. Each row attends under its own 4D mask (its length, or
its token tree: speclm.tree), built by the same functions as the single-row path's, so a row
computes what it computes alone (up to the kernels' reduction order for B > 1).

A step that also hands a drafter the hidden states of a few layers (EAGLE/Medusa features) is one
more graph per layer set. Forwards the graphs do not cover (prefill chunks, which ask for no
logits: their shapes vary too much to compile; more tokens than the largest bucket; every layer's
hidden states) run the same model eagerly on the same cache.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ..errors import SpeclmError
from ..tree import TreeMeta
from .base import spread_hidden
from .dtypes import at_least_float32
from .hf_kwargs import cache_kwarg
from .rows import RowsOutput, TargetView, _select_layers, describe_target
from .static_cache import (
    StaticRowsCache,
    mark_capacity_dynamic,
    static_allowed,
    static_positions,
)
from .warmup import compile_bar

if TYPE_CHECKING:
    from .compiled import CompiledCausalLM


def row_buckets(num_slots: int) -> tuple[int, ...]:
    """Powers of two below ``num_slots``, then ``num_slots``: the row counts graphs run at."""
    buckets, b = [], 1
    while b < num_slots:
        buckets.append(b)
        b *= 2
    return tuple(buckets) + (num_slots,)


class CompiledRows:
    """``num_slots`` rows of a compiled target, decoded in one compiled forward per step."""

    def __init__(self, target: CompiledCausalLM, num_slots: int) -> None:
        if num_slots < 1:
            raise SpeclmError(f"max batch must be >= 1, got {num_slots}")
        self.target = target
        describe_target(self, target)
        self.num_slots = num_slots
        self.row_buckets = row_buckets(num_slots)
        self.cache = StaticRowsCache(target.num_layers, target.kv_heads, target.head_dim, target.capacities,
                                     target.dtype, target.device, num_slots)
        self._step = target._step
        self._zero, self._neg = target._zero, target._neg
        # logits-only graphs, and as many again returning a drafter's feature layers
        self._step.allow_graphs(2 * len(target.buckets) * len(target.capacities) * (len(self.row_buckets) + 2))

    def length(self, slot: int) -> int:
        return self.cache.lengths[slot]

    def _graph_shape(self, num_rows: int, width: int) -> tuple[int, int] | None:
        """The (rows, tokens) of the graph a forward of this shape runs at (None: eager)."""
        padded_rows = next((b for b in self.row_buckets if b >= num_rows), None)
        padded = self.target.bucket(width)
        return None if padded_rows is None or padded is None else (padded_rows, padded)

    def computed(self, num_rows: int, width: int) -> int:
        """The graph's padded rows x tokens; a forward no graph covers runs unpadded."""
        shape = self._graph_shape(num_rows, width)
        return num_rows * width if shape is None else shape[0] * shape[1]

    @torch.inference_mode()
    def forward(self, rows: range, token_ids: torch.Tensor, num_fed: list[int], *,
                logits: bool = True, trees: Sequence[TreeMeta | None] | None = None,
                return_hidden: bool | Sequence[int] = False) -> RowsOutput:
        num_rows, width = token_ids.shape  # [B, T]
        if rows.stop > self.num_slots or len(rows) != num_rows:
            raise SpeclmError(f"rows {rows} do not fit {self.num_slots} slots or {num_rows} fed rows")
        starts = [self.cache.lengths[slot] for slot in rows]
        if max(s + n for s, n in zip(starts, num_fed)) > self.max_context:
            raise SpeclmError(f"a row would exceed the model's context of {self.max_context} positions")
        shape = self._graph_shape(num_rows, width)
        if not logits or return_hidden is True or rows.start != 0 or shape is None:
            out = self._eager(rows, token_ids, num_fed, starts, trees, return_hidden, logits)
        else:
            layers = tuple(_select_layers(return_hidden, self.target.num_layers)) if return_hidden else ()
            out = self._compiled(rows, token_ids, num_fed, starts, trees, *shape, layers)
        for slot, n in zip(rows, num_fed):
            self.cache.lengths[slot] += n  # written; keep() says what stays
        return out

    def _inputs(self, token_ids, num_fed, starts, trees, num_rows: int, width: int, first: int):
        """Ids, positions [num_rows, width] and the additive mask [num_rows, 1, width, capacity]
        of rows fed at ``starts``; rows past the real ones are padding (scratch row, start 0)."""
        real = token_ids.shape[0]
        ids = torch.zeros(num_rows, width, dtype=torch.long)
        ids[:real, : token_ids.shape[1]] = token_ids.to("cpu", torch.long)
        cap = self.cache.capacity
        positions = torch.empty(num_rows, width, dtype=torch.long)
        allowed = torch.zeros(num_rows, width, cap, dtype=torch.bool)
        for b in range(num_rows):
            start, n = (starts[b], num_fed[b]) if b < real else (0, width)
            tree = trees[b] if trees is not None and b < real else None
            root = None
            if tree is not None:
                root = start + n - (tree.num_nodes + 1)  # the pending token's slot
                if not 0 <= root <= start:
                    raise ValueError(f"{n} tokens cannot be the last rows of a tree of {tree.num_nodes} nodes")
            positions[b] = static_positions(start, n, width, tree, root)
            allowed[b] = static_allowed(cap, start, n, width, tree, root)
        scratch = self.num_slots
        self.cache.starts[:num_rows].copy_(torch.tensor(starts[:real] + [0] * (num_rows - real)))
        self.cache.row_index[:num_rows].copy_(torch.tensor(
            list(range(first, first + real)) + [scratch] * (num_rows - real)))
        self.cache.first_row = first
        mask = torch.where(allowed.to(self.device), self._zero, self._neg).unsqueeze(1)
        mark_capacity_dynamic(mask, 3)
        return ids.to(self.device), positions.to(self.device), mask

    def _compiled(self, rows, token_ids, num_fed, starts, trees, padded_rows: int, padded: int,
                  layers: tuple[int, ...]) -> RowsOutput:
        self.cache.reserve(max(max(starts) + padded, padded))
        ids, positions, mask = self._inputs(token_ids, num_fed, starts, trees, padded_rows, padded, 0)
        key = (padded_rows, padded)
        out = self._step(key, self.cache, ids, positions, mask, layers=layers)
        logits, states = out if layers else (out, ())  # [padded_rows, padded, V]; [.., H] each
        num_rows, width = token_ids.shape
        logits = logits[:num_rows, :width]
        hidden = spread_hidden(layers, [h[:num_rows, :width] for h in states], self.target.num_layers) if layers else None
        if self.device.type == "cuda":  # a CUDA graph's outputs are overwritten by its next replay
            logits = logits.clone()
            hidden = hidden and tuple(None if h is None else h.clone() for h in hidden)
        return RowsOutput(logits, hidden)

    def _eager(self, rows, token_ids, num_fed, starts, trees, return_hidden, want_logits) -> RowsOutput:
        """The same model uncompiled, on the same cache: prefill chunks, hidden states."""
        model = self.target.model
        layers = _select_layers(return_hidden, self.target.num_layers) if return_hidden else False
        num_rows, width = token_ids.shape
        chunk = width if (return_hidden or trees is not None) else self.target.prefill_chunk
        logits, hidden = [], []
        for lo in range(0, width, chunk):
            n = min(chunk, width - lo)
            fed = [max(0, min(f - lo, n)) for f in num_fed]
            at = [s + lo for s in starts]
            self.cache.reserve(max(at) + n)
            ids, positions, mask = self._inputs(token_ids[:, lo : lo + n], fed, at, trees, num_rows, n, rows.start)
            out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                        logits_to_keep=0 if want_logits else 1, output_hidden_states=layers,
                        **{cache_kwarg(model): self.cache})
            if want_logits:
                logits.append(at_least_float32(out.logits))
            if return_hidden:
                hidden.append(out.hidden_states)
        self.cache.first_row = 0
        stacked = torch.cat(logits, dim=1) if want_logits else None  # [B, T, V]
        states = None
        if return_hidden:
            states = tuple(None if parts[0] is None else torch.cat(parts, dim=1) for parts in zip(*hidden))
        return RowsOutput(stacked, states)

    def keep(self, slot: int, start: int, keep: list[int]) -> None:
        self.cache.compact_slot(slot, start, keep)

    def move(self, src: int, dst: int) -> None:
        self.cache.move(src, dst)

    def swap(self, a: int, b: int) -> None:
        self.cache.swap(a, b)

    def release(self, slot: int) -> None:
        self.cache.release(slot)

    def clear(self) -> None:
        self.cache.reset()

    def handle(self, slot: int) -> TargetView:
        return TargetView(self.target)

    def warmup(self, max_draft: int | None = None, layers: Sequence[int] = ()) -> float:
        """Compile the batched steps for every rows bucket and every token bucket up to
        ``max_draft + 1`` tokens (each graph serves every cache size); with ``layers`` (the
        drafters' ``feature_layers``), the steps that also return those hidden states. Returns
        the seconds spent."""
        top = self.target.bucket(max_draft + 1) if max_draft is not None else None
        tokens = [b for b in self.target.buckets if top is None or b <= top]
        sel = tuple(_select_layers(list(layers), self.target.num_layers))
        todo = [(r, t) for r in self.row_buckets for t in tokens]
        todo = [key for key in todo
                if ((key, sel) not in self._step.seen_hidden if sel else key not in self._step.seen)]
        if not todo:
            return 0.0
        graphs = compile_bar(todo, f"batched steps, one time ({len(self.row_buckets)} row counts x "
                                   f"{len(tokens)} token counts)")
        t0 = time.perf_counter()
        self._step.warming = True
        try:
            for r, t in graphs:
                self.cache.reset()
                self.forward(range(r), torch.zeros(r, t, dtype=torch.long), [t] * r, return_hidden=list(sel))
        finally:
            self._step.warming = False
            self.cache.reset()
        return time.perf_counter() - t0
