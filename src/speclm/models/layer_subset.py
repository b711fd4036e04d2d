"""The target model with some decoder layers skipped: the draft of self-speculative decoding.

Self-speculation (Draft & Verify, Zhang et al. 2023; SWIFT, Xia et al. 2024) drafts with the
target itself, running only some of its layers; early exit (LayerSkip, Elhoushi et al. 2024) is
the special case "the first N layers, then the final norm and the LM head". No weights are copied
and no model file is forked: for the duration of one forward, the stock model's layer list is
swapped for one in which each skipped layer is an identity module. Layer indices stay aligned,
so per-layer config (sliding windows, layer types) and cache slots keep their meaning. The swap
is visible to anything else running the same model object during that forward, so a model that
drafts this way must not be run from two threads at once (the engine runs one request at a time).

**The cache is the target's own.** The draft attends to the target's keys and values for every
committed position, and writes the keys and values of its draft positions into the kept layers
of that same cache; :meth:`LayerSubset.discard` crops them off again before the target verifies.
No second cache, no draft prefill. For early exit this is exact: the first N layers' keys and
values of a committed position are the same whether or not the later layers run. With layers
skipped in the middle, a kept layer after the first skipped one sees the target's full-depth
states for the context instead of what a truly shallower model would have computed; that makes a
different (better informed) draft, and the verifier judges drafts whatever their source.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn
from transformers.cache_utils import Cache

from ..errors import CacheContractError, SpeclmError
from .hf import HFCausalLM
from .hf_kwargs import cache_kwarg


class _SkippedLayer(nn.Module):
    """Stands in for a skipped decoder layer: the residual stream passes through unchanged.

    transformers 5 decoder layers take the hidden states first and return them as one tensor.
    """

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return hidden_states


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layer list of a transformers causal LM, or a clear error."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise SpeclmError(f"{type(model).__name__} has no decoder layer list (model.layers); "
                          "layer skipping needs one")
    return layers


def check_skip(skip: Sequence[int], num_layers: int) -> tuple[int, ...]:
    """Validate a set of layer indices to skip; returns it sorted."""
    skip = tuple(sorted(set(int(i) for i in skip)))
    bad = [i for i in skip if not 0 <= i < num_layers]
    if bad:
        raise SpeclmError(f"layer {bad[0]} does not exist: the model has layers 0..{num_layers - 1}")
    if not skip:
        raise SpeclmError("skip at least one layer (skipping none drafts with the full target)")
    if len(skip) == num_layers:
        raise SpeclmError(f"cannot skip all {num_layers} layers: keep at least one")
    return skip


@contextmanager
def skipping(model: nn.Module, skip: Sequence[int]) -> Iterator[None]:
    """Run ``model`` with the layers in ``skip`` replaced by identities, inside the block."""
    owner = model.get_decoder()
    full = decoder_layers(model)
    skipped = set(skip)
    owner.layers = nn.ModuleList([_SkippedLayer() if i in skipped else layer
                                  for i, layer in enumerate(full)])
    try:
        yield
    finally:
        owner.layers = full


class LayerSubset:
    """A draft view of ``target`` that runs every layer except ``skip``, on the target's cache.

    ``forward`` appends at ``target.cache_length + appended`` (the draft's own positions follow
    the committed ones); ``discard`` drops every appended position. Between the two, the target
    must not be called: its kept layers hold more positions than its cache contract says.
    """

    def __init__(self, target: HFCausalLM, skip: Sequence[int]) -> None:
        self.target = target
        self.num_layers = len(decoder_layers(target.model))
        self.skip = check_skip(skip, self.num_layers)
        self.kept = tuple(i for i in range(self.num_layers) if i not in set(self.skip))
        self.appended = 0  # draft positions currently written into the kept layers
        self._base = 0  # the target's cache length when they were written

    def _view(self) -> Cache:
        """A cache whose slot i is the target's layer i. Skipped slots are never written; they
        point at a kept layer of the same kind, so mask sizes read from any slot are right."""
        layers = self.target.hf_cache.layers
        if len(layers) != self.num_layers:
            raise CacheContractError(f"the target cache has {len(layers)} layers, the model "
                                     f"{self.num_layers}")
        stand_in: dict[bool, object] = {}
        for i in self.kept:
            stand_in.setdefault(bool(layers[i].is_sliding), layers[i])
        fallback = layers[self.kept[0]]
        return Cache(layers=[layers[i] if i not in self.skip
                             else stand_in.get(bool(layers[i].is_sliding), fallback)
                             for i in range(self.num_layers)])

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, start_pos: int, num_logits: int = 1) -> torch.Tensor:
        """Run ``token_ids`` ([T]) through the kept layers; returns the logits of the last
        ``num_logits`` positions [num_logits, V]."""
        if self.appended == 0:
            self._base = self.target.cache_length
        elif self.target.cache_length != self._base:
            raise CacheContractError(f"the target's cache went from {self._base} to "
                                     f"{self.target.cache_length} positions while the draft held "
                                     f"{self.appended}; discard() first")
        expected = self.target.cache_length + self.appended
        if start_pos != expected:
            raise CacheContractError(f"draft append at position {start_pos}, expected {expected}")
        view = self._view()
        held = view.layers[self.kept[0]].get_seq_length()
        if held != expected:
            raise CacheContractError(f"kept layer {self.kept[0]} holds {held} positions, "
                                     f"expected {expected}: the target moved under the draft")
        num_new = token_ids.shape[0]
        device = self.target.device
        positions = torch.arange(start_pos, start_pos + num_new, device=device)  # [T]
        with skipping(self.target.model, self.skip):
            out = self.target.model(
                input_ids=token_ids.to(device).view(1, num_new),  # [1, T]
                use_cache=True, cache_position=positions, **{cache_kwarg(self.target.model): view},
                position_ids=positions.view(1, num_new), logits_to_keep=num_logits,
            )
        self.appended += num_new
        return out.logits[0]  # [num_logits, V]

    def discard(self) -> None:
        """Crop the draft's positions off the kept layers: the target's cache is as it was."""
        if self.appended:
            layers = self.target.hf_cache.layers
            for i in self.kept:
                layers[i].crop(-self.appended)
            self.appended = 0
