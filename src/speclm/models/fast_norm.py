"""transformers' RMSNorm layers as one kernel call each, for eager float32 steps on the CPU.

A decoding step of a small model runs a norm per sublayer (Gemma-3-270M: 109 a forward, with the
per-head query and key norms), and transformers writes each as six to eight ATen calls on a few
hundred floats: eagerly, ~25 us each against ~9 us for one call, 10-15% of a quantized
self-draft's forward on a 2-core CPU. :func:`use_fast_norms` runs those layers on ``speclm::rms_norm``
(models/small_m_norm.cpp) instead, in the same object (its class swapped for a subclass, as
:func:`~.small_m.use_small_m` does for linear layers): parameters, hooks and ties are kept.

Which layers: any leaf module with a one-dimensional ``weight``, no bias, a forward of one
tensor (a gated norm takes a gate too: left alone) and an ``eps`` or ``variance_epsilon``
attribute whose own forward, probed with a random weight on two inputs (one at a scale where
``eps`` matters), equals ``x * rsqrt(mean(x^2) + eps) * (w + offset)`` for offset 0 (Llama,
Qwen, SmolLM) or 1 (Gemma's ``1 + w``) up to float32 rounding. A layer that computes anything
else (a LayerNorm, a norm without a scale, a model never seen) keeps its own forward. Compiled
graphs, other dtypes and devices, and autograd run the layer's own forward too: inductor fuses
the norm into its neighbours, which a kernel call would prevent; so do all layers after
:func:`set_enabled` (False) or :func:`~.small_m.set_kernel_enabled` (False). A swapped layer
deep-copies and pickles as itself.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from . import small_m

_SUBCLASSES: dict[type, type] = {}  # a norm class -> its fast subclass
_enabled = True  # set_enabled(False): every swapped layer runs its own forward (benchmarks compare)
_F32, _CPU = torch.float32, torch.device("cpu").type


def set_enabled(enabled: bool) -> None:
    """Turn the swapped norms' kernel calls on or off for this process (also off with
    :func:`~.small_m.set_kernel_enabled`)."""
    global _enabled
    _enabled = enabled


def _fast_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    w = self._parameters["weight"]
    if (_enabled and small_m._enabled and x.dtype is _F32 and w.dtype is _F32 and x.device.type == _CPU
            and not torch.compiler.is_compiling()
            and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))):
        return _rms_norm(x, w, self._speclm_eps, self._speclm_offset)
    return type(self)._speclm_own_forward(self, x)  # a plain call: traced graphs inline it


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    return torch.ops.speclm.rms_norm.default(x, w, eps, offset)


def _rebuild(base: type, state: dict) -> nn.Module:
    """Unpickle a swapped layer: the base class's object, swapped again."""
    module = base.__new__(base)
    module.__dict__.update(state)
    module.__class__ = _subclass(base)
    return module


def _reduce_ex(self: nn.Module, protocol: int):
    return _rebuild, (type(self).__mro__[1], self.__dict__)


def _subclass(cls: type) -> type:
    if cls not in _SUBCLASSES:
        _SUBCLASSES[cls] = type(cls.__name__, (cls,), {
            "forward": _fast_forward, "_speclm_own_forward": cls.forward, "__reduce_ex__": _reduce_ex,
            "__module__": cls.__module__})
    return _SUBCLASSES[cls]


def _eps(module: nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps"):
        value = getattr(module, name, None)
        if isinstance(value, float) and value >= 0:
            return value
    return None


def _one_input(module: nn.Module) -> bool:
    """Whether ``module``'s forward takes one tensor (a gated norm takes a gate too)."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return False
    return len(params) == 1 and params[0].kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                   inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _offset(module: nn.Module, eps: float) -> float | None:
    """0.0 or 1.0 where ``module`` computes the RMS norm with that weight offset, else None.
    Probed with a random weight (not the layer's own, which may still be its initial ones or
    zeros and hide how the weight is used) on two inputs, one small enough that ``eps`` matters."""
    size = module.weight.shape[0]
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(size, generator=gen)
    probes = [torch.randn(3, size, generator=gen) * scale for scale in (1.0, max(eps, 1e-12) ** 0.5)]
    with torch.no_grad():
        try:
            own = [torch.func.functional_call(module, {"weight": weight}, (x,)) for x in probes]
        except Exception:  # noqa: BLE001  (a norm that needs other arguments or state: leave it alone)
            return None
        for offset in (0.0, 1.0):
            mine = [_rms_norm(x, weight, eps, offset) for x in probes]
            if all(isinstance(o, torch.Tensor) and o.shape == m.shape and o.dtype == m.dtype
                   and torch.allclose(o, m, rtol=1e-5, atol=1e-6 * float(m.abs().max()) + 1e-30)
                   for o, m in zip(own, mine)):
                return offset
    return None


def use_fast_norms(model: nn.Module) -> int:
    """Run (in place) every RMSNorm layer of a float32 CPU ``model`` on speclm's kernel where it
    builds; returns how many layers were swapped (0 elsewhere)."""
    if not small_m.kernel_runs(model):
        return 0
    swapped = 0
    for module in model.modules():
        weight = module._parameters.get("weight")
        if (type(module) in _SUBCLASSES.values() or next(module.children(), None) is not None
                or weight is None or weight.dim() != 1 or weight.numel() == 0
                or weight.dtype != torch.float32 or getattr(module, "bias", None) is not None
                or not _one_input(module)):
            continue
        eps = _eps(module)
        offset = None if eps is None else _offset(module, eps)
        if offset is None:
            continue
        module._speclm_eps, module._speclm_offset = eps, offset
        module.__class__ = _subclass(type(module))
        swapped += 1
    return swapped
