"""What a llama.cpp forward costs as a function of how many tokens it runs (the verify's width).

Loads the default model's GGUF through speclm's llama.cpp backend, fills the cache with
``--context`` tokens, then times forwards of T = 1, 2, 3, 4, 6, 8, 11 tokens at the end of it
(rolled back after each), with logits for one row or for all T rows; prints the best of
``--repeats`` x 10 calls and v = cost ÷ the one-token cost. v is what bounds speculation: a
round with K drafted tokens costs v(K + 1) plain steps.

    python benchmarks/llamacpp_cost.py [--context 300] [--repeats 5] [--gguf FILE]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from speclm.models.llamacpp import LlamaCppLM, LlamaCppModel
from speclm.models.loading import _default_gguf


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--gguf", type=Path, default=None, help="GGUF file (default: the default model's)")
    args = ap.parse_args()
    model = LlamaCppLM(LlamaCppModel(args.gguf or _default_gguf()), frozenset())
    ids = torch.arange(1000, 1000 + args.context)
    model.forward(ids, 0)
    print(f"{model.weights.threads} threads, {args.context}-token context")
    print("| tokens | ms (1 logit) | ms (all logits) | v |")
    print("|---|---|---|---|")
    one = None
    for t in (1, 2, 3, 4, 6, 8, 11):
        cells = []
        for logits in (1, t):
            best = float("inf")
            for _ in range(args.repeats):
                start = time.perf_counter()
                for _ in range(10):
                    model.forward(ids[:t], args.context, num_logits=logits)
                    model.rollback(args.context)
                best = min(best, (time.perf_counter() - start) / 10 * 1000)
            cells.append(best)
        one = one or cells[1]
        print(f"| {t} | {cells[0]:.1f} | {cells[1]:.1f} | {cells[1] / one:.2f} |")


if __name__ == "__main__":
    main()
