"""Cost of one engine step over B rows x T tokens: one forward per row against one batched forward.

The engine runs a batch through a backend's rows (speclm.models.rows): one single-row handle
per row, run in turn (``SlotRows``), or one batched forward: on llama.cpp the rows as sequence
ids of one context in one ``llama_decode`` (``LlamaCppRows``), on eager torch one transformers
forward over a ragged cache (``RaggedRows``; sliding-window models such as Gemma-3 included), on
the compiled path one compiled forward over a batched static cache (``CompiledRows``; its graphs
compile in the first, untimed repetition).
This times both on the same model, interleaved, each row at its own context length (a prompt of
``--context`` tokens plus a few per row), feeding T tokens per row and cutting them off again as
a rejected draft would be:

    python benchmarks/rows_cost.py [--model default] [--backend llamacpp|torch|compiled [--quantize int4]] [--rows 1 2 4 8 16] [--widths 1 4 8]

Prints median milliseconds per step, the batched form's speedup, and the cost per row-token
relative to a one-row, one-token step.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from speclm.models import load_model
from speclm.models.compiled_rows import CompiledRows
from speclm.models.rows import RaggedRows, SlotRows


def step(rows, batch: int, width: int, tokens: torch.Tensor) -> float:
    """One forward of ``width`` tokens into each of ``batch`` rows, then keep none of them."""
    lengths = [rows.length(b) for b in range(batch)]
    start = time.perf_counter()
    rows.forward(range(batch), tokens, [width] * batch)
    elapsed = time.perf_counter() - start
    for b in range(batch):
        rows.keep(b, lengths[b], [])
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--context", type=int, default=200, help="prompt tokens per row")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--backend", choices=["llamacpp", "torch", "compiled"], default="llamacpp")
    ap.add_argument("--quantize", choices=["int8", "int4", "gguf"], default=None, help="compiled path's weights")
    ap.add_argument("--dtype", default=None, help="compiled path's dtype (default: the model's)")
    args = ap.parse_args()
    compiled = args.backend == "compiled"
    target = load_model(args.model, backend="torch" if compiled else args.backend, compile=compiled,
                        quantize=args.quantize, dtype=args.dtype).backend
    most = max(args.rows)
    if args.backend == "llamacpp":
        batched = target.batched_rows(most)
    elif compiled:
        batched = CompiledRows(target, most)  # graphs compile in the untimed first repetition
    else:
        batched = RaggedRows(target, most)
    kinds = {"one handle per row": SlotRows(target, most), "one batched forward": batched}
    gen = torch.Generator().manual_seed(0)
    for rows in kinds.values():  # every row at its own length
        for b in range(most):
            prompt = torch.randint(0, target.vocab_size, (1, args.context + 3 * b), generator=gen)
            rows.forward(range(b, b + 1), prompt, [prompt.shape[1]], logits=False)
            rows.keep(b, prompt.shape[1], [])
    print(f"# {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"model {args.model}, {args.backend}{'+' + args.quantize if args.quantize else ''} "
          f"({type(batched).__name__}), context {args.context}+")
    print("| rows | tokens per row | one handle per row (ms) | one batched forward (ms) | speedup | "
          "cost per row-token (batched, x a 1-token step) |")
    print("|---:|---:|---:|---:|---:|---:|")
    base = None
    for width in args.widths:
        for batch in args.rows:
            times = {name: [] for name in kinds}
            for _ in range(args.reps + 2):
                tokens = torch.randint(0, target.vocab_size, (batch, width), generator=gen)
                for name, rows in kinds.items():  # interleaved
                    times[name].append(step(rows, batch, width, tokens))
            med = {name: statistics.median(t[2:]) * 1e3 for name, t in times.items()}
            per_row, together = med["one handle per row"], med["one batched forward"]
            if base is None and batch == 1 and width == 1:
                base = per_row
            per_token = f"{together / (batch * width) / base:.2f}" if base else "-"
            print(f"| {batch} | {width} | {per_row:.1f} | {together:.1f} | {per_row / together:.2f}x | {per_token} |",
                  flush=True)


if __name__ == "__main__":
    main()
