"""The fast PyTorch path: the stock HF model compiled over a static KV cache.

:class:`CompiledCausalLM` implements the same interface as the eager reference backend
(:class:`~.hf.HFCausalLM`) and must produce the same greedy tokens. Design:

* the stock transformers model runs unmodified (no forked model file) over a
  :class:`~.static_cache.StaticKVCache`: preallocated buffers written by position, so rollback
  is free and a compiled step sees the same buffers at every call;
* every call passes explicit positions and an explicit 4D additive mask over the whole static
  length (a chain: causal over the filled slots; a tree: speclm.tree's mask), so chains and
  trees share one compiled step and the model's own mask code never runs;
* the step is compiled with ``torch.compile(dynamic=False)``; the tokens fed are padded up to a
  few fixed counts (``buckets``, default 1, 2, 4, 8, 16, 32; on a CPU a step's cost grows with its
  rows, and a 2-token verify, the commonest, costs ~1.15 one-token steps where 4 cost ~1.4) so
  there are few recompiles. Padded
  rows write into the slots after the real ones, which are masked and later overwritten. The
  cache length comes in buckets too (static_cache.capacity_buckets), a dimension the graphs take
  symbolically: each token count is one compiled graph for every cache size, which ``warmup``
  compiles up front;
* a step can also return the hidden states of a few layers (EAGLE/Medusa features): one more
  graph per layer set, the same forward; longer forwards (prompt prefill) and all the hidden
  states at once run the same model eagerly on the same cache: correct, just not compiled;
* bfloat16 where the hardware has it (:func:`fast_dtype`), optional weight-only int8/int4
  (models/quantize.py); the logits handed to the verifier are always float32;
* on CUDA the steps are compiled with ``mode="reduce-overhead"`` (CUDA graphs; written for, not
  yet run on a GPU); on CPU the default mode, with weight freezing for bfloat16/float16;
* once a token count's graph is compiled, calls evaluate only the guards that tell the
  compiled graphs apart (``skip_guard_eval_unsafe``; the full set costs ~1 ms a step), and on a
  CPU, once its direct call is proven to pass the graph dynamo's own inputs (and dynamo to
  change no Python state around it), the graph runs without dynamo (models/direct_call.py: ~1 ms
  a step less).

On a 2-core CPU each graph of the 30-layer default model takes ~25-30 s to compile.
Numerics: float32 and float64 give the eager backend's greedy tokens. In bfloat16 (and with
quantized weights) a verify step over T tokens does not round exactly like a one-token step, so
a speculative run can flip a greedy near-tie that plain decoding resolves the other way; that is
the precision, not the speculation (in float32 the runs are identical).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from ..errors import SpeclmError
from ..tree import TreeMeta
from .attention import MASKED_4D
from .base import ForwardOutput, spread_hidden
from .compiled_step import CompiledStep
from .dtypes import at_least_float32, cast_keeping_rotary, fast_dtype
from .hf_kwargs import cache_kwarg
from .kv_cache import check_forward
from .quant_linear import Int4Linear
from .static_cache import (
    StaticKVCache,
    capacity_buckets,
    mark_capacity_dynamic,
    static_allowed,
    static_positions,
)
from .warmup import compile_bar

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32)
PREFILL_CHUNK = 512  # eager prefill runs in chunks of this many tokens (bounds the mask's size)


def auto_dtype(device: torch.device, quantize: str | None) -> torch.dtype:
    """``dtype="auto"``'s choice: float32 for a GGUF's blocks where speclm's CPU kernel runs them
    (on a Sapphire Rapids VM a one-token step of the default model took 9.8 ms against 12.5 ms
    on bfloat16 int4 kernels; docs/benchmarks.md), else :func:`fast_dtype`."""
    if quantize == "gguf" and device.type == "cpu":
        from .small_m import kernel_available

        if kernel_available():
            return torch.float32
    return fast_dtype(device)


class CompiledCausalLM:
    """A transformers causal LM, compiled, behind the :class:`~speclm.models.base.CausalLM`
    interface. Build it with :func:`make_compiled`."""

    source_gguf = None  # the GGUF file the weights were dequantized from, if any (set by load_model)

    supports_trees = True
    batched_trees = True  # its batched rows (batched_rows) take token trees
    prefill_chunk = PREFILL_CHUNK

    def __init__(self, model: torch.nn.Module, eos_token_ids: frozenset[int], *,
                 buckets: Sequence[int] = DEFAULT_BUCKETS, capacities: Sequence[int] | None = None,
                 quantize: str | None = None, compile_backend: str = "inductor",
                 _step: CompiledStep | None = None) -> None:
        config = model.config
        attention = getattr(config, "_attn_implementation", None) or "eager"
        if attention not in MASKED_4D:
            raise SpeclmError(f"the compiled backend needs eager or sdpa attention, {type(model).__name__} "
                              f"uses {attention!r}")
        if getattr(config, "layer_types", None) and any(t != "full_attention" for t in config.layer_types):
            raise SpeclmError(f"{type(model).__name__} has sliding-window or other special attention "
                              "layers; the compiled backend supports full-attention models only")
        if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
            raise SpeclmError(f"{type(model).__name__} uses sliding-window attention; the compiled "
                              "backend supports full-attention models only")
        self.model = model.eval()
        first = next(model.parameters())
        self.device, self.dtype = first.device, first.dtype
        head = model.get_output_embeddings()  # a quantized head has no float weight to measure
        self.vocab_size = int(getattr(head, "out_features", None) or config.vocab_size)
        self.max_context = int(getattr(config, "max_position_embeddings", 0) or 1 << 30)
        self.eos_token_ids = eos_token_ids
        self.num_layers = int(config.num_hidden_layers)
        self.quantize = quantize
        self.backend_name = "torch-compiled" + (f"+{quantize}" if quantize else "")
        self.buckets = tuple(sorted(set(int(b) for b in buckets)))
        if not self.buckets or self.buckets[0] < 1:
            raise SpeclmError(f"token buckets must be positive, got {tuple(buckets)}")
        self.capacities = tuple(capacities) if capacities else capacity_buckets(
            self.max_context, self.buckets[-1], min(512, self.max_context + self.buckets[-1]))
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self._cache = StaticKVCache(self.num_layers, self.kv_heads, self.head_dim, self.capacities,
                                    self.dtype, self.device)
        mode = "reduce-overhead" if self.device.type == "cuda" and compile_backend == "inductor" else None
        self.compile_backend = compile_backend
        freeze = self.device.type == "cpu" and self.dtype in (torch.bfloat16, torch.float16)
        # PyTorch's CPU int4 product has no C entry point for inductor's C++ wrapper (a float32
        # copy rounded to 4-bit blocks runs on speclm's kernel, which has one)
        torch_int4 = any(isinstance(m, Int4Linear) for m in model.modules())
        self._step = _step or CompiledStep(model, mode, compile_backend, freeze, cpp_wrapper=not torch_int4)
        self._step.allow_graphs(len(self.buckets) * len(self.capacities) * 4)  # with and without features
        self._min = torch.finfo(self.dtype).min
        self._zero = torch.zeros((), dtype=self.dtype, device=self.device)
        self._neg = torch.full((), self._min, dtype=self.dtype, device=self.device)
        
    # -- the CausalLM interface -----------------------------------------------------------
    @property
    def cache_length(self) -> int:
        return self._cache.length

    def rollback(self, length: int) -> None:
        self._cache.rollback(length)

    def compact(self, start: int, keep: list[int]) -> None:
        self._cache.compact(start, keep)

    def reset(self) -> None:
        self._cache.reset()

    def fork(self) -> CompiledCausalLM:
        """A second handle on the same weights and compiled step, with its own cache."""
        twin = CompiledCausalLM(self.model, self.eos_token_ids, buckets=self.buckets,
                                capacities=self.capacities, quantize=self.quantize,
                                compile_backend=self.compile_backend, _step=self._step)
        twin.source_gguf = self.source_gguf
        return twin

    def batched_rows(self, num_slots: int):
        """``num_slots`` rows in one compiled forward over a batched static cache
        (speclm.models.compiled_rows): the engine's batched form of this backend."""
        from .compiled_rows import CompiledRows

        return CompiledRows(self, num_slots)

    @property
    def compiled_graphs(self) -> int:
        """Graphs of the step compiled so far (this model's forks share them): a benchmark
        checks that none was compiled inside a timed request."""
        return len(self._step.seen) + len(self._step.seen_hidden)

    def bucket(self, num_tokens: int) -> int | None:
        """The padded token count a forward of ``num_tokens`` runs at (None: eager)."""
        for b in self.buckets:
            if b >= num_tokens:
                return b
        return None

    @torch.inference_mode()
    def forward(
        self,
        token_ids: torch.Tensor,
        start_pos: int,
        num_logits: int = 1,
        return_hidden: bool | Sequence[int] = False,
        tree: TreeMeta | None = None,
    ) -> ForwardOutput:
        num_new = token_ids.shape[0]
        check_forward(self._cache.length, start_pos, num_new, num_logits)
        if start_pos + num_new > self.max_context:
            raise SpeclmError(f"{start_pos + num_new} positions exceed the model's context of {self.max_context}")
        root_slot = None
        if tree is not None:
            root_slot = start_pos + num_new - (tree.num_nodes + 1)  # the pending token's slot
            if not 0 <= root_slot <= start_pos:
                raise ValueError(f"{num_new} tokens cannot be the last rows of a tree of {tree.num_nodes} nodes")
        padded = self.bucket(num_new)
        if return_hidden is True or padded is None:  # every layer, or a long forward: eager
            return self._eager(token_ids, start_pos, num_logits, return_hidden, tree, root_slot)
        layers = tuple(sorted({i % (self.num_layers + 1) for i in return_hidden})) if return_hidden else ()
        self._cache.reserve(start_pos + padded)
        ids = torch.zeros(padded, dtype=torch.long)
        ids[:num_new] = token_ids.to("cpu", torch.long)
        positions = static_positions(start_pos, num_new, padded, tree, root_slot)
        mask = self._mask(start_pos, num_new, padded, tree, root_slot)
        self._cache.start.fill_(start_pos)
        args = (self._cache, ids.to(self.device).view(1, padded), positions.to(self.device).view(1, padded), mask)
        out = self._step((padded,), *args, layers=layers)
        logits, states = out if layers else (out, ())
        self._cache.length += num_new
        logits = logits[0, num_new - num_logits : num_new]  # [num_logits, V]
        hidden = spread_hidden(layers, [h[0, :num_new] for h in states], self.num_layers) if layers else None
        if self.device.type == "cuda":  # a CUDA graph's outputs are overwritten by its next replay
            logits = logits.clone()
            hidden = hidden and tuple(None if h is None else h.clone() for h in hidden)
        return ForwardOutput(logits=logits, hidden_states=hidden)

    # -- helpers --------------------------------------------------------------------------
    def _mask(self, start_pos: int, num_new: int, rows: int, tree: TreeMeta | None,
              root_slot: int | None) -> torch.Tensor:
        allowed = static_allowed(self._cache.capacity, start_pos, num_new, rows, tree, root_slot)
        mask = torch.where(allowed.to(self.device), self._zero, self._neg).view(1, 1, rows, -1)
        mark_capacity_dynamic(mask, 3)
        return mask

    def _eager(self, token_ids, start_pos, num_logits, return_hidden, tree, root_slot) -> ForwardOutput:
        """An uncompiled forward on the same cache: long prefills (in chunks) and hidden states."""
        num_new = token_ids.shape[0]
        token_ids = token_ids.to("cpu", torch.long)
        layers = None if isinstance(return_hidden, bool) else [i % (self.num_layers + 1) for i in return_hidden]
        self._cache.reserve(start_pos + num_new)
        chunk = num_new if (return_hidden or tree is not None) else PREFILL_CHUNK
        logits, hidden = [], []
        for lo in range(0, num_new, chunk):
            n = min(chunk, num_new - lo)
            pos = start_pos + lo
            positions = static_positions(pos, n, n, tree, root_slot)
            mask = self._mask(pos, n, n, tree, root_slot)
            self._cache.start.fill_(pos)
            want = max(0, num_logits - (num_new - lo - n))  # logits rows of this chunk
            out = self.model(input_ids=token_ids[lo : lo + n].to(self.device).view(1, n),
                             attention_mask=mask, position_ids=positions.to(self.device).view(1, n),
                             use_cache=True, logits_to_keep=max(want, 1), **{cache_kwarg(self.model): self._cache},
                             output_hidden_states=bool(return_hidden) if layers is None else layers)
            self._cache.length += n
            if want:
                rows = out.logits[0, -want:]
                logits.append(at_least_float32(rows))
            if return_hidden:
                hidden = tuple(None if h is None else h[0] for h in out.hidden_states)
        return ForwardOutput(logits=torch.cat(logits), hidden_states=hidden if return_hidden else None)

    def warmup(self, max_draft: int | None = None, layers: Sequence[int] = ()) -> float:
        """Compile the step for every token bucket up to ``max_draft + 1`` tokens (all buckets by
        default), so that compiling does not land in a request's time (each graph serves every
        cache size); with ``layers`` (a drafter's ``feature_layers``), the steps that also return
        those hidden states. Returns the seconds spent."""
        top = self.bucket(max_draft + 1) if max_draft is not None else None
        todo = [b for b in self.buckets if top is None or b <= top]
        sel = tuple(sorted({i % (self.num_layers + 1) for i in layers}))
        todo = [b for b in todo if ((((b,), sel) not in self._step.seen_hidden) if sel else ((b,) not in self._step.seen))]
        if not todo:
            return 0.0
        graphs = compile_bar(todo, f"steps, one time ({len(todo)} token counts)")
        t0 = time.perf_counter()
        self._step.warming = True
        try:
            for b in graphs:
                self.reset()
                self.forward(torch.zeros(b, dtype=torch.long), 0, num_logits=1, return_hidden=list(sel))
        finally:
            self._step.warming = False
            self.reset()
        return time.perf_counter() - t0


