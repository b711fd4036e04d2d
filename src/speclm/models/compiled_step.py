"""The compiled forward of one model: one graph per (rows, tokens) shape.

:class:`CompiledStep` wraps the stock transformers forward over a static cache (the step of
:class:`~speclm.models.compiled.CompiledCausalLM`, shared with its forks and its batched rows,
models/compiled_rows.py) in ``torch.compile(dynamic=False)``: each shape fed is one graph, compiled
on first use (or up front by a warm-up), except the cache's capacity, which the cache and its
mask mark dynamic (models/static_cache.py): one graph serves every cache size; a shape already
compiled is run with only the guards that tell the graphs apart checked, and on a CPU, once proven
for a shape and cache capacity, without dynamo (models/direct_call.py). :func:`compile_options`
are inductor's options for it on a CPU: speclm's pass that groups GGUF block layers reading one
input, freezing for bfloat16, and the step's wrapper in C++ calling speclm's ops directly
(models/c_shims.py).
"""

from __future__ import annotations

import sys
import types

import torch

from . import c_shims, direct_call
from .block_groups import GroupBlockCalls
from .direct_call import DirectGraph, GraphCapture, proven
from .dtypes import at_least_float32
from .hf_kwargs import cache_kwarg
from .static_cache import StaticKVCache


def _raise_dynamo_limits(graphs: int) -> None:
    """Let dynamo keep ``graphs`` graphs of one function. Its settings are context variables:
    they hold for the calling thread only, so a step raises them again on the thread that
    compiles (a server's engine thread otherwise fell back to eager at dynamo's default of 8)."""
    import torch._dynamo.config as dynamo_config

    for name, want in (("recompile_limit", graphs), ("cache_size_limit", graphs),
                       ("accumulated_recompile_limit", 4 * graphs), ("accumulated_cache_size_limit", 4 * graphs)):
        current = getattr(dynamo_config, name, None)
        if isinstance(current, int) and current < want:
            setattr(dynamo_config, name, want)


def _direct_allowed(model: torch.nn.Module) -> bool:
    """Whether graphs may run without dynamo (direct_call.py): on a CPU, unless switched off."""
    first = next(model.parameters(), None)
    return direct_call.DIRECT and (first is None or first.device.type == "cpu")


def _capture(backend: str, mode: str | None, options: dict | None) -> GraphCapture | None:
    """``backend`` (with ``mode`` and ``options``) wrapped to record its graphs, as torch.compile
    would build it; None where it cannot be (torch.compile then builds it itself)."""
    if backend == "inductor":
        wrapper = getattr(torch, "_TorchCompileInductorWrapper", None)
        return GraphCapture(wrapper(mode, options, False), backend) if wrapper is not None else None
    if mode or options:
        return None
    from torch._dynamo.backends.registry import lookup_backend

    return GraphCapture(lookup_backend(backend), backend)


def compile_options(backend: str, mode: str | None, freeze: bool, cpp_wrapper: bool = True) -> dict | None:
    """Inductor's options for a compiled step (torch.compile takes a mode or options, not both).
    ``cpp_wrapper=False`` keeps inductor's Python wrapper where speclm's kernels would allow a C++
    one (a graph whose ops have no C entry point, such as PyTorch's CPU int4 product, would call
    them back through Python)."""
    if backend != "inductor" or mode is not None:
        return None
    # one kernel call for the GGUF block layers that read the same input (block_groups.py)
    options: dict = {"post_grad_custom_pre_pass": GroupBlockCalls()}
    if freeze:
        # freezing folds the weights into the graph as constants, which lets inductor prepack
        # them for oneDNN (AMX): ~1.4x faster bfloat16 matmuls on CPU, no gain in float32. The
        # weights must not change after compiling (inference only), and a frozen graph skips
        # inductor's on-disk cache, so every process compiles it again.
        options["freezing"] = True
    elif cpp_wrapper:
        # the step's wrapper in C++, calling speclm's ops directly (models/c_shims.py)
        options.update(c_shims.wrapper_options())
    return options


