"""Cost of one target forward as a function of the tokens it runs (the verify width).

Speculation pays when a round's committed tokens (tau) outgrow the verify forward's cost
relative to a one-token step. On GPUs the ratio is close to 1 for small widths; on CPUs it is
not, and this script measures it for the model at hand (median of ``--reps`` runs each).

    python benchmarks/step_cost.py --widths 1 2 4 8 11 16 --context 200
    python benchmarks/step_cost.py --compile --quantize gguf      # the compiled path
    python benchmarks/step_cost.py --compile --quantize gguf --activations q8,float
    python benchmarks/step_cost.py --compile --quantize gguf --groups on,off
    python benchmarks/step_cost.py --compile --quantize gguf --wrapper python,cpp
    python benchmarks/step_cost.py --compile --quantize gguf --wrapper cpp,cpp-o3   # wrapper at -O2 / -O3
    python benchmarks/step_cost.py --compile --quantize gguf --widths 1 8 --profile   # where it goes
    python benchmarks/step_cost.py --compile --quantize gguf --direct on,off   # without dynamo / through it

``SPECLM_CPU_KERNEL=0`` runs float32 layers on torch's own products instead of speclm's small-M
kernels (models/small_m.py), for a before/after on the same machine; ``--attention sdpa`` keeps
those for the linear layers but runs attention on PyTorch's SDPA; ``SPECLM_GGUF_ACTIVATIONS=float``
runs a GGUF's blocks on float activations instead of llama.cpp's 8-bit ones; ``--groups off``
compiles one kernel call per GGUF layer instead of one per set of layers reading the same input
(models/block_groups.py); ``--wrapper python`` compiles the step's wrapper in Python instead of C++
(models/c_shims.py), ``--wrapper cpp-o3`` compiles it with the fused loops in one file at -O3
(inductor's default) instead of alone at -O2; ``--direct off`` runs every compiled call through
dynamo instead of calling a proven graph directly (models/direct_call.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from speclm.models import block_groups, c_shims, direct_call, load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 2, 4, 8, 11, 16])
    ap.add_argument("--context", type=int, default=200, help="tokens already in the cache")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--compile", action="store_true", help="the compiled static-cache path")
    ap.add_argument("--quantize", default=None, help="int8, int4 or gguf (implies --compile)")
    ap.add_argument("--dtype", default=None, help="float32, bfloat16 (default: the path's own)")
    ap.add_argument("--attention", choices=["kernel", "sdpa"], default="kernel",
                    help="sdpa: attention on PyTorch's SDPA even where speclm's kernel runs")
    ap.add_argument("--activations", default=None,
                    help="with --quantize gguf: q8, float or both (q8,float): one model each, timed "
                         "interleaved in this process")
    ap.add_argument("--groups", default=None,
                    help="with --compile --quantize gguf: on, off or both (on,off): GGUF layers reading "
                         "the same input in one kernel call or one call each; one model each, interleaved")
    ap.add_argument("--wrapper", default=None,
                    help="with --compile: python, cpp or both (python,cpp): the compiled step's wrapper in "
                         "Python or in C++ calling speclm's ops directly; one model each, interleaved")
    ap.add_argument("--direct", default=None,
                    help="with --compile: on, off or both (on,off): compiled graphs called directly once "
                         "proven, or every call through dynamo; one model each, interleaved")
    ap.add_argument("--profile", action="store_true",
                    help="also profile 20 forwards per width (torch.profiler) and print each part's share")
    args = ap.parse_args()
    if sum(bool(v) for v in (args.activations, args.groups, args.wrapper, args.direct)) > 1:
        ap.error("--activations, --groups, --wrapper and --direct each make the variants: give one of them")
    if args.direct and not set(args.direct.split(",")) <= {"on", "off"}:
        ap.error(f"--direct takes on, off or on,off, got {args.direct!r}")
    if args.groups and not set(args.groups.split(",")) <= {"on", "off"}:
        ap.error(f"--groups takes on, off or on,off, got {args.groups!r}")
    if args.wrapper and not set(args.wrapper.split(",")) <= {"python", "cpp", "cpp-o3"}:
        ap.error(f"--wrapper takes python, cpp, cpp-o3 or a comma-separated list of them, got {args.wrapper!r}")
    if args.attention == "sdpa":
        from speclm.models import attention

        attention.KERNEL_MAX_QUERIES = 0
    variants = {}
    settings = ([("activations", a) for a in args.activations.split(",")] if args.activations else
                [("groups", g) for g in args.groups.split(",")] if args.groups else
                [("wrapper", w) for w in args.wrapper.split(",")] if args.wrapper else
                [("direct", d) for d in args.direct.split(",")] if args.direct else [(None, None)])
    for kind, value in settings:
        if kind == "activations":
            os.environ["SPECLM_GGUF_ACTIVATIONS"] = value  # read when the layers are built
        if kind == "groups":
            block_groups.GROUPING = value == "on"  # read when the graphs compile (warmup)
        if kind == "wrapper":
            c_shims.CPP_WRAPPER = value != "python"  # read when the step is built
            c_shims.WRAPPER_OPT_LEVEL = "O3" if value == "cpp-o3" else "O2"
        if kind == "direct":
            direct_call.DIRECT = value == "on"  # read when the step is built
        lm = load_model(args.model, backend="torch", compile=args.compile, quantize=args.quantize,
                        dtype=args.dtype).backend
        if hasattr(lm, "warmup"):
            compiled_s = lm.warmup(max(args.widths) - 1)
            print(f"{value or lm.backend_name}: compiled in {compiled_s:.0f} s", flush=True)
        variants[f"{kind} {value}" if kind else lm.backend_name] = lm
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, next(iter(variants.values())).vocab_size, (args.context,), generator=gen)
    for lm in variants.values():
        lm.forward(prompt, 0)
    times: dict[tuple[str, int], list[float]] = {}
    for rep in range(args.reps + 2):
        for width in args.widths:
            tokens = torch.randint(0, lm.vocab_size, (width,), generator=gen)
            for name, lm in variants.items():  # interleaved: each variant sees the same machine
                start = time.perf_counter()
                lm.forward(tokens, args.context, num_logits=width)  # as in verification
                if rep >= 2:
                    times.setdefault((name, width), []).append(time.perf_counter() - start)
                lm.rollback(args.context)
    print(f"context {args.context}, {torch.get_num_threads()} threads, attention {args.attention}, "
          f"median of {args.reps}")
    print("| tokens per forward | " + " | ".join(f"{name} ms | vs 1 token" for name in variants) + " |")
    print("|---:|" + "---:|---:|" * len(variants))
    for width in args.widths:
        cells = []
        for name in variants:
            t, base = (statistics.median(times[(name, w)]) for w in (width, args.widths[0]))
            cells.append(f"{t * 1e3:.1f} | {t / base:.2f}x")
        print(f"| {width} | " + " | ".join(cells) + " |")
    if args.profile:
        for name, lm in variants.items():
            for width in args.widths:
                print(f"{name}, {width} tokens: " + _profile(lm, width, args.context, gen))


# profiler events of torch.compile's own machinery around a compiled graph: dynamo's cache lookup
# (the guards), the bytecode that gathers the graph's inputs, AOTAutograd's runtime wrappers
_DYNAMO_EVENTS = ("TorchDynamo Cache Lookup", "Pregraph bytecode", "AOTDispatcher", "Torch-Compiled Region")


def _profile(lm, width: int, context: int, gen: torch.Generator) -> str:
    """Each part's share of 20 forwards of ``width`` tokens: speclm's ops by name, the compiled
    graph's own code (with the C++ wrapper one profiler event, its wrapper and fused loops; with
    ``--wrapper python`` the loops are events of their own and fall in the rest), torch.compile's
    machinery outside the graph (guards, input gathering, wrappers), and the rest (aten ops and
    Python outside the graph)."""
    from torch.profiler import ProfilerActivity, profile

    tokens = torch.randint(0, lm.vocab_size, (width,), generator=gen)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(20):
            lm.forward(tokens, context, num_logits=width)
            lm.rollback(context)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    parts = {e.key: e.self_cpu_time_total for e in events if e.key.startswith("speclm::")}
    parts["the graph's wrapper and fused loops"] = sum(
        e.self_cpu_time_total for e in events if e.key.startswith("## Call CompiledFxGraph"))
    parts["torch.compile outside the graph"] = sum(
        e.self_cpu_time_total for e in events if e.key.startswith(_DYNAMO_EVENTS))
    parts["the rest"] = total - sum(parts.values())
    return ", ".join(f"{key} {t / total:.0%}" for key, t in sorted(parts.items(), key=lambda kv: -kv[1]) if t) + (
        f" ({total / 20 / 1e3:.1f} ms a forward under the profiler)")


if __name__ == "__main__":
    main()
