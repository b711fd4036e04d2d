"""Whole requests with speclm's one-call RMSNorm (models/fast_norm.py) on and off, in one process.

Eager float32 on the CPU, greedy: each prompt runs in four configurations (norm kernel on / off x
plain / speculative) in an order that rotates per prompt and round, so that drifting machine load
hits all alike; prints the median tokens/s of each and checks every speculative text against its
plain decoding.

    python benchmarks/fast_norm.py --model <gemma-3-270m-q4_k_m.gguf> --drafter quant:bits=8,vocab=65536 --prompts P.jsonl
    python benchmarks/fast_norm.py --drafter quant:bits=4 --prompts P.jsonl     # the default model
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from speclm import LLM, SamplingParams
from speclm.models import fast_norm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--drafter", default="quant:bits=8")
    ap.add_argument("--prompts", required=True, help="JSON lines with a 'prompt' (or Spec-Bench 'turns') field")
    ap.add_argument("--num-prompts", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(2)
    try:
        rows = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()]
        prompts = [r["prompt"] if "prompt" in r else r["turns"][0] for r in rows][: args.num_prompts + 1]
    except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise SystemExit(f"--prompts {args.prompts}: not a readable JSON-lines file of 'prompt' or "
                         f"'turns' rows ({type(exc).__name__}: {exc})") from None
    if len(prompts) < 2:
        raise SystemExit(f"--prompts {args.prompts}: needs at least 2 prompts (one warms up), has {len(prompts)}")
    llm = LLM(model=args.model, backend="torch", speculative_model=args.drafter)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    llm.generate(prompts[0], params)  # warm-up: the draft is built, the kernels loaded
    llm.generate(prompts[0], params, speculative=False)
    configs = [(True, False), (False, False), (True, True), (False, True)]  # (norm kernel, speculative)
    rates: dict[tuple[bool, bool], list[float]] = {}
    texts: dict[tuple[bool, bool, int], str] = {}
    for r in range(args.rounds):
        for i, prompt in enumerate(prompts[1:]):
            shift = (i + r) % len(configs)
            for norms, spec in configs[shift:] + configs[:shift]:
                fast_norm.set_enabled(norms)
                start = time.perf_counter()
                out = llm.generate(prompt, params, speculative=spec)[0]
                rates.setdefault((norms, spec), []).append(len(out.token_ids) / (time.perf_counter() - start))
                texts.setdefault((norms, spec, i), out.text)
    fast_norm.set_enabled(True)
    n = len(prompts) - 1
    print(f"| norm kernel | plain tok/s | {args.drafter} tok/s | speculative / plain | speculative text = plain |")
    print("|---|---:|---:|---:|---:|")
    for norms in (False, True):
        plain, spec = (statistics.median(rates[(norms, s)]) for s in (False, True))
        same = sum(texts[(norms, True, i)] == texts[(norms, False, i)] for i in range(n))
        print(f"| {'on' if norms else 'off'} | {plain:.2f} | {spec:.2f} | {spec / plain:.2f}x | {same}/{n} |")
    print(f"plain texts equal with and without the kernel: "
          f"{sum(texts[(True, False, i)] == texts[(False, False, i)] for i in range(n))}/{n}")


if __name__ == "__main__":
    main()
