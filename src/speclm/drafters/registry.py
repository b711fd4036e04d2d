"""Every drafter by name: ``--drafter NAME[:key=value,...]``, ``LLM(speculative_model="NAME...")``
and the ``speclm bench`` method of the same name all come through this table, so adding a
drafter is one entry here and no name is tested for anywhere else.

    ngram[:min=2,max=3]              prompt lookup in the request's own text
    suffix[:capacity=262144,factor=1]  suffix matching over the whole session (all requests)
    recycle[:topk=8]                 token recycling: the target's own earlier top-k candidates
    layerskip[:skip=3,5-9,refresh=0] the target minus some layers; the set is searched per model
                                     (measured speedup, cached) unless given
    early-exit[:layers=N]            the target's first N layers (default: a third)
    draft:path=PATH[,p_min=0,tree=0,budget=16,async=0,fanout=8,threads=1]  a smaller model
                                     with the target's tokenizer; tree=N grows a dynamic token
                                     tree (N children per expansion); async=1 drafts the next
                                     round for the likely outcomes while the target verifies
    distilled[:path=DIR,p_min=0,tree=0,budget=16]  the draft model `speclm distill` made
    quant[:bits=4,fast=0,vocab=0,p_min=0,tree=0,budget=16]  the quantized self-draft: the target's
                                     own weights at fewer bits (torch: int8/int4 copy; llama.cpp: a
                                     requantized copy of its GGUF, bits=2/3/4/8); fast=1: an eager
                                     target's draft runs compiled (minutes to compile, once);
                                     vocab=N: the draft's output layer covers only the N tokens
                                     the target predicts most (torch; 0, the default: all)
    medusa:path=DIR                  Medusa heads from `speclm train-drafter` (static tree)
    eagle[:path=DIR,tree=4,budget=16,lookup=5,bits=B]  an EAGLE head: from `speclm train-drafter`
                                     (path=DIR), or without a path the one speclm ships for the
                                     target (a one-line error where none ships); dynamic tree
                                     (tree=0: a chain); bits=8: the head's layers in 8-bit blocks,
                                     bits=0: in its float dtype (default: 8-bit where the head would
                                     be float32 on a CPU, i.e. one without native bfloat16)
    lookup=N (draft, distilled, quant, eagle; with tree=N): prompt lookup's chain of up to N tokens
                                     merged into every round's tree (a trie), for text that repeats
                                     the request (drafters/lookup_branch.py); eagle's tree has one
                                     of 5 unless lookup=0, the others none unless asked
    A tree's budget is its most nodes: with the adaptive draft length (the default) each round
    keeps the nodes that pay for the target's measured verify cost (drafters/tree_search.py);
    fit=0 keeps the whole budget every round.
    auto[:candidates=a,b,...]        measure candidates on the live requests, keep the fastest
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import SpeclmError
from ..models.base import CausalLM
from ..models.hf import HFCausalLM
from ..specs import REQUIRED, NameList, OptionString, IntList, Schema, parse_options
from .base import Drafter


@dataclass
class BuildContext:
    """What a drafter factory may use: the loaded target and how to load draft models."""

    target: CausalLM  # any backend; drafters with ``needs`` check it (runs_on)
    tokenizer: object
    model_path: Path | None  # the target's folder (per-model caches are keyed by it)
    load_draft: Callable[..., Drafter]  # (model spec, p_min, tree shape[, make=]) -> a draft-model
    #                                     drafter; make() builds a draft backend other than a model file
    progress: bool = True


@dataclass(frozen=True)
class DrafterKind:
    name: str
    summary: str  # one line, for --help
    options: Schema
    default_k: int  # draft length (K) when the user gives none
    build: Callable[[BuildContext, dict], Drafter]
    check: Callable[[dict], None] = lambda options: None  # extra validation, before any loading
    label: Callable[[dict], str] | None = None  # the name in stats (default: the text as given)
    needs: str | None = None  # "layers": runs the target's own layers (eager torch backend:
    #                           a single-row target or a batched ragged cache's TargetView);
    #                           "hidden": reads the target's hidden states (torch backends)


def _check_tree(o: dict) -> None:
    if o.get("tree", 0) < 0 or o.get("budget", 1) < 1 or o.get("fit", 1) not in (0, 1):
        raise SpeclmError("tree must be >= 0 (0: a chain), budget >= 1 and fit 0 or 1")
    if (o.get("lookup") or 0) < 0:
        raise SpeclmError(f"lookup must be >= 0 (0: no prompt-lookup branch), got {o['lookup']}")
    if o.get("lookup") and not o.get("tree"):
        raise SpeclmError("lookup=N adds a prompt-lookup branch to a token tree: give tree=N (N >= 1)")


def _check_ngram(o: dict) -> None:
    if not 1 <= o["min"] <= o["max"]:
        raise SpeclmError(f"n-gram sizes need 1 <= min <= max, got min={o['min']} max={o['max']}")


def _check_p_min(o: dict) -> None:
    if not 0.0 <= o["p_min"] < 1.0:
        raise SpeclmError(f"p_min must be in [0, 1), got {o['p_min']}")
    _check_tree(o)
    if o.get("tree") and o["p_min"] > 0:
        raise SpeclmError("p_min applies to chains; a tree spends its budget by confidence")
    if o.get("async") and (o.get("tree") or o["p_min"] > 0):
        raise SpeclmError("async drafting drafts chains: drop tree= and p_min=")
    if o.get("fanout", 1) < 1 or o.get("threads", 1) < 1:
        raise SpeclmError("fanout and threads must be >= 1")
    if o.get("path") not in (None, "default") and not Path(o["path"]).expanduser().exists():
        raise SpeclmError(f"model path {o['path']!r} does not exist")


def _ngram(ctx: BuildContext, o: dict) -> Drafter:
    from .ngram import NgramDrafter

    return NgramDrafter(o["min"], o["max"])


def _suffix(ctx: BuildContext, o: dict) -> Drafter:
    from .suffix import SuffixDrafter

    return SuffixDrafter(capacity=o["capacity"], factor=o["factor"])


def _recycle(ctx: BuildContext, o: dict) -> Drafter:
    from .recycle import RecycleDrafter

    return RecycleDrafter(ctx.target.vocab_size, o["topk"])


def _layerskip(ctx: BuildContext, o: dict) -> Drafter:
    from .layer_skip import layer_skip_drafter, layer_target

    if o["skip"] is not None:
        return layer_skip_drafter(ctx.target, o["skip"], o["p_min"])
    from .layer_search import choose_skip

    choice, origin = choose_skip(layer_target(ctx.target), ctx.tokenizer, ctx.model_path,
                                 refresh=bool(o["refresh"]), progress=ctx.progress)
    if ctx.progress and origin == "searched":
        print(f"speclm: layerskip chose to skip {len(choice.skip)} of {choice.num_layers} layers "
              f"(measured {choice.speedup:.2f}x plain decoding, alpha {choice.alpha:.2f}, "
              f"{choice.seconds:.0f} s)", file=sys.stderr)
    return layer_skip_drafter(ctx.target, choice.skip, o["p_min"],
                              origin=f"{origin} choice, measured {choice.speedup:.2f}x")


def _early_exit(ctx: BuildContext, o: dict) -> Drafter:
    from ..models.layer_subset import decoder_layers
    from .layer_skip import early_exit_drafter

    layers = o["layers"] or max(1, math.ceil(len(decoder_layers(ctx.target.model)) / 3))
    return early_exit_drafter(ctx.target, layers, o["p_min"])


def _tree_shape(o: dict):
    from .tree_search import TreeShape

    return TreeShape(top_k=o["tree"], budget=o["budget"], fit=bool(o.get("fit", 1))) if o.get("tree") else None


def _maybe_async(drafter: Drafter, o: dict) -> Drafter:
    if not o["async"]:
        return drafter
    from .ssd import make_async

    return make_async(drafter, o["fanout"], o["threads"])


def _draft(ctx: BuildContext, o: dict) -> Drafter:
    return _maybe_async(ctx.load_draft(o["path"], o["p_min"], _tree_shape(o)), o)


def _distilled(ctx: BuildContext, o: dict) -> Drafter:
    from ..distill import find_distilled

    path = o["path"] or find_distilled(ctx.model_path)
    if path is None:
        raise SpeclmError("no distilled draft model for this target yet; make one with "
                          "`speclm distill --target MODEL --layers N` (or give path=DIR)")
    return _maybe_async(ctx.load_draft(str(path), o["p_min"], _tree_shape(o)), o)


def _check_quant(o: dict) -> None:
    from .quant import check_bits

    check_bits(o["bits"])
    if o["vocab"] < 0:
        raise SpeclmError(f"quant: vocab= is the number of tokens the draft proposes from (0: all), got {o['vocab']}")
    _check_p_min(o)


def _quant(ctx: BuildContext, o: dict) -> Drafter:
    from .quant import narrowed_vocabulary, quant_draft

    vocab = narrowed_vocabulary(ctx.target, ctx.tokenizer, ctx.model_path, o["vocab"], ctx.progress) if o["vocab"] else None
    key, make = quant_draft(ctx.target, o["bits"], ctx.progress, fast=bool(o["fast"]), vocab=vocab)
    if not o["tree"] and not o["async"]:  # chains in a batch on eager torch: on the target's cache
        from .quant import shared_cache_member

        member = shared_cache_member(ctx.target, key, make, o["p_min"])
        if member is not None:
            return member
    return _maybe_async(ctx.load_draft(key, o["p_min"], _tree_shape(o), make=make), o)


def _check_learned(o: dict) -> None:
    if o["path"] is not None and not Path(o["path"]).expanduser().is_dir():
        raise SpeclmError(f"drafter folder {o['path']!r} does not exist (make one with speclm train-drafter)")
    from ..learned.loader import HEAD_BITS

    if o.get("bits") not in (None, *HEAD_BITS):
        raise SpeclmError(f"eagle's bits must be one of {', '.join(map(str, HEAD_BITS))} "
                          f"(8: the head's layers in 8-bit blocks, 0: in its float dtype), got {o['bits']}")
    _check_tree(o)


def _medusa(ctx: BuildContext, o: dict) -> Drafter:
    from ..learned.loader import load_learned_drafter

    return load_learned_drafter(o["path"], ctx.target, "medusa")


def _eagle(ctx: BuildContext, o: dict) -> Drafter:
    from ..learned.loader import load_learned_drafter

    path = o["path"]
    if path is None:  # the drafter shipped for this target, or a one-line refusal
        from ..learned.shipped import shipped_folder

        path = shipped_folder(ctx.target.model, "eagle")
    return load_learned_drafter(path, ctx.target, "eagle", top_k=max(1, o["tree"]),
                                budget=o["budget"], tree=o["tree"] > 0, fit=bool(o["fit"]), bits=o["bits"])


def auto_candidates(ctx: BuildContext) -> tuple[str, ...]:
    """The default candidates of ``auto``: every drafter that needs no preparation, plus the
    layer set and the distilled draft model where they already exist for this target."""
    names = ["none", "ngram", "suffix", "recycle"]
    if ctx.model_path is not None:
        from ..distill import find_distilled
        from .layer_search import cache_file, load_choice

        if runs_on(KINDS["layerskip"], ctx.target) and load_choice(cache_file(ctx.model_path, ctx.target)):
            names.append("layerskip")
        if find_distilled(ctx.model_path) is not None:
            names.append("distilled")
    return tuple(names)


def _auto(ctx: BuildContext, o: dict) -> Drafter:
    from .auto import AutoDrafter, NoDrafter

    candidates: dict[str, tuple[Drafter, int]] = {}
    names = o["candidates"] or auto_candidates(ctx)
    for text in names:
        if text == "none":
            candidates[text] = (NoDrafter(), 1)
            continue
        spec = parse_drafter(text)
        if spec.name == "auto":
            raise SpeclmError("auto cannot be a candidate of auto")
        candidates[spec.label] = (build_drafter(spec, ctx), KINDS[spec.name].default_k)
    return AutoDrafter(candidates, probe_rounds=o["probe"], reprobe_every=o["every"],
                       memory=auto_memory(ctx, names))


def auto_memory(ctx: BuildContext, names: tuple[str, ...]) -> Path | None:
    """Where ``auto`` remembers its choice for this model, backend, dtype, threads, device and
    candidate set (None for a model without a file: random weights)."""
    from ..cost_model import cache_path, cost_key, model_file

    key = cost_key(ctx.target, model_file(ctx.target, ctx.model_path))
    return None if key is None else cache_path({**key, "candidates": list(names)}, "auto")


def _check_auto(o: dict) -> None:
    for text in o["candidates"] or ():
        if text != "none":
            parse_drafter(text)
    if o["probe"] < 2 or o["every"] < 1:
        raise SpeclmError("auto needs probe >= 2 and every >= 1")


# eagle's prompt-lookup branch when its options leave it out and it drafts a tree: on Spec-Bench
# the shipped head with it runs 1.17-1.20x the head alone, compiled or eager (docs/benchmarks.md)
LOOKUP_BRANCH = 5

# speculative speculative decoding (drafters/ssd.py): draft ahead while the target verifies
_ASYNC = {"async": (int, 0), "fanout": (int, 8), "threads": (int, 1)}

KINDS: dict[str, DrafterKind] = {kind.name: kind for kind in [
    DrafterKind("ngram", "prompt lookup: continue the latest earlier n-gram of this request",
                {"min": (int, 2), "max": (int, 3)}, 10, _ngram, _check_ngram,
                label=lambda o: f"ngram[{o['min']}..{o['max']}]"),
    DrafterKind("suffix", "suffix matching over every prompt and output of the session",
                {"capacity": (int, 1 << 18), "factor": (float, 1.0)}, 10, _suffix),
    DrafterKind("recycle", "token recycling: the target's own top-k from earlier verify steps",
                {"topk": (int, 8)}, 2, _recycle),
    DrafterKind("layerskip", "the target minus some layers (searched per model unless skip= given)",
                {"skip": (IntList(), None), "refresh": (int, 0), "p_min": (float, 0.0)}, 3,
                _layerskip, _check_p_min, needs="layers"),
    DrafterKind("early-exit", "the target's first N layers (default: a third), norm and LM head",
                {"layers": (int, 0), "p_min": (float, 0.0)}, 3, _early_exit, _check_p_min,
                needs="layers"),
    DrafterKind("draft", "a smaller model sharing the target's tokenizer (tree=N: a token tree)",
                {"path": (str, REQUIRED), "p_min": (float, 0.0), "tree": (int, 0), "budget": (int, 16), "fit": (int, 1),
                 "lookup": (int, 0), **_ASYNC}, 5, _draft, _check_p_min),
    DrafterKind("distilled", "the draft model `speclm distill` made for this target",
                {"path": (str, None), "p_min": (float, 0.0), "tree": (int, 0), "budget": (int, 16), "fit": (int, 1),
                 "lookup": (int, 0), **_ASYNC}, 5, _distilled, _check_p_min),
    DrafterKind("quant", "the target's own weights at fewer bits (int8/int4; a requantized GGUF)",
                {"bits": (int, 4), "fast": (int, 0), "vocab": (int, 0), "p_min": (float, 0.0), "tree": (int, 0),
                 "budget": (int, 16), "fit": (int, 1), "lookup": (int, 0), **_ASYNC}, 5, _quant, _check_quant,
                label=lambda o: f"quant[{o['bits']}-bit]"),
    DrafterKind("medusa", "Medusa heads made by `speclm train-drafter` (a static token tree)",
                {"path": (str, REQUIRED)}, 4, _medusa, _check_learned, needs="hidden"),
    DrafterKind("eagle", "an EAGLE head made by `speclm train-drafter` (path=DIR), or the one shipped "
                "for the target (a dynamic token tree, prompt lookup's chain merged in)",
                {"path": (str, None), "tree": (int, 4), "budget": (int, 16), "fit": (int, 1), "lookup": (int, None),
                 "bits": (int, None)}, 5,
                _eagle, _check_learned,
                needs="hidden"),
    DrafterKind("auto", "measure candidates on the live requests and keep the fastest",
                {"candidates": (NameList(), None), "probe": (int, 6), "every": (int, 256)}, 10,
                _auto, _check_auto),
]}


def is_drafter_spec(text: str) -> bool:
    """Whether ``text`` names a registered drafter (rather than a draft model path)."""
    return text.strip().partition(":")[0] in KINDS


def parse_drafter(text: str, defaults: dict | None = None) -> OptionString:
    """Parse and check ``NAME[:key=value,...]``; ``defaults`` replace the schema's defaults for
    options that the text leaves out (the API's ``ngram_min=`` and the like)."""
    spec = parse_options(text, {name: kind.options for name, kind in KINDS.items()}, what="drafter")
    given = {item.partition("=")[0] for item in text.partition(":")[2].split(",")}
    for key, value in (defaults or {}).items():
        if key in spec.options and key not in given:
            spec.options[key] = value
    KINDS[spec.name].check(spec.options)
    return spec


def drafter_label(spec: OptionString) -> str:
    label = KINDS[spec.name].label
    return label(spec.options) if label is not None else spec.label


def grows_trees(spec: OptionString) -> bool:
    """Whether the drafter ``spec`` names may propose token trees: ``tree=N``, Medusa's static
    tree, or any of ``auto``'s given candidates that does (llama.cpp batches chains only)."""
    if spec.name == "auto":
        return any(grows_trees(parse_drafter(text)) for text in spec.options["candidates"] or ()
                   if text != "none")
    return spec.name == "medusa" or bool(spec.options.get("tree"))


def runs_on(kind: DrafterKind, target) -> bool:
    """Whether ``target``'s backend gives what the drafter needs (see ``DrafterKind.needs``)."""
    if kind.needs == "layers":  # an eager single-row target, or a view of its batched ragged cache
        return isinstance(target, HFCausalLM) or getattr(target, "layer_rows", None) is not None
    if kind.needs == "hidden":
        return getattr(target, "returns_hidden", True)
    return True


def build_drafter(spec: OptionString, ctx: BuildContext) -> Drafter:
    kind = KINDS[spec.name]
    if not runs_on(kind, ctx.target):
        what = "the target's own layers" if kind.needs == "layers" else "the target's hidden states"
        raise SpeclmError(f"{spec.name} uses {what}, which the {getattr(ctx.target, 'backend_name', '?')} "
                          "backend does not give; run it with --backend torch"
                          + (" (without --compile/--quantize)" if kind.needs == "layers" else ""))
    drafter = kind.build(ctx, spec.options)
    lookup = spec.options.get("lookup")
    if lookup is None:  # not given, where the kind's default is "with a tree"
        lookup = LOOKUP_BRANCH if spec.options.get("tree") else 0
    if lookup:  # a prompt-lookup branch merged into every round's tree
        from .lookup_branch import LookupBranch
        from .ngram import NgramDrafter

        drafter = LookupBranch(drafter, NgramDrafter(), lookup)
    return drafter
