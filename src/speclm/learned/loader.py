"""Turn a trained drafter folder into a drafter for a loaded target, checking they belong together."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from ..errors import SpeclmError
from ..models.dtypes import cast_keeping_rotary, fast_dtype
from ..models.fast_norm import use_fast_norms
from ..models.hf import HFCausalLM
from ..models.quantize import blocks_fit, quantize_weights
from ..models.small_m import use_small_m
from .checkpoint import DrafterConfig, TargetIdentity, load_weights


def load_learned_drafter(folder: str | Path, target: HFCausalLM, kind: str, *, top_k: int = 4,
                         budget: int = 16, tree: bool = True, fit: bool = True, bits: int | None = None):
    """A :class:`MedusaDrafter` or :class:`EagleDrafter` from ``folder`` for ``target``.

    ``kind`` is what the user asked for ("medusa" or "eagle"); a folder holding the other kind is
    an error. EAGLE drafts a dynamic tree of ``budget`` nodes (``top_k`` per expansion), or a
    chain with ``tree=False`` (always, for a head trained to draft in parallel: one forward
    proposes its chain); Medusa's tree is the one chosen at training time.
    """
    from ..drafters.eagle import EagleDrafter
    from ..drafters.medusa import MedusaDrafter
    from ..drafters.tree_search import TreeShape

    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise SpeclmError(f"drafter folder {str(folder)!r} does not exist")
    config, module = _load_module(folder.resolve(), kind, target, bits)
    if config.kind == "medusa":
        paths = config.training.get("tree") or [[0] * d for d in range(1, config.num_heads + 1)]
        return MedusaDrafter(module, paths)
    shape = TreeShape(top_k=top_k, budget=budget, fit=fit) if tree and not config.parallel else None
    return EagleDrafter(module, target.model.get_input_embeddings(), config.feature_layers,
                        target.vocab_size, shape)


_MODULES: dict[tuple, tuple] = {}  # (folder, its files' time, kind, target weights, dtype, device, bits)

HEAD_BITS = (0, 8)  # an EAGLE head's weights: 0 its float dtype, 8 llama.cpp's Q8_0 blocks


def _head_in_blocks(bits: int | None, module: torch.nn.Module) -> bool:
    """Whether the head's linear layers go to 8-bit blocks. Asked (``bits``): as asked. Else where
    the head stays float32 on a CPU (no native bfloat16 there: an AVX2 CPU) and every layer fits
    speclm's block kernel (docs/benchmarks.md, "The EAGLE head in 8-bit blocks"): a head forward
    there reads its weights from memory and is bound by them, and Q8_0 blocks are a quarter of
    float32's bytes. A 16-bit head (native bfloat16) or a float64 one (tests) stays as it is."""
    if bits is not None:
        return bits == 8
    linears = [m for m in module.modules() if type(m) is torch.nn.Linear]
    return bool(linears) and all(blocks_fit(m) for m in linears)


def _load_module(folder: Path, kind: str, target: HFCausalLM, bits: int | None = None):
    """The trained module of ``folder`` on ``target``'s device, loaded once per target weights:
    the drafters of a batch's rows share it (each keeps its own drafting state)."""
    from .modules import EagleHead, MedusaHeads

    written = max((f.stat().st_mtime_ns for f in folder.iterdir()), default=0)  # retrained: reload
    key = (str(folder), written, kind, id(target.model), target.dtype, str(target.device), bits)
    if key in _MODULES and _MODULES[key][2] is target.model:
        return _MODULES[key][:2]
    config = DrafterConfig.load(folder)
    if config.kind != kind:
        raise SpeclmError(f"{str(folder)!r} holds a {config.kind} drafter, not {kind}")
    for warning in config.target.check(TargetIdentity.of(target.model, "this target"), str(folder)):
        print(f"speclm: warning: {warning}", file=sys.stderr)
    # A draft's precision never touches the output (the verifier decides), only its speed and
    # acceptance: float64 tests stay exact, a 16-bit target gets a 16-bit drafter, and a float32
    # target one in bfloat16 where the device computes it natively (3-4x faster products on an
    # AVX512-BF16 or AMX CPU), else float32
    dtype = target.dtype if target.dtype in (torch.float64, torch.bfloat16, torch.float16) else fast_dtype(target.device)
    if config.kind == "medusa":
        module = MedusaHeads(config.target.hidden_size, config.num_heads, config.draft_vocab_size or None)
        load_weights(module, folder)
        if not config.draft_vocab_size:
            module.share_head(target.model.get_output_embeddings())
    else:
        module = EagleHead(target.model.config, len(config.feature_layers), config.draft_vocab_size,
                           config.parallel)
        load_weights(module, folder)
    module = cast_keeping_rotary(module.to(target.device), dtype)  # float32 rotary frequencies
    if config.kind == "eagle" and _head_in_blocks(bits, module):
        # the draft's rounding never reaches the output (the verifier decides), only acceptance
        quantize_weights(module, "int8", blocks=True)
    # float32 on a CPU without native bfloat16 (AVX2): the target's few-row kernels, which read
    # each weight row once for all of a tree level's rows (the BLAS packs weights per call and
    # runs 4 rows at twice one row's cost); a no-op for other dtypes and devices
    use_small_m(module)
    use_fast_norms(module)
    _MODULES[key] = (config, module, target.model)
    return config, module
