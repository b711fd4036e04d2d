"""``speclm bench``: its flags, and the command, which checks every input before loading a model."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from ..errors import SpeclmError
from ..sampling import SamplingParams
from .methods import MethodSpec, parse_method

DEFAULT_METHODS = ["plain", "ngram", "hf", "hf-lookup"]
METHOD_HELP = ("Method specs: plain | any drafter with its options plus k= (the most tokens drafted "
               "per round) and adaptive= (default 1: K per round from the live acceptance and the "
               "measured cost model; 0: always k) "
               "(ngram[:k=10,min=2,max=3] | suffix | recycle | layerskip[:skip=..] | early-exit[:layers=N] "
               "| draft:path=PATH[,k=5,p_min=0] | distilled | quant[:bits=4] | medusa:path=DIR | eagle:path=DIR | auto; "
               "see `speclm generate --help`) | oracle:a=0.7[,k=4] | hf | hf-lookup[:k=10] | "
               "hf-assisted:path=PATH[,k=5] | hf-early-exit[:layers=N,k=5] | llamacpp | llamacpp-lookup[:k=10,ngram=2] | "
               "llama-server[:spec=ngram-simple|ngram-map-k|ngram-mod|...,k=K,kmin=M,ngram=N,draft=GGUF] "
               "(llama.cpp's C++ server with its own speculation; build it once with "
               "scripts/build-llama-server.sh). "
               "speclm methods take engine options too: backend=torch|llamacpp, compile=1, quantize=int8|int4|gguf, "
               "dtype=... (one run compares backends; a method's own compile/quantize/dtype run it on torch "
               "whatever --backend says). Models: 'default', an HF "
               "folder, a .gguf file, or random:PRESET / random:CONFIG.json (random weights, for oracle "
               "runs on any shape; presets: %s).")


def add_parser(sub, number) -> argparse.ArgumentParser:
    """Register ``bench`` on the CLI's subparsers; ``number(type)`` parses numeric flags."""
    from ..models.random_init import PRESETS

    bench = sub.add_parser(
        "bench", help="benchmark methods side by side on a prompt set (Spec-Bench format)",
        description="Run plain decoding, speclm's drafters and transformers' own generate() on the "
                    "same prompts, interleaved prompt by prompt after a warm-up, and report speedup, "
                    "tokens/s, alpha, tau, acceptance by draft position, the draft cost c, the "
                    "Leviathan bound and efficiency per category; greedy and seeded sampled outputs are "
                    "checked token by token against plain decoding. Every speedup is against plain "
                    "decoding on "
                    "the method's own engine (added when not given); a method below 0.95x plain "
                    "in a category is flagged SLOW.",
        epilog=METHOD_HELP % ", ".join(PRESETS))
    bench.add_argument("--prompts", help="JSONL of prompts ({'turns': [...], 'category': ...} or "
                                         "{'prompt': ...}), e.g. Spec-Bench's question.jsonl; "
                                         "default: speclm's own small set")
    bench.add_argument("--per-category", type=number(int), default=5,
                       help="prompts per category (default: %(default)s)")
    bench.add_argument("--categories", help="comma-separated categories to keep")
    bench.add_argument("--first-turn-only", action="store_true",
                       help="skip the later turns of multi-turn conversations")
    bench.add_argument("--max-new-tokens", type=number(int), default=128,
                       help="token budget per request, the same for every method (default: %(default)s)")
    bench.add_argument("--method", action="append", default=[],
                       help=f"a method spec (repeatable; default: {', '.join(DEFAULT_METHODS)})")
    bench.add_argument("--oracle-sweep", action="store_true",
                       help="add oracle:a=A,k=K for every A in --oracle-a and K in --oracle-k")
    bench.add_argument("--oracle-a", default="0.5,0.7,0.9",
                       help="acceptance rates of the sweep (default: %(default)s)")
    bench.add_argument("--oracle-k", default="2,4,8", help="draft lengths of the sweep (default: %(default)s)")
    bench.add_argument("--temperature", type=number(float), default=0.0,
                       help="0 = greedy (default); >0 samples, seeded by --seed, so that "
                            "speculative outputs are identity-checked against plain's too")
    bench.add_argument("--top-k", type=number(int), default=0,
                       help="sampling: keep the K most probable tokens (0 = off, the default)")
    bench.add_argument("--top-p", type=number(float), default=1.0,
                       help="sampling: keep the most probable tokens up to this mass, in (0, 1] (1 = off, the default)")
    bench.add_argument("--seed", type=number(int), default=0,
                       help="sampling seed (default: 0): every speclm method draws the same tokens from it")
    bench.add_argument("--out", help="write results.json, results.md and PNG plots here")
    bench.add_argument("--no-warmup", action="store_true", help="skip the warm-up request")
    g = bench.add_argument_group("model")
    g.add_argument("--model", "-m", default="default",
                   help="target: default, an HF folder, a .gguf file, or random:PRESET (default: %(default)s)")
    g.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (default: %(default)s)")
    g.add_argument("--dtype", default="auto", help="float32, bfloat16, float16, float64 or auto")
    g.add_argument("--gguf-file", help="GGUF file name inside --model when it is a folder")
    from ..flags import add_backend_flags

    add_backend_flags(g)
    bench.add_argument("--baseline", metavar="METHOD",
                       help="the method the 'vs baseline' column divides by (default: the first plain); "
                            "e.g. llamacpp (llama.cpp's own plain decoding) or hf")
    return bench


