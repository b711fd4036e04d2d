"""A C++ wrapper for compiled CPU steps that calls speclm's ops without Python.

Inductor turns a compiled step into fused C++ loops plus a wrapper that calls them and the ops it
cannot fuse, here speclm's GGUF block products and attention (models/small_m.py). By default the
wrapper is Python, and on a small model the wrapper is a large share of a step: the default
model's one-token step makes ~150 op calls and ~120 loop calls, a few microseconds of Python
each. Inductor's ``cpp_wrapper`` writes the wrapper in C++ instead, but calls an op it has no C
entry point for through Python again (slower than the Python wrapper). The kernels' build exports
an entry point for each of speclm's ops (``small_m_shims.cpp``), and this module tells inductor
their declarations (``aot_inductor.custom_ops_to_c_shims``), so the whole step runs in C++. Each
entry point calls its op through the dispatcher: the same kernels, the same bits.

Used where the kernels are built (x86 CPUs with AVX2) for compiled steps without weight freezing
(float32 and float64), except on PyTorch's int4 layers, whose CPU product has no C entry point
(models/compiled_step.py decides). ``SPECLM_CPP_WRAPPER=0``, or ``CPP_WRAPPER = False`` before a model is
compiled, keeps the Python wrapper (for a before/after in one process:
``benchmarks/step_cost.py --wrapper python,cpp``).
"""

from __future__ import annotations

import os

import torch

from . import small_m

ENV = "SPECLM_CPP_WRAPPER"  # "0": the Python wrapper
CPP_WRAPPER = os.environ.get(ENV, "1") != "0"  # read when a step is compiled
# The wrapper's optimization level. Inductor compiles a C++ wrapper and the fused loops as one
# file at -O3 by default, and -O3 on the wrapper (one straight-line function of ~1,000 calls for
# the default model) took g++ 145 s on a Zen 3 VM (the loops: 4 s), for each compiled graph;
# at -O2 it takes 35 s. "O2": the wrapper in its own file at -O2, the loops at -O3 as before;
# "O3": inductor's one file (for a before/after: benchmarks/step_cost.py --wrapper cpp,cpp-o3).
WRAPPER_OPT_LEVEL = "O2"

# op -> the declaration of its entry point, as inductor writes a call for its schema (a Tensor? is
# a pointer to a handle, a bool an int32_t, an int[] a pointer and a length, outputs last)
DECLARATIONS = {
    "small_m_mm": "AOTITorchError aoti_torch_cpu_small_m_mm(AtenTensorHandle x, AtenTensorHandle w, "
                  "AtenTensorHandle* ret0)",
    "small_m_blocks": "AOTITorchError aoti_torch_cpu_small_m_blocks(AtenTensorHandle x, AtenTensorHandle codes, "
                      "AtenTensorHandle scale, AtenTensorHandle* minimum, int64_t bits, AtenTensorHandle* ret0)",
    "small_m_blocks_q8": "AOTITorchError aoti_torch_cpu_small_m_blocks_q8(AtenTensorHandle x, AtenTensorHandle codes, "
                         "AtenTensorHandle scale, AtenTensorHandle* minimum, int64_t bits, AtenTensorHandle* ret0)",
    "dequantize_blocks": "AOTITorchError aoti_torch_cpu_dequantize_blocks(AtenTensorHandle codes, "
                         "AtenTensorHandle scale, AtenTensorHandle* minimum, int64_t bits, AtenTensorHandle* ret0)",
    "registered_blocks": "AOTITorchError aoti_torch_cpu_registered_blocks(AtenTensorHandle x, int64_t handle, "
                         "int32_t q8, AtenTensorHandle* ret0)",
    "registered_blocks_group": "AOTITorchError aoti_torch_cpu_registered_blocks_group(AtenTensorHandle x, "
                               "const int64_t* handles, int64_t count, AtenTensorHandle* ret0)",
    "small_m_attention": "AOTITorchError aoti_torch_cpu_small_m_attention(AtenTensorHandle query, "
                         "AtenTensorHandle key, AtenTensorHandle value, AtenTensorHandle* mask, double scale, "
                         "AtenTensorHandle* ret0)",
}


def wrapper_options() -> dict:
    """Inductor options for a C++ wrapper calling speclm's ops directly; empty (the Python
    wrapper) where it is turned off or the kernels' entry points are not loaded."""
    if not CPP_WRAPPER or not small_m.shims_available():
        return {}
    options = {"cpp_wrapper": True, "aot_inductor.custom_ops_to_c_shims": _ShimTable(tuple(DECLARATIONS.items()))}
    if WRAPPER_OPT_LEVEL != "O3":
        options.update({"cpp_wrapper_build_separate": True, "aot_inductor.compile_wrapper_opt_level": WRAPPER_OPT_LEVEL})
    return options


class _ShimTable(dict):
    """Inductor's ``custom_ops_to_c_shims`` (op -> [declaration]) that pickles by op name.

    Inductor keys its on-disk graph cache by a pickle of its options, and an op object does not
    pickle: with a plain dict every process compiled every graph again (~50 s a graph on a 2-core
    CPU, ~30 minutes for a server's 25). By name it pickles, so a graph compiled once is loaded
    by the next process; the table's contents are part of the key."""

    def __init__(self, items: tuple[tuple[str, str], ...]) -> None:
        ops = torch.ops.speclm
        super().__init__({getattr(ops, name).default: [declaration] for name, declaration in items})
        self.items_by_name = items

    def __reduce__(self) -> tuple:
        return _ShimTable, (self.items_by_name,)
