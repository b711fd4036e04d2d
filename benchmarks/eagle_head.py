"""The shipped EAGLE head's forward, float32 against 8-bit blocks (``eagle:bits=0`` / ``bits=8``).

Loads the default model (eager float32) and the head speclm ships for it twice, through the
loader the drafter uses: once with its linear layers in float32 (the target's few-row kernels),
once in Q8_0 blocks (speclm's block kernel, 8-bit activations). Each timed round runs what a
tree round runs: ``--levels`` head forwards of ``rows`` rows each on the head's cache, each
followed by the draft logits. With ``--cold`` (the default) a 256 MB buffer is written before
every round, as the target's forward between two drafting rounds evicts the head's weights from
the caches. Rounds alternate between the two heads; medians of ``--reps``, ms per forward.

    python benchmarks/eagle_head.py --rows 1 4 8 --reps 60
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8], help="rows per head forward (a tree level)")
    ap.add_argument("--levels", type=int, default=4, help="head forwards per timed round")
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--context", type=int, default=40, help="pairs in the head's cache before a round")
    ap.add_argument("--warm", dest="cold", action="store_false", help="do not evict the weights between rounds")
    args = ap.parse_args()

    from transformers import DynamicCache

    from speclm.learned.loader import _load_module
    from speclm.learned.shipped import shipped_folder
    from speclm.models import load_model

    target = load_model("default", backend="torch", dtype="float32").backend
    folder = shipped_folder(target.model, "eagle")
    heads = {bits: _load_module(folder, "eagle", target, bits)[1] for bits in (0, 8)}
    print({bits: sorted({type(m).__name__ for m in head.modules() if hasattr(m, "in_features")})
           for bits, head in heads.items()})
    hidden, gen = target.model.config.hidden_size, torch.Generator().manual_seed(0)
    evict = torch.empty(64 * 1024 * 1024)  # 256 MB, more than the last-level cache

    def round_ms(head: torch.nn.Module, rows: int) -> float:
        cache = DynamicCache(config=head.config)
        pairs = torch.randn(2, 1, args.context, hidden, generator=gen)
        head(pairs[0], pairs[1], torch.arange(args.context).view(1, -1), None, cache)
        if args.cold:
            evict.add_(1.0)
        start = time.perf_counter()
        for level in range(args.levels):
            at = args.context + level * rows
            out = head(torch.randn(1, rows, hidden, generator=gen), torch.randn(1, rows, hidden, generator=gen),
                       torch.arange(at, at + rows).view(1, -1), None, cache)
            head.logits(out)
        return (time.perf_counter() - start) / args.levels * 1e3

    print(f"ms per head forward ({'weights evicted before each round' if args.cold else 'warm'}):")
    print("rows | float32 (bits=0) | 8-bit blocks (bits=8) | ratio")
    with torch.inference_mode():
        for rows in args.rows:
            times: dict[int, list[float]] = {0: [], 8: []}
            for _ in range(args.reps):
                for bits, head in heads.items():
                    times[bits].append(round_ms(head, rows))
            f32, q8 = statistics.median(times[0]), statistics.median(times[8])
            print(f"{rows:4d} | {f32:16.2f} | {q8:21.2f} | {q8 / f32:.2f}x")


if __name__ == "__main__":
    main()
