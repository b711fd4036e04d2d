"""A stock transformers causal LM run over the rows of a :class:`BatchKVCache`.

One forward feeds ``T`` tokens to each of ``B`` rows at the rows' own positions (explicit
``position_ids`` [B, T] and a 4D mask), so sequences of any lengths share one target forward.
No forked model file: the model sees an ordinary ``Cache`` and an ordinary 4D attention mask.
"""

from __future__ import annotations

import torch

from ..errors import SpeclmError
from ..models.base import ForwardOutput
from ..models.hf import HFCausalLM
from ..models.hf_kwargs import cache_kwarg
from ..tree import TreeMeta
from .cache import BatchKVCache


def _check_full_attention(config) -> None:
    layer_types = set(getattr(config, "layer_types", None) or [])
    if getattr(config, "sliding_window", None) or layer_types - {"full_attention"}:
        raise SpeclmError(
            f"batched serving supports full-attention models; {config.model_type} has "
            f"{', '.join(sorted(layer_types - {'full_attention'})) or 'sliding-window'} layers"
        )


class BatchModel:
    """The target model plus a ragged batch cache of ``max_batch`` rows."""

    def __init__(self, target: HFCausalLM, max_batch: int) -> None:
        _check_full_attention(target.model.config)
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
                return_hidden: bool | list[int] = False) -> ForwardOutput:
        """Run ``token_ids`` [B, T] (right-padded) on slots ``rows``, each row continuing at its
        cached length L_b. A row with ``trees[b]`` (k nodes) feeds [pending, node_0 ..]: each
        node at RoPE position L_b + its depth, seeing the row's cache, the pending token and its
        own ancestors (speclm.tree); its entries are written at slots L_b .. L_b + k, so a
        verified path is kept with :meth:`BatchKVCache.compact`. ``return_hidden``: True or
        the layer indices wanted (0: embeddings), as ``HFCausalLM.forward``.

        Returns logits of each row's last ``num_logits`` fed positions ([B, num_logits, V]) and
        hidden states per layer ([B, T, H]). The rows' lengths are not advanced: the caller
        commits what it keeps (prefill: everything fed; a step: the accepted path).
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
        out = self.model(
            input_ids=token_ids.to(self.device),
            attention_mask=mask,
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