def _grid(text: str, kind: type, flag: str) -> list:
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SpeclmError(f"{flag} takes comma-separated {kind.__name__}s, got {text!r}") from None
    if not values:
        raise SpeclmError(f"{flag} is empty")
    return values


def method_specs(args: argparse.Namespace) -> list[MethodSpec]:
    """The methods to run, parsed and checked (no model is loaded yet)."""
    texts = list(args.method) or ([] if args.oracle_sweep else list(DEFAULT_METHODS))
    if args.oracle_sweep:
        texts += [f"oracle:a={a:g},k={k}" for a in _grid(args.oracle_a, float, "--oracle-a")
                  for k in _grid(args.oracle_k, int, "--oracle-k")]
    specs = [parse_method(m) for m in texts]
    if len({s.label for s in specs}) != len(specs):
        raise SpeclmError("the same method spec is given twice")
    short = [s.short_label() for s in specs]
    if len(set(short)) == len(specs):  # row names in tables and plots, unless that makes twins
        specs = [dataclasses.replace(s, label=label) for s, label in zip(specs, short)]
    if getattr(args, "baseline", None) is not None and args.baseline not in {s.label for s in specs} | {"plain"}:
        raise SpeclmError(f"--baseline {args.baseline!r} is not one of the methods")
    if args.temperature > 0 and any(s.name == "oracle" for s in specs):
        raise SpeclmError("the oracle method replays greedy output: use it with --temperature 0")
    return specs


def run(args: argparse.Namespace) -> int:
    from ..prompts import load_prompts, per_category

    specs = method_specs(args)
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            max_tokens=args.max_new_tokens, seed=args.seed)
    categories = [c.strip() for c in args.categories.split(",")] if args.categories else None
    prompts = per_category(load_prompts(args.prompts), args.per_category, categories)
    if args.first_turn_only:
        prompts = [dict(p, turns=p["turns"][:1]) for p in prompts]
    out_dir = Path(args.out) if args.out else None
    if out_dir is not None:
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise SpeclmError(f"cannot create output folder {args.out!r}: {exc.strerror}") from None

    from .report import drafter_notes, markdown, mismatches, slower_than_plain, summarize_all, write_outputs
    from .runner import run_bench

    from ..models.llamacpp import set_native_logging
    from .runner import EnginePool

    set_native_logging(args.verbose)

    pool = EnginePool(args.model, args.device, (args.backend, int(args.compile), args.quantize, args.dtype),
                      args.gguf_file)
    llm = pool.get(pool.engine_of(next((s for s in specs if not s.is_peer), specs[0])))  # for the header
    results = run_bench(pool, specs, prompts, params, warmup=not args.no_warmup, baseline=args.baseline)
    summary = summarize_all(results, specs)
    mode = "greedy" if params.greedy else f"temperature {params.temperature}" + (
        f", top-k {params.top_k}" if params.top_k else "") + (f", top-p {params.top_p}" if params.top_p < 1 else "")
    header = (f"speclm bench: {len(prompts)} prompts ({', '.join(sorted({p['category'] for p in prompts}))}), "
              f"{sum(len(p['turns']) for p in prompts)} turns, {mode}, max {params.max_tokens} new tokens, "
              f"model {args.model} ({llm.backend_name}, {str(llm.target.dtype).removeprefix('torch.')} on "
              f"{llm.target.device}). "
              "Medians over requests; tok/s includes prefill.")
    table = markdown(summary, header, specs, drafter_notes(results))
    print(table)
    bad = mismatches(results)
    for line in bad:
        print(line)
    for r in results:
        if r.get("error"):
            print(f"FAILED: {r['method']} on question {r['prompt_id']} turn {r['turn']}: {r['error']}")
    if out_dir is not None:
        meta = dict(command=["speclm", *args.argv], params={k: v for k, v in vars(args).items() if k != "argv"},
                    model_path=str(llm.model_path), device=str(llm.target.device), dtype=str(llm.target.dtype),
                    backend=llm.backend_name, slower_than_plain=slower_than_plain(summary))
        for path in write_outputs(out_dir, results, summary, table, meta):
            print(f"wrote {path}", file=sys.stderr)
    # a greedy mismatch beyond rounding is a bug: make it fail the command
    return 1 if any("BUG" in line for line in bad) else 0
