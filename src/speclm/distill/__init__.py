"""``speclm distill``: a small draft model for a target, made in minutes, with no data to find.

The student is the target's own architecture with fewer decoder layers, initialised from a subset
of the target's layers (with its embeddings, final norm and LM head), then trained to match the
target's next-token distributions on the target's own answers to a built-in prompt set
(:mod:`.data`, :mod:`.student`, :mod:`.train`). It is saved as an ordinary transformers model
folder with the target's tokenizer, so speclm (``--draft-model DIR``, ``--drafter distilled``) and
transformers (``generate(assistant_model=...)``) both load it.

This module only knows where distilled models live; the training code loads on demand.
"""

from __future__ import annotations

from pathlib import Path

from ..models.loading import cache_dir


def default_distill_dir(model_path: Path, layers: int) -> Path:
    """Where ``speclm distill`` puts the draft for the target folder ``model_path`` by default."""
    return cache_dir() / "distilled" / f"{Path(model_path).resolve().name}-{layers}layers"


def find_distilled(model_path: Path | None) -> Path | None:
    """The newest distilled draft model for ``model_path`` in the cache, or None."""
    if model_path is None:
        return None
    root = cache_dir() / "distilled"
    found = [p for p in root.glob(f"{Path(model_path).resolve().name}-*layers")
             if (p / "config.json").is_file()] if root.is_dir() else []
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


__all__ = ["default_distill_dir", "find_distilled"]
