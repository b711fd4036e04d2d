"""The attention function speclm runs stock transformers models with on the CPU: grouped-query
attention inside PyTorch's SDPA kernel, without copying the cache.

transformers' SDPA attention repeats every key/value head for the query heads that share it
(``repeat_kv``: a copy of the layer's whole cache) whenever a forward feeds more than one token
under an explicit mask on the CPU. That is every verify and every batched step speclm runs: at
16 rows of up to ~800 positions on a 2-core CPU the copies were 40% of a 5-token step, which
made a wide verify cost 2x to 5x a plain step (docs/benchmarks.md). PyTorch's SDPA takes grouped
heads itself (``enable_gqa=True``) and reads the shared heads in place.

:func:`gqa_sdpa_attention` is registered with transformers' attention interface under
:data:`NAME` and handles exactly that case; everything else goes to transformers' own SDPA
function unchanged: eager one-token queries (transformers already folds the groups there without
a copy, so plain decoding computes what it always did), unmasked prefill (transformers passes
``enable_gqa`` itself there), CUDA (masked GQA would leave the fused kernels), position biases
and soft-capping. Graphs being compiled (models/compiled.py) take it for every query length:
traced, transformers' path copies the repeated heads of the whole static cache in every layer
(for 16 rows of the default model, 30% of a one-token step).

In float32 on a CPU where speclm's kernels build (models/small_m.py), queries of up to
:data:`KERNEL_MAX_QUERIES` rows (every decoding step, verify and batched step; not a long
prefill) run ``speclm::small_m_attention`` instead, in eager and compiled forwards alike: each
query head reads its shared key/value head in place, and only the slots its mask lets it see, so
a compiled step over a static cache costs what the filled part costs, not the whole capacity.
Each query row is computed alone in a fixed order, so a row's attention has the same bits in a
one-token step as inside a verify.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .small_m import kernel_available

NAME = "speclm_sdpa"
KERNEL_MAX_QUERIES = 64  # query rows per forward that run speclm's attention kernel
# attention implementations that apply a 4D mask as given (token trees, ragged rows)
MASKED_4D = ("eager", "sdpa", NAME)


def gqa_sdpa_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                       is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """query [B, H, T, D], key/value [B, H_kv, L, D], attention_mask [B|1, 1, T, L] -> [B, T, H, D]."""
    if _kernel_applies(module, query, key, value, attention_mask, dropout, kwargs):
        scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
        return torch.ops.speclm.small_m_attention(query, key, value, attention_mask, scale), None
    groups = getattr(module, "num_key_value_groups", 1)
    compiling = torch.compiler.is_compiling()
    if (groups == 1 or (query.shape[2] == 1 and not compiling) or attention_mask is None
            or query.device.type != "cpu" or kwargs.get("position_bias") is not None
            or kwargs.get("softcap") is not None or key.shape[-1] != value.shape[-1]):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, enable_gqa=True)  # [B, H, T, D]
    return out.transpose(1, 2).contiguous(), None


def _kernel_applies(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    mask: torch.Tensor | None, dropout: float, kwargs: dict) -> bool:
    """Whether speclm's attention kernel computes exactly this call: float32 on the CPU, a few
    query rows, an additive or boolean mask (or none for one query), no dropout, biases,
    soft-capping or sinks."""
    if (query.device.type != "cpu" or query.dtype != torch.float32 or key.dtype != torch.float32
            or value.dtype != torch.float32 or query.shape[2] > KERNEL_MAX_QUERIES
            or key.shape != value.shape or query.shape[-1] != key.shape[-1]
            or key.shape[0] != query.shape[0] or query.shape[1] % key.shape[1] or dropout
            or (torch.is_grad_enabled() and query.requires_grad)
            or any(kwargs.get(name) is not None for name in ("position_bias", "softcap", "s_aux"))):
        return False
    if mask is None:  # one query sees the whole cache; longer ones leave causality to transformers
        if query.shape[2] != 1:
            return False
    elif (mask.dtype not in (torch.float32, torch.bool) or mask.dim() != 4 or mask.shape[1] != 1
          or mask.shape[0] not in (1, query.shape[0]) or mask.shape[2] != query.shape[2]
          or mask.shape[3] != key.shape[2]):
        return False
    return kernel_available()


def _register() -> None:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(NAME, gqa_sdpa_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # the model's own masks: as for "sdpa"


def use_gqa_sdpa(model: torch.nn.Module) -> None:
    """Run a stock model that uses transformers' SDPA attention with :func:`gqa_sdpa_attention`
    instead (the same attention, without the copies); other implementations are left alone."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return
    _register()
    for sub in model.modules():  # the model and any sub-model sharing or owning a config
        sub_config = getattr(sub, "config", None)
        if getattr(sub_config, "_attn_implementation", None) == "sdpa":
            sub_config._attn_implementation = NAME
