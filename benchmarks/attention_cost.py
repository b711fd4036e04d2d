"""speclm's CPU attention kernel alone (``speclm::small_m_attention``, models/small_m_attention.cpp).

The default model's shape in a compiled step: 9 query heads over 3 key/value heads of 64, a cache
of ``--capacity`` slots with ``--context`` of them filled, T query rows (a verify of T tokens,
causal over the filled slots). Prints the median microseconds per call for each T. To compare two
builds, run this once per checkout (each builds its own kernels), alternating.

    python benchmarks/attention_cost.py --rows 1 2 4 8 16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from speclm.models import small_m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16], help="query rows (T)")
    ap.add_argument("--context", type=int, default=200, help="filled cache slots before the queries")
    ap.add_argument("--capacity", type=int, default=512, help="cache slots")
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args()
    if not small_m.kernel_available():
        ap.error("speclm's CPU kernels are not available here (no AVX2, no compiler, or SPECLM_CPU_KERNEL=0)")
    if args.context + max(args.rows) > args.capacity:
        ap.error("--context plus the most rows must fit in --capacity")
    gen = torch.Generator().manual_seed(0)
    key, value = (torch.randn(1, 3, args.capacity, 64, generator=gen) for _ in range(2))
    cells = []
    for rows in args.rows:
        query = torch.randn(1, 9, rows, 64, generator=gen)
        mask = torch.full((1, 1, rows, args.capacity), torch.finfo(torch.float32).min)
        for t in range(rows):
            mask[0, 0, t, : args.context + t + 1] = 0
        for _ in range(args.calls // 10):  # warm-up
            torch.ops.speclm.small_m_attention(query, key, value, mask, 0.125)
        times = []
        for _ in range(args.calls):
            start = time.perf_counter()
            torch.ops.speclm.small_m_attention(query, key, value, mask, 0.125)
            times.append(time.perf_counter() - start)
        cells.append(f"T = {rows}: {statistics.median(times) * 1e6:.1f} us")
    print(f"{small_m.isa()} build, {torch.get_num_threads()} threads, {args.context} of {args.capacity} slots: "
          + "; ".join(cells))


if __name__ == "__main__":
    main()
