"""Benchmark output: markdown tables, results.json (every raw figure) and PNG plots."""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path

from .methods import MethodSpec
from .metrics import leviathan_bound, summarize


def _plain_step_s(rows: list[dict]) -> float | None:
    """Target time per forward in plain decoding: the unit of the draft cost ratio c."""
    plain = [r for r in rows if r["method"] == "plain" and r.get("forwards")]
    if not plain:
        return None
    return sum(r["target_s"] for r in plain) / sum(r["forwards"] for r in plain)


def summarize_all(rows: list[dict], specs: list[MethodSpec]) -> dict:
    """{method: {category | "all": figures}}, plus the bound and efficiency where they apply."""
    step = _plain_step_s(rows)
    labels = ["plain"] + [s.label for s in specs if s.label != "plain"]
    cats = sorted({r["category"] for r in rows}) + ["all"]
    k_of = {s.label: s.k for s in specs}
    out: dict = {}
    for label in labels:
        out[label] = {}
        for cat in cats:
            subset = [r for r in rows if r["method"] == label and cat in ("all", r["category"])]
            if not subset:
                continue
            plain_rows = [r for r in rows if r["method"] == "plain" and cat in ("all", r["category"])]
            fig = summarize(subset, step, plain_rows)
            if "alpha_iid" in fig and k_of.get(label) and "c" in fig:
                fig["k"] = k_of[label]
                fig["bound"] = leviathan_bound(fig["alpha_iid"], fig["k"], fig["c"])
                if fig.get("decode_speedup"):  # the bound is about decoding: compare like with like
                    fig["efficiency"] = fig["decode_speedup"] / fig["bound"]
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
        if "choice" not in reports[-1]:
            notes.append(f"- {method}: {reports[-1].get('summary', '')}")
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


def markdown(summary: dict, header: str, notes: list[str] | None = None) -> str:
    lines = [header, "",
             "| method | category | requests | median tok/s | median speedup | decode speedup "
             "| alpha | alpha/token | tau | c | bound | efficiency | identical | errors |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, by_cat in summary.items():
        for cat, f in by_cat.items():
            ident = f"{f['identical']}/{f['checked']}" if f.get("checked") else "-"
            lines.append(
                f"| {label} | {cat} | {f['requests']} | {_fmt(f.get('tok_s'), '{:.1f}')} "
                f"| {_fmt(f.get('speedup'), '{:.2f}x')} | {_fmt(f.get('decode_speedup'), '{:.2f}x')} "
                f"| {_fmt(f.get('alpha'))} | {_fmt(f.get('alpha_iid'))} | {_fmt(f.get('tau'))} "
                f"| {_fmt(f.get('c'), '{:.3f}')} | {_fmt(f.get('bound'), '{:.2f}x')} "
                f"| {_fmt(f.get('efficiency'), '{:.0%}')} | {ident} | {f['errors']} |")
    lines += ["", "Acceptance by draft position (all categories):", "",
              "| method | " + " | ".join(str(i) for i in range(1, 11)) + " |",
              "|---|" + "---|" * 10]
    for label, by_cat in summary.items():
        rates = by_cat.get("all", {}).get("acceptance_by_position")
        if rates:
            cells = [f"{r:.2f}" for r in rates[:10]] + [""] * (10 - min(10, len(rates)))
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    if notes:
        lines += ["", "Drafters' own reports:", "", *notes]
    lines += ["", "Columns: median speedup = median over requests of tok/s ÷ plain's tok/s on the same "
              "request, prefill included; decode speedup = pooled decode tokens/s ÷ plain's, "
              "prefill excluded (speclm methods only); alpha = accepted ÷ drafted; alpha/token = "
              "P(accept | reached), the i.i.d. rate the bound assumes; c = draft time per token ÷ "
              "plain's target time per step; bound = (1 − a^(K+1)) / ((1 − a)(cK + 1)) with "
              "a = alpha/token and the configured K; efficiency = decode speedup ÷ bound."]
    return "\n".join(lines) + "\n"


def mismatches(rows: list[dict]) -> list[str]:
    """Greedy outputs that differ from plain decoding, with the first differing position."""
    plain = {(r["prompt_id"], r["turn"]): r for r in rows if r["method"] == "plain"}
    out = []
    for r in rows:
        if r.get("identical") is False:
            ref = plain[(r["prompt_id"], r["turn"])]["token_ids"]
            at = next((i for i, (a, b) in enumerate(zip(r["token_ids"], ref)) if a != b),
                      min(len(ref), len(r["token_ids"])))
            out.append(f"MISMATCH {r['method']} on question {r['prompt_id']} turn {r['turn']} "
                       f"({r['category']}) from token {at}")
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


def plot(out_dir: Path, summary: dict) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    labels = [m for m in summary if m != "plain"]
    cats = sorted({c for m in labels for c in summary[m]} - {"all"}) + ["all"]
    fig, ax = plt.subplots(figsize=(min(14, 3 + 1.3 * len(cats)), 4.5))
    width = 0.8 / max(1, len(labels))
    for i, label in enumerate(labels):
        values = [summary[label].get(c, {}).get("speedup") or 0 for c in cats]
        ax.bar([j + i * width for j in range(len(cats))], values, width, label=label)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + width * (len(labels) - 1) / 2 for j in range(len(cats))], cats, rotation=20)
    ax.set_ylabel("median speedup over plain decoding")
    ax.legend(fontsize=7)
    fig.tight_layout()
    written.append(out_dir / "speedup_by_category.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for label in labels:
        rates = summary[label].get("all", {}).get("acceptance_by_position")
        if rates:
            ax.plot(range(1, len(rates) + 1), rates, marker="o", label=label)
    ax.set_xlabel("draft position")
    ax.set_ylabel("P(accepted | earlier accepted)")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=7)
    fig.tight_layout()
    written.append(out_dir / "acceptance_by_position.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5, 5))
    points = [(summary[m]["all"]["bound"], summary[m]["all"]["speedup"], m)
              for m in labels if summary[m].get("all", {}).get("bound") and summary[m]["all"].get("speedup")]
    if points:
        top = max(max(b, s) for b, s, _ in points) * 1.1
        ax.plot([0, top], [0, top], color="gray", linestyle="--", linewidth=0.8, label="measured = bound")
        for b, s, m in points:
            ax.scatter(b, s)
            ax.annotate(m, (b, s), fontsize=6)
    ax.set_xlabel("Leviathan bound (measured alpha, K, c)")
    ax.set_ylabel("measured median speedup")
    ax.legend(fontsize=7)
    fig.tight_layout()
    written.append(out_dir / "measured_vs_bound.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)
    return written

