"""A draft model (or the target's own layers) drafting B rows: one forward per row and depth, or
one per depth for all rows.

Runs the engine over B concurrent requests with a draft model, K fixed (no timing in the draft
length, so both modes draft the same rounds), in two modes interleaved round by round:

- ``per-row``: each request's ``DraftModelDrafter`` runs its own draft forwards;
- ``batched``: one ``DraftRows`` group drafts every row with one forward per depth.

With ``--skip LAYERS`` or ``--early-exit N`` the draft is the target minus those layers
(self-speculation), and the modes are how a server ran it before and after the rows learned to
draft on the batched cache:

- ``per-row``: one single-row handle per slot (``SlotRows``): each row drafts with
  ``LayerSkipDrafter`` on its own cache and is verified by its own forward;
- ``batched``: the ragged batched cache (``RaggedRows``): one ``LayerSkipRows`` skipping forward
  per depth for every row, then one verify forward for every row.

``--plain`` adds plain decoding over the same batched rows (no drafter) as a third mode.

Reports, per mode and batch size, the median over rounds of the drafting seconds per engine
step and of the aggregate output tokens/s, and checks that both modes' outputs are identical.

The draft is ``--draft DIR`` (a transformers folder sharing the target's tokenizer, e.g. what
``speclm distill`` made) or, by default, the target's own architecture with ``--draft-layers``
of its layers (how ``speclm distill`` initialises its student: the distilled draft's shape and
cost, untrained).

    python benchmarks/draft_rows.py --rows 1,4,16 --rounds 3 --max-new-tokens 48 --out results/draft_rows.json
    python benchmarks/draft_rows.py --early-exit 20 --plain --rows 1,4,16 --out results/early_exit_rows.json
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
from speclm.drafters.layer_skip import LayerSkipDrafter, early_exit_skip, layer_skip_drafter
from speclm.engine import Engine
from speclm.errors import SpeclmError
from speclm.models.hf import HFCausalLM
from speclm.models.layer_subset import decoder_layers
from speclm.models.rows import SlotRows, make_rows
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
    ap.add_argument("--skip", help="self-speculation: the target minus these layers (e.g. 10-29)")
    ap.add_argument("--early-exit", type=int, help="self-speculation: the target's first N layers")
    ap.add_argument("--plain", action="store_true", help="add plain decoding on the batched rows")
    ap.add_argument("--rows", default="1,4,16", help="batch sizes, comma-separated")
    ap.add_argument("--k", type=int, default=3, help="draft tokens per round (fixed)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--prompts", type=Path, default=SPEC_BENCH)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    llm = LLM(args.target, None, backend="torch")
    target = llm.target
    num_layers = len(decoder_layers(target.model))
    skip = None
    if args.early_exit:
        try:
            skip = early_exit_skip(num_layers, args.early_exit)
        except SpeclmError as exc:
            ap.error(f"--early-exit: {exc}")
        label = f"early exit after {args.early_exit} of {num_layers} layers"
    elif args.skip:
        from speclm.specs import IntList

        try:
            skip = IntList()(args.skip)
        except (ValueError, SpeclmError) as exc:
            ap.error(f"--skip: {exc}")
        label = f"the target minus layers {args.skip}"
    elif args.draft:
        draft = LLM(args.draft, None, backend="torch", dtype=str(target.dtype).removeprefix("torch.")).target
        label = args.draft
    else:
        layers = pick_layers(num_layers, args.draft_layers)
        draft = HFCausalLM(build_student(target.model, layers), target.eos_token_ids)
        label = f"{args.target} cut to layers {layers} (untrained)"
    sizes = [int(x) for x in args.rows.split(",")]
    prompts = load_prompts(llm, args.prompts, max(sizes))
    params = SamplingParams(max_tokens=args.max_new_tokens, ignore_eos=True)
    results: dict[str, dict[str, list]] = {}
    for rnd in range(args.rounds):
        for b in sizes:
            outputs = {}
            if skip is not None:
                modes = [("per-row", lambda: SlotRows(target, b), lambda h: LayerSkipDrafter(h, skip)),
                         ("batched", lambda: make_rows(target, b), lambda h: layer_skip_drafter(h, skip))]
            else:
                modes = [("per-row", lambda: make_rows(target, b), lambda h: DraftModelDrafter(draft.fork(), target.vocab_size)),
                         ("batched", lambda: make_rows(target, b),
                          lambda h, g=DraftRows(draft, target.vocab_size, b): g.member())]
            if args.plain:
                modes.append(("plain", lambda: make_rows(target, b), None))
            for mode, rows, factory in modes if rnd % 2 == 0 else modes[::-1]:
                tokens, wall, draft_s = run(rows(), factory, prompts[:b], params, args.k)
                outputs[mode] = tokens
                cell = results.setdefault(f"{b}", {}).setdefault(mode, [])
                cell.append({"tok_s": sum(map(len, tokens)) / wall, "draft_s_per_step": statistics.median(draft_s or [0.0])})
                print(f"round {rnd} rows {b:>2} {mode:>8}: {cell[-1]['tok_s']:.1f} tok/s, "
                      f"draft {1000 * cell[-1]['draft_s_per_step']:.0f} ms/step", flush=True)
            if len({json.dumps(o) for o in outputs.values()}) != 1:
                raise SystemExit(f"rows {b}: the modes' outputs differ")
    print(f"\n{cpu_name()}, {torch.get_num_threads()} threads; draft: {label}; K = {args.k}, "
          f"{args.max_new_tokens} new tokens, medians of {args.rounds} rounds\n")
    plain = " | tok/s plain | batched / plain" if args.plain else ""
    print(f"| rows | draft ms/step per-row | batched | tok/s per-row | batched | batched / per-row{plain} |")
    print("|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if args.plain else ""))
    table = []
    for b in sizes:
        med = {m: {key: statistics.median(c[key] for c in cells) for key in ("tok_s", "draft_s_per_step")}
               for m, cells in results[str(b)].items()}
        table.append({"rows": b, **{f"{m}_{key}": v for m in med for key, v in med[m].items()}})
        extra = (f" | {med['plain']['tok_s']:.1f} | {med['batched']['tok_s'] / med['plain']['tok_s']:.2f}x"
                 if args.plain else "")
        print(f"| {b} | {1000 * med['per-row']['draft_s_per_step']:.0f} | {1000 * med['batched']['draft_s_per_step']:.0f} "
              f"| {med['per-row']['tok_s']:.1f} | {med['batched']['tok_s']:.1f} "
              f"| {med['batched']['tok_s'] / med['per-row']['tok_s']:.2f}x{extra} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"cpu": cpu_name(), "threads": torch.get_num_threads(), "draft": label,
                                        "k": args.k, "max_new_tokens": args.max_new_tokens, "rounds": results,
                                        "table": table}, indent=1))


if __name__ == "__main__":
    main()
