"""A static, preallocated KV cache for the compiled backend (models/compiled.py).

Keys and values live in fixed buffers of ``capacity`` slots per layer, written by position
(``index_copy_`` at ``start + arange(T)``): rolling back only moves ``length``, and a compiled
step sees the same buffers (same addresses, same shapes) at every call, so it neither recompiles
nor copies the cache. Attention always reads the whole buffer under an explicit 4D additive mask
that hides the slots not yet (or no longer) filled.

The capacity comes in buckets (e.g. 512, 1024, 2048, ...) so that a short request does not read
a 4k-slot cache at every step; each bucket is one set of buffers, allocated on first use and
kept, and growing copies the filled slots into the next bucket's buffers. The buffers' capacity
dimension is marked dynamic for TorchDynamo (and so is the mask's, by its callers): one compiled
graph per token count serves every bucket, so a request that outgrows the buckets compiled so far
does not stop for a compile (30-70 s a graph on 2 cores); the symbolic size cost ~1% of a step
on the default model (docs/benchmarks.md).

The object is duck-typed as a transformers cache: the stock HF attention calls
``update(key_states, value_states, layer_idx)`` and attends over what it returns. Nothing else
of the Cache API is needed because positions and the mask are always passed explicitly.
"""

from __future__ import annotations

import torch

from ..errors import CacheContractError, SpeclmError
from ..tree import TreeMeta
from .kv_cache import check_compact, check_rollback


def capacity_buckets(max_context: int, max_tokens: int, smallest: int = 512) -> tuple[int, ...]:
    """Powers of two from ``smallest`` up to the first that holds ``max_context`` positions plus
    the padding of the largest step (``max_tokens`` rows), the last one cut to exactly that."""
    top = max_context + max_tokens
    caps, cap = [], smallest
    while cap < top:
        caps.append(cap)
        cap *= 2
    caps.append(top)
    return tuple(caps)


def mark_capacity_dynamic(t: torch.Tensor, dim: int) -> None:
    """Tell TorchDynamo that dimension ``dim`` of ``t`` (a cache buffer's or a mask's capacity)
    varies, so the graphs traced with it take any capacity. Where a graph specializes it anyway
    (``maybe``), that graph recompiles per capacity as before, and stays correct."""
    torch._dynamo.maybe_mark_dynamic(t, dim)


def static_positions(start_pos: int, num_new: int, rows: int, tree: TreeMeta | None,
                     root_slot: int | None) -> torch.Tensor:
    """[rows] positions of a forward at ``start_pos``: the real ones (a tree's by depth), then the
    padded rows continuing after the last."""
    if tree is None:
        return torch.arange(start_pos, start_pos + rows)
    real = tree.positions(root_slot, num_new)
    pad = real[-1] + 1 + torch.arange(rows - num_new)
    return torch.cat([real, pad])


def static_allowed(capacity: int, start_pos: int, num_new: int, rows: int, tree: TreeMeta | None,
                   root_slot: int | None) -> torch.Tensor:
    """[rows, capacity] bool: which cache slots row r (written at slot start_pos + r) sees: the
    slots up to its own (a chain; padded rows too), or the committed past and its tree ancestors
    (a tree whose pending token sits at ``root_slot``)."""
    slots = torch.arange(start_pos, start_pos + rows).view(rows, 1)
    allowed = torch.arange(capacity).view(1, capacity) <= slots  # [rows, cap]
    if tree is not None:
        k = tree.num_nodes
        block = torch.ones(k + 1, k + 1, dtype=torch.bool).tril_()  # [pending, nodes] rows
        block[1:, 1:] = tree.ancestors
        block[1:, 0] = True
        block[0, 1:] = False
        allowed[:num_new, root_slot : root_slot + k + 1] = block[k + 1 - num_new :]
    return allowed


