"""transformers' RMSNorm layers as one kernel call each, for eager float32 steps on the CPU.

A decoding step of a small model runs a norm per sublayer (Gemma-3-270M: 109 a forward, with the
per-head query and key norms), and transformers writes each as six to eight ATen calls on a few
hundred floats: eagerly, ~45 us of dispatch each, 10-15% of a quantized self-draft's forward on a
2-core CPU. :func:`use_fast_norms` runs those layers on ``speclm::rms_norm``
(models/small_m_norm.cpp) instead, in the same object (its class swapped for a subclass, as
:func:`~.small_m.use_small_m` does for linear layers): parameters, hooks and ties are kept.

Which layers: any leaf module with a one-dimensional ``weight``, no bias and an ``eps`` or
``variance_epsilon`` attribute whose own forward, probed on two inputs (one at a scale where
``eps`` matters), equals ``x * rsqrt(mean(x^2) + eps) * (w + offset)`` for offset 0 (Llama,
Qwen, SmolLM) or 1 (Gemma's ``1 + w``) up to float32 rounding. A layer that computes anything
else (a LayerNorm, a norm without a scale, a model never seen) keeps its own forward. Compiled
graphs, other dtypes and devices, and autograd run the layer's own forward too: inductor fuses
the norm into its neighbours, which a kernel call would prevent.
"""

from __future__ import annotations

import torch
from torch import nn

from .small_m import kernel_runs

_SUBCLASSES: dict[type, type] = {}  # a norm class -> its fast subclass


def _applies(module: nn.Module, x: torch.Tensor) -> bool:
    return (not torch.compiler.is_compiling() and x.dtype == torch.float32 and x.device.type == "cpu"
            and not (torch.is_grad_enabled() and (x.requires_grad or module.weight.requires_grad))
            and module.weight.dtype == torch.float32 and x.shape[-1] == module.weight.shape[0])


def _fast_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if _applies(self, x):
        return torch.ops.speclm.rms_norm(x, self.weight, self._speclm_eps, self._speclm_offset)
    return type(self)._speclm_own_forward(self, x)  # a plain call: traced graphs inline it


def _subclass(cls: type) -> type:
    if cls not in _SUBCLASSES:
        _SUBCLASSES[cls] = type(cls.__name__, (cls,), {"forward": _fast_forward, "_speclm_own_forward": cls.forward,
                                                       "__module__": cls.__module__})
    return _SUBCLASSES[cls]


def _eps(module: nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps"):
        value = getattr(module, name, None)
        if isinstance(value, float) and value >= 0:
            return value
    return None


def _offset(module: nn.Module, eps: float) -> float | None:
    """0.0 or 1.0 where ``module`` computes the RMS norm with that weight offset, else None."""
    weight = module.weight
    gen = torch.Generator().manual_seed(0)
    probes = [torch.randn(3, weight.shape[0], generator=gen) * scale for scale in (1.0, max(eps, 1e-12) ** 0.5)]
    with torch.no_grad():
        try:
            own = [module.forward(x) for x in probes]
        except Exception:  # noqa: BLE001  (a norm that takes other arguments: leave it alone)
            return None
        for offset in (0.0, 1.0):
            mine = [torch.ops.speclm.rms_norm(x, weight, eps, offset) for x in probes]
            if all(isinstance(o, torch.Tensor) and o.shape == m.shape and o.dtype == m.dtype
                   and torch.allclose(o, m, rtol=1e-5, atol=1e-6 * float(m.abs().max()) + 1e-30)
                   for o, m in zip(own, mine)):
                return offset
    return None


def use_fast_norms(model: nn.Module) -> int:
    """Run (in place) every RMSNorm layer of a float32 CPU ``model`` on speclm's kernel where it
    builds; returns how many layers were swapped (0 elsewhere)."""
    if not kernel_runs(model):
        return 0
    swapped = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (type(module) in _SUBCLASSES.values() or next(module.children(), None) is not None
                or not isinstance(weight, nn.Parameter) or weight.dim() != 1
                or weight.dtype != torch.float32 or getattr(module, "bias", None) is not None):
            continue
        eps = _eps(module)
        offset = None if eps is None else _offset(module, eps)
        if offset is None:
            continue
        module._speclm_eps, module._speclm_offset = eps, offset
        module.__class__ = _subclass(type(module))
        swapped += 1
    return swapped
