"""Weight-only int8 / int4 quantization of a model's ``nn.Linear`` layers with PyTorch's own kernels
(the layer modules: models/quant_linear.py).

* ``int8``: per-output-channel symmetric scales, ``torch._weight_int8pack_mm`` (CPU and CUDA);
  activations stay in the model's dtype (float32 or bfloat16/float16). A quantized self-draft's
  float32 CPU copy (:func:`quantized_copy`) takes 8-bit blocks on speclm's kernel instead (and
  4-bit blocks for ``int4``).
* ``int4``: groups of 32-128 input channels with a scale and a zero point each (asymmetric),
  ``torch._weight_int4pack_mm_for_cpu`` on CPU and ``torch._weight_int4pack_mm`` on CUDA
  (bfloat16 activations there).

* ``gguf``: a GGUF model's own Q4_0/Q4_1/Q8_0 blocks on the int4 kernels, no second rounding
  (models/gguf_int4.py).

Embeddings stay as they are (only the gathered rows are read). The output head is a Linear and is
quantized too, even when its weight is tied to the embeddings (the embedding keeps the original).
Quantization is lossy: a quantized model's greedy tokens differ from the float model's, but
speculative decoding on it stays lossless with respect to its own plain decoding.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

from ..errors import SpeclmError
from .dtypes import cast_keeping_rotary
from .quant_linear import Int4Linear, Int8Linear, _group_size

__all__ = ["CHOICES", "SCHEMES", "Int4Linear", "Int8Linear", "quantize_weights", "quantized_copy"]

SCHEMES = ("int8", "int4")  # rounded here from float weights
CHOICES = SCHEMES + ("gguf",)  # what --quantize takes: gguf keeps a GGUF's own blocks (gguf_int4.py)


def _check(scheme: str, linear: nn.Linear, blocks: bool = False) -> None:
    """Fail with a clear message on a combination PyTorch's kernels do not support (with
    ``blocks``, a layer that goes to speclm's block kernel needs no probe of PyTorch's)."""
    w = linear.weight
    dt, dev = w.dtype, w.device.type
    if dt not in (torch.float32, torch.bfloat16, torch.float16):
        raise SpeclmError(f"{scheme} quantization needs float32, bfloat16 or float16 weights, "
                          f"the model is {str(dt).removeprefix('torch.')}")
    if dev not in ("cpu", "cuda"):
        raise SpeclmError(f"{scheme} quantization runs on cpu or cuda, the model is on {dev}")
    if blocks and blocks_fit(linear):
        return
    try:  # probe the kernel once on a small layer of the same dtype and device
        probe = nn.Linear(128, 16, bias=False, device=w.device, dtype=dt)
        module = Int8Linear(probe) if scheme == "int8" else Int4Linear.from_linear(probe)
        module(torch.zeros(2, 128, dtype=dt, device=w.device))
    except (RuntimeError, NotImplementedError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise SpeclmError(f"{scheme} quantization is not supported for {str(dt).removeprefix('torch.')} "
                          f"on {dev} by this PyTorch build: {first}") from None


def blocks_fit(linear: nn.Linear) -> bool:
    """Whether speclm's CPU block kernel runs ``linear`` rounded to blocks of 32 inputs: float32
    on a CPU where the kernel builds, input width a multiple of 32."""
    from .small_m import kernel_available

    w = linear.weight
    return (w.dtype == torch.float32 and w.device.type == "cpu" and linear.in_features % 32 == 0
            and kernel_available())


def _rounded(linear: nn.Linear, scheme: str, blocks: bool = False) -> nn.Module:
    """``linear`` rounded to ``scheme`` ("int8" or "int4") by PyTorch's kernels' layers; with
    ``blocks``, a float32 CPU layer goes to llama.cpp's block forms on speclm's kernel instead
    (int8: Q8_0, a scale per 32 inputs; int4: Q4_1, a scale and a minimum per 32 inputs)."""
    if blocks and blocks_fit(linear):
        from .gguf_int4 import block_activations, pack_q4
        from .quant_linear import int4_codes, q8_0_codes
        from .small_m import BlockLinear

        if scheme == "int8":
            codes, scale = q8_0_codes(linear.weight)
            return BlockLinear(codes, scale, None, 8, linear.bias, block_activations())
        codes, scale, minimum = int4_codes(linear.weight.detach(), 32)  # [N, K] in 0..15: w ~ code * scale + min
        packed = pack_q4(codes.to(torch.uint8))  # [N, K/2], Q4_1's nibble order
        return BlockLinear(packed, scale, minimum, 4, linear.bias, block_activations())
    return Int8Linear(linear) if scheme == "int8" else Int4Linear.from_linear(linear)


def quantize_weights(model: nn.Module, scheme: str, *, skip: tuple[str, ...] = (),
                     gguf: str | Path | None = None, blocks: bool = False) -> int:
    """Swap every ``nn.Linear`` of ``model`` (in place) for its weight-only ``scheme`` version
    ("int8" or "int4"), except modules whose name contains one of ``skip``; or, for "gguf", the
    layers that the GGUF file ``gguf`` (the model's source) stores in blocks for int4 layers on
    those blocks (models/gguf_int4.py). ``blocks``: float32 layers on a CPU run as 8- or 4-bit
    blocks on speclm's kernel where it builds (:func:`_rounded`). Returns how many."""
    if scheme not in CHOICES:
        raise SpeclmError(f"unknown quantization {scheme!r}; use one of {', '.join(CHOICES)}")
    if scheme == "gguf":
        if gguf is None:
            raise SpeclmError("--quantize gguf keeps a GGUF file's own blocks; this model was not "
                              "loaded from a GGUF file (use int4 or int8)")
        from .gguf_int4 import keep_gguf_int4

        return len(keep_gguf_int4(model, gguf).int4)
    linears = [(name, m) for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and not any(s in name for s in skip)]
    if not linears:
        raise SpeclmError(f"{type(model).__name__} has no nn.Linear layers to quantize")
    # a layer that runs on PyTorch's kernels is probed; if every one goes to blocks, none is
    _check(scheme, next((m for _, m in linears if not (blocks and blocks_fit(m))), linears[0][1]), blocks)
    if scheme == "int4":
        for name, m in linears:
            _group_size(m.in_features)  # fail before touching the model
    with torch.no_grad():
        for name, m in linears:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, _rounded(m, scheme, blocks))
    return len(linears)


