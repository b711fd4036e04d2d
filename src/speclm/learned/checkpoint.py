"""A trained drafter on disk: ``drafter.json`` (what it is, and the target it was made for) and
``drafter.safetensors`` (its weights). Loading it for a different target is a clear error."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..errors import SpeclmError

FORMAT = 1
CONFIG_FILE = "drafter.json"
WEIGHTS_FILE = "drafter.safetensors"


@dataclass
class TargetIdentity:
    """What a drafter needs to match in its target: shapes are checked, the fingerprint warns."""

    name: str
    architecture: str
    hidden_size: int
    vocab_size: int
    num_hidden_layers: int
    fingerprint: float  # sum of a fixed slice of the LM head: differs between checkpoints

    @staticmethod
    def of(model: torch.nn.Module, name: str) -> TargetIdentity:
        config = model.config
        head = head_weight(model)
        return TargetIdentity(
            name=name, architecture=type(model).__name__, hidden_size=int(config.hidden_size),
            vocab_size=int(head.shape[0]), num_hidden_layers=int(config.num_hidden_layers),
            fingerprint=round(float(head[:64, :64].double().sum()), 4),
        )

    def same_as(self, other: TargetIdentity) -> bool:
        """The same shapes and the same weights (by fingerprint): the model it was made for."""
        return (all(getattr(self, k) == getattr(other, k) for k in ("hidden_size", "vocab_size", "num_hidden_layers"))
                and abs(self.fingerprint - other.fingerprint) <= 1e-2 * max(1.0, abs(self.fingerprint)))

    def check(self, other: TargetIdentity, where: str) -> list[str]:
        """Raise on a shape mismatch; return warnings (a different checkpoint of the same shape)."""
        for key in ("hidden_size", "vocab_size", "num_hidden_layers"):
            mine, theirs = getattr(self, key), getattr(other, key)
            if mine != theirs:
                raise SpeclmError(f"the drafter in {where} was made for {self.name} ({key} {mine}); "
                                  f"this target has {key} {theirs}: train one for it with "
                                  "speclm train-drafter")
        if not self.same_as(other):
            return [f"the drafter in {where} was trained for {self.name}, whose weights differ "
                    "from this target's: expect lower acceptance (output is still exact)"]
        return []


def head_weight(model: torch.nn.Module) -> torch.Tensor:
    """The target's LM head as float weights [V, H], for its identity. A quantized head (int8 or
    int4 layers, a GGUF file's blocks: ``--quantize``) keeps no float weight; it then reads the
    embeddings the head is tied to (which quantizing leaves as they were), else the weights its
    blocks describe, so a drafter made on the float model is recognised on its quantized copy."""
    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    if isinstance(weight, torch.Tensor):
        return weight.detach()
    if getattr(model.config, "tie_word_embeddings", False):
        return model.get_input_embeddings().weight.detach()
    dequantized = getattr(head, "dequantized", None)
    if callable(dequantized):
        return dequantized()
    raise SpeclmError(f"this target's output head is quantized ({type(head).__name__}) and not tied to "
                      "its embeddings, so a drafter cannot check that it was made for it: load the "
                      "target without --quantize, or with --quantize gguf")


@dataclass
class DrafterConfig:
    kind: str  # "medusa" or "eagle"
    target: TargetIdentity
    draft_vocab_size: int  # rows of the draft head (ids map to the target's through draft_to_target);
    #                        0: the drafter uses the target's own LM head
    feature_layers: list[int] = field(default_factory=list)  # target hidden states it reads
    num_heads: int = 0  # medusa: heads (draft depth)
    parallel: int = 0  # eagle: tokens proposed by one forward (mask pairs + 1); 0: one per forward
    training: dict = field(default_factory=dict)  # how it was made: data, epochs, time, acceptance
    format: int = FORMAT

    def save(self, folder: Path) -> None:
        (folder / CONFIG_FILE).write_text(json.dumps(asdict(self), indent=1))

    @staticmethod
    def load(folder: Path) -> DrafterConfig:
        path = Path(folder) / CONFIG_FILE
        try:
            raw = json.loads(path.read_text())
            raw["target"] = TargetIdentity(**raw["target"])
            config = DrafterConfig(**raw)
        except FileNotFoundError:
            raise SpeclmError(f"{str(folder)!r} is not a speclm drafter folder (no {CONFIG_FILE}); "
                              "make one with speclm train-drafter") from None
        except (OSError, json.JSONDecodeError, TypeError, KeyError) as exc:
            raise SpeclmError(f"cannot read {path}: {exc}") from None
        if config.format != FORMAT:
            raise SpeclmError(f"{path} has format {config.format}; this speclm reads format {FORMAT}")
        return config


def save_weights(module: torch.nn.Module, folder: Path) -> None:
    from safetensors.torch import save_file

    state = {k: v.detach().contiguous().cpu() for k, v in module.state_dict().items()}
    save_file(state, str(folder / WEIGHTS_FILE))


def load_weights(module: torch.nn.Module, folder: Path, strict: bool = True) -> None:
    """``strict=False``: a start for training (parts the file lacks keep their values, parts
    the module lacks are skipped); every shared tensor must still have the module's shape."""
    from safetensors.torch import load_file

    path = Path(folder) / WEIGHTS_FILE
    try:
        state = load_file(str(path))
        module.load_state_dict(state, strict=strict)
    except (OSError, RuntimeError) as exc:
        raise SpeclmError(f"cannot load drafter weights from {path}: {str(exc).splitlines()[0]}") from None


def export_drafter(folder: Path, dest: Path, dtype: torch.dtype = torch.bfloat16) -> int:
    """Copy the drafter in ``folder`` to ``dest`` with its floating-point weights in ``dtype``
    (what ships in the package: half the bytes, and the head runs in float32 or float64 after
    loading, so drafting stays exact); returns the weights file's size in bytes."""
    from safetensors.torch import load_file, save_file

    config = DrafterConfig.load(folder)
    state = load_file(str(Path(folder) / WEIGHTS_FILE))
    state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    dest = Path(dest)
    try:
        dest.mkdir(parents=True, exist_ok=True)
        save_file(state, str(dest / WEIGHTS_FILE))
    except OSError as exc:
        raise SpeclmError(f"cannot write the drafter to {str(dest)!r}: {exc.strerror or exc}") from None
    config.training = {**config.training, "weights_dtype": str(dtype).removeprefix("torch.")}
    config.save(dest)
    return (dest / WEIGHTS_FILE).stat().st_size
