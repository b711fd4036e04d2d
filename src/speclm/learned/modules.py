"""The trained drafter networks. Both read the target's hidden states. They can draft over a
reduced vocabulary (the most frequent tokens of the training data; ``draft_to_target`` maps a
draft id to the target's), so that their output layer costs a fraction of the target's.

- :class:`MedusaHeads` (Cai et al., 2024): K residual blocks on the target's last hidden state
  h_t, sharing the target's LM head (or a reduced-vocabulary head); head k's logits predict the
  token k + 1 places after the one h_t predicts.
- :class:`EagleHead` (Li et al., 2024-2025; EAGLE-3's multi-layer features): one stock decoder
  layer over (fused target features at t, embedding of token t + 1), predicting token t + 2.
  It is autoregressive at the feature level: for positions the target has not run, its own
  output hidden state stands in for the target's features. A head made for parallel drafting
  (``parallel`` > 1, as in P-EAGLE and PARD) also learns a mask pair (a feature and an
  embedding) that stands for a position whose token is not drafted yet, so that one forward over
  the new true pairs and ``parallel - 1`` mask pairs proposes ``parallel`` tokens.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from ..models.hf_kwargs import cache_kwarg


def _draft_head(target_head: nn.Module, draft_to_target: torch.Tensor) -> nn.Linear:
    """A linear layer over the draft vocabulary, initialised from the target's LM head rows."""
    weight = target_head.weight.detach()[draft_to_target].float()  # [N, H]
    head = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    with torch.no_grad():
        head.weight.copy_(weight)
    return head


