"""Float32 linear layers over a few rows on an AVX2 CPU: a verify that costs about one step.

Speculation pays when a forward over the K + 1 tokens of a verify costs about what a one-token
step costs. On an AVX2 CPU in float32 it does not with the BLAS: MKL runs 2-16 rows at 1.7-2.2x
its one-row cost (docs/benchmarks.md, "Where a compiled float32 step goes on an AVX2 CPU"),
because it packs the weights for a large product. ``small_m.cpp`` multiplies tiles of 3 weight
rows by 4 activation rows in registers, each weight row read from memory once for all rows and
the next ones asked into L2 meanwhile, so a few rows cost little more than one, a tree's 16-32
rows stay below the BLAS, and the one-row product runs at the memory bandwidth.

It also sums every output in one fixed order whatever the number of rows, so a row's linear
layers give bit-identical results in a one-token step and inside a verify.

A second entry runs a GGUF file's own Q4_0/Q4_1/Q8_0 blocks (:class:`BlockLinear`, made by
models/gguf_int4.py for ``--quantize gguf`` in float32): each block's codes are decoded to floats
once per weight row for every activation row. PyTorch's own int4 kernel takes about 0.2 s a token
for the default model in float32 on an AVX2 CPU; this one runs its step in a fraction of that.

:func:`use_small_m` swaps a model's ``nn.Linear`` layers for :class:`SmallMLinear` (same
parameters, tied weights stay tied), which runs the kernel for float32 inputs of at most
:data:`MAX_ROWS` rows on the CPU with autograd off, and ``F.linear`` otherwise (larger prefills,
other dtypes, other devices, training). The kernel is compiled on first use with PyTorch's C++
extension loader (g++ and ninja, about a minute once, cached per machine); where that fails, or the
CPU lacks AVX2/FMA, or ``SPECLM_CPU_KERNEL=0``, every layer runs ``F.linear`` as before.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import sys
import threading
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

# rows up to which the kernels beat the BLAS (benchmarks/small_m_gemm.py --modes aten,kernel,q4-q8,q4-blas):
MAX_ROWS = 32  # float weights: faster than MKL at every count to 32 (--modes aten,kernel); beyond, MKL
BLOCK_MAX_ROWS = 32  # a GGUF's blocks with float activations (small_m_blocks): beyond, the BLAS is cheaper
SOURCES = tuple(Path(__file__).with_name(n)
                for n in ("small_m.cpp", "small_m_attention.cpp", "small_m_q8.cpp", "small_m_tiles.cpp",
                          "small_m_tiles_avx2.cpp", "small_m_shims.cpp", "small_m_norm.cpp"))
HEADER = Path(__file__).with_name("small_m.h")
ENV = "SPECLM_CPU_KERNEL"  # "0" turns the kernel off
ISA_ENV = "SPECLM_CPU_ISA"  # "avx2" or "avx512-vnni": those kernels even where the CPU has more
ACTIVATIONS = ("q8", "float")  # how BlockLinear multiplies: 8-bit activations (llama.cpp's way) or floats

_lock = threading.Lock()
_loaded: bool | None = None  # None: not tried yet
_enabled = True
_shims = False  # the loaded build's C entry points are visible to a compiled step's C++ wrapper
_level: str | None = None  # the instruction set of the build this process loaded


def _cpu_has_avx2() -> bool:
    capability = torch.backends.cpu.get_cpu_capability()  # "DEFAULT", "AVX2", "AVX512", ...
    return capability.startswith(("AVX2", "AVX512"))


def isa() -> str:
    """The instruction set the kernels are built for on this CPU: "amx", "avx512-vnni" or "avx2"
    (where the compiler lacks its flags, the build falls back to the next lower one, with a warning).

    Detected, never assumed; SPECLM_CPU_ISA=avx2 or avx512-vnni builds for less than the CPU has (to
    compare). Each sums the 8-bit-activation products in its own order: their results agree up to
    float rounding, not bit for bit (within one build a row's result never depends on its batch)."""
    cpu, flags = torch.cpu, _cpu_flags()
    found = "avx2"
    if (all(getattr(cpu, f, lambda: False)() for f in ("_is_avx512_supported", "_is_vnni_supported"))
            and {"avx512bw", "avx512vl", "avx512_vnni"} <= flags):
        found = "avx512-vnni"
        if getattr(cpu, "_is_amx_tile_supported", lambda: False)() and "amx_int8" in flags:
            found = "amx"
    wanted = os.environ.get(ISA_ENV, "")
    order = list(_ISA_FLAGS)
    if wanted and wanted not in order:
        log.warning("speclm: %s=%r is not one of %s; building for this CPU's %s", ISA_ENV, wanted,
                    ", ".join(order), found)
    return wanted if wanted in order and order.index(wanted) < order.index(found) else found


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as fh:
            return next((frozenset(line.split(":", 1)[1].split()) for line in fh if line.startswith("flags")),
                        frozenset())
    except OSError:  # not Linux: the AVX2 build (AMX needs Linux's permission call anyway)
        return frozenset()


_AVX512 = ["-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"]
_ISA_FLAGS = {"avx2": ["-mavx2", "-mfma"], "avx512-vnni": _AVX512, "amx": [*_AVX512, "-mamx-tile", "-mamx-int8"]}


def kernel_available() -> bool:
    """Whether the kernel runs in this process: builds (or loads the cached build) on first call.

    False, with one logged warning, where it cannot be built; never raises."""
    global _loaded
    if _loaded is not None:
        return _loaded and _enabled
    with _lock:
        if _loaded is None:
            _loaded = _load()
    return _loaded and _enabled


def shims_available() -> bool:
    """Whether a compiled step's C++ wrapper can call the kernels' ops directly (models/c_shims.py)."""
    return kernel_available() and _shims


def build_name(level: str | None = None) -> str:
    """The kernels' build for instruction set ``level`` (default: what this process loaded, else
    this CPU's): named by a digest of the sources and flags, so a changed kernel is a new build
    (and a verify cost measured on the old one is not reused: cost_model.cost_key names it)."""
    level = level or _level or isa()
    flags = _ISA_FLAGS[level]
    return f"speclm_small_m_{_sources_digest(' '.join(flags))}"


@functools.cache
def _sources_digest(flags: str) -> str:
    sources = b"".join(p.read_bytes() for p in (*SOURCES, HEADER))
    return hashlib.sha256(sources + flags.encode()).hexdigest()[:12]


def _load() -> bool:
    global _level
    if os.environ.get(ENV, "1") == "0" or not _cpu_has_avx2():
        return False
    if hasattr(torch.ops, "speclm") and hasattr(torch.ops.speclm, "small_m_mm"):
        return True
    levels = list(_ISA_FLAGS)
    tried = levels[: levels.index(isa()) + 1][::-1]  # the CPU's best first; a compiler without its flags: lower
    for level in tried:
        try:
            _build(level)
        except Exception as exc:  # noqa: BLE001  (no compiler, no ninja, a read-only cache: run as before)
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            if level == "avx2":
                log.warning("speclm: the float32 CPU kernel is unavailable (%s); using torch's own "
                            "matrix products", first)
                return False
            log.warning("speclm: the %s CPU kernels did not build (%s); building for %s", level, first,
                        tried[tried.index(level) + 1])
            continue
        _register_fake()
        _level = level
        if not torch.ops.speclm.enable_tiles(level == "amx") and level == "amx":
            log.warning("speclm: the OS refused this process AMX's tile state; the block kernels run on AVX-512")
        return True
    return False


def _build(level: str) -> None:
    """Build (or load the cached build of) the kernels for instruction set ``level``."""
    from torch.utils.cpp_extension import _get_build_directory as _build_directory
    from torch.utils.cpp_extension import load

    flags = _ISA_FLAGS[level]
    name = build_name(level)  # flags in the name: a build for one CPU is never loaded on another
    if not any(Path(_build_directory(name, False)).glob("*.so")):
        print(f"speclm: building the CPU kernels for float32 steps ({level}; once, about a minute) ...",
              file=sys.stderr, flush=True)
    # -fopenmp: at::parallel_for's threads; -ffp-contract=off: the roundings written, no fused ones
    load(name=name, sources=[str(p) for p in SOURCES], extra_include_paths=[str(HEADER.parent)],
         extra_ldflags=["-fopenmp"], is_python_module=False,
         extra_cflags=["-O3", *flags, "-ffp-contract=off", "-fopenmp"], verbose=False)
    # the ops' C entry points (small_m_shims.cpp) are what a compiled step's C++ wrapper links
    # against when it is loaded: make the library's symbols visible to libraries loaded later
    library = Path(_build_directory(name, False)) / f"{name}.so"
    global _shims
    try:
        ctypes.CDLL(str(library), mode=os.RTLD_GLOBAL | os.RTLD_NOW)
        _shims = True
    except (AttributeError, OSError):  # no such flags (not a Unix) or no such file: the Python wrapper
        _shims = False


def _register_fake() -> None:
    """The op's output shape, so that torch.compile traces through it (an extern kernel call)."""
    def fake(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x.new_empty(x.shape[0], w.shape[0])

    def fake_blocks(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                    minimum: torch.Tensor | None, bits: int) -> torch.Tensor:
        return x.new_empty(x.shape[0], scale.shape[0])

    def fake_dequantize(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor | None,
                        bits: int) -> torch.Tensor:
        return scale.new_empty(scale.shape[0], scale.shape[1] * 32)

    def fake_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       mask: torch.Tensor | None, scale: float) -> torch.Tensor:
        return query.new_empty(query.shape[0], query.shape[2], query.shape[1], query.shape[3])

    def fake_registered(x: torch.Tensor, handle: int, q8: bool) -> torch.Tensor:
        return x.new_empty(x.shape[0], _block_rows[handle])

    def fake_group(x: torch.Tensor, handles: list[int]) -> torch.Tensor:
        return x.new_empty(x.shape[0], sum(_block_rows[h] for h in handles))

    for name, function in (("speclm::small_m_mm", fake), ("speclm::small_m_blocks", fake_blocks),
                           ("speclm::small_m_blocks_q8", fake_blocks),
                           ("speclm::registered_blocks", fake_registered),
                           ("speclm::registered_blocks_group", fake_group),
                           ("speclm::dequantize_blocks", fake_dequantize),
                           ("speclm::small_m_attention", fake_attention),
                           ("speclm::rms_norm", lambda x, w, eps, offset: x.new_empty(x.shape))):
        try:
            torch.library.register_fake(name)(function)
        except RuntimeError:  # registered already in this process
            pass


def set_kernel_enabled(enabled: bool) -> None:
    """Turn the kernel on or off for this process (benchmarks compare both in one run).
    Compiled graphs keep what they were compiled with."""
    global _enabled
    _enabled = enabled


def block_max_rows() -> int | None:
    """Rows up to which a :class:`BlockLinear` with 8-bit activations runs the kernel (None: any).

    On the tile layout the integer products beat decoding the blocks for the BLAS at every row
    count measured (AVX-512 VNNI / AMX: 1.6-4x from 16 to 512 rows on a 2-core Sapphire Rapids;
    AVX2: docs/benchmarks.md, "AVX2 products on the tile layout"), so every forward runs them,
    prefill chunks and wide verifies included, and a row's result has the same bits whatever
    else shares its forward. Every build repacks registered layers into that layout; without the
    kernel the limit is :data:`BLOCK_MAX_ROWS`."""
    return None if kernel_available() else BLOCK_MAX_ROWS


def _kernel_rows(x: torch.Tensor, limit: int | None) -> int:
    """How many rows ``x`` [..., K] hands the kernel: its rows for a float32 CPU input of at
    most ``limit`` rows outside autograd, else 0 (the layer runs the BLAS)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if ((limit is not None and rows > limit) or x.dtype != torch.float32 or x.device.type != "cpu"
            or (torch.is_grad_enabled() and x.requires_grad)):
        return 0
    return rows


class SmallMLinear(nn.Linear):
    """An ``nn.Linear`` whose float32 CPU forward over at most :data:`MAX_ROWS` rows runs the
    small-M kernel; any other call runs ``F.linear``. Same parameters and state dict."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        rows = _kernel_rows(x, MAX_ROWS)
        if (rows and w.dtype == torch.float32 and not (torch.is_grad_enabled() and w.requires_grad)
                and kernel_available()):
            y = torch.ops.speclm.small_m_mm(x.reshape(rows, x.shape[-1]), w)  # [rows, N]
            y = y.view(*x.shape[:-1], w.shape[0])
            return y if self.bias is None else y + self.bias
        return F.linear(x, w, self.bias)


class BlockLinear(nn.Module):
    """A GGUF layer on its own Q4_0/Q4_1/Q8_0 blocks, for float32 on an AVX2 CPU: inputs of at
    most :func:`block_max_rows` rows (any number with 8-bit activations on the tile layout,
    :data:`BLOCK_MAX_ROWS` with float activations) run the kernel on the file's codes, scales and
    minimums; longer ones (a float-activation prefill) multiply the blocks' float32 weights, decoded
    for the call (``speclm::dequantize_blocks``, gguf-py's values exactly), with the BLAS.

    ``codes``: uint8 [N, K/32 * 16] (4-bit, the file's nibble order) or [N, K] (8-bit, int8
    codes as bytes); ``scale``: float32 [N, K/32]; ``minimum``: float32 [N, K/32] for Q4_1,
    None for Q4_0 (weights scale * (code - 8)) and Q8_0.

    ``activations``: ``"q8"`` (the default) quantizes the activations to 8 bits per block of 32
    as llama.cpp does for these weights and multiplies with integer dot products
    (``speclm::small_m_blocks_q8``: what llama.cpp computes, about twice as fast); ``"float"``
    multiplies the float activations by the decoded weights (``speclm::small_m_blocks``).

    The blocks are registered with the kernel once (``speclm::register_blocks``) and the layer
    calls it with that integer handle: a compiled step then guards one integer per layer instead
    of three tensors (TorchDynamo checks every tensor a graph reads at each call, ~2 us each).
    The handle is released when the layer is freed, and taken anew by a copy or a moved layer."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor | None,
                 bits: int, bias: torch.Tensor | None, activations: str = "q8") -> None:
        super().__init__()
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {ACTIVATIONS}, got {activations!r}")
        self.bits, self.activations = bits, activations
        self.in_features, self.out_features = scale.shape[1] * 32, scale.shape[0]
        self.register_buffer("codes", codes.contiguous())
        self.register_buffer("scale", scale.float().contiguous())
        self.register_buffer("minimum", None if minimum is None else minimum.float().contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self._register()

    def _register(self) -> None:
        """Register the current buffers with the kernel (releasing what was registered before);
        the handle is released with the layer."""
        release = self.__dict__.get("_release")
        if release is not None:
            release()
        handle = torch.ops.speclm.register_blocks(self.codes, self.scale, self.minimum, self.bits)
        _block_rows[handle] = self.out_features
        self.handle = handle
        self._release = weakref.finalize(self, _release_blocks, handle)

    def __getstate__(self) -> dict:  # the handle belongs to this object, not to a copy
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__.copy()
        state = dict(state)
        state.pop("_release", None)
        state.pop("handle", None)
        return state

    def __setstate__(self, state: dict) -> None:  # a deep copy or an unpickled layer: its own handle
        super().__setstate__(state)
        self._register()

    def _apply(self, fn, recurse: bool = True):  # .to() and friends replace the buffers
        out = super()._apply(fn, recurse)
        self._register()
        return out

    def dequantized(self) -> torch.Tensor:
        """The layer's float32 weight [N, K], as the file's blocks describe it."""
        return torch.ops.speclm.dequantize_blocks(self.codes, self.scale, self.minimum, self.bits)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = _kernel_rows(x, block_max_rows() if self.activations == "q8" else BLOCK_MAX_ROWS)
        if rows:
            y = torch.ops.speclm.registered_blocks(x.reshape(rows, x.shape[-1]), self.handle,
                                                   self.activations == "q8")  # [rows, N]
            y = y.view(*x.shape[:-1], self.out_features)
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.dequantized().to(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, gguf {self.bits}-bit blocks, "
                f"{self.activations} activations")


_block_rows: dict[int, int] = {}  # registered block layers: handle -> output rows (for the fake)


def _release_blocks(handle: int) -> None:
    _block_rows.pop(handle, None)
    torch.ops.speclm.release_blocks(handle)


def kernel_in_use(model: nn.Module | None) -> bool:
    """Whether ``model``'s linear layers run the kernel now (its speed depends on it)."""
    if not isinstance(model, nn.Module) or not kernel_available():
        return False
    return any(isinstance(m, BlockLinear) or (type(m) is SmallMLinear and m.weight.dtype == torch.float32)
               for m in model.modules())


def kernel_runs(model: nn.Module) -> bool:
    """Whether ``model``'s layers can be swapped for the kernel's: its parameters are float32 on
    the CPU and the kernel runs in this process."""
    param = next(model.parameters(), None)
    return (param is not None and param.device.type == "cpu" and param.dtype == torch.float32
            and kernel_available())


def use_small_m(model: nn.Module) -> int:
    """Swap (in place) every plain ``nn.Linear`` of a float32 CPU ``model`` for a
    :class:`SmallMLinear` sharing its parameters; returns how many were swapped (0 where the
    kernel is unavailable, the model is not float32 on the CPU, or it has no such layers)."""
    if not kernel_runs(model):
        return 0
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    for module in linears:
        module.__class__ = SmallMLinear  # the same object: parameters, hooks, ties kept
    return len(linears)
