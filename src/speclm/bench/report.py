"""Benchmark output: markdown tables, results.json (every raw figure) and PNG plots."""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path

from .methods import MethodSpec
from .metrics import leviathan_bound, summarize
from .plots import plot


def _plain_step_s(rows: list[dict], plain: str = "plain") -> float | None:
    """Target time per forward in plain decoding: the unit of the draft cost ratio c."""
    plain_rows = [r for r in rows if r["method"] == plain and r.get("forwards")]
    if not plain_rows:
        return None
    return sum(r["target_s"] for r in plain_rows) / sum(r["forwards"] for r in plain_rows)


def summarize_all(rows: list[dict], specs: list[MethodSpec]) -> dict:
    """{method: {category | "all": figures}}, plus the bound and efficiency where they apply.
    Each method is measured against plain decoding on its own engine (the rows' ``reference``)."""
    labels = list(dict.fromkeys([r["method"] for r in rows if r["method"] == r.get("reference", "plain")]
                                + [s.label for s in specs]))
    reference = {r["method"]: r.get("reference", "plain") for r in rows}
    cats = sorted({r["category"] for r in rows}) + ["all"]
    k_of = {s.label: s.k for s in specs}
    out: dict = {}
    for label in labels:
        out[label] = {}
        ref = reference.get(label, "plain")
        step = _plain_step_s(rows, ref)
        for cat in cats:
            subset = [r for r in rows if r["method"] == label and cat in ("all", r["category"])]
            if not subset:
                continue
            plain_rows = [r for r in rows if r["method"] == ref and cat in ("all", r["category"])]
            fig = summarize(subset, step, plain_rows)
            if "alpha_iid" in fig and k_of.get(label) and "c" in fig:
                fig["k"] = k_of[label]
                fig["bound"] = leviathan_bound(fig["alpha_iid"], fig["k"], fig["c"])
                fig["bound_v"] = leviathan_bound(fig["alpha_iid"], fig["k"], fig["c"], fig["v"])
                if fig.get("decode_speedup"):  # the bound is about decoding: compare like with like
                    fig["efficiency"] = fig["decode_speedup"] / fig["bound"]
                    fig["efficiency_v"] = fig["decode_speedup"] / fig["bound_v"]
            out[label][cat] = fig
    return out


def _fmt(value, pattern: str = "{:.2f}", empty: str = "-") -> str:
    return empty if value is None else pattern.format(value)


def drafter_notes(rows: list[dict]) -> list[str]:
    """One line per method whose drafter reported on itself: for ``auto``, which candidate each
    request ended on, the rounds each drafted and the median of the rates it measured."""
    import statistics

    notes = []
    for method in dict.fromkeys(r["method"] for r in rows):
        reports = [r["drafter_report"] for r in rows if r["method"] == method and r.get("drafter_report")]
        if not reports:
            continue
        if "choice" not in reports[-1]:  # the last request's summary; counts summed over requests
            counts = {key: sum(rep.get(key, 0) for rep in reports) for key, value in reports[-1].items()
                      if isinstance(value, int) and not isinstance(value, bool)}
            totals = ", ".join(f"{key} {value}" for key, value in counts.items())
            notes.append(f"- {method}: {reports[-1].get('summary', '')}"
                         + (f" (last request); over all {len(reports)} requests: {totals}" if totals else ""))
            continue
        choices: dict[str, int] = {}
        rounds: dict[str, int] = {}
        rates: dict[str, list[float]] = {}
        for rep in reports:
            choices[str(rep["choice"])] = choices.get(str(rep["choice"]), 0) + 1
            for name, count in rep["rounds"].items():
                rounds[name] = rounds.get(name, 0) + count
            for name, figures in rep["rates"].items():
                rates.setdefault(name, []).append(figures["tok_s"])
        switches = sum(1 for rep in reports for d in rep["decisions"] if "switch" in d["reason"])
        notes.append(
            f"- {method}: choice at the end of each request: "
            + ", ".join(f"{n} {c}x" for n, c in sorted(choices.items(), key=lambda x: -x[1]))
            + "; rounds drafted: " + ", ".join(f"{n} {c}" for n, c in sorted(rounds.items(), key=lambda x: -x[1]))
            + "; median measured tok/s: " + ", ".join(
                f"{n} {statistics.median(v):.1f}" for n, v in sorted(rates.items(), key=lambda x: -statistics.median(x[1])))
            + f"; {switches} switch(es)")
    return notes


_COLUMNS = [  # (header, key, format)
    ("requests", "requests", "{}"), ("median tok/s", "tok_s", "{:.1f}"),
    ("vs baseline", "vs_baseline", "{:.2f}x"), ("median speedup", "speedup", "{:.2f}x"), ("decode speedup", "decode_speedup", "{:.2f}x"),
    ("alpha", "alpha", "{:.2f}"), ("alpha/token", "alpha_iid", "{:.2f}"), ("tau", "tau", "{:.2f}"),
    ("c", "c", "{:.3f}"), ("v", "v", "{:.2f}"), ("bound", "bound", "{:.2f}x"),
    ("efficiency", "efficiency", "{:.0%}"), ("bound (v)", "bound_v", "{:.2f}x"),
    ("efficiency (v)", "efficiency_v", "{:.0%}"),
]
_ORACLE_COLUMNS = [("alpha/token", "alpha_iid", "{:.2f}"), ("tau", "tau", "{:.2f}"),
                   ("decode speedup", "decode_speedup", "{:.2f}x"), ("v", "v", "{:.2f}"),
                   ("bound", "bound", "{:.2f}x"), ("efficiency", "efficiency", "{:.0%}"),
                   ("bound (v)", "bound_v", "{:.2f}x"), ("efficiency (v)", "efficiency_v", "{:.0%}")]