def quantized_copy(model: nn.Module, scheme: str, dtype: torch.dtype | None = None,
                   gguf: str | Path | None = None, vocab: torch.Tensor | None = None) -> nn.Module:
    """A weight-only ``scheme`` copy of ``model`` that shares every tensor it does not quantize.

    The copy's ``nn.Linear`` layers are swapped for quantized ones built from the original
    weights; embeddings, norms and every other parameter stay the very tensors of ``model`` (no
    second float copy), and ``model`` itself is unchanged. ``dtype`` (default: the model's own)
    is the copy's compute dtype; PyTorch's quantized kernels take float32, bfloat16 or float16,
    so a float64 model (tests) is copied in float32. A copy in another dtype than the model's
    owns its tensors (cast like the compiled path casts: rotary frequencies stay float32).

    ``vocab`` (ascending token ids): the copy's output layer covers only those tokens, its other
    logits -inf (models/vocab_subset.py; a draft's cheaper head). The rows are rounded to int8
    (``int8``, and ``gguf``, whose heads are commonly 8-bit or wider) or int4 (``int4``).

    A copy in float32 on a CPU where speclm's block kernel builds is rounded to llama.cpp's block
    forms instead (``int8``: Q8_0, one scale per 32 inputs; ``int4``: Q4_1, a scale and a minimum
    per 32 inputs) and runs on that kernel with 8-bit activations (:class:`~.small_m.BlockLinear`):
    PyTorch's weight-only kernels multiply float32 rows in bfloat16 at about half the bandwidth
    (docs/benchmarks.md, "The quantized self-draft on speclm's block kernel"). A draft may round
    as it likes; the target is untouched.
    """
    current = next(model.parameters()).dtype
    if dtype is None:
        dtype = current if current in (torch.float32, torch.bfloat16, torch.float16) else torch.float32
    if dtype == current:
        # the module tree is new, every parameter memoized as itself: the tensors are shared
        clone = copy.deepcopy(model, memo={id(p): p for p in model.parameters()})
    else:  # casting shared parameters would cast the target's own (``Module.to`` sets .data)
        clone = cast_keeping_rotary(copy.deepcopy(model), dtype)
    if vocab is not None:  # before the rest, so that the full head is never quantized
        from .vocab_subset import restrict_head

        head_scheme = "int4" if scheme == "int4" else "int8"

        def rows_layer(rows: nn.Linear) -> nn.Module:
            rows = rows.to(dtype)
            _check(head_scheme, rows, blocks=True)
            return _rounded(rows, head_scheme, blocks=True)

        restrict_head(clone, model, vocab, rows_layer)
    quantize_weights(clone, scheme, gguf=gguf, blocks=True)
    return clone.eval()
