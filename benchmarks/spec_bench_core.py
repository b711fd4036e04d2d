"""Plain vs speculative decoding on Spec-Bench prompts: speed, acceptance and greedy identity.

Methods run interleaved prompt by prompt in one process (the order rotates each prompt) after a
warm-up; every method gets the same prompts and token budget. Reports medians, because these
machines are shared and noisy. In greedy mode every output is compared with plain decoding.

    python benchmarks/spec_bench_core.py --num-prompts 30 --max-tokens 128 \
        --method ngram --method ngram:adaptive=1

Method specs: ``ngram[:k=10,min=2,max=3,adaptive=0]`` or ``draft:path=PATH[,k=5,p_min=0]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from tqdm import tqdm

from speclm import LLM, SamplingParams
from speclm.prompts import load_prompts, spread

DEFAULT_QUESTIONS = Path(__file__).resolve().parents[2] / "shared/data/spec_bench/question.jsonl"


def parse_method(spec: str) -> tuple[str, dict]:
    name, _, rest = spec.partition(":")
    opts = dict(kv.split("=", 1) for kv in rest.split(",") if kv)
    if name == "ngram":
        kwargs = dict(speculative_model="ngram", num_speculative_tokens=int(opts.get("k", 10)),
                      ngram_min=int(opts.get("min", 2)), ngram_max=int(opts.get("max", 3)),
                      adaptive_draft=opts.get("adaptive", "0") == "1")
    elif name == "draft":
        kwargs = dict(speculative_model=opts.get("path", "default"),
                      num_speculative_tokens=int(opts.get("k", 5)),
                      draft_p_min=float(opts.get("p_min", 0)),
                      adaptive_draft=opts.get("adaptive", "0") == "1")
    else:
        raise SystemExit(f"unknown method {spec!r}; use ngram[:...] or draft:path=...")
    return spec, kwargs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--questions", type=Path, default=DEFAULT_QUESTIONS)
    ap.add_argument("--num-prompts", type=int, default=30)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--method", action="append", default=[])
    ap.add_argument("--model", default="default")
    ap.add_argument("--json", type=Path, help="write per-request results here")
    args = ap.parse_args()
    methods = [parse_method(m) for m in (args.method or ["ngram"])]
    prompts = spread(load_prompts(args.questions), args.num_prompts)
    llm = LLM(args.model)
    setups = {"plain": False}
    for spec, kwargs in methods:
        setups[spec] = llm.make_speculation(**kwargs)
    params = SamplingParams(max_tokens=args.max_tokens)
    llm.generate("Warm up.", SamplingParams(max_tokens=8))
    results = []  # one row per (prompt, method)
    names = list(setups)
    for i, p in enumerate(tqdm(prompts, desc="prompts", file=sys.stderr)):
        order = names[i % len(names):] + names[: i % len(names)]
        outs = {}
        for name in order:
            outs[name] = llm.chat([{"role": "user", "content": p["turns"][0]}], params, speculative=setups[name])
        for name in names:
            s = outs[name].stats
            base = outs["plain"].stats
            results.append(dict(id=p["id"], category=p["category"], method=name,
                                prompt_tokens=s.prompt_tokens, tokens=s.generated_tokens,
                                time_s=s.total_time_s, prefill_s=s.prefill_time_s,
                                tok_s=s.tokens_per_s, decode_tok_s=s.generated_tokens / s.decode_time_s,
                                decode_speedup=(s.generated_tokens / s.decode_time_s)
                                / (base.generated_tokens / base.decode_time_s),
                                alpha=s.alpha, tau=s.tau,
                                drafted=s.drafted_tokens, accepted=s.accepted_tokens,
                                forwards=s.target_forwards,
                                speedup=s.tokens_per_s / outs["plain"].stats.tokens_per_s,
                                identical=outs[name].token_ids == outs["plain"].token_ids))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    print(f"\n{len(prompts)} prompts from {args.questions.name}, greedy, max {args.max_tokens} new "
          f"tokens, model {args.model}; medians over prompts; tok/s counts wall time from the "
          f"request's start (prefill included), decode tok/s excludes the prefill\n")
    print("| method | category | prompts | tok/s | speedup | decode tok/s | decode speedup "
          "| alpha | tau | identical |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    cats = sorted({r["category"] for r in results}) + ["all"]
    for name in names:
        for cat in cats:
            rows = [r for r in results if r["method"] == name and cat in ("all", r["category"])]
            drafted = sum(r["drafted"] for r in rows)
            alpha = sum(r["accepted"] for r in rows) / drafted if drafted else 0.0
            tau = sum(r["tokens"] for r in rows) / sum(r["forwards"] for r in rows)
            med = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
            print(f"| {name} | {cat} | {len(rows)} | {med('tok_s'):.1f} | {med('speedup'):.2f}x "
                  f"| {med('decode_tok_s'):.1f} | {med('decode_speedup'):.2f}x | {alpha:.2f} "
                  f"| {tau:.2f} | {sum(r['identical'] for r in rows)}/{len(rows)} |")
    bad = [r for r in results if not r["identical"]]
    for r in bad:
        print(f"MISMATCH: question {r['id']} ({r['category']}), method {r['method']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
