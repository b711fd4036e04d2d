"""A KV cache for a batch of sequences of different lengths, with free per-row rollback.

Each *slot* (row) holds one sequence's keys and values from position 0 up to its own length;
rows never share positions and need no left padding. A forward feeds ``T`` tokens to each of ``B``
rows (ragged rows are padded to ``T``): the new keys are written at each row's own positions
``length[b] .. length[b] + T - 1``, and an explicit 4D mask lets the query at position ``p`` see
exactly the keys at positions ``0 .. p`` of its own row. Padding writes land past a row's length,
where the mask hides them until they are overwritten. Rolling a row back is therefore just
lowering its length: no copy, no recomputation.

The stock transformers model runs unmodified: the cache subclasses ``transformers.Cache`` and
only overrides ``update`` (every attention layer calls it with its new keys and values).
"""

from __future__ import annotations

import torch
from transformers import Cache
from transformers.cache_utils import CacheLayerMixin

from ..errors import CacheContractError


class _RaggedLayer(CacheLayerMixin):
    """Bookkeeping only (transformers inspects layer kinds); storage lives in the cache."""

    is_sliding = False

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):  # pragma: no cover - unused
        raise NotImplementedError("BatchKVCache.update handles every layer")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:  # pragma: no cover - unused
        raise NotImplementedError("BatchKVCache is always used with an explicit 4D mask")

    def get_seq_length(self) -> int:
        return 0

    def get_max_length(self) -> int:
        return -1


class BatchKVCache(Cache):
    """Keys/values for ``num_slots`` rows: per layer [slots, kv_heads, capacity, head_dim].

    Call :meth:`plan` before each forward (which rows, at which positions), then run the model
    with :meth:`attention_mask` and ``position_ids = plan positions``; :meth:`commit` records the
    rows' new lengths. Storage grows on demand (doubling) and is dropped by :meth:`clear`.
    """

    def __init__(self, num_layers: int, num_slots: int) -> None:
        super().__init__(layers=[_RaggedLayer() for _ in range(num_layers)])
        self.num_slots = num_slots
        self.lengths = torch.zeros(num_slots, dtype=torch.long)  # [slots] valid positions per row
        self._keys: list[torch.Tensor | None] = [None] * num_layers  # [slots, H, C, D] each
        self._values: list[torch.Tensor | None] = [None] * num_layers
        self._capacity_needed = 0
        self._rows = slice(0, 0)
        self._index: torch.Tensor | None = None  # [B, H, T, D] write positions, built lazily
        self._positions: torch.Tensor | None = None  # [B, T]
        self._kv_len = 0
        self._fed = 0

    # -- planning a forward ----------------------------------------------------------------
    def plan(self, rows: slice, num_new: int) -> torch.Tensor:
        """Prepare a forward of ``num_new`` tokens per row for the slots in ``rows``; returns
        the positions [B, T] (each row continues at its own length)."""
        start = self.lengths[rows]  # [B]
        positions = start.unsqueeze(1) + torch.arange(num_new).unsqueeze(0)  # [B, T]
        self._rows, self._positions, self._index, self._fed = rows, positions, None, num_new
        self._kv_len = int(positions.max()) + 1
        self._capacity_needed = max(self._capacity_needed, self._kv_len)
        return positions

    def attention_mask(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Additive mask [B, 1, T, L] for the planned forward: query at position p sees keys 0..p."""
        keys = torch.arange(self._kv_len)  # [L]
        visible = keys.view(1, 1, 1, -1) <= self._positions.unsqueeze(1).unsqueeze(-1)  # [B,1,T,L]
        mask = torch.zeros(visible.shape, dtype=dtype)
        return mask.masked_fill_(~visible, torch.finfo(dtype).min).to(device)

    def commit(self, new_lengths: torch.Tensor) -> None:
        """Set the planned rows' lengths ([B]): each between the row's length before the forward
        and what the forward wrote. Anything past them is garbage, hidden by later masks."""
        before = self.lengths[self._rows]
        if bool((new_lengths < before).any()) or bool((new_lengths > before + self._fed).any()):
            raise CacheContractError("committed lengths outside what the last forward wrote")
        self.lengths[self._rows] = new_lengths

    def rollback(self, slot: int, length: int) -> None:
        if not 0 <= length <= int(self.lengths[slot]):
            raise CacheContractError(f"cannot roll slot {slot} back to {length}: it holds "
                                     f"{int(self.lengths[slot])} positions")
        self.lengths[slot] = length

    @torch.inference_mode()
    def compact(self, slot: int, start: int, keep: list[int]) -> None:
        """Keep the slot's first ``start`` entries, then those at ``start + keep[i]``
        (ascending): what a verified tree leaves of the forward that wrote it."""
        written = start + (keep[-1] + 1 if keep else 0)
        if not 0 <= start <= written or (keep and (keep[0] < 0 or keep != sorted(set(keep)))) \
                or written > max(int(self.lengths[slot]), self._kv_len):
            raise CacheContractError(f"cannot keep {keep} after {start} in slot {slot}")
        if keep:
            src = torch.tensor(keep, dtype=torch.long) + start
            for store in (self._keys, self._values):
                for buf in store:
                    if buf is not None:
                        buf[slot, :, start : start + len(keep)] = buf[slot, :, src.to(buf.device)]
        self.lengths[slot] = start + len(keep)

    # -- slots -----------------------------------------------------------------------------
    @torch.inference_mode()  # the buffers are inference tensors (made inside the forward)
    def move(self, src: int, dst: int) -> None:
        """Copy slot ``src`` into slot ``dst`` (used to keep the running rows contiguous)."""
        length = int(self.lengths[src])
        for store in (self._keys, self._values):
            for buf in store:
                if buf is not None:
                    buf[dst, :, :length] = buf[src, :, :length]
        self.lengths[dst] = length
        self.lengths[src] = 0

    def release(self, slot: int) -> None:
        self.lengths[slot] = 0

    def clear(self) -> None:
        """Drop all storage (after an error, or when the server goes idle)."""
        self.lengths.zero_()
        self._keys = [None] * len(self._keys)
        self._values = [None] * len(self._values)
        self._capacity_needed = 0

    # -- transformers' side ----------------------------------------------------------------
    def _storage(self, store: list, layer: int, like: torch.Tensor) -> torch.Tensor:
        buf = store[layer]
        needed = self._capacity_needed
        if buf is None or buf.shape[2] < needed:
            capacity = max(64, 1 << (needed - 1).bit_length())
            grown = like.new_zeros(self.num_slots, like.shape[1], capacity, like.shape[3])
            if buf is not None:
                grown[:, :, : buf.shape[2]] = buf
            store[layer] = buf = grown
        return buf

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new keys/values ([B, H, T, D]) at the planned positions; return the rows'
        keys/values up to the longest planned position ([B, H, L, D] each)."""
        out = []
        for store, new in ((self._keys, key_states), (self._values, value_states)):
            buf = self._storage(store, layer_idx, new)[self._rows]  # a view: writes go through
            if self._index is None or self._index.shape != new.shape:
                self._index = self._positions.to(new.device).view(
                    new.shape[0], 1, new.shape[2], 1).expand(new.shape)  # [B, H, T, D]
            buf.scatter_(2, self._index, new)
            out.append(buf[:, :, : self._kv_len])
        return out[0], out[1]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._kv_len
