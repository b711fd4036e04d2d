"""A lower-bit copy of a GGUF file, made once by llama.cpp's own quantizer and cached.

The quantized self-draft (drafters/quant.py) drafts with the target's own weights at fewer bits.
On llama.cpp those weights come from ``llama_model_quantize`` run on the target's GGUF file
(``allow_requantize``: the source is usually quantized already). The copy is cached under the
speclm cache directory (``$SPECLM_CACHE_DIR``, ``requantized/``), keyed by the source file's
identity (resolved path, size, modification time) and the type, and written to a temporary file
that is renamed into place, so a crash never leaves a half-written copy behind.

llama.cpp chooses per tensor: a k-quant (``q2_k``, ``q3_k_s``) needs rows that divide into blocks
of 256, and tensors whose rows do not (SmolLM2-135M's 576-wide layers) get llama.cpp's own
fallback type instead, so such a model's "2-bit" copy is mostly 4-bit (IQ4_NL).
"""

from __future__ import annotations

import ctypes
import os
import sys
import tempfile
import time
from pathlib import Path

from ..errors import SpeclmError
from .llamacpp import import_llama_cpp, last_native_error
from .loading import cache_dir, file_key

# speclm's name -> llama.cpp's file type (LLAMA_FTYPE_MOSTLY_*)
GGUF_TYPES = {"q2_k": "Q2_K", "q3_k_s": "Q3_K_S", "q4_0": "Q4_0", "q4_k_s": "Q4_K_S",
              "q5_0": "Q5_0", "q8_0": "Q8_0"}


def requantized_path(source: Path, type_name: str) -> Path:
    """Where the ``type_name`` copy of ``source`` is cached (it may not exist yet)."""
    return cache_dir() / "requantized" / f"{source.stem}-{type_name}-{file_key(source, type_name)}.gguf"


def requantize_gguf(source: Path, type_name: str, *, threads: int | None = None,
                    progress: bool = True) -> Path:
    """The cached ``type_name`` copy of the GGUF file ``source``, made now if missing."""
    if type_name not in GGUF_TYPES:
        raise SpeclmError(f"unknown GGUF type {type_name!r}; use one of {', '.join(GGUF_TYPES)}")
    out = requantized_path(source, type_name)
    if out.is_file():
        return out
    lc = import_llama_cpp()
    ftype = getattr(lc, f"LLAMA_FTYPE_MOSTLY_{GGUF_TYPES[type_name]}", None)
    if ftype is None:
        raise SpeclmError(f"this llama-cpp-python build has no {GGUF_TYPES[type_name]} quantization")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(dir=out.parent, prefix=".tmp-", suffix=".gguf")
        os.close(fd)
    except OSError as exc:
        raise SpeclmError(f"cannot write the requantized model under {out.parent} ({exc.strerror}); "
                          "set SPECLM_CACHE_DIR to a writable folder") from None
    tmp = Path(tmp_name)
    if progress:
        print(f"speclm: requantizing {source.name} to {GGUF_TYPES[type_name]} for the quantized draft "
              f"(one time; cached at {out})...", file=sys.stderr)
    t0 = time.perf_counter()
    try:
        lc.llama_backend_init()
        params = lc.llama_model_quantize_default_params()
        params.ftype = ftype
        params.allow_requantize = True
        params.nthread = threads or os.cpu_count() or 1
        rc = lc.llama_model_quantize(str(source).encode(), str(tmp).encode(), ctypes.byref(params))
        if rc != 0:
            detail = last_native_error()
            raise SpeclmError(f"llama.cpp could not requantize {source.name} to {GGUF_TYPES[type_name]} "
                              f"(code {rc}" + (f": {detail})" if detail else ")"))
        os.replace(tmp, out)  # atomic: readers see the whole file or none
    finally:
        tmp.unlink(missing_ok=True)
    if progress:
        print(f"speclm: requantized in {time.perf_counter() - t0:.1f} s "
              f"({out.stat().st_size / 2**20:.0f} MiB, source {source.stat().st_size / 2**20:.0f} MiB)",
              file=sys.stderr)
    return out
