"""The float32 small-M CPU kernel (models/small_m.py) against torch's own products, end to end.

One model, one process, one interleaved run: every request runs each method twice, with the
kernel and without it (``set_kernel_enabled``), in an order rotated from prompt to prompt. For
each (method, kernel) it reports median tok/s, the median per-request speedup over plain
decoding with the same kernel setting, tau, greedy identity with that plain decoding, and the
median per-request ratio kernel on / kernel off. Also the forward cost by width both ways
(``--widths``), as benchmarks/step_cost.py measures it.

    python benchmarks/cpu_kernel.py --prompts ../shared/data/spec_bench/question.jsonl \\
        --per-category 3 --max-new-tokens 128 --method ngram --method eagle:path=DIR,tree=0,k=4,adaptive=0
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from speclm.bench.methods import parse_method
from speclm.bench.runner import EnginePool, _run_one, build_setups
from speclm.models import small_m
from speclm.prompts import load_prompts, per_category
from speclm.sampling import SamplingParams


def forward_costs(target, widths: list[int], reps: int = 9, context: int = 200) -> list[tuple]:
    gen = torch.Generator().manual_seed(0)
    target.reset()
    target.forward(torch.randint(0, target.vocab_size, (context,), generator=gen), 0)
    times: dict[tuple, list[float]] = {}
    for _ in range(reps + 2):
        for width in widths:
            for on in (False, True):
                small_m.set_kernel_enabled(on)
                tokens = torch.randint(0, target.vocab_size, (width,), generator=gen)
                start = time.perf_counter()
                target.forward(tokens, context, num_logits=width)
                times.setdefault((width, on), []).append(time.perf_counter() - start)
                target.rollback(context)
    small_m.set_kernel_enabled(True)
    return [(w, statistics.median(times[w, False][2:]), statistics.median(times[w, True][2:])) for w in widths]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--per-category", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--method", action="append", default=[], help="a speclm bench method (besides plain)")
    ap.add_argument("--widths", type=int, nargs="*", default=[1, 2, 4, 5, 8, 11, 16])
    args = ap.parse_args()
    if not small_m.kernel_available():
        sys.exit("the kernel is not available on this machine (AVX2 CPU, g++ and ninja needed)")
    pool = EnginePool(args.model, "cpu", ("torch", 0, None, "float32"))
    specs = [parse_method("plain")] + [parse_method(m) for m in args.method]
    setups = build_setups(pool, specs)
    llm = pool.get(pool.engine_of(specs[0]))
    print(f"{torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"{sum(isinstance(m, small_m.SmallMLinear) for m in llm.target.model.modules())} kernel layers")
    if args.widths:
        print("| tokens per forward | torch ms | vs 1 token | kernel ms | vs 1 token | kernel / torch |")
        print("|---:|---:|---:|---:|---:|---:|")
        costs = forward_costs(llm.target, args.widths)
        for w, off, on in costs:
            print(f"| {w} | {off * 1e3:.1f} | {off / costs[0][1]:.2f}x | {on * 1e3:.1f} | "
                  f"{on / costs[0][2]:.2f}x | {on / off:.2f}x |", flush=True)
    prompts = per_category(load_prompts(args.prompts), args.per_category)
    params = SamplingParams(max_tokens=args.max_new_tokens)
    configs = [(s.label, on) for s in specs for on in (False, True)]
    short = {s.label: s.short_label() for s in specs}
    rows: dict[tuple, list[dict]] = {c: [] for c in configs}
    for i, prompt in enumerate(prompts):
        messages = [{"role": "user", "content": prompt["turns"][0]}]
        order = configs[2 * i % len(configs):] + configs[: 2 * i % len(configs)]
        for label, on in order:
            small_m.set_kernel_enabled(on)
            rows[label, on].append(_run_one(llm, setups[label], messages, params))
        print(f"{i + 1}/{len(prompts)} {prompt['category']}", file=sys.stderr, flush=True)
    small_m.set_kernel_enabled(True)
    print(f"\n{len(prompts)} requests, greedy, {args.max_new_tokens} new tokens, eager float32")
    print("| method | kernel | tok/s | speedup over plain | tau | identical to plain | kernel on / off |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for label, on in configs:
        got, plain = rows[label, on], rows["plain", on]
        speed = statistics.median(r["tok_s"] / p["tok_s"] for r, p in zip(got, plain))
        tau = (sum(r["tokens"] for r in got) / sum(r["forwards"] for r in got)) if label != "plain" else None
        same = sum(r["token_ids"] == p["token_ids"] for r, p in zip(got, plain))
        ratio = statistics.median(a["tok_s"] / b["tok_s"] for a, b in zip(rows[label, True], rows[label, False]))
        print(f"| {short[label]} | {'on' if on else 'off'} | {statistics.median(r['tok_s'] for r in got):.1f} | "
              f"{speed:.2f}x | {'' if tau is None else f'{tau:.2f}'} | {same}/{len(got)} | "
              f"{f'{ratio:.2f}x' if on else ''} |")
    same = sum(a["token_ids"] == b["token_ids"] for a, b in zip(rows["plain", True], rows["plain", False]))
    print(f"\nplain with the kernel vs without: {same}/{len(prompts)} outputs identical "
          "(float32 rounding differs between the two products; a difference is a near-tie)")


if __name__ == "__main__":
    main()
