"""Cost of one target forward as a function of the tokens it runs (the verify width).

Speculation pays when a round's committed tokens (tau) outgrow the verify forward's cost
relative to a one-token step. On GPUs the ratio is close to 1 for small widths; on CPUs it is
not, and this script measures it for the model at hand (median of ``--reps`` runs each).

    python benchmarks/step_cost.py --widths 1 2 4 8 11 16 --context 200
    python benchmarks/step_cost.py --compile --quantize gguf      # the compiled path

``SPECLM_CPU_KERNEL=0`` runs float32 layers on torch's own products instead of speclm's small-M
kernel (models/small_m.py), for a before/after on the same machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from speclm.models import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 2, 4, 8, 11, 16])
    ap.add_argument("--context", type=int, default=200, help="tokens already in the cache")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--compile", action="store_true", help="the compiled static-cache path")
    ap.add_argument("--quantize", default=None, help="int8, int4 or gguf (implies --compile)")
    ap.add_argument("--dtype", default=None, help="float32, bfloat16 (default: the path's own)")
    args = ap.parse_args()
    lm = load_model(args.model, backend="torch", compile=args.compile, quantize=args.quantize,
                    dtype=args.dtype).backend
    if hasattr(lm, "warmup"):
        lm.warmup(max(args.widths) - 1)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, lm.vocab_size, (args.context,), generator=gen)
    lm.forward(prompt, 0)
    rows = []
    for width in args.widths:
        times = []
        for _ in range(args.reps + 2):
            tokens = torch.randint(0, lm.vocab_size, (width,), generator=gen)
            start = time.perf_counter()
            lm.forward(tokens, args.context, num_logits=width)  # as in verification
            times.append(time.perf_counter() - start)
            lm.rollback(args.context)
        rows.append((width, statistics.median(times[2:])))
    base = rows[0][1]
    print(f"| tokens per forward | median ms | vs 1 token |  ({lm.backend_name}, context {args.context}, "
          f"{torch.get_num_threads()} threads)")
    print("|---|---|---|")
    for width, t in rows:
        print(f"| {width} | {t * 1e3:.1f} | {t / base:.2f}x |")


if __name__ == "__main__":
    main()
