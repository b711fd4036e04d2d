"""The small interface the engine needs from a model, so that backends plug in unchanged.

A backend owns the KV cache of one sequence. The engine appends tokens at explicit positions and
rolls the cache back after a rejection; it never touches backend internals. A llama.cpp backend
(planned) implements the same four calls on top of its own context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [num_logits, V] for the last num_logits positions fed
    hidden_states: tuple[torch.Tensor, ...] | None = None  # per layer (embeddings first): [T, H]


@runtime_checkable
class CausalLM(Protocol):
    vocab_size: int  # width of the logits
    max_context: int  # positions the model supports
    device: torch.device
    eos_token_ids: frozenset[int]

    @property
    def cache_length(self) -> int:
        """Positions currently held in the KV cache (0 after reset)."""

    def forward(
        self,
        token_ids: torch.Tensor,
        start_pos: int,
        num_logits: int = 1,
        return_hidden: bool = False,
    ) -> ForwardOutput:
        """Run ``token_ids`` ([T] int64) at positions start_pos .. start_pos + T - 1.

        ``start_pos`` must equal ``cache_length`` (the cache contract: roll back explicitly first).
        """

    def rollback(self, length: int) -> None:
        """Keep only the first ``length`` cached positions."""

    def reset(self) -> None:
        """Drop the whole cache."""

    def fork(self) -> CausalLM:
        """A second handle on the same weights with its own empty cache (self-drafting)."""
