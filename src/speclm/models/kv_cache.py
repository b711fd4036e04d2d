"""The KV cache of one sequence: preallocated buffers written by position, with rollback.

transformers' ``DynamicLayer`` concatenates every new key onto the old ones, copying the whole
cache at every step of every layer. :class:`BufferLayer` keeps keys and values in a buffer with
spare room (gpt-fast's static cache, grown by doubling when full): appending T positions writes T
slots, rolling back only moves the length, and attention reads a view of the filled part. It is
a drop-in ``DynamicCache`` layer, so the stock model and its mask code use it unchanged.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from ..errors import CacheContractError


class BufferLayer(DynamicLayer):
    """One full-attention layer's keys and values: [B, H, capacity, D] buffers, the first
    ``length`` slots filled; ``keys``/``values`` are views of those slots."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.length = 0
        self._k = self._v = None

    def _reserve(self, needed: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        capacity = 0 if self._k is None else self._k.shape[-2]
        if needed <= capacity:
            return
        capacity = max(needed + 256, 2 * capacity)
        k = key_states.new_empty(*key_states.shape[:-2], capacity, key_states.shape[-1])
        v = value_states.new_empty(*value_states.shape[:-2], capacity, value_states.shape[-1])
        if self.length:
            k[..., : self.length, :] = self._k[..., : self.length, :]
            v[..., : self.length, :] = self._v[..., : self.length, :]
        self._k, self._v = k, v

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        self._reserve(end, key_states, value_states)
        self._k[..., self.length : end, :] = key_states
        self._v[..., self.length : end, :] = value_states
        self.length = end
        self.keys, self.values = self._k[..., :end, :], self._v[..., :end, :]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative count of positions to drop")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        self.length = max(0, self.length + tokens_to_remove)
        self.keys, self.values = self._k[..., : self.length, :], self._v[..., : self.length, :]

    def reset(self) -> None:
        super().reset()
        self._k = self._v = None
        self.length = 0

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("speclm's cache holds one sequence")

    batch_select_indices = batch_repeat_interleave


def check_append(held: int, start_pos: int) -> None:
    """The cache contract of every backend: append only at the end of what is held."""
    if start_pos != held:
        raise CacheContractError(f"append at position {start_pos} but the cache holds {held} positions; "
                                 "roll back explicitly before rewriting history")


def check_forward(held: int, start_pos: int, num_new: int, num_logits: int) -> None:
    """A forward of ``num_new`` tokens asking for ``num_logits`` rows, appended at ``start_pos``."""
    if not 1 <= num_logits <= num_new:
        raise ValueError(f"num_logits must be in [1, {num_new}], got {num_logits}")
    check_append(held, start_pos)


def check_rollback(held: int, length: int) -> None:
    """... and roll back only to a length it holds."""
    if not 0 <= length <= held:
        raise CacheContractError(f"cannot roll back to {length}: cache holds {held}")


def check_compact(held: int, start: int, keep: list[int]) -> None:
    """... and keep, after ``start``, only entries it holds (``keep`` ascending)."""
    if not 0 <= start <= held or (keep and (keep[0] < 0 or start + keep[-1] >= held)):
        raise CacheContractError(f"cannot keep {keep} after {start}: cache holds {held}")


def supports_trees(cache: DynamicCache) -> bool:
    """A tree mask replaces the model's own masks: only plain full-attention layers qualify."""
    return bool(cache.layers) and all(isinstance(layer, BufferLayer) for layer in cache.layers)


class KVCache:
    """One sequence's keys and values, with the number of positions they cover.

    Rollback is a crop: rejected positions are cut off the end in place, no recomputation.
    """

    def __init__(self, model: PreTrainedModel) -> None:
        self._config = model.config
        self.reset()

    def _new_cache(self) -> DynamicCache:
        cache = DynamicCache(config=self._config)
        # sliding-window layers drop old states unless told to keep them for rollback
        cache.activate_past_recording()
        for i, layer in enumerate(cache.layers):  # full-attention layers: written by position
            if type(layer) is DynamicLayer:
                cache.layers[i] = BufferLayer()
        return cache

    def rollback(self, length: int) -> None:
        check_rollback(self.length, length)
        if length < self.length:
            self.hf.crop(length - self.length)  # transformers 5: a negative count to drop
            self.length = length

    @torch.inference_mode()  # the cached tensors are inference tensors
    def compact(self, start: int, keep: list[int]) -> None:
        """Move the entries at start + keep[i] to start + i (keep ascending), then crop."""
        if keep == list(range(len(keep))):
            self.rollback(start + len(keep))
            return
        check_compact(self.length, start, keep)
        src = torch.tensor(keep, dtype=torch.long) + start
        on_device: dict[torch.device, torch.Tensor] = {}  # one copy per device, not per layer
        for layer in self.hf.layers:
            if not isinstance(layer, BufferLayer) or layer.keys is None:
                raise CacheContractError(f"{type(layer).__name__} cannot be compacted after a tree")
            index = on_device.get(layer.keys.device)
            if index is None:
                index = on_device[layer.keys.device] = src.to(layer.keys.device)
            layer.keys[:, :, start : start + len(keep)] = layer.keys.index_select(2, index)
            layer.values[:, :, start : start + len(keep)] = layer.values.index_select(2, index)
        self.hf.crop(start + len(keep) - self.length)
        self.length = start + len(keep)

    def reset(self) -> None:
        self.hf = self._new_cache()
        self.length = 0


