"""A static, preallocated KV cache for the compiled backend (models/compiled.py).

Keys and values live in fixed buffers of ``capacity`` slots per layer, written by position
(``index_copy_`` at ``start + arange(T)``): rolling back only moves ``length``, and a compiled
step sees the same buffers (same addresses, same shapes) at every call, so it neither recompiles
nor copies the cache. Attention always reads the whole buffer under an explicit 4D additive mask
that hides the slots not yet (or no longer) filled.

The capacity comes in buckets (e.g. 512, 1024, 2048, ...) so that a short request does not read
a 4k-slot cache at every step; each bucket is one set of buffers, allocated on first use and
kept, and growing copies the filled slots into the next bucket's buffers.

The object is duck-typed as a transformers cache: the stock HF attention calls
``update(key_states, value_states, layer_idx)`` and attends over what it returns. Nothing else
of the Cache API is needed because positions and the mask are always passed explicitly.
"""

from __future__ import annotations

import torch

from ..errors import CacheContractError, SpeclmError
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

    def _use(self, capacity: int) -> None:
        if capacity not in self._buffers:
            shape = (1, self.kv_heads, capacity, self.head_dim)
            with torch.inference_mode():
                keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
                values = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
            for t in keys + values:
                torch._dynamo.mark_static_address(t)
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