class MedusaHeads(nn.Module):
    """K residual blocks; their logits come from the target's own LM head (shared, as in Medusa:
    ``draft_vocab_size=None``) or from a trained head over a reduced vocabulary."""

    def __init__(self, hidden_size: int, num_heads: int, draft_vocab_size: int | None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(hidden_size, hidden_size) for _ in range(num_heads))
        for block in self.blocks:  # zero init: each head starts as the target's own head
            nn.init.zeros_(block.weight)
            nn.init.zeros_(block.bias)
        self.lm_head = None if draft_vocab_size is None else nn.Linear(hidden_size, draft_vocab_size, bias=False)
        self._shared: list[nn.Module] = []  # the target's head, not a submodule: never saved
        if draft_vocab_size is not None:
            self.register_buffer("draft_to_target", torch.zeros(draft_vocab_size, dtype=torch.long))

    @staticmethod
    def create(target: nn.Module, num_heads: int, draft_to_target: torch.Tensor | None) -> MedusaHeads:
        """``draft_to_target`` None: share the target's LM head; else a head over those ids."""
        size = None if draft_to_target is None else draft_to_target.shape[0]
        heads = MedusaHeads(target.config.hidden_size, num_heads, size)
        if draft_to_target is None:
            heads.share_head(target.get_output_embeddings())
        else:
            heads.lm_head = _draft_head(target.get_output_embeddings(), draft_to_target)
            heads.draft_to_target.copy_(draft_to_target)
        return heads

    def share_head(self, head: nn.Module) -> None:
        self._shared[:] = [head]
        if "draft_to_target" not in self._buffers:
            rows = getattr(head, "out_features", None) or head.weight.shape[0]  # a quantized head has no weight
            self.register_buffer("draft_to_target", torch.arange(rows), persistent=False)

    @property
    def num_heads(self) -> int:
        return len(self.blocks)

    def head_logits(self, d: int, hidden: torch.Tensor) -> torch.Tensor:
        """Head d's logits [..., N] from the target's last hidden state [..., H]."""
        state = hidden + nn.functional.silu(self.blocks[d](hidden))
        if self.lm_head is not None:
            return self.lm_head(state)
        head = self._shared[0]
        return nn.functional.linear(state.to(head.weight.dtype), head.weight).to(state.dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] (the target's last hidden state) -> logits [K, ..., N]."""
        return torch.stack([self.head_logits(d, hidden) for d in range(self.num_heads)])


def _layer_config(target_config):
    """A one-layer config with the target's attention shape, for the stock decoder layer."""
    from transformers import LlamaConfig

    head_dim = getattr(target_config, "head_dim", None) or (
        target_config.hidden_size // target_config.num_attention_heads)
    config = LlamaConfig(
        hidden_size=target_config.hidden_size, intermediate_size=target_config.intermediate_size,
        num_hidden_layers=1, num_attention_heads=target_config.num_attention_heads,
        num_key_value_heads=getattr(target_config, "num_key_value_heads", None) or target_config.num_attention_heads,
        head_dim=head_dim, max_position_embeddings=target_config.max_position_embeddings,
        rms_norm_eps=getattr(target_config, "rms_norm_eps", 1e-6),
        vocab_size=1, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    rope = getattr(target_config, "rope_parameters", None)  # the target's positions, exactly
    if rope and "rope_type" not in rope and all(isinstance(v, dict) for v in rope.values()):
        # per layer type (Gemma-3: sliding and full attention): the last layer's, which the
        # head starts from
        kinds = getattr(target_config, "layer_types", None) or ["full_attention"]
        rope = rope.get(kinds[-1]) or next(iter(rope.values()))
    if rope:
        config.rope_parameters = dict(rope)
    elif getattr(target_config, "rope_theta", None):
        config.rope_parameters = {"rope_theta": target_config.rope_theta, "rope_type": "default"}
    config._attn_implementation = "sdpa"
    return config


class EagleHead(nn.Module):
    def __init__(self, target_config, num_features: int, draft_vocab_size: int, parallel: int = 0) -> None:
        from transformers.models.llama.modeling_llama import (
            LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding)

        super().__init__()
        hidden = target_config.hidden_size
        self.parallel = parallel  # tokens one forward proposes (0: one per forward, autoregressive)
        if parallel:  # the pair fed where the token is not known yet
            self.mask_feature = nn.Parameter(torch.zeros(hidden))
            self.mask_embedding = nn.Parameter(torch.zeros(hidden))
        self.config = _layer_config(target_config)
        self.fuse = nn.Linear(num_features * hidden, hidden, bias=False)  # target features -> H
        self.fc_in = nn.Linear(2 * hidden, hidden, bias=False)  # [embedding; feature] -> H
        self.layer = LlamaDecoderLayer(self.config, layer_idx=0)
        self.norm = LlamaRMSNorm(hidden, eps=self.config.rms_norm_eps)
        self.rotary = LlamaRotaryEmbedding(self.config)
        self.lm_head = nn.Linear(hidden, draft_vocab_size, bias=False)
        self.register_buffer("draft_to_target", torch.zeros(draft_vocab_size, dtype=torch.long))

    @staticmethod
    def create(target: nn.Module, feature_layers: list[int], draft_to_target: torch.Tensor,
               parallel: int = 0) -> EagleHead:
        """Warm start from the target: its last decoder layer, final norm and LM-head rows; the
        fusion picks the highest feature layer and adds the token embedding; a mask pair starts
        as the mean token embedding with a zero feature."""
        head = EagleHead(target.config, len(feature_layers), draft_to_target.shape[0], parallel)
        hidden = target.config.hidden_size
        with torch.no_grad():
            try:
                head.layer.load_state_dict(target.model.layers[-1].state_dict())
                head.norm.load_state_dict(target.model.norm.state_dict())
            except RuntimeError:  # not a Llama-shaped layer (Gemma-3's extra norms): no warm start
                print("speclm: the target's last layer is not a Llama layer; the EAGLE head's layer "
                      "starts from random weights", file=sys.stderr)
            head.fuse.weight.zero_()
            head.fuse.weight[:, -hidden:] = torch.eye(hidden)
            head.fc_in.weight.copy_(torch.cat([torch.eye(hidden), torch.eye(hidden)], dim=1))
            if parallel:
                head.mask_embedding.copy_(target.get_input_embeddings().weight.float().mean(0))
        head.lm_head = _draft_head(target.get_output_embeddings(), draft_to_target)
        head.draft_to_target.copy_(draft_to_target)
        return head.float()

    def forward(
        self,
        feature: torch.Tensor,
        embedded: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor | None = None,
        cache=None,
    ) -> torch.Tensor:
        """One step over T positions of a batch.

        feature: [B, T, H] fused target features (``self.fuse``) or the head's own earlier output;
        embedded: [B, T, H] embeddings of the *next* tokens; positions: [B, T];
        mask: [B, 1, T, past + T] additive, or None for causal; cache: a DynamicCache or None.
        Returns the output hidden states [B, T, H] (logits: ``self.logits``).
        """
        x = self.fc_in(torch.cat([embedded, feature], dim=-1))
        rope = self.rotary(x, position_ids=positions)
        return self.layer(x, attention_mask=mask, position_ids=positions, use_cache=cache is not None,
                          position_embeddings=rope, **{cache_kwarg(self.layer): cache})

    def mask_pairs(self, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """The mask pair broadcast to ``shape + (H,)``: (feature, embedding) for ``forward``."""
        size = (*shape, self.mask_feature.shape[0])
        return self.mask_feature.expand(size), self.mask_embedding.expand(size)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., N] over the draft vocabulary."""
        return self.lm_head(self.norm(hidden))
