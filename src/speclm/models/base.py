"""The small interface the engine needs from a model, so that backends plug in unchanged.

A backend owns the KV cache of one sequence. The engine appends tokens at explicit positions and
rolls the cache back after a rejection; it never touches backend internals. A llama.cpp backend
(planned) implements the same calls on top of its own context (a tree maps to its sequence ids).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from ..tree import TreeMeta


def device_clock(device: torch.device) -> float:
    """Now, once ``device``'s queued work is done (a CUDA forward returns before it runs): the
    clock every forward is timed by (the engine's prefill and verify, a draft's catch-up)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


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
        return_hidden: bool | Sequence[int] = False,
        tree: TreeMeta | None = None,
    ) -> ForwardOutput:
        """Run ``token_ids`` ([T] int64) at positions start_pos .. start_pos + T - 1; or, with a
        ``tree`` of k nodes, as the last T rows of [pending, node_0 .. node_{k-1}] laid out from
        the pending token's slot (start_pos + T - 1 - k; T = k + 1 feeds the whole tree), each at
        the pending token's position plus its depth, under the tree mask (speclm.tree).
        ``return_hidden``: True for every layer, or the indices of the layers wanted.

        ``start_pos`` must equal ``cache_length`` (the cache contract: roll back explicitly first).
        """

    def rollback(self, length: int) -> None:
        """Keep only the first ``length`` cached positions."""

    def compact(self, start: int, keep: list[int]) -> None:
        """Keep the first ``start`` cached entries and, after them, the entries at
        ``start + keep[i]`` (ascending): what a verified tree leaves of its forward."""

    def reset(self) -> None:
        """Drop the whole cache."""

    def fork(self) -> CausalLM:
        """A second handle on the same weights with its own empty cache (self-drafting)."""


def spread_hidden(layers: Sequence[int], states: Sequence[torch.Tensor],
                  num_layers: int) -> tuple[torch.Tensor | None, ...]:
    """The hidden-states tuple of a forward that computed only ``layers`` (``states`` in that
    order): one entry per layer (embeddings first), None where not selected, as transformers
    returns a selection, so callers index it by layer whichever path ran."""
    hidden: list[torch.Tensor | None] = [None] * (num_layers + 1)
    for i, h in zip(layers, states):
        hidden[i] = h
    return tuple(hidden)
