"""The quantized self-draft: the target's own weights at fewer bits draft for the unchanged target.

Training-free, and lossless like every drafter: only the draft is quantized, and the verifier
judges its tokens against the full-precision target (the idea of Intel's ML-SpecQD). The draft
agrees with the target on most tokens, so acceptance is high; it pays where a forward's cost
follows the bytes of weights read, so fewer bits make a cheaper forward.

What the draft is, by the target's backend:

* eager torch: a copy of the target whose ``nn.Linear`` layers are weight-only int8 or int4
  (models/quantize.py ``quantized_copy``; embeddings, norms and rotary tables are the target's
  own tensors), run eagerly. A float32 target's copy on a CPU is rounded to llama.cpp's
  blocks of 32 inputs (int8: Q8_0, int4: Q4_1) and runs on speclm's block kernel. With
  bits=4, a target loaded from a GGUF file that stores 4-bit blocks drafts with those blocks
  (models/gguf_int4.py): the draft then computes the target's own weights, on int4 kernels,
  and agrees with it on nearly every token;
* the compiled torch path: the same copy of the compiled target's model (its dtype, e.g.
  bfloat16), compiled over its own static cache with the target's token and cache buckets;
* llama.cpp: a requantized copy of the target's GGUF file (models/requantize.py, made once and
  cached), run by llama.cpp.

The draft then drafts exactly as a draft model does (:class:`~.draft_model.DraftModelDrafter`:
chains, ``p_min``, token trees, asynchronous drafting); the rows of a server share one loaded
copy: on the torch backends their chains come from one batched group that drafts every row in
one forward per depth (drafters/draft_rows.py), otherwise each row forks the copy's cache (api
``row_drafters``).

One case needs no cache of its own: chains for the rows of an eager target's batched ragged
cache (a server on ``--backend torch``). The copy has the target's layers, dtype and positions,
so it runs on the target's own cache (:class:`QuantRows`, drafters/shared_cache.py): it reads the
target's keys and values for every committed position and only writes its draft positions,
which are dropped before verification. No draft prefill of each prompt, no catch-up after rounds
a row sat out (the costs that kept a server's rows from drafting at all), and a draft that
attends to the target's exact context.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from ..errors import SpeclmError
from ..models.base import CausalLM
from ..models.rows import RaggedRows, RowsOutput
from .shared_cache import SharedCacheMember, SharedCacheRows

TORCH_BITS = {4: "int4", 8: "int8"}  # bits -> models/quantize.py scheme
GGUF_BITS = {2: "q2_k", 3: "q3_k_s", 4: "q4_0", 8: "q8_0"}  # bits -> models/requantize.py type
ALL_BITS = sorted(set(TORCH_BITS) | set(GGUF_BITS))
# A chain's draft step feeds one token, and its catch-up after a verified round the accepted
# tokens plus the bonus: up to K + 1. A draft that agrees with the target (the file's own
# blocks) reaches large K, so its steps are compiled up front for feeds of up to 16 tokens
# (buckets 1, 2, 4, 8, 16), not in the middle of a request (~30-70 s a graph on 2 cores); a
# longer feed (a row's first catch-up on a prompt it did not prefill) runs eagerly.
WARM_TOKENS = 15
_NARROWED: dict[tuple, torch.Tensor] = {}  # narrowed_vocabulary's answers, by (ranking file, size, eos ids)


def _warm_buckets(buckets) -> tuple[int, ...]:
    """The draft's token buckets: those its warmup compiles. A longer feed (a row's first
    catch-up on its prompt, or on many plain steps) runs eagerly instead of compiling a graph
    inside a request."""
    return tuple(b for b in buckets if b <= WARM_TOKENS + 1) or tuple(buckets)[:1]


def check_bits(bits: int) -> None:
    """Reject a bit width no backend offers (before any model loads)."""
    if bits not in ALL_BITS:
        raise SpeclmError(f"quant: bits={bits} is not offered; torch backends take bits="
                          f"{'/'.join(map(str, TORCH_BITS))}, llama.cpp bits={'/'.join(map(str, GGUF_BITS))}")


def _backend_kind(target) -> str:
    name = getattr(target, "backend_name", "torch")
    if name == "llamacpp":
        return "llamacpp"
    return "compiled" if name.startswith("torch-compiled") else "torch"


def quant_draft(target, bits: int, progress: bool = True, fast: bool = False,
                vocab: torch.Tensor | None = None) -> tuple[str, Callable[[], CausalLM]]:
    """A key naming the quantized draft of ``target`` (shared by every row of a setup) and a
    function that builds it. Raises a one-line error where the backend cannot give ``bits``.
    ``fast``: an eager torch target's draft runs on the compiled path instead (its own static
    cache and compiled steps, bfloat16 where the hardware has it). ``vocab``: the token ids the
    draft's output layer covers (models/vocab_subset.py; None: all), torch backends only."""
    kind = _backend_kind(target)
    if fast and kind != "torch":
        raise SpeclmError("quant: fast=1 compiles the draft of an eager torch target; this target "
                          f"runs on {'llama.cpp' if kind == 'llamacpp' else 'the compiled path'} already")
    if kind == "llamacpp":
        if bits not in GGUF_BITS:
            raise SpeclmError(f"quant: bits={bits} is not offered on llama.cpp; use bits="
                              f"{'/'.join(map(str, GGUF_BITS))} (GGUF {', '.join(GGUF_BITS.values())}) "
                              "or run the target with --backend torch")
        return f"quant:{GGUF_BITS[bits]}", lambda: _gguf_draft(target, GGUF_BITS[bits], progress)
    if bits not in TORCH_BITS:
        raise SpeclmError(f"quant: bits={bits} is not offered on the torch backends; use bits="
                          f"{'/'.join(map(str, TORCH_BITS))} (weight-only int8/int4), or bits=2/3 on "
                          "--backend llamacpp")
    quantized = getattr(target, "quantize", None)
    if quantized:
        raise SpeclmError(f"quant: the target is already {quantized}-quantized (--quantize); the "
                          "quantized self-draft needs a full-precision target (drop --quantize)")
    scheme = TORCH_BITS[bits]
    gguf = getattr(target, "source_gguf", None)
    if scheme == "int4" and gguf is not None:
        from ..models.gguf_int4 import stores_4bit

        if stores_4bit(gguf):  # the file's own 4-bit blocks: the target's weights, on int4 kernels
            scheme = "gguf"
    key = f"quant:{scheme}" + ("" if vocab is None else f":vocab{vocab.numel()}")
    if fast:
        return f"{key}:fast", lambda: _fast_draft(target, scheme, gguf, vocab)
    return key, lambda: _torch_draft(target, scheme, gguf, vocab, compiled=kind == "compiled")


