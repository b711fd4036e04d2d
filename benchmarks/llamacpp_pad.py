"""Ragged llama.cpp rows: padded to one graph, or fed as they are?

llama.cpp runs a batch of sequences (a KV stream each) as one graph only when every row brings
the same number of tokens; otherwise it splits the batch, about one graph per distinct row length.
``LlamaCppRows`` may right-pad ragged rows to the widest instead (speclm.models.llamacpp_rows).
This times both for row shapes the server meets (verifies of different draft lengths, prompt
chunks of different lengths), alternating, and prints the best of ``--repeats`` each, so the
padding rule (``PAD_TOKENS_PER_GRAPH``) can be checked on a CPU.

    python benchmarks/llamacpp_pad.py [--gguf FILE] [--context 200] [--repeats 5]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import speclm.models.llamacpp_rows as llamacpp_rows
from speclm.errors import SpeclmError
from speclm.models.llamacpp import LlamaCppLM, LlamaCppModel
from speclm.models.loading import _default_gguf

SHAPES = [  # (label, tokens fed per row, cached tokens per row first, logits)
    ("verify: 4 rows of 3, 3, 3, 2", [3, 3, 3, 2], True),
    ("verify: 4 rows of 2, 2, 1, 1", [2, 2, 1, 1], True),
    ("verify: 16 rows, 15 of 3 and 1 of 2", [3] * 15 + [2], True),
    ("verify: 16 rows, 8 of 2 and 8 of 1", [2] * 8 + [1] * 8, True),
    ("verify: 8 rows, 4 of 5 and 4 of 3", [5] * 4 + [3] * 4, True),
    ("prefill: chunks of 100 and 300", [100, 300], False),
    ("prefill: 16 chunks of 20 to 35", list(range(20, 36)), False),
]


def time_shape(rows, fed: list[int], context: int, logits: bool, always_pad: bool) -> float:
    llamacpp_rows.PAD_TOKENS_PER_GRAPH = 10**9 if always_pad else 0
    rows.clear()
    if logits:  # verifies run at the end of a cached context
        for slot in range(len(fed)):
            rows.forward(range(slot, slot + 1), torch.arange(1000, 1000 + context).view(1, -1), [context],
                         logits=False)
    ids = torch.full((len(fed), max(fed)), 7)
    start = time.perf_counter()
    rows.forward(range(len(fed)), ids, fed, logits=logits)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, default=None, help="GGUF file (default: the default model's)")
    ap.add_argument("--context", type=int, default=200, help="cached tokens per row before a verify")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if args.repeats < 1 or args.context < 1:
        ap.error(f"--repeats and --context must be >= 1, got {args.repeats} and {args.context}")
    try:
        target = LlamaCppLM(LlamaCppModel(args.gguf or _default_gguf()), frozenset())
    except SpeclmError as exc:
        raise SystemExit(f"--gguf: {exc}") from None
    rows = llamacpp_rows.LlamaCppRows(target, 16)
    rule = llamacpp_rows.PAD_TOKENS_PER_GRAPH
    print(f"{target.weights.threads} threads; ms, best of {args.repeats} (padded and ragged alternating)")
    print("| rows | padded | ragged | padding tokens | the rule |")
    print("|---|---:|---:|---:|---|")
    for label, fed, logits in SHAPES:
        best = {True: float("inf"), False: float("inf")}
        for _ in range(args.repeats):
            for always_pad in (True, False):
                best[always_pad] = min(best[always_pad], time_shape(rows, fed, args.context, logits, always_pad))
        llamacpp_rows.PAD_TOKENS_PER_GRAPH = rule
        choice = "pads" if llamacpp_rows.pad_width(fed) else "ragged"
        waste = len(fed) * max(fed) - sum(fed)
        print(f"| {label} | {best[True] * 1e3:.0f} | {best[False] * 1e3:.0f} | {waste} | {choice} |", flush=True)


if __name__ == "__main__":
    main()
