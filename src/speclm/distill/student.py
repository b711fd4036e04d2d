"""The student: the target's architecture with fewer layers, initialised from the target's own.

Copying a subset of trained layers (spread evenly over the depth, the first and the last
included) gives the student the target's embeddings, the representations its LM head reads, and
a starting point that already agrees with the target on easy tokens; training then only has to
repair what the missing layers did.
"""

from __future__ import annotations

import copy
import re

import torch
from transformers import PreTrainedModel

from ..errors import SpeclmError
from ..models.layer_subset import decoder_layers


def pick_layers(num_layers: int, keep: int) -> list[int]:
    """``keep`` layer indices spread evenly over 0 .. num_layers - 1 (first and last included)."""
    if not 1 <= keep < num_layers:
        raise SpeclmError(f"--layers must be in [1, {num_layers - 1}] for a target with "
                          f"{num_layers} layers, got {keep}")
    if keep == 1:
        return [0]
    return sorted({round(i * (num_layers - 1) / (keep - 1)) for i in range(keep)})


def build_student(target: PreTrainedModel, layers: list[int]) -> PreTrainedModel:
    """A new model of the target's class with only ``layers`` (target indices, ascending)."""
    num_layers = len(decoder_layers(target))
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = len(layers)
    if getattr(config, "layer_types", None):  # per-layer attention kinds follow their layers
        config.layer_types = [config.layer_types[i] for i in layers]
    for attr in ("_name_or_path", "_commit_hash"):
        if hasattr(config, attr):
            setattr(config, attr, "")
    student = type(target)(config).to(dtype=target.dtype)
    new_index = {old: new for new, old in enumerate(layers)}
    pattern = re.compile(r"^(.*\.layers\.)(\d+)(\..*)$")
    state = {}
    for name, tensor in target.state_dict().items():
        match = pattern.match(name)
        if match is None:
            state[name] = tensor.clone()
        elif int(match.group(2)) in new_index:
            state[f"{match.group(1)}{new_index[int(match.group(2))]}{match.group(3)}"] = tensor.clone()
    missing, unexpected = student.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.endswith("lm_head.weight")]  # tied to the embeddings
    if missing or unexpected:
        raise SpeclmError(f"cannot map {num_layers}-layer target weights onto the student "
                          f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    if getattr(config, "tie_word_embeddings", False):
        student.tie_weights()
    student.generation_config = copy.deepcopy(target.generation_config)
    return student.eval()


def num_params(model: torch.nn.Module) -> int:
    """Distinct parameters (tied tensors counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
