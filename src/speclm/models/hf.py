"""Hugging Face transformers backend: any ``AutoModelForCausalLM`` with a croppable cache.

The stock model runs unmodified (no forked model file); positions are passed explicitly and the
cache is a ``DynamicCache`` wrapped in :class:`KVCache`, which enforces the append/rollback
contract and fails loudly when the engine breaks it.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel

from ..errors import CacheContractError, SpeclmError
from .base import ForwardOutput


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
        return cache

    def check_append(self, start_pos: int) -> None:
        if start_pos != self.length:
            raise CacheContractError(
                f"append at position {start_pos} but the cache holds {self.length} positions; "
                "roll back explicitly before rewriting history"
            )

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise CacheContractError(f"cannot roll back to {length}: cache holds {self.length}")
        if length < self.length:
            self.hf.crop(length - self.length)  # transformers 5: a negative count to drop
            self.length = length

    def reset(self) -> None:
        self.hf = self._new_cache()
        self.length = 0


class HFCausalLM:
    """A transformers causal LM behind the :class:`~speclm.models.base.CausalLM` interface."""

    def __init__(self, model: PreTrainedModel, eos_token_ids: frozenset[int]) -> None:
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.max_context = int(getattr(model.config, "max_position_embeddings", 0) or 1 << 30)
        self.eos_token_ids = eos_token_ids
        self.num_layers = int(getattr(model.config, "num_hidden_layers", 0))
        self._cache = KVCache(model)
        if not self._cache.hf.is_croppable:
            raise SpeclmError(
                f"{type(model).__name__} uses a cache that cannot be rolled back "
                "(recurrent or linear-attention layers); speculative decoding needs rollback"
            )

    @property
    def cache_length(self) -> int:
        return self._cache.length

    @property
    def hf_cache(self) -> DynamicCache:
        """The transformers cache behind this backend (replaced by ``reset``). Self-speculation
        (models/layer_subset.py) appends draft positions to some of its layers and crops them
        off again before the next call here, so the contract above still holds."""
        return self._cache.hf

    @torch.inference_mode()
    def forward(
        self,
        token_ids: torch.Tensor,
        start_pos: int,
        num_logits: int = 1,
        return_hidden: bool = False,
    ) -> ForwardOutput:
        num_new = token_ids.shape[0]
        if not 1 <= num_logits <= num_new:
            raise ValueError(f"num_logits must be in [1, {num_new}], got {num_logits}")
        self._cache.check_append(start_pos)
        positions = torch.arange(start_pos, start_pos + num_new, device=self.device)  # [T]
        out = self.model(
            input_ids=token_ids.to(self.device).view(1, num_new),  # [1, T]
            past_key_values=self._cache.hf,
            use_cache=True,
            cache_position=positions,
            position_ids=positions.view(1, num_new),
            logits_to_keep=num_logits,
            output_hidden_states=return_hidden,
        )
        self._cache.length += num_new
        hidden = tuple(h[0] for h in out.hidden_states) if return_hidden else None  # [T, H] each
        return ForwardOutput(logits=out.logits[0], hidden_states=hidden)  # logits [num_logits, V]

    def rollback(self, length: int) -> None:
        self._cache.rollback(length)

    def reset(self) -> None:
        self._cache.reset()

    def fork(self) -> HFCausalLM:
        return HFCausalLM(self.model, self.eos_token_ids)