class CompiledStep:
    """The compiled forward of one model, shared by a backend, its forks and its batched rows
    (models/compiled_rows.py): one graph per (rows, tokens) seen."""

    def __init__(self, model: torch.nn.Module, mode: str | None, backend: str = "inductor",
                 freeze: bool = False, cpp_wrapper: bool = True) -> None:
        self.model = model
        cache_kw = cache_kwarg(model)

        def step(cache: StaticKVCache, input_ids: torch.Tensor, position_ids: torch.Tensor,
                 mask: torch.Tensor, layers: tuple[int, ...] = ()):
            out = model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids,
                        use_cache=True, output_hidden_states=list(layers) if layers else False,
                        **{cache_kw: cache})
            logits = at_least_float32(out.logits)  # [B, T, V] float32 (or 64)
            if not layers:
                return logits
            return logits, tuple(out.hidden_states[i] for i in layers)  # [B, T, H] each

        # a code object of its own: dynamo keeps its graphs, recompile counts and limits per code
        # object, so steps sharing this function's would pile their graphs onto one list that
        # never shrinks (dead models' graphs kept), and past dynamo's recompile limits a later
        # step ran eagerly without a word (seen late in a long test session: a process that
        # builds many compiled models)
        step = types.FunctionType(step.__code__.replace(), step.__globals__, step.__name__,
                                  step.__defaults__, step.__closure__)
        self.eager = step
        options = compile_options(backend, mode, freeze, cpp_wrapper)
        # the backend wrapped so that a compiled shape can later run without dynamo (direct_call.py)
        self.capture = _capture(backend, mode, options) if _direct_allowed(model) else None
        if self.capture is not None:  # as torch.compile does, the backend being ours (mode, options inside)
            self.compiled = torch._dynamo.optimize(backend=self.capture, dynamic=False)(step)
        else:
            self.compiled = torch.compile(step, dynamic=False, mode=mode, backend=backend, options=options)
        self.direct: dict[tuple, DirectGraph | None] = {}  # (entry, capacity) -> its graph, or None: dynamo
        self.direct_calls = 0  # calls that ran a graph without dynamo (tests, diagnostics)
        code = step.__code__
        self._arg_names = code.co_varnames[: code.co_argcount]  # cache, input_ids, ..., layers
        self._closure = dict(zip(code.co_freevars, (cell.cell_contents for cell in step.__closure__ or ())))
        self.seen: set[tuple] = set()  # (tokens,) or (rows, tokens) compiled so far
        self.seen_hidden: set[tuple] = set()  # (key, layers): graphs that also return hidden states
        self.skip_guards = True
        self.warming = False
        self.graphs = 8  # graphs dynamo may keep of the step (allow_graphs)
        self._hooks_installed = False

    def _install_output_hooks(self) -> None:
        """transformers installs the hooks that capture hidden states on the first forward that
        asks for them. Traced inside the compiled step, that installation breaks the graph, and
        the first graph compiled with hidden states then ran two graphs a call: ~1.8x a plain
        step (60 against 34 ms for one bfloat16 token on the default model). One eager forward
        of one token, without a cache, installs them before anything is traced."""
        if self._hooks_installed:
            return
        first = next(self.model.parameters())
        with torch.no_grad():
            self.model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=first.device), use_cache=False,
                       output_hidden_states=True)
        self._hooks_installed = True

    def allow_graphs(self, graphs: int) -> None:
        """Raise dynamo's recompile limits to hold ``graphs`` graphs of the step (more, never
        fewer, than asked before), here and on whichever thread compiles one later."""
        self.graphs = max(self.graphs, graphs)
        _raise_dynamo_limits(self.graphs)

    def __call__(self, key: tuple, *args, layers: tuple[int, ...] = ()):
        """Run the graph for ``key`` (compiling it on first use) on ``args``: the logits, or with
        ``layers`` (sorted indices into the hidden states, 0 = embeddings) the logits and those
        layers' hidden states, for a drafter that reads the target's features."""
        seen, entry = (self.seen_hidden, (key, layers)) if layers else (self.seen, key)
        direct_key = (entry, getattr(args[0], "capacity", None))  # each capacity proven apart
        graph = self.direct.get(direct_key, False)
        if graph and graph.global_state.check():
            self.direct_calls += 1
            return graph(self._frame_locals(args, layers), len(layers))
        learn = graph is False and self.capture is not None
        if learn:  # keep what dynamo passes the graph it runs, to prove the direct call by
            self.capture.calls.clear()
            self.capture.observing = True
        try:
            if entry in seen:
                out = self._call_compiled(args, layers)
            else:
                if (self.seen or self.seen_hidden) and not self.warming:
                    rows = f"{key[0]} rows x " if len(key) == 2 else ""
                    hidden = f" with the hidden states of layers {list(layers)}" if layers else ""
                    print(f"speclm: compiling a step for {rows}{key[-1]} tokens{hidden} (one time)...",
                          file=sys.stderr)
                _raise_dynamo_limits(self.graphs)  # dynamo's limits are per thread
                if layers:
                    self._install_output_hooks()
                out = self.compiled(*args, layers)
                seen.add(entry)
        finally:
            if learn:
                self.capture.observing = False
                calls, self.capture.calls = self.capture.calls, []  # no inputs kept past the call
        if learn:
            # one graph ran (more: a graph break, with Python between), on the inputs the step gathers
            ok = len(calls) == 1 and proven(calls[0][0], self._frame_locals(args, layers), calls[0][1],
                                            calls[0][2], out, len(layers))
            self.direct[direct_key] = calls[0][0] if ok else None
        return out

    def _call_compiled(self, args: tuple, layers: tuple[int, ...]):
        """A compiled shape through dynamo, checking only the guards that tell the compiled
        graphs apart (dynamo's full guard set costs ~1 ms per call on a 30-layer model)."""
        try:
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=self.skip_guards):
                return self.compiled(*args, layers)
        except RuntimeError as exc:  # a guard beyond the shape failed (global state, another
            if "skip_guard_eval_unsafe" not in str(exc):  # instance's graphs): check them all
                raise
            _raise_dynamo_limits(self.graphs)
            return self.compiled(*args, layers)

    def _frame_locals(self, args: tuple, layers: tuple[int, ...]) -> dict:
        """The step's locals as dynamo named them: its closure and its arguments."""
        frame = dict(self._closure)
        frame.update(zip(self._arg_names, (*args, layers)))
        return frame
