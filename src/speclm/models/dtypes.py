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
