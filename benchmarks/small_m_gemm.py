"""What a verify of T tokens costs in matrix products against a one-token step, on this CPU.

A decode step multiplies each weight matrix by one activation row (a matrix-vector product,
bound by memory bandwidth); a verify step of T tokens multiplies it by T rows. Where the BLAS
runs small-M products as efficiently as the one-row product, a T-token verify costs about one
step (speculation's premise); where it does not, each verify costs more and speculation must
accept more tokens to pay. This runs 30 pairs of the default model's MLP projections
(576 -> 1536 -> 576, float32, 212 MB of weights: cache-cold, as in a real step) on M rows,
with PyTorch's own matrix product (ATen: MKL on x86) and through ``torch.compile`` (inductor's
default, which calls ATen's product; and ``max_autotune`` with inductor's C++ GEMM template
where it applies), medians of 15 after 3 warm-up runs, and prints the cost per M against M = 1.

    python benchmarks/small_m_gemm.py [--modes aten,speclm,inductor,autotune] [--rows 1,2,4,8,16]
    python benchmarks/small_m_gemm.py --modes q4-q8 --rows 1,4 --hot      # bound by what?

``speclm`` is speclm's own small-M kernel (models/small_m.py; beyond its ``MAX_ROWS`` rows it runs ATen);
``kernel`` calls that kernel at every M (where its row limit should sit). On the same shapes as
GGUF Q4_1 blocks (random codes, 57 MB): ``q4-float`` (``speclm::small_m_blocks``, float
activations), ``q4-q8`` (registered ``BlockLinear`` layers as a model runs them: 8-bit
activations and integer dot products, llama.cpp's arithmetic, on the tile layout at every M)
and ``q4-blas`` (the blocks decoded for the call, then ATen: what a float-activation prefill
runs). ``--hot`` runs the q4 modes on one pair of layers 30 times instead of
30 pairs (1.3 MB: the weights stay in the caches): a mode as fast hot as cold is bound by its
instructions, not by memory bandwidth.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn


class Projections(nn.Module):
    """30 residual up/down projection pairs of the default model's MLP shape."""

    def __init__(self, layers: int = 30, hidden: int = 576, inner: int = 1536) -> None:
        super().__init__()
        self.ups = nn.ModuleList(nn.Linear(hidden, inner, bias=False) for _ in range(layers))
        self.downs = nn.ModuleList(nn.Linear(inner, hidden, bias=False) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [M, hidden] -> [M, hidden]
        for up, down in zip(self.ups, self.downs):
            x = x + down(torch.relu(up(x)))
        return x


class BlockProjections(nn.Module):
    """The same projections as GGUF Q4_1 blocks (random codes, scales and minimums)."""

    def __init__(self, mode: str, layers: int = 30, hidden: int = 576, inner: int = 1536,
                 hot: bool = False) -> None:
        super().__init__()
        self.mode = mode

        def blocks(n: int, k: int) -> tuple[torch.Tensor, ...]:
            codes = torch.randint(0, 256, (n, k // 32 * 16), dtype=torch.uint8)
            scale = torch.rand(n, k // 32) * 0.004
            return codes, scale, -7.5 * scale  # weights centred on zero, as a trained layer's are

        distinct = [(blocks(inner, hidden), blocks(hidden, inner)) for _ in range(1 if hot else layers)]
        if mode == "q4-q8":  # registered layers, as a model runs them (on the tile layout)
            from speclm.models.small_m import BlockLinear

            distinct = [tuple(BlockLinear(*blocks_, 4, None, "q8") for blocks_ in pair) for pair in distinct]
        self.pairs = distinct * (layers if hot else 1)  # hot: one pair, in cache after its first read

    def linear(self, x: torch.Tensor, layer) -> torch.Tensor:
        ops = torch.ops.speclm
        if self.mode == "q4-q8":
            return layer(x)
        if self.mode == "q4-float":
            return ops.small_m_blocks(x, *layer, 4)
        return x @ ops.dequantize_blocks(*layer, 4).t()  # q4-blas

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for up, down in self.pairs:
            x = x + self.linear(torch.relu(self.linear(x, up)), down)
        return x


class KernelProjections(nn.Module):
    """The float projections through speclm's small-M kernel at every M (no row limit)."""

    def __init__(self, model: Projections) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mm = torch.ops.speclm.small_m_mm
        for up, down in zip(self.model.ups, self.model.downs):
            x = x + mm(torch.relu(mm(x, up.weight)), down.weight)
        return x


def median_ms(fn, x: torch.Tensor, reps: int = 15) -> float:
    for _ in range(3):
        fn(x)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def build(model: nn.Module, mode: str, hot: bool = False):
    torch._dynamo.reset()
    if mode == "aten":
        return model
    if mode == "speclm":  # speclm's small-M kernel (models/small_m.py), up to its MAX_ROWS rows
        import copy

        from speclm.models.small_m import use_small_m

        mine = copy.deepcopy(model)
        if not use_small_m(mine):
            raise SystemExit("speclm's kernel is not available here (AVX2, g++ and ninja needed)")
        return mine
    if mode == "kernel" or mode.startswith("q4-"):
        from speclm.models.small_m import kernel_available

        if not kernel_available():
            raise SystemExit("speclm's kernel is not available here (AVX2, g++ and ninja needed)")
        return KernelProjections(model) if mode == "kernel" else BlockProjections(mode, hot=hot)
    if mode == "inductor":
        return torch.compile(model, dynamic=False)
    if mode == "autotune":
        return torch.compile(model, dynamic=False, options={
            "freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"})
    raise SystemExit(f"unknown mode {mode!r}: aten, speclm, kernel, inductor, autotune, q4-float, q4-q8 "
                     "or q4-blas")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="aten,inductor,autotune")
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--hot", action="store_true",
                    help="q4 modes: one pair of layers read 30 times (weights in cache), not 30 pairs")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = Projections().eval()
    rows = [int(r) for r in args.rows.split(",")]
    print(f"{torch.get_num_threads()} threads, torch {torch.__version__}, MKL {torch.backends.mkl.is_available()}")
    print("| rows (M) | " + " | ".join(f"{m} ms | vs M=1" for m in args.modes.split(",")) + " |")
    print("|---:|" + "---:|---:|" * len(args.modes.split(",")))
    table: dict[str, dict[int, float]] = {}
    with torch.no_grad():
        for mode in args.modes.split(","):
            for m in rows:  # a fresh compile per shape: each graph is static
                x = torch.randn(m, 576) * 0.1
                table.setdefault(mode, {})[m] = median_ms(build(model, mode, args.hot), x)
    for m in rows:
        cells = [f"{table[mode][m]:.1f} | {table[mode][m] / table[mode][rows[0]]:.2f}x" for mode in table]
        print(f"| {m} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
