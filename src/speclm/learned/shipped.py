"""Drafters that ship inside the package, found by the target they were trained for.

``--drafter eagle`` with no path looks here: each folder under ``speclm/data/drafters`` is a
drafter folder as ``speclm train-drafter --export`` writes it (bfloat16 weights and the
``drafter.json`` that names its target). One is used only for the exact target it was made for
(same shapes and the same LM-head fingerprint); any other target is refused in one line that
says how to make a drafter for it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import SpeclmError
from .checkpoint import CONFIG_FILE, DrafterConfig, TargetIdentity

SHIPPED_DIR = Path(__file__).resolve().parent.parent / "data" / "drafters"


def shipped_drafters(root: Path = SHIPPED_DIR) -> list[tuple[Path, DrafterConfig]]:
    """Every drafter folder under ``root`` with its config, in name order."""
    if not root.is_dir():
        return []
    return [(folder, DrafterConfig.load(folder)) for folder in sorted(root.iterdir())
            if (folder / CONFIG_FILE).is_file()]


def shipped_folder(model: torch.nn.Module, kind: str, root: Path = SHIPPED_DIR) -> Path:
    """The shipped ``kind`` drafter made for ``model`` (a transformers model), or a one-line
    :class:`SpeclmError` naming the targets drafters ship for."""
    mine = TargetIdentity.of(model, "this target")
    known = shipped_drafters(root)
    for folder, config in known:
        if config.kind == kind and config.target.same_as(mine):
            return folder
    names = sorted({config.target.name for _, config in known if config.kind == kind})
    shipped = f"it ships one for {', '.join(names)}" if names else "it ships none"
    raise SpeclmError(f"speclm ships no {kind} drafter for this target ({shipped}); make one with "
                      f"`speclm train-drafter --method {kind} --target MODEL --out DIR` and use {kind}:path=DIR")
