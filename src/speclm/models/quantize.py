"""Weight-only int8 / int4 quantization of a model's ``nn.Linear`` layers with PyTorch's own kernels.

* ``int8``: per-output-channel symmetric scales, ``torch._weight_int8pack_mm`` (CPU and CUDA);
  activations stay in the model's dtype (float32 or bfloat16/float16).
* ``int4``: groups of 32-128 input channels with a scale and a zero point each (asymmetric),
  ``torch._weight_int4pack_mm_for_cpu`` on CPU and ``torch._weight_int4pack_mm`` on CUDA
  (bfloat16 activations there).

Embeddings stay as they are (only the gathered rows are read). The output head is a Linear and is
quantized too, even when its weight is tied to the embeddings (the embedding keeps the original).
Quantization is lossy: a quantized model's greedy tokens differ from the float model's, but
speculative decoding on it stays lossless with respect to its own plain decoding.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..errors import SpeclmError
from .dtypes import cast_keeping_rotary

SCHEMES = ("int8", "int4")


class Int8Linear(nn.Module):
    """y = x @ (w_int8 * scale[:, None]).T + bias, with w_int8 [N, K] and one scale per row."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        wf = w.float()
        scale = wf.abs().amax(dim=1).clamp(min=1e-8) / 127.0  # [N]
        q = torch.clamp(torch.round(wf / scale[:, None]), -127, 127).to(torch.int8)
        self.register_buffer("weight_int8", q.contiguous())
        self.register_buffer("scales", scale.to(w.dtype))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        # (converting the scales inside a compiled graph trips inductor's int8 lowering: keep
        # them in the activations' dtype, as quantize_weights leaves them)
        scales = self.scales if self.scales.dtype == x.dtype else self.scales.to(x.dtype)
        y = torch._weight_int8pack_mm(x.reshape(-1, shape[-1]), self.weight_int8, scales)
        y = y.view(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def _group_size(in_features: int) -> int:
    for g in (128, 64, 32):
        if in_features % g == 0:
            return g
    raise SpeclmError(f"int4 needs input widths divisible by 32, a layer has {in_features}")


class Int4Linear(nn.Module):
    """Grouped asymmetric int4: w ~ (q - 8) * scale + zero per group of ``group_size`` inputs."""

    def __init__(self, linear: nn.Linear, inner_k_tiles: int = 8) -> None:
        super().__init__()
        w = linear.weight.detach()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.group_size = g = _group_size(self.in_features)
        self.on_cuda = w.device.type == "cuda"
        n, k = w.shape
        multiple = 8 if self.on_cuda else 16  # the packing kernels want N in whole tiles: pad rows
        padded = -(-n // multiple) * multiple
        wf = torch.cat([w.float(), w.new_zeros(padded - n, k, dtype=torch.float32)]) if padded > n else w.float()
        n = padded
        grouped = wf.view(n, k // g, g)
        lo, hi = grouped.amin(dim=2), grouped.amax(dim=2)  # [N, K/g]
        scale = ((hi - lo) / 15).clamp(min=1e-8)
        q = torch.clamp(torch.round((grouped - lo[..., None]) / scale[..., None]), 0, 15)
        q = q.view(n, k).to(torch.int32).contiguous()
        zero = lo + 8 * scale  # the kernels compute (q - 8) * scale + zero
        scales_zeros = torch.stack([scale, zero], dim=2).transpose(0, 1).contiguous()  # [K/g, N, 2]
        if self.on_cuda:
            if k % (inner_k_tiles * 16):
                raise SpeclmError(f"int4 on CUDA needs input widths divisible by {inner_k_tiles * 16}, "
                                  f"a layer has {k}")
            packed = torch._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8), inner_k_tiles)
            scales_zeros = scales_zeros.to(torch.bfloat16)
        else:
            packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
            scales_zeros = scales_zeros.to(w.dtype)
        self.register_buffer("weight_int4", packed)
        self.register_buffer("scales_and_zeros", scales_zeros)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.on_cuda:
            y = torch._weight_int4pack_mm(x2.to(torch.bfloat16), self.weight_int4, self.group_size,
                                          self.scales_and_zeros).to(x.dtype)
        else:
            sz = self.scales_and_zeros
            y = torch._weight_int4pack_mm_for_cpu(x2, self.weight_int4, self.group_size,
                                                  sz if sz.dtype == x.dtype else sz.to(x.dtype))
        if y.shape[-1] != self.out_features:  # padded rows
            y = y[:, : self.out_features]
        y = y.reshape(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 g={self.group_size}"


def _check(scheme: str, linear: nn.Linear) -> None:
    """Fail with a clear message on a combination PyTorch's kernels do not support."""
    w = linear.weight
    dt, dev = w.dtype, w.device.type
    if dt not in (torch.float32, torch.bfloat16, torch.float16):
        raise SpeclmError(f"{scheme} quantization needs float32, bfloat16 or float16 weights, "
                          f"the model is {str(dt).removeprefix('torch.')}")
    if dev not in ("cpu", "cuda"):
        raise SpeclmError(f"{scheme} quantization runs on cpu or cuda, the model is on {dev}")
    try:  # probe the kernel once on a small layer of the same dtype and device
        probe = nn.Linear(128, 16, bias=False, device=w.device, dtype=dt)
        module = Int8Linear(probe) if scheme == "int8" else Int4Linear(probe)
        module(torch.zeros(2, 128, dtype=dt, device=w.device))
    except (RuntimeError, NotImplementedError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise SpeclmError(f"{scheme} quantization is not supported for {str(dt).removeprefix('torch.')} "
                          f"on {dev} by this PyTorch build: {first}") from None


def quantize_weights(model: nn.Module, scheme: str, *, skip: tuple[str, ...] = ()) -> int:
    """Swap every ``nn.Linear`` of ``model`` (in place) for its weight-only ``scheme`` version
    ("int8" or "int4"), except modules whose name contains one of ``skip``. Returns how many."""
    if scheme not in SCHEMES:
        raise SpeclmError(f"unknown quantization {scheme!r}; use one of {', '.join(SCHEMES)}")
    linears = [(name, m) for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and not any(s in name for s in skip)]
    if not linears:
        raise SpeclmError(f"{type(model).__name__} has no nn.Linear layers to quantize")
    _check(scheme, linears[0][1])
    if scheme == "int4":
        for name, m in linears:
            _group_size(m.in_features)  # fail before touching the model
    with torch.no_grad():
        for name, m in linears:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, Int8Linear(m) if scheme == "int8" else Int4Linear(m))
    return len(linears)


def quantized_copy(model: nn.Module, scheme: str, dtype: torch.dtype | None = None) -> nn.Module:
    """A weight-only ``scheme`` copy of ``model`` that shares every tensor it does not quantize.

    The copy's ``nn.Linear`` layers are swapped for quantized ones built from the original
    weights; embeddings, norms and every other parameter stay the very tensors of ``model`` (no
    second float copy), and ``model`` itself is unchanged. ``dtype`` (default: the model's own)
    is the copy's compute dtype; PyTorch's quantized kernels take float32, bfloat16 or float16,
    so a float64 model (tests) is copied in float32. A copy in another dtype than the model's
    owns its tensors (cast like the compiled path casts: rotary frequencies stay float32).
    """
    current = next(model.parameters()).dtype
    if dtype is None:
        dtype = current if current in (torch.float32, torch.bfloat16, torch.float16) else torch.float32
    if dtype == current:
        # the module tree is new, every parameter memoized as itself: the tensors are shared
        clone = copy.deepcopy(model, memo={id(p): p for p in model.parameters()})
    else:  # casting shared parameters would cast the target's own (``Module.to`` sets .data)
        clone = cast_keeping_rotary(copy.deepcopy(model), dtype)
    quantize_weights(clone, scheme)
    return clone.eval()