def narrowed_vocabulary(target, tokenizer, model_path, size: int, progress: bool = True) -> torch.Tensor:
    """The ``size`` token ids ``vocab=size`` gives the draft's output layer: those the target
    predicts most on speclm's own prompts (models/vocab_subset.py; cached per model file), the
    end-of-sequence ids among them. A one-line error on llama.cpp, which computes every logit."""
    from ..cost_model import cache_path, file_stamp, model_file
    from ..models.vocab_subset import PRIOR_TOKENS, PRIOR_VERSION, draft_vocabulary, prior_ranking

    if _backend_kind(target) == "llamacpp":
        raise SpeclmError("quant: vocab= narrows a torch draft's output layer; llama.cpp computes "
                          "every logit (drop vocab=, or run the target with --backend torch)")
    path = model_file(target, model_path)
    stamp = file_stamp(path)
    key = None if stamp is None else dict(version=PRIOR_VERSION, model=str(Path(path).resolve()), files=stamp,
                                          vocab=target.vocab_size, tokens=PRIOR_TOKENS, backend="prior")
    cached = None if key is None else cache_path(key, "vocab").with_suffix(".pt")
    always = tuple(sorted(target.eos_token_ids))
    memo = None if cached is None else (cached, size, always)
    if memo in _NARROWED:  # a server builds the drafter of every request it admits
        return _NARROWED[memo]
    ranking = prior_ranking(target.model, tokenizer, target.vocab_size, cached, progress=progress)
    chosen = draft_vocabulary(ranking, size, always)
    if memo is not None:
        _NARROWED[memo] = chosen
    return chosen


def _gguf_draft(target, type_name: str, progress: bool) -> CausalLM:
    from ..models.llamacpp import LlamaCppLM, LlamaCppModel
    from ..models.requantize import requantize_gguf

    weights = target.weights  # the target's LlamaCppModel (every row's handle has it)
    path = requantize_gguf(weights.path, type_name, threads=weights.threads, progress=progress)
    return LlamaCppLM(LlamaCppModel(path, threads=weights.threads), target.eos_token_ids,
                      max_context=target.max_context)


def _torch_draft(target, scheme: str, gguf, vocab, compiled: bool) -> CausalLM:
    from ..models.quantize import quantized_copy

    model = quantized_copy(target.model, scheme, gguf=gguf, vocab=vocab)
    if not compiled:
        from ..models.hf import HFCausalLM

        return HFCausalLM(model, target.eos_token_ids)
    from ..models.compiled import CompiledCausalLM

    draft = CompiledCausalLM(model, target.eos_token_ids, buckets=_warm_buckets(target.buckets),
                             capacities=target.capacities, quantize=scheme,
                             compile_backend=target.compile_backend)
    draft.warmup(WARM_TOKENS)  # its graphs serve every cache size, as the target's do
    return draft


def _fast_draft(target, scheme: str, gguf, vocab) -> CausalLM:
    """An eager target's draft on the compiled path, in the fast dtype (it owns its tensors)."""
    from ..models.compiled import DEFAULT_BUCKETS, CompiledCausalLM, auto_dtype
    from ..models.quantize import quantized_copy

    model = quantized_copy(target.model, scheme, dtype=auto_dtype(target.device, scheme), gguf=gguf, vocab=vocab)
    draft = CompiledCausalLM(model, target.eos_token_ids, buckets=_warm_buckets(DEFAULT_BUCKETS), quantize=scheme)
    draft.warmup(WARM_TOKENS)
    return draft


class QuantRows(SharedCacheRows):
    """The quantized copy drafting for every row of the target's ragged cache, on that cache:
    one forward of the copy per depth over the rows asked."""

    def __init__(self, rows: RaggedRows, model: torch.nn.Module, p_min: float = 0.0) -> None:
        super().__init__(rows, p_min)
        self.model = model

    def run_variant(self, rows: RaggedRows, span: range, tokens: torch.Tensor) -> RowsOutput:
        return rows.forward(span, tokens, [1] * len(span), model=self.model)


def shared_cache_member(handle, key: str, make: Callable[[], CausalLM], p_min: float) -> SharedCacheMember | None:
    """A member of the :class:`QuantRows` group of the ragged cache ``handle`` (a row's
    :class:`~speclm.models.rows.TargetView`) names, or None where the draft cannot share it: a
    single-row target, a draft compiled on its own cache (``fast``), or a copy that computes in
    another dtype than the target's cache holds (a float64 target's copy runs in float32).
    ``key``, ``make``: :func:`quant_draft`'s (the copy is built once per cache)."""
    rows = getattr(handle, "layer_rows", None)
    if rows is None or key.endswith(":fast") or handle.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return None
    return QuantRows.group(rows, (key, p_min), lambda: QuantRows(rows, make().model, p_min)).member()
