"""The host-side cost of growing a draft tree, without the drafter's forwards.

``grow_tree`` (drafters/tree_search.py) with a stepper that returns fixed log-probabilities at
once, so what is timed is the bookkeeping a tree drafter pays per round besides its forwards:
the top-k per level, the candidates' scores and parents, the tree metadata of each level
(``TreeMeta.from_parents``) and the kept tree. Also ``from_parents`` and ``attention_bias``
alone. Medians, microseconds or milliseconds.

    python benchmarks/tree_bookkeeping.py --columns 8192 --depth 5 --top-k 4 --budget 16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from speclm.drafters.tree_search import TreeShape, TreeSizer, grow_tree
from speclm.tree import TreeMeta


def median_s(fn, reps: int) -> float:
    for _ in range(20):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--columns", type=int, default=8192, help="the drafter's vocabulary (an EAGLE head's)")
    ap.add_argument("--depth", type=int, default=5)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--budget", type=int, default=16)
    ap.add_argument("--reps", type=int, default=300)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    vocab = torch.randperm(49152, generator=gen)[: args.columns].numpy()  # each column's target id
    levels = [torch.log_softmax(3 * torch.randn(args.top_k, args.columns, generator=gen), -1) for _ in range(4)]

    class Stepper:
        def expand(self, tokens: torch.Tensor, fed: TreeMeta) -> torch.Tensor:
            return levels[fed.num_nodes % 4][: tokens.shape[0]]  # [T, columns]

    root = torch.log_softmax(3 * torch.randn(args.columns, generator=gen), -1)
    sizer = TreeSizer()
    for fit in (False, True):
        def grow() -> None:
            grow_tree(root, Stepper(), args.depth, TreeShape(args.top_k, args.budget, fit),
                      lambda n: 0.045 + 0.002 * n, sizer, vocab=vocab)
            sizer.observe(2)

        print(f"grow_tree (fit={int(fit)}): {median_s(grow, args.reps) * 1e3:.2f} ms")
    for k in (4, 16, 24):
        parents = torch.tensor([-1] * 4 + [i // 4 for i in range(k - 4)])
        tree = TreeMeta.from_parents(parents)
        build = median_s(lambda: TreeMeta.from_parents(parents), args.reps * 3)
        mask = median_s(lambda: tree.attention_bias(40, torch.float32, torch.device("cpu"), 4), args.reps * 3)
        print(f"{k} nodes: from_parents {build * 1e6:.0f} us, attention_bias (4 rows) {mask * 1e6:.0f} us")


if __name__ == "__main__":
    main()
