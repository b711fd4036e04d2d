"""Weight-only quantized linear layers on PyTorch's own kernels: the modules themselves.

* :class:`Int8Linear`: per-output-channel symmetric int8, ``torch._weight_int8pack_mm``;
* :class:`Int4Linear`: grouped asymmetric int4 (a scale and a zero per group of inputs),
  ``torch._weight_int4pack_mm_for_cpu`` on CPU and ``torch._weight_int4pack_mm`` on CUDA, packed
  from codes rounded here (:meth:`Int4Linear.from_linear`) or given (a GGUF file's own blocks,
  models/gguf_int4.py).

On a CPU, PyTorch's weight-only kernels are vectorized for bfloat16 activations only: float32
(and float16) rows take a scalar loop, 5-50x slower (a 262k-row output head: 80 ms a token
against 16 ms in bfloat16, docs/benchmarks.md "Weight-only kernels in float32"). So a layer
rounded here (:class:`Int8Linear`, :meth:`Int4Linear.from_linear`) of a float32 model on a CPU
multiplies its activations in bfloat16 and returns its rows in the model's dtype
(:func:`kernel_dtype`); its weights are rounded to 8 or 4 bits anyway. A layer on a GGUF file's
own blocks keeps the model's dtype, so that it computes the file's weights.

:func:`q8_0_codes` rounds a float weight to llama.cpp's Q8_0 form for speclm's own block kernel
(:class:`~.small_m.BlockLinear`), which the quantized self-draft's float32 CPU copy runs instead
of :class:`Int8Linear`.

Which layers get swapped, and how a model is copied for it: models/quantize.py.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import SpeclmError


def kernel_dtype(dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
    """The activations' dtype a rounded int8/int4 layer of a ``dtype`` model on ``device``
    multiplies in: bfloat16 on a CPU (the kernels' only vectorized form there), else ``dtype``."""
    return torch.bfloat16 if torch.device(device).type == "cpu" else dtype


class Int8Linear(nn.Module):
    """y = x @ (w_int8 * scale[:, None]).T + bias, with w_int8 [N, K] and one scale per row;
    x multiplied in :func:`kernel_dtype`, y in x's dtype."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        wf = w.float()
        scale = wf.abs().amax(dim=1).clamp(min=1e-8) / 127.0  # [N]
        q = torch.clamp(torch.round(wf / scale[:, None]), -127, 127).to(torch.int8)
        self.register_buffer("weight_int8", q.contiguous())
        # (converting the scales inside a compiled graph trips inductor's int8 lowering: keep
        # them in the dtype the kernel multiplies in)
        self.register_buffer("scales", scale.to(kernel_dtype(w.dtype, w.device)))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape  # [..., K]
        y = torch._weight_int8pack_mm(x.reshape(-1, shape[-1]).to(self.scales.dtype), self.weight_int8,
                                      self.scales)  # [M, N]; .to() is a no-op at the same dtype
        y = y.to(x.dtype).view(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def q8_0_codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round ``weight`` [N, K] (K a multiple of 32) to llama.cpp's Q8_0 form: one symmetric
    scale per block of 32 inputs, codes [N, K] (int8, as uint8 bytes) and scale [N, K/32]
    (float32; the file format stores it in float16), w ~ code * scale. Finer than one scale per
    row (:class:`Int8Linear`), and the layout of speclm's block kernel (models/small_m.py)."""
    n, k = weight.shape
    blocks = weight.detach().float().view(n, k // 32, 32)
    scale = blocks.abs().amax(dim=2).clamp(min=1e-12) / 127.0  # [N, K/32]
    codes = torch.clamp(torch.round(blocks / scale[..., None]), -127, 127).to(torch.int8)
    return codes.view(n, k).view(torch.uint8).contiguous(), scale.contiguous()


def _group_size(in_features: int) -> int:
    for g in (128, 64, 32):
        if in_features % g == 0:
            return g
    raise SpeclmError(f"int4 needs input widths divisible by 32, a layer has {in_features}")


def int4_codes(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round ``weight`` [N, K] to asymmetric 4-bit codes per group of ``group_size`` inputs:
    codes [N, K] (0..15), scale and minimum [N, K/group_size], w ~ code * scale + minimum."""
    n, k = weight.shape
    grouped = weight.float().view(n, k // group_size, group_size)
    lo, hi = grouped.amin(dim=2), grouped.amax(dim=2)  # [N, K/g]
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    codes = torch.clamp(torch.round((grouped - lo[..., None]) / scale[..., None]), 0, 15)
    return codes.view(n, k).to(torch.int32), scale, lo


class Int4Linear(nn.Module):
    """Grouped asymmetric int4: w = code * scale + minimum per group of ``group_size`` inputs.

    Built from a float layer (:meth:`from_linear`, codes rounded here) or from codes someone
    else rounded (a GGUF file's own blocks, models/gguf_int4.py): the packed layout keeps the
    codes as given, so such a layer computes exactly the weights they describe (up to the
    rounding of scale and minimum to the compute dtype)."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                 bias: torch.Tensor | None, dtype: torch.dtype, inner_k_tiles: int = 8) -> None:
        """``dtype``: the dtype the kernel multiplies in on a CPU (its scales and zeros are
        stored in it; activations of another dtype are cast to it and back)."""
        super().__init__()
        n, k = codes.shape  # codes [N, K] int 0..15; scale, minimum [N, K/g] float32
        self.in_features, self.out_features = k, n
        self.group_size = g = k // scale.shape[1]
        self.on_cuda = codes.device.type == "cuda"
        multiple = 8 if self.on_cuda else 16  # the packing kernels want N in whole tiles: pad rows
        padded = -(-n // multiple) * multiple
        if padded > n:
            codes = torch.cat([codes, codes.new_zeros(padded - n, k)])
            scale = torch.cat([scale, scale.new_ones(padded - n, k // g)])
            minimum = torch.cat([minimum, minimum.new_zeros(padded - n, k // g)])
        codes = codes.to(torch.int32).contiguous()
        zero = minimum + 8 * scale  # the kernels compute (code - 8) * scale + zero
        scales_zeros = torch.stack([scale, zero], dim=2).transpose(0, 1).contiguous()  # [K/g, N, 2]
        if self.on_cuda:
            if k % (inner_k_tiles * 16):
                raise SpeclmError(f"int4 on CUDA needs input widths divisible by {inner_k_tiles * 16}, "
                                  f"a layer has {k}")
            packed = torch._convert_weight_to_int4pack((codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8),
                                                       inner_k_tiles)
            scales_zeros = scales_zeros.to(torch.bfloat16)
        else:
            packed = torch._convert_weight_to_int4pack_for_cpu(codes, 1)
            scales_zeros = scales_zeros.to(dtype)
        self.register_buffer("weight_int4", packed)
        self.register_buffer("scales_and_zeros", scales_zeros)
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int4Linear:
        """Round a float layer's weights to int4 in groups of 128, 64 or 32 inputs."""
        w = linear.weight.detach()
        codes, scale, minimum = int4_codes(w, _group_size(linear.in_features))
        return cls(codes, scale, minimum, linear.bias, kernel_dtype(w.dtype, w.device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.on_cuda:
            y = torch._weight_int4pack_mm(x2.to(torch.bfloat16), self.weight_int4, self.group_size,
                                          self.scales_and_zeros).to(x.dtype)
        else:
            sz = self.scales_and_zeros
            y = torch._weight_int4pack_mm_for_cpu(x2.to(sz.dtype), self.weight_int4, self.group_size,
                                                  sz).to(x.dtype)
        if y.shape[-1] != self.out_features:  # padded rows
            y = y[:, : self.out_features]
        y = y.reshape(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 g={self.group_size}"
