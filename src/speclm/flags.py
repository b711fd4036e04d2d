"""Command-line flags shared by ``speclm generate``, ``chat``, ``bench`` and ``serve``: one
definition each, so the commands cannot drift apart (and none imports another to get them)."""

from __future__ import annotations

import argparse


def _positive(kind: type):
    def parse(text: str):
        try:
            return kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a valid {kind.__name__}: {text!r}") from None
    return parse


def add_target_flags(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """--model, --gguf-file, --device, --dtype (also used by ``speclm serve``)."""
    g = p.add_argument_group("model")
    g.add_argument("--model", "-m", default="default",
                   help="target: 'default' (embedded SmolLM2-135M-Instruct), an HF folder or a "
                        ".gguf file (default: %(default)s)")
    g.add_argument("--gguf-file", help="GGUF file name inside --model when it is a folder")
    g.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (default: %(default)s)")
    g.add_argument("--dtype", default="auto",
                   help="float32, bfloat16, float16, float64 or auto: float32 on CPU, bfloat16 on "
                        "GPUs that support it (default: %(default)s)")
    return g


def add_backend_flags(g: argparse._ArgumentGroup) -> None:
    """--backend, --compile, --quantize (generate, chat and bench)."""
    g.add_argument("--backend", choices=["auto", "torch", "llamacpp"], default="auto",
                   help="what runs the model: torch (transformers), llamacpp (a GGUF file through "
                        "llama.cpp; pip install 'speclm[llamacpp]') or auto: llama.cpp for a GGUF "
                        "model on the CPU when installed and nothing needs torch (default: %(default)s)")
    g.add_argument("--compile", action="store_true",
                   help="torch fast path: static KV cache, torch.compile'd decode/verify steps, "
                        "bfloat16 where the hardware has it unless --dtype says otherwise; the "
                        "first request pays the compile (one time)")
    # models/quantize.py CHOICES, spelled out: importing the models here would load transformers
    g.add_argument("--quantize", choices=["int8", "int4", "gguf"], default=None,
                   help="weight-only quantized linear layers on the torch fast path: int8 or int4 "
                        "round the float weights (int4 in groups of up to 128; on a CPU they "
                        "multiply bfloat16 activations, PyTorch's only fast form); gguf runs a GGUF "
                        "model's own Q4_0/Q4_1/Q8_0 blocks as the file stores them (groups of 32, "
                        "the file's scales and minimums; no second rounding), other layers in the "
                        "compute dtype")
    g.add_argument("--verbose", "-v", action="store_true",
                   help="show llama.cpp's own loader and context logs (silent otherwise) and the "
                        "measured cost model (verify cost per tokens fed) that the draft length uses")