LEGEND = (
    "Columns: vs baseline = median over requests of tok/s ÷ the baseline method's tok/s on the "
    "same request (--baseline; default the first plain); median speedup = the same ÷ plain "
    "decoding on the method's own engine (backend, compile, quantize, dtype), prefill included; "
    "c, v, the bounds and identity are against that plain too; decode speedup = pooled decode tokens/s ÷ plain's, prefill excluded "
    "(speclm methods only); alpha = accepted ÷ drafted (speclm methods and llama-server); alpha/token = P(accept | reached), the "
    "i.i.d. rate the bound assumes; tau = tokens per target forward; c = draft time per token ÷ "
    "plain's time per step; v = target time per speculative forward ÷ plain's time per step; "
    "bound = (1 − a^(K+1)) / ((1 − a)(cK + 1)) (Leviathan et al.) with a = alpha/token and the "
    "configured K; bound (v) = the same with cK + v, the verify's measured cost; efficiency = "
    "decode speedup ÷ bound. guard SLOW: median speedup below 0.95x plain decoding on the same engine; "
    "COMPILED n: n requests compiled a graph of the fast path while timed (their times include it).")


GUARD = 0.95  # a method whose median speedup in a category is below this is flagged


def slower_than_plain(summary: dict, guard: float = GUARD) -> list[str]:
    """One line per (method, category) whose median speedup over plain decoding on its own
    engine is below ``guard``: speculation that costs the user time is shown, never averaged
    away."""
    return [f"SLOWER THAN PLAIN: {label} on {cat}: median speedup {f['speedup']:.2f}x < {guard:.2f}x"
            for label, by_cat in summary.items() for cat, f in by_cat.items()
            if f.get("speedup") is not None and f["speedup"] < guard]


def _cells(fig: dict, columns: list) -> str:
    return " | ".join(_fmt(fig.get(key), pattern) for _, key, pattern in columns)


def markdown(summary: dict, header: str, specs: list[MethodSpec] | None = None,
             notes: list[str] | None = None) -> str:
    """The terminal/results.md report: per method and category, acceptance by position, oracle sweep."""
    lines = [header, "",
             "| method | category | " + " | ".join(h for h, _, _ in _COLUMNS) + " | identical | errors | guard |",
             "|---" * (len(_COLUMNS) + 5) + "|"]
    for label, by_cat in summary.items():
        for cat, f in by_cat.items():
            ident = f"{f['identical']}/{f['checked']}" if f.get("checked") else "-"
            slow = "SLOW" if f.get("speedup") is not None and f["speedup"] < GUARD else ""
            slow = " ".join(filter(None, [slow, f"COMPILED {f['compiled']}" if f.get("compiled") else ""]))
            lines.append(f"| {label} | {cat} | {_cells(f, _COLUMNS)} | {ident} | {f['errors']} | {slow} |")
    guard = slower_than_plain(summary) + [
        f"COMPILED WHILE TIMED: {label} on {cat}: {f['compiled']} request(s) include a compile"
        for label, by_cat in summary.items() for cat, f in by_cat.items() if f.get("compiled") and cat != "all"]
    lines += ["", *guard] if guard else []
    lines += ["", "Acceptance by draft position (all categories):", "",
              "| method | " + " | ".join(str(i) for i in range(1, 11)) + " |",
              "|---|" + "---|" * 10]
    for label, by_cat in summary.items():
        rates = by_cat.get("all", {}).get("acceptance_by_position")
        if rates:
            cells = [f"{r:.2f}" for r in rates[:10]] + [""] * (10 - min(10, len(rates)))
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    oracles = [s for s in specs or [] if s.name == "oracle" and s.label in summary]
    if oracles:
        lines += ["", "Oracle sweep (acceptance controlled exactly; drafting costs nothing, so "
                  "efficiency (v) is the engine's own overhead):", "",
                  "| a | K | " + " | ".join(h for h, _, _ in _ORACLE_COLUMNS) + " |",
                  "|---|---" + "|---" * len(_ORACLE_COLUMNS) + "|"]
        for spec in sorted(oracles, key=lambda s: (s.options["a"], s.k)):
            fig = summary[spec.label].get("all", {})
            lines.append(f"| {spec.options['a']:g} | {spec.k} | {_cells(fig, _ORACLE_COLUMNS)} |")
    if notes:
        lines += ["", "Drafters' own reports:", "", *notes]
    lines += ["", LEGEND]
    return "\n".join(lines) + "\n"


def mismatches(rows: list[dict]) -> list[str]:
    """One line per greedy or seeded output that differs from plain decoding, with the runner's diagnosis
    (numerical near-tie or bug) of the first differing token."""
    out = []
    for r in rows:
        if r.get("identical") is False:
            d = r.get("mismatch", {})
            out.append(f"MISMATCH {r['method']} on question {r['prompt_id']} turn {r['turn']} "
                       f"({r['category']}) from token {d.get('position', '?')}: {d.get('verdict', '?')}")
    return out


def environment() -> dict:
    import torch
    import transformers

    from .. import __version__

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), cpu)
    except OSError:
        pass
    return dict(python=sys.version.split()[0], platform=platform.platform(), cpu=cpu,
                cpu_count=os.cpu_count(), torch_threads=torch.get_num_threads(), torch=torch.__version__,
                transformers=transformers.__version__, speclm=__version__,
                cuda=torch.cuda.get_device_name() if torch.cuda.is_available() else None)


def write_outputs(out_dir: Path, rows: list[dict], summary: dict, table: str, meta: dict) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(
        dict(meta=meta, environment=environment(), summary=summary, rows=rows), indent=1))
    (out_dir / "results.md").write_text(table)
    return [out_dir / "results.json", out_dir / "results.md"] + plot(out_dir, summary)