class StaticKVCache:
    """One sequence's keys and values in preallocated [1, H_kv, capacity, D] buffers per layer.

    ``start`` (a 0-dim int64 tensor at a fixed address) is where the next forward writes; the
    backend sets it before every call. ``length`` is the number of valid slots (host int).
    """

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, capacities: tuple[int, ...],
                 dtype: torch.dtype, device: torch.device) -> None:
        if not capacities or list(capacities) != sorted(set(capacities)):
            raise SpeclmError(f"cache capacities must be distinct and ascending, got {capacities}")
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.capacities = tuple(int(c) for c in capacities)
        self.dtype, self.device = dtype, device
        self._buffers: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        with torch.inference_mode():
            self.start = torch.zeros((), dtype=torch.long, device=device)
        torch._dynamo.mark_static_address(self.start)
        self.length = 0
        self._use(self.capacities[0])

    # -- the transformers side -----------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        slots = self.start + torch.arange(key_states.shape[-2], device=key_states.device)
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys.index_copy_(2, slots, key_states.to(keys.dtype))
        values.index_copy_(2, slots, value_states.to(values.dtype))
        return keys, values

    # -- capacity ------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    num_buffer_rows = 1  # the buffers' leading dimension

    def _use(self, capacity: int) -> None:
        if capacity not in self._buffers:
            shape = (self.num_buffer_rows, self.kv_heads, capacity, self.head_dim)
            with torch.inference_mode():
                keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
                values = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
            for t in keys + values:
                torch._dynamo.mark_static_address(t)
                mark_capacity_dynamic(t, 2)
            self._buffers[capacity] = (keys, values)
        self.keys, self.values = self._buffers[capacity]

    @torch.inference_mode()
    def reserve(self, end: int) -> None:
        """Make room for slots [0, end): move to the smallest capacity bucket that holds them."""
        if end <= self.capacity:
            return
        fits = [c for c in self.capacities if c >= end]
        if not fits:
            raise CacheContractError(f"{end} cache slots needed, the largest bucket holds {self.capacities[-1]}")
        old_keys, old_values = self.keys, self.values
        self._use(fits[0])
        n = self.length
        for src, dst in zip(old_keys + old_values, self.keys + self.values):
            dst[:, :, :n].copy_(src[:, :, :n])

    # -- the engine's contract -----------------------------------------------------------
    def rollback(self, length: int) -> None:
        check_rollback(self.length, length)
        self.length = length  # the slots past it are masked, then overwritten

    @torch.inference_mode()
    def compact(self, start: int, keep: list[int]) -> None:
        """Move the entries at start + keep[i] to start + i (keep ascending), then crop."""
        if keep == list(range(len(keep))):
            self.rollback(start + len(keep))
            return
        check_compact(self.length, start, keep)
        src = torch.tensor(keep, dtype=torch.long).add_(start).to(self.device)
        for buf in self.keys + self.values:
            buf[:, :, start : start + len(keep)] = buf.index_select(2, src)
        self.length = start + len(keep)

    def reset(self) -> None:
        self.length = 0
        self._use(self.capacities[0])


class StaticRowsCache(StaticKVCache):
    """``num_slots`` sequences' keys and values in [num_slots + 1, H_kv, capacity, D] buffers per
    layer (the last row is scratch: swaps pass through it, padded rows write into it), for the
    compiled path's batched step (models/compiled_rows.py).

    A forward over B rows writes row b's tokens at ``starts[b] + t`` of buffer row
    ``row_index[b]`` (both [num_slots + 1] int64 tensors at fixed addresses, set by the backend
    before every call) and attends over buffer rows ``first_row .. first_row + B - 1``. Each slot
    keeps its own length; the capacity bucket is shared and fits the longest.
    """

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, capacities: tuple[int, ...],
                 dtype: torch.dtype, device: torch.device, num_slots: int) -> None:
        self.num_slots = num_slots
        self.num_buffer_rows = num_slots + 1
        self.lengths = [0] * (num_slots + 1)
        self.first_row = 0
        with torch.inference_mode():
            self.starts = torch.zeros(num_slots + 1, dtype=torch.long, device=device)
            self.row_index = torch.arange(num_slots + 1, dtype=torch.long, device=device)
        torch._dynamo.mark_static_address(self.starts)
        torch._dynamo.mark_static_address(self.row_index)
        super().__init__(num_layers, kv_heads, head_dim, capacities, dtype, device)

    @property
    def length(self) -> int:  # what growing the capacity copies: the longest slot
        return max(self.lengths)

    @length.setter
    def length(self, value: int) -> None:  # the base class's reset
        self.lengths = [value] * len(self.lengths)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        rows, heads, t = key_states.shape[:3]  # [B, H, T, D]
        device = key_states.device
        slots = self.starts[:rows, None] + torch.arange(t, device=device)  # [B, T]
        # (row, head, slot) of every written vector: indexes [S + 1, H, cap] like key_states' [B, H, T]
        index = (self.row_index[:rows, None, None], torch.arange(heads, device=device)[None, :, None],
                 slots[:, None, :])
        keys, values = self.keys[layer_idx], self.values[layer_idx]  # [S + 1, H, cap, D]
        keys.index_put_(index, key_states.to(keys.dtype))
        values.index_put_(index, value_states.to(values.dtype))
        lo = self.first_row
        return keys[lo : lo + rows], values[lo : lo + rows]

    # -- per slot ------------------------------------------------------------------------
    @torch.inference_mode()
    def compact_slot(self, slot: int, start: int, keep: list[int]) -> None:
        """Slot ``slot`` keeps its first ``start`` entries, then those at start + keep[i]."""
        check_compact(self.lengths[slot], start, keep)
        if keep != list(range(len(keep))):
            src = torch.tensor(keep, dtype=torch.long).add_(start).to(self.device)
            for buf in self.keys + self.values:
                buf[slot, :, start : start + len(keep)] = buf[slot].index_select(1, src)
        self.lengths[slot] = start + len(keep)

    @torch.inference_mode()
    def move(self, src: int, dst: int) -> None:
        """Copy slot ``src``'s entries to slot ``dst``, then empty ``src``."""
        n = self.lengths[src]
        for buf in self.keys + self.values:
            buf[dst, :, :n] = buf[src, :, :n]
        self.lengths[dst], self.lengths[src] = n, 0

    def swap(self, a: int, b: int) -> None:
        scratch = self.num_slots
        self.move(a, scratch)
        self.move(b, a)
        self.move(scratch, b)

    def release(self, slot: int) -> None:
        self.lengths[slot] = 0
