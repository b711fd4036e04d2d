"""What a symbolic cache capacity costs a compiled step: the same model compiled twice, once with
the capacity dimension of the cache buffers and masks dynamic (speclm's default:
models/static_cache.py), once with it static (one graph per token count and capacity, as before),
timed interleaved in one process at two contexts and three widths.

    python benchmarks/dynamic_capacity.py                      # the compiled GGUF default model
    python benchmarks/dynamic_capacity.py --contexts 200 1500 --widths 1 4 8 --reps 30
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from speclm.models import load_model


def _static(lm) -> None:
    """Take the dynamic marks off this model's cache buffers and masks (the old behaviour)."""
    def unmark(t: torch.Tensor) -> torch.Tensor:
        for name in ("_dynamo_weak_dynamic_indices", "_has_dynamo_dim_marking"):
            if hasattr(t, name):
                delattr(t, name)
        return t

    cache, use, mask = lm._cache, lm._cache._use, lm._mask

    def static_use(capacity: int) -> None:
        use(capacity)
        for t in cache.keys + cache.values:
            unmark(t)

    cache._use = static_use
    lm._mask = lambda *a: unmark(mask(*a))
    cache._buffers.clear()
    cache._use(cache.capacities[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--quantize", default="gguf")
    ap.add_argument("--contexts", type=int, nargs="+", default=[200, 1500])
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    models = {}
    for name in ("static", "dynamic"):
        lm = load_model(args.model, compile=True, quantize=args.quantize).backend
        if name == "static":
            _static(lm)
        lm.warmup(max(args.widths) - 1)
        models[name] = lm

    def once(lm, ctx: int, width: int) -> float:
        lm._cache.length = ctx
        t = time.perf_counter()
        lm.forward(torch.randint(0, 1000, (width,)), ctx, num_logits=width)
        return time.perf_counter() - t

    print("| context | tokens fed | static capacity ms | dynamic capacity ms | ratio |")
    print("|---:|---:|---:|---:|---:|")
    for ctx in args.contexts:
        for lm in models.values():
            lm.reset()
            lm.forward(torch.randint(0, 1000, (ctx,)), 0, num_logits=1)
            for w in args.widths:  # compiles what a static capacity needs here, untimed
                once(lm, ctx, w)
        times = {(n, w): [] for n in models for w in args.widths}
        for rep in range(args.reps):
            for n in (list(models) if rep % 2 else list(models)[::-1]):
                for w in args.widths:
                    times[n, w].append(once(models[n], ctx, w))
        for w in args.widths:
            s, d = (statistics.median(times[n, w]) * 1e3 for n in ("static", "dynamic"))
            print(f"| {ctx} | {w} | {s:.2f} | {d:.2f} | {d / s:.3f} |", flush=True)


if __name__ == "__main__":
    main()
