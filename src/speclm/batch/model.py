"""A stock transformers causal LM run over the rows of a :class:`BatchKVCache`.

One forward feeds ``T`` tokens to each of ``B`` rows at the rows' own positions (explicit
``position_ids`` [B, T] and a 4D mask), so sequences of any lengths share one target forward.
No forked model file: the model sees an ordinary ``Cache`` and ordinary 4D attention masks.

Sliding-window layers (Gemma-3's local layers, Mistral's) keep every position in the ragged cache
like full layers do; their mask additionally hides keys at or beyond the window, as transformers'
own sliding mask does (query position p sees key positions p - window + 1 .. p). Models that
declare ``layer_types`` get one mask per type (the dict transformers' hybrid models accept).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import SpeclmError
from ..models.base import ForwardOutput
from ..models.hf import HFCausalLM
from ..models.hf_kwargs import cache_kwarg
from ..tree import TreeMeta
from .cache import BatchKVCache


SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class MaskPlan:
    """Which masks a model's forward takes: ``window`` is None for full attention only;
    ``by_type``: a dict of masks keyed by layer type (hybrid models), else one mask for all."""

    window: int | None
    by_type: bool


def mask_plan(config) -> MaskPlan:
    """Read the attention layer kinds of ``config``; refuse kinds the ragged cache cannot mask
    (chunked or linear attention, per-layer windows), so callers fall back to one handle per row."""
    declared = list(getattr(config, "layer_types", None) or [])
    window = getattr(config, "sliding_window", None)
    if getattr(config, "attention_chunk_size", None):
        raise SpeclmError(f"batched rows support full and sliding-window attention; "
                          f"{config.model_type} has chunked attention layers")
    if not declared:  # one kind for every layer (Mistral: sliding when a window is set)
        return MaskPlan(window=int(window) if window else None, by_type=False)
    other = set(declared) - {SLIDING, FULL}
    if other:
        raise SpeclmError(f"batched rows support full and sliding-window attention; "
                          f"{config.model_type} has {', '.join(sorted(other))} layers")
    if SLIDING not in declared:
        return MaskPlan(window=None, by_type=False)
    if not isinstance(window, int) or window < 1:
        raise SpeclmError(f"{config.model_type} declares sliding-window layers without one window size")
    return MaskPlan(window=window, by_type=True)


class BatchModel:
    """The target model plus a ragged batch cache of ``max_batch`` rows."""

    def __init__(self, target: HFCausalLM, max_batch: int) -> None:
        self.masks = mask_plan(target.model.config)
        self.model = target.model
        self.device = target.device
        self.dtype = target.dtype
        self.vocab_size = target.vocab_size
        self.max_context = target.max_context
        self.eos_token_ids = target.eos_token_ids
        self.max_batch = max_batch
        self.cache = BatchKVCache(target.model.config.num_hidden_layers, max_batch)

    @torch.inference_mode()
    def forward(self, rows: slice, token_ids: torch.Tensor, num_logits: int, *,
                trees: list[TreeMeta | None] | None = None,
                return_hidden: bool | list[int] = False, model: torch.nn.Module | None = None) -> ForwardOutput:
        """Run ``token_ids`` [B, T] (right-padded) on slots ``rows``, each row continuing at its
        cached length L_b. A row with ``trees[b]`` (k nodes) feeds [pending, node_0 ..]: each
        node at RoPE position L_b + its depth, seeing the row's cache, the pending token and its
        own ancestors (speclm.tree); its entries are written at slots L_b .. L_b + k, so a
        verified path is kept with :meth:`BatchKVCache.compact`. ``return_hidden``: True or
        the layer indices wanted (0: embeddings), as ``HFCausalLM.forward``.

        Returns logits of each row's last ``num_logits`` fed positions ([B, num_logits, V]) and
        hidden states per layer ([B, T, H]). The rows' lengths are not advanced: the caller
        commits what it keeps (prefill: everything fed; a step: the accepted path).
        ``model``: run another module of the target's architecture and dtype on this cache
        instead (a quantized copy of the target that drafts on the target's own keys and values).
        """
        num_rows, num_new = token_ids.shape
        if rows.stop - rows.start != num_rows:
            raise ValueError(f"{num_rows} rows of tokens for slots {rows.start}..{rows.stop - 1}")
        slots = self.cache.plan(rows, num_new)  # [B, T] write slots = causal positions
        mask = self.cache.attention_mask(self.dtype, self.device)  # [B, 1, T, L]
        positions = slots
        if trees is not None and any(t is not None for t in trees):
            positions = slots.clone()
            for b, tree in enumerate(trees):
                if tree is None:
                    continue
                width = tree.num_nodes + 1
                if width > num_new:
                    raise ValueError(f"row {b}: a tree of {tree.num_nodes} nodes in {num_new} tokens")
                root = int(slots[b, 0])  # the pending token's slot and position
                positions[b, :width] = tree.positions(root)
                mask[b, 0, :width, : root + width] = tree.attention_bias(root, self.dtype, self.device)[0, 0]
        layers = None if isinstance(return_hidden, bool) else list(return_hidden)
        out = (self.model if model is None else model)(
            input_ids=token_ids.to(self.device),
            attention_mask=self._masks(mask, slots, positions, trees),
            position_ids=positions.to(self.device),
            **{cache_kwarg(self.model): self.cache},
            use_cache=True,
            logits_to_keep=num_logits,
            output_hidden_states=bool(return_hidden) if layers is None else layers,
        )
        return ForwardOutput(out.logits, out.hidden_states if return_hidden else None)

    def set_lengths(self, lengths: torch.Tensor) -> None:
        """Commit ``lengths`` ([B]) positions for the rows of the last forward."""
        self.cache.commit(lengths)

    def _masks(self, mask: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
               trees: list[TreeMeta | None] | None) -> torch.Tensor | dict[str, torch.Tensor]:
        """The full-attention ``mask`` [B, 1, T, L], plus its sliding-window form where the model
        has such layers: a key is hidden when its position is ``window`` or more before the
        query's. Positions, not slots: a tree node's position is its root's plus its depth, and
        so is that of the node it reads (so a verified path sees what plain decoding would)."""
        window = self.masks.window
        if window is None:
            return mask
        key_pos = torch.arange(mask.shape[-1]).expand(mask.shape[0], -1).clone()  # [B, L] slot = position
        if trees is not None:
            for b, tree in enumerate(trees):
                if tree is not None:
                    root = int(slots[b, 0])
                    key_pos[b, root : root + tree.num_nodes + 1] = positions[b, : tree.num_nodes + 1]
        far = positions.unsqueeze(-1) - key_pos.unsqueeze(1) >= window  # [B, T, L]
        sliding = mask.masked_fill(far.unsqueeze(1).to(mask.device), torch.finfo(mask.dtype).min)
        return {FULL: mask, SLIDING: sliding} if self.masks.by_type else sliding
