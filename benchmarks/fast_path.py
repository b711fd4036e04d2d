"""The torch fast path (models/compiled.py) against transformers' eager plain decoding.

Loads the default model once and, per prompt, interleaves every configuration (eager float32,
compiled float32 / bfloat16 / bfloat16+int8 / bfloat16+int4), each plainly and with prompt lookup
(``ngram``), greedy, ``--max-tokens`` new tokens. Prints the median tok/s of each configuration,
its ratio to eager float32 plain, and greedy identity: compiled float32 against eager float32
plain; bfloat16 and quantized configurations legitimately differ from float32, so their
speculative runs are compared with their own plain runs.

    OMP_NUM_THREADS=2 python benchmarks/fast_path.py --prompts 6 --max-tokens 128

Compiling every step shape happens before the measured runs (a one-time cost, reported).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from speclm.draft_length import DraftLengthConfig
from speclm.drafters.ngram import NgramDrafter
from speclm.engine import generate_tokens
from speclm.models import load_model
from speclm.models.compiled import make_compiled
from speclm.prompts import encode_user_turn, load_prompts, spread
from speclm.sampling import SamplingParams
from speclm.stats import RequestStats

CONFIGS = {  # name: (dtype, quantize); None dtype = the model's float32
    "compiled-fp32": (None, None),
    "compiled-bf16": (torch.bfloat16, None),
    "compiled-bf16-int8": (torch.bfloat16, "int8"),
    "compiled-bf16-int4": (torch.bfloat16, "int4"),
    "compiled-fp32-int8": (None, "int8"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--draft-max", type=int, default=7, help="ngram draft length K (fed K + 1 <= a bucket)")
    ap.add_argument("--configs", default="compiled-fp32,compiled-bf16,compiled-bf16-int8,compiled-bf16-int4",
                    help=f"comma-separated, from: {', '.join(CONFIGS)}")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each (prompt, config)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    loaded = load_model("default", backend="torch")
    eager = loaded.backend
    backends = {"eager-fp32": eager}
    for name in args.configs.split(","):
        dtype, quantize = CONFIGS[name]
        t0 = time.perf_counter()
        backend = make_compiled(eager.model, eager.eos_token_ids, dtype=dtype, quantize=quantize)
        spent = backend.warmup(args.draft_max)
        print(f"{name}: {backend.backend_name}, built and compiled in {time.perf_counter() - t0:.0f} s "
              f"(compile {spent:.0f} s)", file=sys.stderr, flush=True)
        backends[name] = backend

    rows = spread(load_prompts(), args.prompts)
    prompts = [torch.tensor(encode_user_turn(loaded.tokenizer, r["turns"][0])) for r in rows]
    params = SamplingParams(max_tokens=args.max_tokens)
    length = DraftLengthConfig(draft_max=args.draft_max)
    rates: dict[tuple[str, str], list[float]] = {}
    accept: dict[str, list[float]] = {}
    identical: dict[tuple[str, str], list[bool]] = {}
    for i, prompt in enumerate(prompts):
        outputs = {}
        for _ in range(args.repeats):
            for name, backend in backends.items():
                for spec in ("plain", "ngram"):
                    drafter = NgramDrafter(2, 3) if spec == "ngram" else None
                    stats = RequestStats()
                    tokens = [t for step in generate_tokens(backend, prompt, params, drafter=drafter,
                                                            draft_length=length, stats=stats)
                              for t in step.tokens]
                    rates.setdefault((name, spec), []).append(len(tokens) / stats.total_time_s)
                    if spec == "ngram":
                        accept.setdefault(name, []).append(stats.accepted_tokens / max(1, len(tokens)))
                    outputs[name, spec] = tokens
        for name in backends:
            reference = outputs["eager-fp32", "plain"] if name in ("eager-fp32", "compiled-fp32") \
                else outputs[name, "plain"]
            for spec in ("plain", "ngram"):
                identical.setdefault((name, spec), []).append(outputs[name, spec] == reference)
        print(f"prompt {i + 1}/{len(prompts)} ({rows[i].get('category', '?')}, {prompt.shape[0]} tokens) done",
              file=sys.stderr, flush=True)

    base = statistics.median(rates["eager-fp32", "plain"])
    print(f"\n{len(prompts)} prompts x {args.repeats}, greedy, {args.max_tokens} new tokens, "
          f"torch threads {torch.get_num_threads()}, ngram K={args.draft_max}")
    print(f"{'config':22s} {'spec':6s} {'tok/s':>7s} {'x eager':>8s}  identical  (accepted/token)")
    for (name, spec), values in rates.items():
        med = statistics.median(values)
        same = identical[name, spec]
        ref = "eager-fp32 plain" if name in ("eager-fp32", "compiled-fp32") else "own plain"
        extra = f"  ({statistics.mean(accept[name]):.2f})" if spec == "ngram" else ""
        print(f"{name:22s} {spec:6s} {med:7.1f} {med / base:7.2f}x  {sum(same)}/{len(same)} vs {ref}{extra}")


if __name__ == "__main__":
    main()
