"""Hugging Face transformers backend: any ``AutoModelForCausalLM`` with a croppable cache.

The stock model runs unmodified (no forked model file); positions are passed explicitly and the
cache is a :class:`~.kv_cache.KVCache`, which enforces the append/rollback contract and fails
loudly when the engine breaks it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from ..errors import SpeclmError
from ..tree import TreeMeta
from .attention import MASKED_4D, use_gqa_sdpa
from .base import ForwardOutput
from .fast_norm import use_fast_norms
from .hf_kwargs import cache_kwarg
from .kv_cache import KVCache, check_forward, supports_trees
from .small_m import use_small_m


class HFCausalLM:
    """A transformers causal LM behind the :class:`~speclm.models.base.CausalLM` interface."""

    source_gguf = None  # the GGUF file the weights were dequantized from, if any (set by load_model)

    backend_name = "torch"

    def __init__(self, model: PreTrainedModel, eos_token_ids: frozenset[int]) -> None:
        use_gqa_sdpa(model)  # verifies and batched steps without copying the cache per layer
        use_small_m(model)  # float32 on an AVX2 CPU: a verify of a few tokens costs about one step
        use_fast_norms(model)  # ... and its norms one kernel call each
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        head = model.get_output_embeddings()  # a quantized head (models/quantize.py) has no float weight
        self.vocab_size = int(getattr(head, "out_features", None) or head.weight.shape[0])
        self.max_context = int(getattr(model.config, "max_position_embeddings", 0) or 1 << 30)
        self.eos_token_ids = eos_token_ids
        self.num_layers = int(getattr(model.config, "num_hidden_layers", 0))
        self._cache = KVCache(model)
        # a tree mask replaces the model's own masks, so trees need plain full-attention layers
        # and an attention implementation that applies a 4D additive mask as given
        attention = getattr(model.config, "_attn_implementation", None) or "eager"
        self.supports_trees = attention in MASKED_4D and supports_trees(self._cache.hf)
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
        return_hidden: bool | Sequence[int] = False,
        tree: TreeMeta | None = None,
    ) -> ForwardOutput:
        num_new = token_ids.shape[0]
        check_forward(self._cache.length, start_pos, num_new, num_logits)
        slots = torch.arange(start_pos, start_pos + num_new, device=self.device)  # [T] cache slots
        mask = None
        if tree is None:
            positions = slots
        else:
            if not self.supports_trees:
                raise SpeclmError(f"{type(self.model).__name__} has sliding-window or other special "
                                  "attention layers, or an attention implementation other than eager/sdpa; "
                                  "token trees need full attention with a 4D mask (use a chain drafter)")
            root_slot = start_pos + num_new - (tree.num_nodes + 1)  # the pending token's slot
            if not 0 <= root_slot <= start_pos:
                raise ValueError(f"{num_new} tokens cannot be the last rows of a tree of {tree.num_nodes} nodes")
            # the fed tokens are the last T rows of [pending, nodes...]; earlier rows are cached
            positions = tree.positions(root_slot, num_new).to(self.device)  # [T]
            mask = tree.attention_bias(root_slot, self.dtype, self.device, num_new)  # [1, 1, T, start_pos + T]
        if isinstance(return_hidden, bool):
            layers = None
        else:
            layers = [i % (self.num_layers + 1) for i in return_hidden]
        out = self.model(
            input_ids=token_ids.to(self.device).view(1, num_new),  # [1, T]
            attention_mask=mask,
            **{cache_kwarg(self.model): self._cache.hf},
            use_cache=True,
            cache_position=slots,
            position_ids=positions.view(1, num_new),
            logits_to_keep=num_logits,
            output_hidden_states=bool(return_hidden) if layers is None else layers,
        )
        self._cache.length += num_new
        hidden = None
        if return_hidden:  # [T, H] per layer; with a selection, only the selected are filled
            hidden = tuple(None if h is None else h[0] for h in out.hidden_states)
        return ForwardOutput(logits=out.logits[0], hidden_states=hidden)  # logits [num_logits, V]

    def rollback(self, length: int) -> None:
        self._cache.rollback(length)

    def compact(self, start: int, keep: list[int]) -> None:
        self._cache.compact(start, keep)

    def reset(self) -> None:
        self._cache.reset()

    def fork(self) -> HFCausalLM:
        twin = HFCausalLM(self.model, self.eos_token_ids)
        twin.source_gguf = self.source_gguf
        return twin