def make_compiled(
    hf_model: torch.nn.Module,
    eos_token_ids: frozenset[int],
    *,
    dtype: torch.dtype | str | None = None,
    quantize: str | None = None,
    buckets: Sequence[int] = DEFAULT_BUCKETS,
    capacities: Sequence[int] | None = None,
    inplace: bool = False,
    compile_backend: str = "inductor",
    gguf: str | Path | None = None,
) -> CompiledCausalLM:
    """A :class:`CompiledCausalLM` over ``hf_model``.

    ``dtype``: the compute dtype; ``"auto"`` picks :func:`fast_dtype` (bfloat16 where the hardware
    has it), except for ``quantize="gguf"`` on a CPU where speclm's block kernel runs: float32, so
    that the file's blocks run as llama.cpp runs them (8-bit activations, integer dot products)
    rather than on bfloat16 int4 kernels; None keeps the model's own. ``quantize``: None, ``"int8"`` or ``"int4"`` (weight-only,
    models/quantize.py) or ``"gguf"``: the linear layers that the GGUF file ``gguf`` (which
    ``hf_model`` was loaded from) stores as Q4_0/Q4_1/Q8_0 run its own blocks on int4 kernels
    (models/gguf_int4.py). When the dtype changes or weights are quantized, the model is copied first
    (the caller's eager model stays the reference) unless ``inplace``.
    Compiling happens lazily on first use of each shape, or up front with ``warmup``.
    ``compile_backend``: torch.compile's backend ("inductor"; "aot_eager" for quick tests).
    """
    from .quantize import quantize_weights

    device = next(hf_model.parameters()).device
    if isinstance(dtype, str):
        from .dtypes import resolve_dtype

        dtype = auto_dtype(device, quantize) if dtype == "auto" else resolve_dtype(dtype, device)
    model = hf_model
    current = next(hf_model.parameters()).dtype
    if (dtype is not None and dtype != current) or quantize:
        model = hf_model if inplace else copy.deepcopy(hf_model)
        if dtype is not None and dtype != current:
            model = cast_keeping_rotary(model, dtype)
    if quantize:
        quantize_weights(model, quantize, gguf=gguf)
    return CompiledCausalLM(model.eval(), eos_token_ids, buckets=buckets, capacities=capacities,
                            quantize=quantize, compile_backend=compile_backend)
