"""PNG plots of a benchmark summary: speedup by category, acceptance by position, measured vs bound."""

from __future__ import annotations

from pathlib import Path


def _save(fig, path: Path, written: list[Path]) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)


def plot(out_dir: Path, summary: dict) -> list[Path]:
    """Write the three plots for ``summary`` ({method: {category: figures}}); return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: list[Path] = []
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
    ax.legend(fontsize=7, ncol=2)
    _save(fig, out_dir / "speedup_by_category.png", written)

    fig, ax = plt.subplots(figsize=(6, 4))
    for label in labels:
        rates = summary[label].get("all", {}).get("acceptance_by_position")
        if rates:
            ax.plot(range(1, len(rates) + 1), rates, marker="o", label=label)
    ax.set_xlabel("draft position")
    ax.set_ylabel("P(accepted | earlier accepted)")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=7)
    _save(fig, out_dir / "acceptance_by_position.png", written)

    fig, ax = plt.subplots(figsize=(5.5, 5))
    points = [(f["bound"], f["decode_speedup"], m) for m in labels
              if (f := summary[m].get("all", {})).get("bound") and f.get("decode_speedup")]
    if points:
        top = max(max(b, s) for b, s, _ in points) * 1.1
        ax.plot([0, top], [0, top], color="gray", linestyle="--", linewidth=0.8, label="measured = bound")
        for b, s, m in points:
            ax.scatter(b, s)
            ax.annotate(m, (b, s), fontsize=6)
    ax.set_xlabel("Leviathan bound (measured alpha, K, c)")
    ax.set_ylabel("measured decode speedup")
    ax.legend(fontsize=7)
    _save(fig, out_dir / "measured_vs_bound.png", written)
    return written
