"""Precision names: what ``--dtype`` and ``dtype=`` accept, resolved for a device."""

from __future__ import annotations

import torch

from ..errors import SpeclmError

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "float64": torch.float64, "fp64": torch.float64,
}


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    try:
        return _DTYPES[dtype.lower()]
    except KeyError:
        raise SpeclmError(
            f"unknown dtype {dtype!r}; use float32, bfloat16, float16, float64 or auto"
        ) from None


def at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32 when it is 16-bit (logits for a softmax or a sampler); float32 and float64
    as they are."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def fast_dtype(device: torch.device | str) -> torch.dtype:
    """bfloat16 where the device computes it natively (CPU with AVX512-BF16/AMX, CUDA with bf16
    support), else float32."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    if device.type == "cpu" and torch.backends.mkldnn.is_available():
        try:
            if torch.ops.mkldnn._is_mkldnn_bf16_supported():
                return torch.bfloat16
        except (AttributeError, RuntimeError):
            pass
    return torch.float32


def cast_keeping_rotary(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``model.to(dtype)``, but the rotary embedding's frequencies (``inv_freq``, non-persistent
    float32 buffers that transformers itself keeps in float32 when loading in bfloat16) stay
    float32: cast to bfloat16 they shift every position's phase and the model loses the plot
    of long prompts."""
    saved = {name: buf.detach().clone() for name, buf in model.named_buffers() if "inv_freq" in name}
    model = model.to(dtype)
    for name, buf in saved.items():
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner) if owner else model, leaf, buf)
    return model
