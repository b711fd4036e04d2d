"""The memory-bandwidth floor of decoding on this machine, for each way of running the model.

One decode step reads every weight once (a tied embedding is read once, as the LM head), so
no engine can decode faster than (memory bandwidth) / (bytes of weights per forward). This
measures the bandwidth (a streaming sum over a buffer far larger than the caches, with the same
threads torch uses, median of several runs) and prints the floor for the default model as
float32, bfloat16, int8 and int4 weights in torch and as the GGUF file's own quantization in llama.cpp.

    python benchmarks/bandwidth.py [--gib 2] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def read_bandwidth(gib: float, repeats: int) -> float:
    """Bytes per second read by ``x.sum()`` over a ``gib`` GiB float32 buffer (median)."""
    x = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32)
    x.sum()  # touch every page first
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        rates.append(x.numel() * 4 / (time.perf_counter() - t0))
    return statistics.median(rates)


def torch_bytes(model: torch.nn.Module, bytes_per_weight: float, matrices: float | None = None) -> float:
    """Weights read per decode step: every parameter once (a tied embedding once, as the LM
    head); ``matrices``: bytes per weight of the 2-D ones when quantized (models/quantize.py
    quantizes every Linear, the LM head included; the embedding lookup reads one row)."""
    total = 0.0
    for p in model.parameters():
        per = matrices if matrices is not None and p.dim() == 2 else bytes_per_weight
        total += p.numel() * per
    return total


def gguf_bytes(path) -> float:
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    return float(sum(int(t.n_bytes) for t in reader.tensors))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=2.0, help="buffer size (default: 2 GiB)")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()

    from speclm.models import load_model
    from speclm.models.loading import _default_gguf

    bw = read_bandwidth(args.gib, args.repeats)
    model = load_model("default", backend="torch").backend.model
    rows = [
        ("torch float32", torch_bytes(model, 4)),
        ("torch bfloat16", torch_bytes(model, 2)),
        ("torch int8 weight-only (+ per-row scales)", torch_bytes(model, 2, matrices=1.0)),
        ("torch int4 weight-only (+ a scale and zero per 128)", torch_bytes(model, 2, matrices=0.5 + 4 / 128)),
        ("llama.cpp, the GGUF file as shipped (Q4_1)", gguf_bytes(_default_gguf())),
    ]
    print(f"read bandwidth: {bw / 1e9:.1f} GB/s ({torch.get_num_threads()} threads, "
          f"{args.gib:g} GiB buffer, median of {args.repeats})")
    print("| weights | MB per forward | floor (tok/s) |")
    print("|---|---|---|")
    for name, nbytes in rows:
        print(f"| {name} | {nbytes / 1e6:.0f} | {bw / nbytes:.0f} |")


if __name__ == "__main__":
    main()
