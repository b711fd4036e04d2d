"""A draft model drafting B rows: one forward per row and depth, or one per depth for all rows.

Runs the engine over B concurrent requests with a draft model, K fixed (no timing in the draft
length, so both modes draft the same rounds), in two modes interleaved round by round:

- ``per-row``: each request's ``DraftModelDrafter`` runs its own draft forwards;
- ``batched``: one ``DraftRows`` group drafts every row with one forward per depth.

Reports, per mode and batch size, the median over rounds of the drafting seconds per engine
step and of the aggregate output tokens/s, and checks that both modes' outputs are identical.

The draft is ``--draft DIR`` (a transformers folder sharing the target's tokenizer, e.g. what
``speclm distill`` made) or, by default, the target's own architecture with ``--draft-layers``
of its layers (how ``speclm distill`` initialises its student: the distilled draft's shape and
cost, untrained).

    python benchmarks/draft_rows.py --rows 1,4,16 --rounds 3 --max-new-tokens 48 --out results/draft_rows.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from speclm.api import LLM
from speclm.distill.student import build_student, pick_layers
from speclm.draft_length import DraftLengthConfig
from speclm.drafters import DraftModelDrafter
from speclm.drafters.draft_rows import DraftRows
from speclm.engine import Engine
from speclm.models.hf import HFCausalLM
from speclm.models.layer_subset import decoder_layers
from speclm.models.rows import make_rows
from speclm.sampling import SamplingParams

SPEC_BENCH = Path(__file__).resolve().parents[2] / "shared/data/spec_bench/question.jsonl"


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def load_prompts(llm: LLM, path: Path, count: int) -> list[list[int]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    step = max(1, len(rows) // count)
    return [llm.encode([{"role": "user", "content": r["turns"][0]}]) for r in rows[::step][:count]]


def run(rows, factory, prompts, params, k: int) -> tuple[list[list[int]], float, list[float]]:
    """All prompts at once; returns outputs, wall seconds and each decode step's draft seconds."""
    engine = Engine(rows, drafter_factory=factory, draft_length=DraftLengthConfig(k, 0, adaptive=False))
    out: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        engine.add(str(i), p, params)
        out[str(i)] = []
    draft_s = []
    start = time.perf_counter()
    while engine.has_work:
        outputs, report = engine.step()
        if report.batch_size:
            draft_s.append(report.draft_s)
        for o in outputs:
            out[o.request_id] += o.step.tokens
    return [out[str(i)] for i in range(len(prompts))], time.perf_counter() - start, draft_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="default")
    ap.add_argument("--draft", help="a draft model folder (default: the target cut to --draft-layers)")
    ap.add_argument("--draft-layers", type=int, default=6)
    ap.add_argument("--rows", default="1,4,16", help="batch sizes, comma-separated")
    ap.add_argument("--k", type=int, default=3, help="draft tokens per round (fixed)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--prompts", type=Path, default=SPEC_BENCH)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    llm = LLM(args.target, None, backend="torch")
    target = llm.target
    if args.draft:
        draft = LLM(args.draft, None, backend="torch", dtype=str(target.dtype).removeprefix("torch.")).target
        label = args.draft
    else:
        layers = pick_layers(len(decoder_layers(target.model)), args.draft_layers)
        draft = HFCausalLM(build_student(target.model, layers), target.eos_token_ids)
        label = f"{args.target} cut to layers {layers} (untrained)"
    sizes = [int(x) for x in args.rows.split(",")]
    prompts = load_prompts(llm, args.prompts, max(sizes))
    params = SamplingParams(max_tokens=args.max_new_tokens, ignore_eos=True)
    results: dict[str, dict[str, list]] = {}
    for rnd in range(args.rounds):
        for b in sizes:
            outputs = {}
            modes = [("per-row", lambda h: DraftModelDrafter(draft.fork(), target.vocab_size)),
                     ("batched", lambda h, g=DraftRows(draft, target.vocab_size, b): g.member())]
            for mode, factory in modes if rnd % 2 == 0 else modes[::-1]:
                tokens, wall, draft_s = run(make_rows(target, b), factory, prompts[:b], params, args.k)
                outputs[mode] = tokens
                cell = results.setdefault(f"{b}", {}).setdefault(mode, [])
                cell.append({"tok_s": sum(map(len, tokens)) / wall, "draft_s_per_step": statistics.median(draft_s)})
                print(f"round {rnd} rows {b:>2} {mode:>8}: {cell[-1]['tok_s']:.1f} tok/s, "
                      f"draft {1000 * cell[-1]['draft_s_per_step']:.0f} ms/step", flush=True)
            if outputs["per-row"] != outputs["batched"]:
                raise SystemExit(f"rows {b}: the two modes' outputs differ")
    print(f"\n{cpu_name()}, {torch.get_num_threads()} threads; draft: {label}; K = {args.k}, "
          f"{args.max_new_tokens} new tokens, medians of {args.rounds} rounds\n")
    print("| rows | draft ms/step per-row | batched | tok/s per-row | batched | batched / per-row |")
    print("|---:|---:|---:|---:|---:|---:|")
    table = []
    for b in sizes:
        med = {m: {key: statistics.median(c[key] for c in results[str(b)][m]) for key in ("tok_s", "draft_s_per_step")}
               for m in ("per-row", "batched")}
        table.append({"rows": b, **{f"{m}_{key}": v for m in med for key, v in med[m].items()}})
        print(f"| {b} | {1000 * med['per-row']['draft_s_per_step']:.0f} | {1000 * med['batched']['draft_s_per_step']:.0f} "
              f"| {med['per-row']['tok_s']:.1f} | {med['batched']['tok_s']:.1f} "
              f"| {med['batched']['tok_s'] / med['per-row']['tok_s']:.2f}x |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"cpu": cpu_name(), "threads": torch.get_num_threads(), "draft": label,
                                        "k": args.k, "max_new_tokens": args.max_new_tokens, "rounds": results,
                                        "table": table}, indent=1))


if __name__ == "__main__":
    main()
